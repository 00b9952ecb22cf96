"""What Kubernetes' training operators tell a pod: a PyTorchJob pod run without torchrun (platform
``"pytorchjob"``), and the ``PET_*`` and ``JOB_COMPLETION_INDEX`` variables that ``ddpkit run``
takes as defaults (docs/kubernetes-and-ray.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddpkit._errors import ConfigError
from ddpkit.platforms import _cpus as cpus
from ddpkit.platforms._base import LaunchDefault, LaunchEnv, checked, read_int

NAME = "pytorchjob"

POD_ENV = "KUBERNETES_SERVICE_HOST"  # set in every container Kubernetes starts

OPERATOR_VARS = {
    "--nnodes": "PET_NNODES", "--nproc": "PET_NPROC_PER_NODE", "--node-rank": "PET_NODE_RANK",
    "--rdzv-endpoint": "PET_RDZV_ENDPOINT", "--rdzv-id": "PET_RDZV_ID",
    "--max-restarts": "PET_MAX_RESTARTS",
}  # fmt: skip
"""``ddpkit run``'s options and the ``PET_*`` variables that give their defaults."""

# what torchrun takes in each variable; [0-9]: ASCII only (int("٣") is 3, int("²") raises)
_VALUE_FORMS = {
    "PET_NNODES": ("[0-9]+(:[0-9]+)?", "use a number of nodes, or MIN:MAX for an elastic job"),
    "PET_NPROC_PER_NODE": ("[0-9]+|auto|gpu|cpu", "use a number of processes, auto, gpu or cpu"),
    "PET_NODE_RANK": ("[0-9]+", "use this node's rank, a number from 0"),
    "PET_MAX_RESTARTS": ("[0-9]+", "use a number of restarts"),
    "PET_MASTER_PORT": ("[0-9]{1,5}", "use the master's port, a number"),
}


def pet_value(env: Mapping[str, str], name: str) -> str | None:
    """The value of the ``PET_*`` variable ``name``, stripped, or None where it is unset: the one
    reading of these variables, for ``ddpkit run`` and :func:`ddpkit.init`. Anything but the form
    torchrun takes (a sign, an empty value, a digit that is not ASCII) is a :class:`ConfigError`
    naming the variable and its value, shown with escapes."""
    if name not in env:
        return None
    value = env[name].strip()
    form, hint = _VALUE_FORMS[name]
    if not (value.isascii() and re.fullmatch(form, value)):
        raise ConfigError(
            f"{name}={env[name][:40]!a}, set in this pod's environment: {hint} (the job's spec "
            "sets it)"
        )
    return value


# what the rendezvous ddpkit run serves at the endpoint stands in for
_RDZV_BACKENDS = ("c10d", "static")


def in_pod(env: Mapping[str, str]) -> bool:
    return POD_ENV in env


