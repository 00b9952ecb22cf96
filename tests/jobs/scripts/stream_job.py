"""Jobs on a JSON Lines stream: the Trainer on it (``python stream_job.py RUN_DIR
--data FILE [options]`` under ``ddpkit run``), and loops that only read it, for :func:`ddpkit.spawn`
(the stream's loader, and the naive sharding users write, as a control).

Every record is ``{"id": i, "x": [8 floats], "y": 0 or 1}``; the training job's transform augments
``x`` with torch, numpy and python draws, so a resume is bitwise only if each record's draws are
restored.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import ddpkit
import ddpkit.data
import ddpkit.training._trainer
from ddpkit import LoggingConfig, SnapshotConfig, Trainer, TrainerConfig
from ddpkit.data._stream_sources import IterableStream, JsonlStream
from tests.jobs.scripts.train_job import _sigkill_self, build_model, rank_state

N_RECORDS, N_FEATURES = 240, 8


def write_records(path: str | Path, n: int = N_RECORDS) -> Path:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, N_FEATURES, generator=g)
    y = (x[:, :2].sum(1) > 0).long()
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "x": x[i].tolist(), "y": int(y[i])}) + "\n")
    return Path(path)


def augment(record: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    x = torch.tensor(record["x"])
    noise = (
        0.3 * torch.randn(N_FEATURES) + float(np.random.normal(0, 0.1)) + random.uniform(-0.1, 0.1)
    )
    return x + noise, torch.tensor(record["y"]), record["id"]


def ids_only(batch: list) -> list[int]:
    return [r["id"] for r in batch]


# -- loops that read only (for ddpkit.spawn) -------------------------------------------------------


def read_steps(
    data: str,
    per_rank: int,
    *,
    workers: int,
    epochs: int = 1,
    start: tuple[int, int] = (0, 0),
    stop_after: int | None = None,
    iterable: bool = False,
    window: int = 16,
) -> list[list[list[int]]]:
    """Each rank's record ids, step by step, from global cursor ``start = (epoch, cursor)``;
    gathered: one list of steps per rank. ``iterable``: the same file through
    :class:`IterableStream` (read front to back)."""
    ddpkit.init()
    if iterable:
        lines = _Lines(data)
        stream = IterableStream(lines, num_records=sum(1 for _ in lines), window=window)
    else:
        stream = JsonlStream(data, window=window)
    loader = ddpkit.build_loader(
        stream, per_rank, seed=11, num_workers=workers, collate_fn=ids_only
    )
    steps: list[list[int]] = []
    loader.batch_sampler.set_position(*start)
    for _ in range(epochs):
        for batch in loader:
            steps.append(batch)
            if stop_after is not None and len(steps) == stop_after:
                break
    return ddpkit.all_gather_object(steps)


class _Lines:
    """A file's records, read front to back on every ``iter()`` (a source with no positional
    read)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __iter__(self):
        with open(self.path) as f:
            for line in f:
                yield json.loads(line)


class NaiveShards(IterableDataset):
    """The usual streaming split: rank ``r``'s worker ``w`` of ``W`` takes every ``(world x W)``-th
    record from ``r x W + w``, and a resume skips, in each worker's share, the cursor's worth of
    records (``cursor / (world x W)``). ``by_worker=False``: split by rank only, as a plain
    IterableDataset is."""

    def __init__(
        self, path: str, rank: int, world: int, cursor: int = 0, by_worker: bool = True
    ) -> None:
        self.path, self.rank, self.world, self.cursor, self.by_worker = (
            path,
            rank,
            world,
            cursor,
            by_worker,
        )

    def __iter__(self):
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None and self.by_worker else (0, 1)
        records = (json.loads(line) for line in open(self.path))
        mine = itertools.islice(records, self.rank * nw + w, None, self.world * nw)
        return itertools.islice(mine, self.cursor // (self.world * nw), None)


def naive_steps(
    data: str,
    per_rank: int,
    *,
    workers: int,
    cursor: int = 0,
    stop_after: int | None = None,
    by_worker: bool = True,
) -> list[list[list[int]]]:
    """:func:`read_steps` with :class:`NaiveShards` in a plain DataLoader (the control)."""
    rt = ddpkit.init()
    shards = NaiveShards(data, rt.rank, rt.world_size, cursor, by_worker)
    loader = DataLoader(shards, batch_size=per_rank, num_workers=workers, collate_fn=ids_only)
    steps = list(itertools.islice(loader, stop_after))
    return ddpkit.all_gather_object(steps)


# -- the training job (under ddpkit run) -----------------------------------------------------------


def train(
    run_dir: str,
    data: str,
    *,
    global_batch: int = 24,
    epochs: int = 2,
    workers: int = 2,
    max_steps: int | None = None,
    kill_rank: int | None = None,
    kill_step: int | None = None,
    sample_log: str | None = None,
    out: str | None = None,
    seed_samples: bool = True,
) -> dict:
    rt = ddpkit.init()
    model = build_model(batchnorm=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    config = TrainerConfig(
        run_dir=run_dir,
        epochs=epochs,
        max_steps=max_steps,
        global_batch_size=global_batch,
        sync_batchnorm=False,
        scheduler_interval="step",
        seed=3,
        num_workers=workers,
        seed_samples=seed_samples,  # False for the control: each worker draws from its own stream
        snapshot=SnapshotConfig(every_steps=3, keep=3),
        logging=LoggingConfig(progress=False, every_steps=5),
    )
    attempt = rt.restart_count
    log = (
        open(Path(sample_log) / f"rank{rt.rank}-world{rt.world_size}.jsonl", "a", buffering=1)
        if sample_log
        else None
    )

    def batch_loss(model, batch):
        x, y, ids = batch
        if (
            kill_step is not None
            and attempt == 0
            and rt.rank == kill_rank
            and trainer.step == kill_step
        ):
            _sigkill_self(sample_log, f"rank{rt.rank}-step{kill_step}")
        if log is not None:
            log.write(
                json.dumps(
                    {
                        "attempt": attempt,
                        "world": rt.world_size,
                        "epoch": trainer.epoch,
                        "step": trainer.step,
                        "idx": ids.tolist(),
                    }
                )
                + "\n"
            )
        return torch.nn.functional.cross_entropy(model(x), y)

    stream = JsonlStream(data, transform=augment, window=64)
    trainer = Trainer(
        model, optimizer, stream, config, scheduler=scheduler, batch_loss_fn=batch_loss
    )
    trainer.fit()
    final = {
        "model": {k: v.clone() for k, v in ddpkit.unwrap(trainer.model).state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "step": trainer.step,
        "resumed_from": trainer.resumed_from,
        "attempt": attempt,
    }
    if out and rt.is_main:
        torch.save(final, out)
    if out:
        torch.save(rank_state(trainer), f"{out}.rank{rt.rank}")
    return final


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--sample-log", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--unseeded-samples", action="store_true")
    a = p.parse_args()
    train(
        a.run_dir,
        a.data,
        epochs=a.epochs,
        workers=a.workers,
        max_steps=a.max_steps,
        kill_rank=a.kill_rank,
        kill_step=a.kill_step,
        sample_log=a.sample_log,
        out=a.out,
        seed_samples=not a.unseeded_samples,
    )
    ddpkit.shutdown()
