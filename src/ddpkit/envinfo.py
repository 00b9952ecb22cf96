"""``ddpkit env``: what this machine offers a DDP job, and a live two-process all-reduce."""

from __future__ import annotations

import argparse
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


def collect(live: bool = True) -> dict[str, Any]:
    from ddpkit.data import default_num_workers
    from ddpkit.launcher import resolve_nproc

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda available": cuda,
        "cuda (build)": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else None,
        "gloo available": dist.is_available() and dist.is_gloo_available(),
        "cpu cores (usable)": cpu_count(),
        "scheduler": scheduler() or "none detected",
    }
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
    parser = argparse.ArgumentParser(prog="ddpkit env", description=__doc__)
    parser.add_argument("--no-live", action="store_true", help="skip the two-process rendezvous check")
    ns = parser.parse_args(argv)
    info = collect(live=not ns.no_live)
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0 if "FAILED" not in str(info.get("live check (2 processes, gloo all-reduce)", "")) else 1
