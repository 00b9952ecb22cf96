"""A hand-written loop on ddpkit's primitives (no Trainer) that snapshots with ``ddpkit.Snapshots``.

A small MLP with BatchNorm (each rank's own running statistics unless ``--sync-bn``) and dropout,
Adam, and an LR scheduler stepped after each epoch's batches, on 48 samples: global batch 12, 4
steps an epoch, 5 epochs. Each rank writes its final weights, optimizer state and the (epoch, index
in epoch, step) of every batch it trained on to ``OUT-rank<R>.pt``.

    ddpkit run --nproc 2 --max-restarts 1 tests/jobs/scripts/hand_loop_job.py RUN_DIR
        --out OUT --kill-step 7

``--kill-step K``: on the first attempt, ``--kill-rank`` sends itself SIGKILL right after step K
(once the snapshot being written, if any, is whole). ``--stop-after K``: every rank stops after step
K, its snapshots written (to resume at another world size). ``--memory``: copies in shared memory
after steps (``--every-steps 0``: none on disk). ``--control``: what a resume leaves out:
``streams`` (the random streams stay as the fresh process seeded them), ``loader`` (the loader's
position is not saved).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import ddpkit

N_SAMPLES, FEATURES, CLASSES, GLOBAL_BATCH, EPOCHS = 48, 8, 3, 12, 5


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, CLASSES, (N_SAMPLES,), generator=g))


def train(
    run_dir: str | Path,
    *,
    batch_size: int,
    every_steps: int | None = 3,
    dropout: bool = True,
    sync_bn: bool = False,
    control: str | None = None,
    stop_after: int | None = None,
    kill: tuple[int, int] | None = None,
    async_write: bool = True,
    memory: bool = False,
) -> dict[str, Any]:
    """Train (resuming from ``run_dir`` when it holds a snapshot); this rank's final state and
    batches."""
    rt = ddpkit.get_runtime()
    ddpkit.seed_everything(0)
    # No bias before BatchNorm: its gradient is 0 up to rounding, which Adam would scale up to whole
    # steps, and runs at different world sizes (other summation orders) would drift apart on it
    # alone.
    layers = [torch.nn.Linear(FEATURES, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU()]
    layers += [torch.nn.Dropout(0.3)] if dropout else []
    net = torch.nn.Sequential(*layers, torch.nn.Linear(16, CLASSES))
    model = ddpkit.prepare_model(net, sync_batchnorm=sync_bn)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    loader = ddpkit.build_loader(dataset(), batch_size=batch_size, num_workers=0)
    snapshots = ddpkit.Snapshots(
        run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=None if control == "loader" else loader,
        every_steps=every_steps,
        async_write=async_write,
        memory=memory,
        # not an interval chosen from timings: the test counts steps
        memory_every_steps=1 if memory else None,
    )
    fresh = torch.get_rng_state()
    resumed_from = snapshots.resume()
    if control == "streams":
        # a resume without the random streams: as seed_everything left them
        torch.set_rng_state(fresh)
    batches = []
    for epoch in range(loader.epoch, EPOCHS):
        model.train()
        for i, (x, y) in enumerate(loader, start=loader.batch_in_epoch):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            batches.append((epoch, i, snapshots.steps + 1))
            snapshots.step()
            if kill is not None and rt.restart_count == 0 and (rt.rank, snapshots.steps) == kill:
                # the snapshot in flight whole first: the restart resumes from the newest one due
                snapshots.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            # as if killed here, once the writes under way are whole
            if snapshots.steps == stop_after:
                snapshots.close()
                return {"stopped": stop_after}
        scheduler.step()
    snapshots.close()
    return {
        "model": {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()},
        "optim": optimizer.state_dict(),
        "batches": batches,
        "resumed_from": resumed_from,
        "attempt": rt.restart_count,
        "steps": snapshots.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--batch-size", type=int, default=None, help="per rank (default: the global batch / ranks)"
    )
    parser.add_argument("--every-steps", type=int, default=3, help="0: no disk snapshots")
    parser.add_argument(
        "--memory", action="store_true", help="copies in shared memory after every step"
    )
    parser.add_argument("--no-dropout", action="store_true")
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--control", choices=["streams", "loader"])
    parser.add_argument("--kill-step", type=int)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--stop-after", type=int)
    args = parser.parse_args()
    rt = ddpkit.init()
    Path(f"{args.out}-pid-rank{rt.rank}-attempt{rt.restart_count}").write_text(str(os.getpid()))
    result = train(
        args.run_dir,
        batch_size=args.batch_size or GLOBAL_BATCH // rt.world_size,
        every_steps=args.every_steps or None,
        memory=args.memory,
        dropout=not args.no_dropout,
        sync_bn=args.sync_bn,
        control=args.control,
        stop_after=args.stop_after,
        kill=None if args.kill_step is None else (args.kill_rank, args.kill_step),
    )
    torch.save(result, f"{args.out}-rank{rt.rank}.pt")
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