def detect(env: Mapping[str, str]) -> bool:
    """A PyTorchJob pod's without torchrun: ``RANK`` and the rest, no ``LOCAL_RANK``, in a pod."""
    return (
        in_pod(env)
        and "LOCAL_RANK" not in env
        and all(name in env for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    )


def world(env: Mapping[str, str]) -> LaunchEnv:
    """A PyTorchJob pod run without torchrun: one process per pod, so local rank 0 of 1."""
    check_one_process_per_pod(env)
    return checked(
        LaunchEnv(
            rank=read_int(env, "RANK"),
            local_rank=0,
            world_size=read_int(env, "WORLD_SIZE"),
            local_world_size=1,
            launcher=NAME,
            master_addr=env["MASTER_ADDR"],
            master_port=read_int(env, "MASTER_PORT"),
        )
    )


def check_one_process_per_pod(env: Mapping[str, str]) -> None:
    """Refuse a lone process in a pod meant for several (``nprocPerNode`` above 1, elastic)."""
    nproc, nnodes = pet_value(env, "PET_NPROC_PER_NODE") or "1", pet_value(env, "PET_NNODES") or ""
    elastic = "PET_RDZV_ENDPOINT" in env or ":" in nnodes
    if not _one_process(nproc) or elastic:
        why = f"PET_NPROC_PER_NODE={nproc}"
        if elastic:
            why = f"an elastic policy, PET_NNODES={nnodes[:20]}"
        raise ConfigError(
            f"this pod's PyTorchJob starts torchrun's processes ({why}), but this process was "
            "started alone: make the container's command `ddpkit run train.py` (or torchrun), "
            "which reads the PET_* variables" + ("" if elastic else ", or set nprocPerNode to 1")
        )


def check_not_alone_in_torchrun_pod(env: Mapping[str, str]) -> None:
    """Refuse :func:`ddpkit.init` with no launcher in a pod whose job is meant for torchrun across
    several pods or processes (``PET_*`` and no ``RANK``): every pod would train alone as rank 0."""
    if not in_pod(env) or "PET_NNODES" not in env:
        return
    nnodes, nproc = pet_value(env, "PET_NNODES") or "", pet_value(env, "PET_NPROC_PER_NODE") or "1"
    if one_node(nnodes) and _one_process(nproc):
        return  # one pod of one process: a world of one, as started
    raise ConfigError(
        f"this pod's job is set for torchrun (PET_NNODES={nnodes[:20]}, "
        f"PET_NPROC_PER_NODE={nproc[:20]}), but this process was started alone and would train as "
        "the only rank: make the container's command `ddpkit run train.py` (or torchrun), which "
        "reads the PET_* variables"
    )


def launch_defaults(env: Mapping[str, str]) -> list[LaunchDefault]:
    """``ddpkit run``'s option defaults from the ``PET_*`` variables and JobSet's
    ``JOB_COMPLETION_INDEX`` (``PET_NPROC_PER_NODE=cpu``: one process per core this pod may use). A
    :class:`ConfigError` for a rendezvous backend ``ddpkit run`` cannot stand in for, or a value
    torchrun would not take either."""
    backend = env.get("PET_RDZV_BACKEND")
    if backend is not None and backend not in _RDZV_BACKENDS:
        raise ConfigError(
            f"PET_RDZV_BACKEND={backend[:40]!r}: `ddpkit run` serves its own rendezvous at the "
            f"endpoint, which stands in for {' or '.join(_RDZV_BACKENDS)} only; set the job's "
            "rendezvous backend to c10d, or start the pods with torchrun"
        )
    found = []
    for option, name in OPERATOR_VARS.items():
        value = pet_value(env, name) if name in _VALUE_FORMS else env.get(name, "").strip() or None
        if value is not None:
            if name == "PET_NPROC_PER_NODE" and value == "cpu":  # torchrun: one per core
                value = str(cpus.cpu_count(env))
            found.append(LaunchDefault(option, value, name))
    if env.get("PET_RDZV_CONF", "").strip():
        found += _rdzv_conf(env["PET_RDZV_CONF"])
    if "PET_RDZV_ENDPOINT" not in env and env.get("PET_MASTER_ADDR") and "PET_MASTER_PORT" in env:
        endpoint = f"{env['PET_MASTER_ADDR'].strip()}:{pet_value(env, 'PET_MASTER_PORT')}"
        found.append(LaunchDefault("--rdzv-endpoint", endpoint, "PET_MASTER_ADDR:PET_MASTER_PORT"))
    if "PET_NODE_RANK" not in env and re.fullmatch(
        "[0-9]{1,7}", env.get("JOB_COMPLETION_INDEX", "")
    ):
        found.append(
            LaunchDefault("--node-rank", env["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")
        )
    return found


def _rdzv_conf(text: str) -> list[LaunchDefault]:
    """``PET_RDZV_CONF``: its ``join_timeout`` is ``--join-timeout``, the rest ``--rdzv-conf``."""
    pairs = [
        (key.strip(), value.strip())
        for key, _, value in (item.partition("=") for item in text.split(","))
    ]
    for key, value in pairs:
        if not (re.fullmatch("[A-Za-z_][A-Za-z0-9_]*", key) and re.fullmatch("[^=]+", value)):
            raise ConfigError(
                f"PET_RDZV_CONF={text[:80]!r}, set in this pod's environment: use "
                "KEY=VALUE[,KEY=VALUE] (the job's spec sets it)"
            )
    found = []
    if join := [value for key, value in pairs if key == "join_timeout"]:
        if not re.fullmatch(r"[0-9]+(\.[0-9]*)?", join[-1]):
            raise ConfigError(
                f"PET_RDZV_CONF's join_timeout={join[-1][:20]!r}: use a number of seconds"
            )
        found.append(LaunchDefault("--join-timeout", join[-1], "PET_RDZV_CONF's join_timeout"))
    if rest := [f"{key}={value}" for key, value in pairs if key != "join_timeout"]:
        found.append(LaunchDefault("--rdzv-conf", ",".join(rest), "PET_RDZV_CONF"))
    return found


def one_node(nnodes: str) -> bool:
    """``--nnodes`` / ``PET_NNODES`` of a job that never has more than one node."""
    return re.fullmatch(r"0*1(:0*1)?", nnodes.strip()) is not None


def _one_process(nproc: str) -> bool:
    """``PET_NPROC_PER_NODE`` as ``WORLD_SIZE`` counts it: a word is one process."""
    return not nproc.isdigit() or int(nproc) == 1


def resolve_options(
    given: Mapping[str, str], defaults: list[LaunchDefault]
) -> tuple[dict[str, str], list[LaunchDefault]]:
    """(the options to add to the command line, the defaults taken) from the options the user
    ``given`` (option -> value as typed) and the environment's ``defaults``; a default the user
    gave with another value is refused, naming both."""
    taken: list[LaunchDefault] = []
    for default in defaults:
        typed = given.get(default.option)
        # repeatable: the job's settings, then the typed
        if typed is None or default.option == "--rdzv-conf":
            if not any(t.option == default.option for t in taken):
                taken.append(default)
        elif default.source != "JOB_COMPLETION_INDEX" and not _same(
            default.option, typed, default.value
        ):
            raise ConfigError(
                f"{default.option} {typed[:80]} disagrees with "
                f"{default.source}={default.value[:80]} set in this pod by the job's operator: "
                f"drop {default.option} from the command (the operator's value is used), or change "
                "the job's spec so that they agree"
            )
    nnodes = given.get("--nnodes") or next((t.value for t in taken if t.option == "--nnodes"), "1")
    # JOB_COMPLETION_INDEX is a node rank only for a job of fixed size across several nodes; a job
    # of one node takes no endpoint (nor rendezvous id, nor node rank) from the environment
    fixed_size_nodes = ":" not in nnodes and not one_node(nnodes)
    taken = [t for t in taken if t.source != "JOB_COMPLETION_INDEX" or fixed_size_nodes]
    if one_node(nnodes) and "--rdzv-endpoint" not in given:
        taken = [
            t for t in taken if t.option not in ("--rdzv-endpoint", "--rdzv-id", "--node-rank")
        ]
    return {t.option: t.value for t in taken}, taken


def _same(option: str, typed: str, value: str) -> bool:
    typed, value = typed.strip(), value.strip()
    if option == "--nnodes" and ":" in value and ":" not in typed:
        typed = f"{typed}:{typed}"
    try:  # numbers as numbers: 01 is 1, 600 is 600.0
        return [float(n) for n in typed.split(":")] == [float(n) for n in value.split(":")]
    except ValueError:
        return typed == value


def summary(taken: list[LaunchDefault], env: Mapping[str, str]) -> str:
    """One line for the launch: which options came from the environment."""
    items = ", ".join(f"{t.option} {t.value} ({t.source})" for t in taken)
    where = "the pod's environment (Kubernetes)" if in_pod(env) else "the environment"
    return f"ddpkit run: from {where}: {items}"
