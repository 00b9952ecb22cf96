"""The job of the in-place recovery edge tests: a hand loop written as docs/snapshots.md shows (or,
with ``--trainer``, the Trainer) with copies in memory after every step, and failures planned at the
edges of a recovery.

    ddpkit run --nproc 4 --max-restarts 5 --recover in-place \\
        tests/jobs/scripts/recover_job.py RUN_DIR --log LOG [--fail KIND:RANK:ATTEMPT[:ARG]]...

A failure's ``ATTEMPT`` is the run's restart count (``TORCHELASTIC_RESTART_COUNT``: a survivor's
rerun counts one more). Kinds: ``raise-before-init``, ``kill-before-init``, ``stop-before-init``,
``sleep-before-init:SECONDS``, ``told-before-init`` (waits until its agent has opened a recovery:
the other ranks are being told), ``kill-after-step:STEP``, ``stop-after-step:STEP``. Every run of
the script writes a line to ``LOG/rank<R>.jsonl`` at its top: its attempt, pid, the optimizers and
modules alive in the process (the collector's), its resident memory and open files; at the end
each rank writes
its weights to ``LOG/final-rank<R>.pt``. ``--control KIND``: ``keep-global``, the run keeps its
optimizer in a module's global (what a rerun cannot let go of); ``no-reset``, torch's count of
process groups left as a failed run leaves it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import signal
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--log", required=True)
    p.add_argument("--fail", action="append", default=[])
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--control", default=None, choices=["keep-global", "no-reset"])
    p.add_argument("--hidden", type=int, default=64, help="the model's width (its memory)")
    p.add_argument("--steps", type=int, default=60)
    return p.parse_args()


def due(a: argparse.Namespace, kind: str) -> str | None:
    """The argument of a failure ``kind`` planned for this rank's run, "" without one; else None."""
    for fail in a.fail:
        name, rank, attempt, *arg = fail.split(":")
        if (name, int(rank), int(attempt)) == (kind, RANK, ATTEMPT):
            return arg[0] if arg else ""
    return None


def top(a: argparse.Namespace) -> None:
    """A line at the top of this run: what the process holds of earlier runs."""
    gc.collect()
    # freed memory given back first: the resident size counts what is alive, not the allocator's
    # free lists (which threads' arenas keep as it happens)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    alive = gc.get_objects()
    record = {
        "attempt": ATTEMPT,
        "pid": os.getpid(),
        "optimizers": sum(isinstance(o, torch.optim.Optimizer) for o in alive),
        "modules": sum(isinstance(o, torch.nn.Module) for o in alive),
        "rss": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
        "fds": len(os.listdir("/proc/self/fd")),
    }
    with open(Path(a.log) / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def keep(a: argparse.Namespace, optimizer: torch.optim.Optimizer) -> None:
    """``keep-global``: the optimizer kept in a cache of a module of the script's own."""
    if a.control == "keep-global":
        cache = sys.modules.setdefault("leaky_cache", types.ModuleType("leaky_cache"))
        cache.__dict__.setdefault("kept", []).append(optimizer)


def controls(a: argparse.Namespace) -> None:
    if a.control == "no-reset":
        from ddpkit._internals import groups

        groups.reset_process_groups = lambda: None  # type: ignore[assignment]


def before_init(a: argparse.Namespace) -> None:
    if (seconds := due(a, "sleep-before-init")) is not None:
        time.sleep(float(seconds))  # the planned edge made likely; any order passes the tests
    if due(a, "told-before-init") is not None:
        from ddpkit.distributed import _channels as channels

        incident = channels.channel(channels.RECOVER) / "incident"  # type: ignore[operator]
        while not incident.exists():
            time.sleep(0.01)
    if due(a, "raise-before-init") is not None:
        raise RuntimeError("planned failure before init()")
    if due(a, "stop-before-init") is not None:
        os.kill(os.getpid(), signal.SIGSTOP)
    if due(a, "kill-before-init") is not None:
        os.kill(os.getpid(), signal.SIGKILL)


def after_step(a: argparse.Namespace, step: int) -> None:
    if due(a, "kill-after-step") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    if due(a, "stop-after-step") == str(step):
        os.kill(os.getpid(), signal.SIGSTOP)


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(960, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2),
    )  # fmt: skip


def hand_loop(a: argparse.Namespace) -> torch.nn.Module:
    import ddpkit

    ddpkit.init()
    ddpkit.seed_everything(0)
    net = ddpkit.prepare_model(model(a.hidden))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    keep(a, optimizer)
    loader = ddpkit.build_loader(data(), batch_size=8)
    snapshots = ddpkit.Snapshots(
        a.run_dir, model=net, optimizer=optimizer, loader=loader, every_steps=None,
        memory=True, memory_every_steps=1,
    )  # fmt: skip
    snapshots.resume()
    while snapshots.steps < a.steps:
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            snapshots.step()
            after_step(a, snapshots.steps)
            if snapshots.steps == a.steps:
                break
    snapshots.close()
    return ddpkit.unwrap(net)


def trainer(a: argparse.Namespace) -> torch.nn.Module:
    import ddpkit
    from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig

    ddpkit.init()

    class Plan(ddpkit.Callback):
        def on_step_end(self, trainer, taken, output) -> None:  # noqa: ANN001
            after_step(a, trainer.step)

    torch.manual_seed(0)
    config = TrainerConfig(
        run_dir=a.run_dir, global_batch_size=32, max_steps=a.steps, epochs=100, num_workers=0,
        logging=LoggingConfig(progress=False),
        snapshot=SnapshotConfig(memory=True, memory_every_steps=1, every_epochs=0),
    )  # fmt: skip
    net = model(a.hidden)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    keep(a, optimizer)
    fit = ddpkit.Trainer(net, optimizer, data(), config, callbacks=[Plan()])
    fit.fit()
    return ddpkit.unwrap(fit.model)


def main() -> None:
    a = parse()
    top(a)
    controls(a)
    before_init(a)
    net = trainer(a) if a.trainer else hand_loop(a)
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    torch.save(weights, Path(a.log) / f"final-rank{RANK}.pt")
    import ddpkit

    ddpkit.shutdown()


if __name__ == "__main__":
    main()
