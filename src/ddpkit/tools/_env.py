"""``ddpkit env``: what this machine offers a DDP job, and a live two-process all-reduce."""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.platforms import LAUNCH_PREFIXES, LAUNCH_VARIABLES, scheduler
from ddpkit.platforms._cpus import cpu_count


def _live_check(device: str | None) -> int:
    import ddpkit

    rt = ddpkit.init(device=device)
    return int(ddpkit.all_reduce(rt.rank + 1))


def live_checks(gpus: int) -> list[tuple[str, int, str | None]]:
    """The all-reduces ``ddpkit env`` runs: (backend, processes, device for ``ddpkit.init``): gloo
    on 2 CPU processes; where GPUs are visible nccl too, one process per GPU up to 2."""
    return [("gloo", 2, "cpu"), *([("nccl", min(gpus, 2), None)] if gpus else [])]


def _gpu(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return (
        f"{props.name} ({props.total_memory / 2**30:.1f} GiB, compute capability "
        f"{props.major}.{props.minor})"
    )


_VARIABLES = LAUNCH_VARIABLES | {
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCH_DISTRIBUTED_DEBUG"
}  # fmt: skip
_PREFIXES = (*LAUNCH_PREFIXES, "PET_", "MPI_LOCAL", "NCCL_", "GLOO_", "TORCH_NCCL_", "DDPKIT_")


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def _memory() -> str:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every platform
        return "unknown"
    return f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)"


def internals_state() -> dict[str, str]:
    """Each private internal ddpkit relies on: "ok", or what differs and what a user gets for it."""
    from ddpkit._internals import all_internals
    from ddpkit._internals.contract import problem, version_of

    try:
        internals = all_internals()
    except Exception as err:  # a diagnostic reports, it does not crash
        return {"(all)": f"cannot be listed: {type(err).__name__}: {err}"}
    state = {}
    for internal in internals:
        version = version_of(internal.owner)
        if version.endswith("(not installed)"):
            state[internal.name] = f"not checked: {version}"
            continue
        line = problem(internal)  # the internal's name, then what differs
        state[internal.name] = (
            "ok" if line is None else "DIFFERS " + line[len(internal.name) :].lstrip()
        )
    return state


def collect(live: bool = True) -> dict[str, Any]:
    from ddpkit import __version__
    from ddpkit._launch.cli.options import resolve_nproc
    from ddpkit.data import default_num_workers

    gpus = torch.cuda.device_count()
    cuda = gpus > 0 and torch.cuda.is_available()
    info: dict[str, Any] = {
        "ddpkit": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "os": platform.platform(),
        "memory": _memory(),
        "cuda available": cuda,
        "cuda (build)": torch.version.cuda,
        "gpus": [_gpu(i) for i in range(gpus)] if cuda else [],
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "bf16 on the GPU": torch.cuda.is_bf16_supported() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))
        if cuda and dist.is_nccl_available()
        else None,
        "gloo available": dist.is_available() and dist.is_gloo_available(),
        "cpu cores (usable)": cpu_count(),
        "scheduler": scheduler(os.environ) or "none detected",
    }
    # the launcher's, scheduler's and communication's; a secret is reported as set, never shown
    variables = {
        k: "(set, not shown)" if "SECRET" in k else v
        for k, v in sorted(os.environ.items())
        if k in _VARIABLES or k.startswith(_PREFIXES)
    }
    info["distributed variables set"] = variables or "none"
    nproc = resolve_nproc("auto")
    info["ddpkit run --nproc auto"] = nproc
    info["loader workers per rank"] = default_num_workers(nproc)
    info["threads per rank"] = max(1, cpu_count() // nproc)
    state = internals_state()
    unchecked = sum(value.startswith("not checked") for value in state.values())
    differing = sum(value != "ok" for value in state.values()) - unchecked
    counts = f"{differing} of {len(state) - unchecked} differ" + (
        f", {unchecked} not checked" if unchecked else ""
    )
    info[f"private internals relied on ({counts})"] = state
    if live:
        for backend, nprocs, device in live_checks(gpus if cuda else 0):
            key = f"live check ({nprocs} process{'es' if nprocs > 1 else ''}, {backend} all-reduce)"
            info[key] = _run_live_check(nprocs, device)
    return info


def _run_live_check(nprocs: int, device: str | None) -> str:
    from ddpkit.distributed._spawn import spawn

    start = time.perf_counter()
    try:
        sums = spawn(functools.partial(_live_check, device), nprocs)
    except Exception as err:  # report, do not crash: this is a diagnostic
        return f"FAILED: {type(err).__name__}: {err}"
    expected = [nprocs * (nprocs + 1) // 2] * nprocs
    verdict = "ok" if sums == expected else f"WRONG RESULT {sums!r}, expected {expected!r}"
    return f"{verdict} in {time.perf_counter() - start:.1f}s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddpkit env",
        description="Print what this machine offers a DDP job (versions, devices, cores, memory, "
        "the launcher and\nscheduler variables that are set, the choices `ddpkit run` would make, "
        "whether each private internal of\ntorch, CPython, numpy or Optuna that ddpkit relies on "
        "still has the shape it relies on) and check a\ntwo-process all-reduce.",
        epilog="examples:\n  ddpkit env\n  ddpkit env --no-live      # skip the all-reduce check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--no-live", action="store_true", help="skip the two-process rendezvous check"
    )
    ns = parser.parse_args(argv)
    info = collect(live=not ns.no_live)
    width = max(len(k) for k, v in info.items() if not isinstance(v, dict))
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key:<{width}}")
            separator = ": " if key.startswith("private internals") else "="
            for name, setting in value.items():
                print(f"  {name}{separator}{setting}")
        else:
            print(f"{key:<{width}}  {value}")
    live = [str(v) for k, v in info.items() if k.startswith("live check")]
    return 0 if all(v.startswith("ok") for v in live) else 1
