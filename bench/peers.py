"""ddpkit against raw DDP and its peers: the same tiny model, data and steps in every framework,
each under torchrun.

The case of pytorch/examples' ddp-tutorial-series, at the size where a framework's per-step cost
shows: 2 ranks over gloo on the CPU, 1 thread each (``OMP_NUM_THREADS=1``), a plain map-style
``Dataset`` holding a list of ``(torch.rand(20), torch.rand(1))`` pairs, read in the main process
(no loader workers), batch 16 per rank, an MLP 20-H-H-1 with MSE loss and SGD. Each framework's loop
is written as its users write it:

- ``raw``: ``init_process_group`` + ``DistributedDataParallel`` +
  ``DataLoader(sampler=DistributedSampler)``, the tutorial's loop;
- ``ddpkit-loop``: ``ddpkit.init()``, ``ddpkit.prepare_model``,
  ``ddpkit.build_loader(..., num_workers=0)``;
- ``ddpkit-trainer``: ``ddpkit.Trainer`` (no loader workers, no snapshot at the epoch's end, no
  progress bar);
- ``accelerate``: Hugging Face Accelerate, ``Accelerator(cpu=True).prepare(model,
  optimizer, loader)``;
- ``fabric``: Lightning Fabric, ``Fabric(accelerator="cpu", strategy="ddp", devices=2)``, ``setup``,
  ``setup_dataloaders``;
- ``lightning``: Lightning's ``Trainer`` on a ``LightningModule`` (no logger, checkpoints, progress
  bar or model summary).

Every job is one epoch of ``--warmup`` + ``--steps`` optimizer steps, launched as ``python -m
torch.distributed.run --standalone --nproc-per-node 2 bench/peers.py --framework NAME ...``, with
glibc malloc's thresholds fixed (``MALLOC_MMAP_THRESHOLD_`` and the like, as
``bench/trainer_overhead.py``'s ``steady_malloc``) for every framework alike. The ranks are not
pinned to cores: under torchrun, pinned, the steps of every framework stretched toward the
scheduler's 4 ms tick in most rounds. Step time is measured inside the job the same way for all: a
global optimizer post-step hook (every framework ends in a torch optimizer's ``step``) stamps each
step on rank 0, and the job reports the median time between consecutive steps after the warm-up, so
a step is all between two updates (loading the batch, forward, backward and its all-reduce, the
update, the framework's bookkeeping) and start-up and teardown are left out. The driver runs every
framework once per round, in an order that rotates and reverses from round to round, drops the first
round, and reports each framework's step time (median over rounds, and the rounds' range) and its
ratio to raw DDP: the median over rounds of the per-round ratio, with a distribution-free 95%
interval and the rounds' range. A peer that is not installed is skipped, saying so (``pip install -e
".[bench]"`` installs them).

    python bench/peers.py                        # 2 ranks, batch 16, 40 rounds x 300 steps
    python bench/peers.py --rounds 3 --steps 50  # a quick look (the first round is dropped)
    python bench/peers.py --only raw,ddpkit-loop,ddpkit-trainer --json peers.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, Dataset

FRAMEWORKS = {  # name: (label, the package it needs beyond torch and ddpkit)
    "raw": ("raw DDP", None),
    "ddpkit-loop": ("ddpkit loop", None),
    "ddpkit-trainer": ("ddpkit Trainer", None),
    "accelerate": ("Accelerate", "accelerate"),
    "fabric": ("Lightning Fabric", "lightning"),
    "lightning": ("Lightning Trainer", "lightning"),
}
LR = 1e-3
NPROC = 2  # Fabric and Lightning name their devices: devices=2, as their users write it


class MyTrainDataset(Dataset):
    """pytorch/examples' ddp-tutorial-series dataset: random pairs in a list, read as they are."""

    def __init__(self, size: int) -> None:
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


# The programs, one per framework. Each gets the dataset, the model and the per-rank batch, and
# trains one epoch.


def run_raw(data: Dataset, model: nn.Module, batch_size: int) -> None:
    from torch.distributed import destroy_process_group, init_process_group
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    init_process_group(backend="gloo")
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(
        data, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(data)
    )
    loader.sampler.set_epoch(0)
    for source, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(source), targets)
        loss.backward()
        optimizer.step()
    destroy_process_group()


def run_ddpkit_loop(data: Dataset, model: nn.Module, batch_size: int) -> None:
    import ddpkit

    ddpkit.init()
    model = ddpkit.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = ddpkit.build_loader(data, batch_size, num_workers=0)
    for source, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(source), targets)
        loss.backward()
        optimizer.step()
    ddpkit.shutdown()


def run_ddpkit_trainer(data: Dataset, model: nn.Module, batch_size: int, run_dir: str) -> None:
    import ddpkit
    from ddpkit import LoggingConfig, SnapshotConfig, Trainer, TrainerConfig

    ddpkit.init()
    config = TrainerConfig(
        run_dir=run_dir,
        batch_size=batch_size,
        epochs=1,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(progress=False),
    )
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        data,
        config,
        loss_fn=nn.functional.mse_loss,
    )
    trainer.fit()
    ddpkit.shutdown()


