"""``ddpkit env``: what this machine offers a DDP job, and a live two-process all-reduce."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.cluster import cpu_count, scheduler


def _live_check() -> int:
    import ddpkit

    rt = ddpkit.init()
    return int(ddpkit.all_reduce(rt.rank + 1))


# Variables through which launchers, schedulers and the communication libraries are steered.
_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NSLOTS",
              "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCH_DISTRIBUTED_DEBUG")
_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PET_", "OMPI_COMM_WORLD_", "PMI_", "MPI_LOCAL", "NCCL_", "GLOO_",
             "TORCH_NCCL_", "DDPKIT_")


def distributed_variables(env: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher, scheduler and communication variables set in ``env`` (this process's by default)."""
    env = dict(os.environ) if env is None else env
    # A secret (DDPKIT_RDZV_SECRET) is reported as set, never shown: this output is pasted into bug reports.
    return {k: "(set, not shown)" if "SECRET" in k else env[k] for k in sorted(env)
            if k in _VARIABLES or k.startswith(_PREFIXES)}


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


def collect(live: bool = True) -> dict[str, Any]:
    from ddpkit.data import default_num_workers
    from ddpkit.launcher import resolve_nproc

    from ddpkit import __version__

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "ddpkit": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "os": platform.platform(),
        "memory": _memory(),
        "cuda available": cuda,
        "cuda (build)": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else None,
        "gloo available": dist.is_available() and dist.is_gloo_available(),
        "cpu cores (usable)": cpu_count(),
        "scheduler": scheduler() or "none detected",
    }
    info["distributed variables set"] = distributed_variables() or "none"
    nproc = resolve_nproc("auto")
    info["ddpkit run --nproc auto"] = nproc
    info["loader workers per rank"] = default_num_workers(nproc)
    info["threads per rank"] = max(1, cpu_count() // nproc)
    if live:
        from ddpkit.spawn import spawn

        start = time.perf_counter()
        try:
            sums = spawn(_live_check, 2)
            ok = sums == [3, 3]
            info["live check (2 processes, gloo all-reduce)"] = (
                f"{'ok' if ok else 'WRONG RESULT ' + repr(sums)} in {time.perf_counter() - start:.1f}s"
            )
        except Exception as err:  # report, do not crash: this is a diagnostic
            info["live check (2 processes, gloo all-reduce)"] = f"FAILED: {type(err).__name__}: {err}"
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddpkit env",
        description="Print what this machine offers a DDP job (versions, devices, cores, memory, the launcher and\n"
        "scheduler variables that are set, the choices `ddpkit run` would make) and check a two-process all-reduce.",
        epilog="examples:\n  ddpkit env\n  ddpkit env --no-live      # skip the all-reduce check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--no-live", action="store_true", help="skip the two-process rendezvous check")
    ns = parser.parse_args(argv)
    info = collect(live=not ns.no_live)
    width = max(map(len, info))
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key:<{width}}")
            for name, setting in value.items():
                print(f"  {name}={setting}")
        else:
            print(f"{key:<{width}}  {value}")
    return 0 if "FAILED" not in str(info.get("live check (2 processes, gloo all-reduce)", "")) else 1
