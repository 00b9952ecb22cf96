"""Ray, where ddpkit reaches past its public API.

- ``ray.experimental.internal_kv._internal_kv_get`` / ``_internal_kv_put``: the cluster's key-value
  store (in Ray's GCS, which outlives the workers). Ray Train restarts its whole worker group after
  a failure (``FailureConfig(max_failures=N)``) but its context holds no count of those restarts;
  each rank counts its own starts there, under the Ray job and the run's name, and the count before
  this start is the runtime's ``restart_count`` (:func:`ddpkit.distributed._runtime.init`). Where
  the store is not as relied on, the count stays 0 with one warning.

Ray is optional (``ddpkit[ray]``): this module imports without it, and its check returns None where
Ray is not installed. The check reads Ray's source and never imports Ray (see :func:`kv_source`).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from ddpkit._internals.contract import Internal, warn_lost

NAMESPACE = "ddpkit"
_KV = "ray.experimental.internal_kv"


def kv_source() -> Path | None:
    """The file of Ray's ``internal_kv`` module, found without importing Ray (None where Ray is not
    installed).

    Importing Ray takes seconds and starts threads of its own, in whatever process runs the checks
    (``ddpkit env``, a launcher before it forks its workers): the check reads the module's source
    instead."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "experimental" / "internal_kv.py"


def count_start(rank: int, job: str) -> int:
    """How many times this rank of this Ray Train run started before (0 at the first start),
    counting this one.

    The key: the Ray job (``job``, :func:`ddpkit.platforms._ray.job_id`, one per driver), the run's
    experiment name and the rank."""
    if problem := _check_kv():
        warn_lost(
            f"{_KV}._internal_kv_get/_put", "Ray", f"restart_count under Ray Train ({problem})"
        )
        return 0
    import ray.train
    from ray.experimental import internal_kv

    key = f"restarts/{job}/{ray.train.get_context().get_experiment_name()}/{rank}"
    before = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
    count = int(before) if before else 0
    internal_kv._internal_kv_put(key, str(count + 1).encode(), overwrite=True, namespace=NAMESPACE)
    return count


def _check_kv(source: Path | None = None) -> str | None:
    source = kv_source() if source is None else source
    if source is None:
        return None
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return f"{_KV} is gone"
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for name, keywords in (
        ("_internal_kv_get", {"namespace"}),
        ("_internal_kv_put", {"namespace", "overwrite"}),
    ):
        if name not in functions:
            return f"{_KV} has no {name}"
        args = functions[name].args
        taken = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        if missing := keywords - taken:
            return f"{_KV}.{name} takes no {', '.join(sorted(missing))}"
    return None


INTERNALS = [
    Internal(
        f"{_KV}._internal_kv_get/_put",
        "Ray",
        "the count of Ray Train's worker-group restarts (Runtime.restart_count under launcher "
        "'ray'); without it the count stays 0",
        _check_kv,
    ),
]