def run_accelerate(data: Dataset, model: nn.Module, batch_size: int) -> None:
    from accelerate import Accelerator

    # cpu=True, as `accelerate launch --cpu` sets it: without a GPU, Accelerate takes torchrun's
    # ranks for a multi-CPU job only when told (otherwise each rank trains alone, on all the data).
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for source, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(source), targets)
        accelerator.backward(loss)
        optimizer.step()
    accelerator.end_training()


def run_fabric(data: Dataset, model: nn.Module, batch_size: int) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()  # under torchrun: the processes are there already
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch_size, shuffle=True))
    for source, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(source), targets)
        fabric.backward(loss)
        optimizer.step()


def run_lightning(data: Dataset, model: nn.Module, batch_size: int) -> None:
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            source, targets = batch
            return nn.functional.mse_loss(self.net(source), targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(model), DataLoader(data, batch_size=batch_size, shuffle=True))


def job(a: argparse.Namespace) -> None:
    """One framework's run inside torchrun; rank 0 writes its step time to ``a.job_out``."""
    stamps: list[float] = []

    def stamp(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        # The SGD itself, not a framework's wrapper around it (Accelerate's is an Optimizer
        # too): one stamp a step.
        if isinstance(optimizer, torch.optim.SGD):
            stamps.append(time.perf_counter())

    register_optimizer_step_post_hook(stamp)
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)  # the same data and initial weights in every framework
    data = MyTrainDataset((a.warmup + a.steps) * a.batch_size * world)
    model = mlp(a.hidden)
    if a.framework == "ddpkit-trainer":
        run_ddpkit_trainer(data, model, a.batch_size, a.job_dir)
    else:
        PROGRAMS[a.framework](data, model, a.batch_size)
    if os.environ["RANK"] == "0":
        timed = stamps[a.warmup :]
        step = statistics.median(b - x for x, b in zip(timed, timed[1:]))
        result = {
            "framework": a.framework,
            "step_s": step,
            "steps": len(stamps),
            "threads": torch.get_num_threads(),
        }
        Path(a.job_out).write_text(json.dumps(result))


PROGRAMS = {
    "raw": run_raw,
    "ddpkit-loop": run_ddpkit_loop,
    "accelerate": run_accelerate,
    "fabric": run_fabric,
    "lightning": run_lightning,
}


def launch(a: argparse.Namespace, name: str, folder: Path, tag: str) -> dict:
    """Run ``name`` as a torchrun job of 2 ranks; its rank 0's result."""
    out, log = folder / f"{tag}.json", folder / f"{tag}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
    ]
    cmd += [
        __file__,
        "--framework",
        name,
        "--job-out",
        str(out),
        "--job-dir",
        str(folder / f"{tag}-run"),
    ]
    cmd += ["--steps", str(a.steps), "--warmup", str(a.warmup), "--batch-size", str(a.batch_size)]
    cmd += ["--hidden", str(a.hidden)]
    # glibc malloc's thresholds fixed, for every framework alike (bench/trainer_overhead.py's
    # steady_malloc, set here through glibc's environment so that no job imports ddpkit for it)
    big = str(1 << 30)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": big,
        "MALLOC_TRIM_THRESHOLD_": big,
        "MALLOC_TOP_PAD_": big,
    }
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=a.job_timeout
        )
    # the log goes with the bench's temporary folder: its end is shown here
    tail = log.read_text()[-4000:]
    if not out.exists():
        raise SystemExit(f"{name} failed (exit {proc.returncode}); the end of its output:\n{tail}")
    if proc.returncode != 0:
        # Rank 0 wrote its result after its last step, whose all-reduce every rank joined: the job
        # failed in its teardown. Seen with Lightning 2.6 on torch 2.13, now and then: a rank aborts
        # at exit with "terminate called without an active exception". The figure stands; the
        # failure is said, and marked in the report.
        said = [line for line in tail.splitlines() if "terminate" in line or "Error" in line]
        said = said or [""]
        print(f"  {name}: exit {proc.returncode} after its steps were timed ({said[0][:120]})")
    try:
        result = json.loads(out.read_text())
    except ValueError:  # rank 0 stopped while it wrote it
        raise SystemExit(
            f"{name}'s result is torn (exit {proc.returncode}); the end of its output:\n{tail}"
        ) from None
    result["exit"] = proc.returncode
    # e.g. a framework that took the ranks for separate runs
    if result["steps"] != a.warmup + a.steps:
        raise SystemExit(
            f"{name} took {result['steps']} optimizer steps, not {a.warmup + a.steps}:\n{tail}"
        )
    return result


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def drive(a: argparse.Namespace) -> None:
    # here, not at the top: it imports ddpkit, which raw DDP must not
    from trainer_overhead import median_interval

    wanted = a.only.split(",") if a.only else list(FRAMEWORKS)
    unknown = [n for n in wanted if n not in FRAMEWORKS]
    if unknown or "raw" not in wanted:
        raise SystemExit(
            f"--only: names from {', '.join(FRAMEWORKS)}, raw among them (got {a.only})"
        )
    skipped = {
        n: f"{FRAMEWORKS[n][1]} is not installed"
        for n in wanted
        if not _installed(FRAMEWORKS[n][1])
    }
    names = [n for n in wanted if n not in skipped]
    steps: dict[str, list[float]] = {n: [] for n in names}
    # per framework, the kept rounds (from 0) whose job exited non-zero after its steps
    failed_exits: dict[str, list[int]] = {n: [] for n in names}
    threads: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="ddpkit-peers-") as tmp:
        for r in range(a.rounds):
            k = r % len(names)
            order = names[k:] + names[:k]
            # every framework in every place, both ways round
            for name in order if r % 2 == 0 else order[::-1]:
                result = launch(a, name, Path(tmp), f"r{r}-{name}")
                threads.add(result["threads"])
                # the first round warms the disk cache and the imports
                if r > 0 or a.keep_first:
                    steps[name].append(result["step_s"] * 1e3)
                    if result["exit"] != 0:  # kept, and said in the report
                        failed_exits[name].append(len(steps[name]) - 1)
            kept = r > 0 or a.keep_first
            done = ", ".join(f"{n} {steps[n][-1]:.3f} ms" for n in names) if kept else "dropped"
            print(f"round {r + 1}/{a.rounds}: {done}", flush=True)
    print(
        f"date {datetime.datetime.now():%Y-%m-%d %H:%M}  machine {platform.machine()}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}  python "
        f"{platform.python_version()}  torch {torch.__version__}  "
        + "  ".join(f"{p} {version(p)}" for p in ("ddpkit", "accelerate", "lightning"))
    )
    print(
        f"config: {NPROC} ranks under torchrun (gloo, CPU, {'/'.join(map(str, sorted(threads)))} "
        "thread(s) each, fixed malloc thresholds), "
        "MyTrainDataset (a list of (rand(20), rand(1))), MLP "
        f"20-{a.hidden}-{a.hidden}-1, MSE, SGD, batch {a.batch_size}/rank, no loader workers; a "
        f"job: {a.warmup} warm-up + {a.steps} timed steps; {a.rounds} interleaved rounds, the "
        + ("first kept (a check, not a measurement)" if a.keep_first else "first dropped")
    )
    print(
        f"  {'':18s} {'ms/step (rounds: min-max)':30s} / raw DDP: median of per-round ratios (95% "
        "interval; rounds: min-max)"
    )
    report: dict = {
        "rounds": a.rounds - (0 if a.keep_first else 1),
        "skipped": skipped,
        "frameworks": {},
    }
    for name in names:
        ms = steps[name]
        ratios = sorted(x / b for x, b in zip(ms, steps["raw"]))
        lo, hi = median_interval(ratios)
        ratio = statistics.median(ratios)
        step = f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})"
        print(
            f"  {FRAMEWORKS[name][0]:18s} {step:30s} {ratio:.3f} ({lo:.3f}-{hi:.3f}; "
            f"{ratios[0]:.3f}-{ratios[-1]:.3f})"
        )
        report["frameworks"][name] = {
            "label": FRAMEWORKS[name][0],
            "step_ms": statistics.median(ms),
            "step_ms_rounds": ms,
            "ratio": ratio,
            "ratio_interval": [lo, hi],
            "ratio_range": [ratios[0], ratios[-1]],
            "rounds_failed_in_teardown": failed_exits[name],
        }
    for name, why in skipped.items():
        print(f'  {FRAMEWORKS[name][0]:18s} skipped: {why} (pip install -e ".[bench]")')
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


def _installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=40,
        help="rounds of one job per framework; the first is dropped",
    )
    p.add_argument("--steps", type=int, default=300, help="timed optimizer steps a job")
    p.add_argument("--warmup", type=int, default=20, help="optimizer steps before the timed ones")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--hidden", type=int, default=384, help="the MLP's width: sets the step time")
    p.add_argument("--only", help="a comma-separated subset of the frameworks (raw among them)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--job-timeout", type=float, default=600, help="seconds one job may take")
    # One job, under torchrun (not --run: torchrun would take it for an abbreviation of its
    # --run-path).
    p.add_argument(
        "--keep-first",
        action="store_true",
        help="keep the first round: a check that every job runs, not a measurement",
    )
    p.add_argument("--framework", choices=list(FRAMEWORKS), help=argparse.SUPPRESS)
    p.add_argument("--job-out", help=argparse.SUPPRESS)
    p.add_argument("--job-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rounds < (1 if a.keep_first else 2) or a.steps < 2 or a.warmup < 1:
        raise SystemExit(
            "--rounds at least 2 (the first is dropped; 1 with --keep-first), --steps at least 2, "
            "--warmup at least 1"
        )
    job(a) if a.framework else drive(a)


if __name__ == "__main__":
    main()
