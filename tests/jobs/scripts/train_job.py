"""The job the resume tests train: an MLP with BatchNorm and dropout, Adam, a per-step LR schedule.

Runs under ``ddpkit run`` (``python train_job.py RUN_DIR [options]``) or on ranks of the test's
process (:func:`train_on_ranks`). Test hooks live here, not in ddpkit: killing this process at a
step or inside a snapshot write (after damaging the newest snapshot, if asked), filling the disk,
logging every sample it trains on, and the controls: leaving a part of the snapshot out on restore,
or saving each rank's own values as one copy per key. With ``out``, rank 0 writes its final state
there and every rank ``r`` its own to ``out.rank<r>``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import ddpkit
import ddpkit._fs
import ddpkit.data
import ddpkit.training._trainer
from ddpkit.distributed._seeding import rng_state, set_rng_state
from ddpkit.strategies import strategy_config
from ddpkit.strategies._base import join_own
from ddpkit.testing import Job, run_job, run_on_ranks
from ddpkit.training._config import (
    EarlyStoppingConfig,
    LoggingConfig,
    SnapshotConfig,
    TrainerConfig,
)
from ddpkit.training._trainer import Trainer

N_SAMPLES, N_FEATURES = 240, 8


class IndexedData(torch.utils.data.Dataset):
    """A fixed classification set whose batches carry their sample indices."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)[:n]
        self.y = (self.x[:, :2].sum(1) + 0.3 * torch.randn(N_SAMPLES, generator=g)[:n] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class AugmentedData(IndexedData):
    """The same set, each read perturbed with torch, numpy and python random draws
    (augmentation)."""

    def __getitem__(self, i: int):
        noise = (
            0.3 * torch.randn(N_FEATURES)
            + float(np.random.normal(0, 0.1))
            + random.uniform(-0.1, 0.1)
        )
        return self.x[i] + noise, self.y[i], i


def build_model(batchnorm: bool = True, hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would amplify to
        # full steps.
        nn.Linear(N_FEATURES, hidden, bias=False),
        nn.BatchNorm1d(hidden) if batchnorm else nn.Identity(),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(hidden, 2),
    )


class SabotagedTrainer(Trainer):
    """Leaves one part of the snapshot out when resuming: what a test must catch."""

    drop: str | None = None

    def load_state_dict(self, state):
        rng_before = rng_state()
        super().load_state_dict(state)
        if self.drop == "rng":
            set_rng_state(rng_before)
        elif self.drop == "cursor":
            self.cursor = 0
        elif self.drop == "early_stopping":
            self.early_stopping.best, self.early_stopping.bad_epochs = None, 0
        elif self.drop == "scheduler":
            self.scheduler.load_state_dict(
                torch.optim.lr_scheduler.StepLR(self.optimizer, 4, 0.7).state_dict()
            )
            for group in self.optimizer.param_groups:
                group["lr"] = 0.05


def _sigkill_self(marks: str | None, what: str) -> None:
    """SIGKILL this process, first leaving ``marks/killed-<what>`` as proof that the kill was sent
    (the agent's own log names one failed worker only, and it may name the peer whose collective
    failed first)."""
    if marks is not None:
        Path(marks, f"killed-{what}").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _damage_newest_snapshot(trainer) -> None:
    """Flip the last bytes of rank 1's file in the newest whole snapshot: the restart must skip
    it."""
    trainer.wait_for_snapshot()
    newest = sorted((trainer.run_dir / "snapshots").glob("step-*/complete.json"))[-1].parent
    part = newest / "__1_0.distcp"
    data = part.read_bytes()
    part.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))


def _fill_disk(trainer) -> None:
    """Fill the file system of the snapshots (a small one the test mounted) once the last write is
    done."""
    trainer.wait_for_snapshot()
    with open(trainer.run_dir / "snapshots" / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass


def one_copy_per_key(strategy) -> None:
    """Save and load each rank's own values (buffers) under the shared names, as DCP keeps one copy
    of a key that every rank saves: the control for per-rank buffers."""
    state_dict = strategy.state_dict
    strategy.state_dict = lambda: join_own(state_dict())


def rank_state(trainer) -> dict:
    """Everything this rank holds of model and optimizer (shards as local tensors), its RNG and
    scheduler."""
    from torch.distributed.tensor import DTensor

    out = {"rng": torch.get_rng_state(), "scheduler": trainer.scheduler.state_dict()}

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = (
                    (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
                    if isinstance(v, torch.Tensor)
                    else v
                )

    walk(join_own(trainer.strategy.state_dict()), "")
    return out


def _kill_inside_snapshot_write(call_to_kill: int, marks: str | None) -> None:
    calls = {"n": 0}
    write = ddpkit._fs.write_atomic

    def dying_write(path, data, **kw):
        calls["n"] += 1
        if calls["n"] == call_to_kill:
            tmp = path.with_name(f".{path.name}.dead.tmp")
            tmp.write_bytes(data[: len(data) // 2])  # half a file, then gone
            _sigkill_self(marks, f"in-write-{call_to_kill}")
        write(path, data, **kw)

    ddpkit._fs.write_atomic = dying_write


def train(
    run_dir: str,
    *,
    global_batch: int = 24,
    epochs: int = 3,
    max_steps: int | None = None,
    kill_rank: int | None = None,
    kill_step: int | None = None,
    kill_in_snapshot: int | None = None,
    drop: str | None = None,
    sample_log: str | None = None,
    sync_batchnorm: bool = True,
    dropout: bool = True,
    global_dropout: bool = False,
    batchnorm: bool = True,
    grad_accum: int = 1,
    precision: str = "fp32",
    on_nonfinite: str = "stop",
    event: tuple[str, int, int] | None = None,
    early_stopping_patience: int | None = None,
    snapshot_every_steps: int | None = 3,
    log_every_steps: int = 20,
    tensorboard: bool = False,
    clip_grad_norm: float | None = None,
    out: str | None = None,
    trainer_hook=None,
    lr: float = 0.05,
    hidden: int = 32,
    seed: int = 0,
    resume: bool = True,
    augment: bool = False,
    num_workers: int = 0,
    unseeded_samples: bool = False,
    raise_on_stop_signal: bool = True,
    catch_preempted: bool = True,
    callbacks=(),
    loggers: tuple[str, ...] = (),
    strategy: str = "ddp",
    strategy_options: dict | None = None,
    snapshot_async: bool = True,
    n_samples: int = N_SAMPLES,
    drop_last: bool = True,
    damage_newest: bool = False,
    kill_after_write: bool = False,
    fill_disk_at: int | None = None,
    shared_buffers: bool = False,
    val_every_steps: int | None = None,
    weights_format: str | None = "safetensors",
    compile: bool = False,
    snapshot_every_epochs: int = 1,
    memory: bool = False,
    memory_every_steps: int | None = None,
) -> dict:
    """Train the job; ``event=(what, rank, step)`` makes ``rank`` produce a NaN loss (``nan``), an
    infinite loss whose gradients are finite (``inf``), a NaN loss whose gradients are zero
    (``ignored``: every target is ``ignore_index``), raise (``raise``, on the first attempt only) or
    receive SIGUSR1 (``signal``) when it reaches ``step``. ``unseeded_samples``: the loader leaves
    augmentation to each worker's own stream (the behaviour before samples were seeded from (seed,
    epoch, index)), for the controls. ``damage_newest``: the rank that kills itself first damages
    the newest snapshot; ``kill_after_write``: it first waits for the snapshot in flight.
    ``fill_disk_at``: rank 0 fills the disk of the snapshots at that step. ``shared_buffers``:
    :func:`one_copy_per_key`. ``val_every_steps``: validate every that many steps, keeping the best
    ``val/loss`` (early stopping after ``early_stopping_patience`` validations, if given).
    ``memory``: snapshots in memory too (under ``ddpkit run``)."""
    rt = ddpkit.init()
    model = build_model(batchnorm, hidden)
    if not dropout:
        model[3].p = 0.0
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    config = TrainerConfig(
        run_dir=run_dir,
        seed_samples=not unseeded_samples,
        epochs=epochs,
        max_steps=max_steps,
        global_batch_size=global_batch,
        sync_batchnorm=sync_batchnorm,
        global_batch_dropout=global_dropout,
        scheduler_interval="step",
        clip_grad_norm=clip_grad_norm,
        grad_accum_steps=grad_accum,
        precision=precision,
        on_nonfinite=on_nonfinite,
        seed=seed,
        resume=resume,
        num_workers=num_workers,
        raise_on_stop_signal=raise_on_stop_signal,
        strategy=strategy_config(strategy, strategy_options),
        snapshot=SnapshotConfig(
            every_steps=snapshot_every_steps,
            every_epochs=snapshot_every_epochs,
            keep=3,
            async_write=snapshot_async,
            memory=memory,
            memory_every_steps=memory_every_steps,
        ),
        early_stopping=EarlyStoppingConfig(
            metric="val/loss" if early_stopping_patience or val_every_steps else None,
            patience=early_stopping_patience if val_every_steps else early_stopping_patience or 1,
        ),
        val_every_steps=val_every_steps,
        weights_format=weights_format,
        logging=LoggingConfig(
            every_steps=log_every_steps, progress=False, tensorboard=tensorboard, trackers=loggers
        ),
        drop_last=drop_last,
        compile=compile,
    )
    attempt = rt.restart_count
    if kill_in_snapshot is not None and attempt == 0 and rt.rank == 0:
        _kill_inside_snapshot_write(kill_in_snapshot, sample_log)
    log = open(Path(sample_log) / f"rank{rt.rank}.jsonl", "a", buffering=1) if sample_log else None

    fired: list[bool] = []
    filled: list[bool] = []

    def batch_loss(model, batch):
        x, y, idx = batch
        if (
            kill_step is not None
            and attempt == 0
            and rt.rank == kill_rank
            and trainer.step == kill_step
        ):
            if kill_after_write:  # the snapshot in flight is whole: the restart resumes from it
                trainer.wait_for_snapshot()
            if damage_newest:
                _damage_newest_snapshot(trainer)
            _sigkill_self(sample_log, f"rank{rt.rank}-step{kill_step}")
        if (
            fill_disk_at is not None
            and rt.rank == 0
            and trainer.step == fill_disk_at
            and not filled
        ):
            filled.append(True)
            _fill_disk(trainer)
        if log is not None:
            log.write(
                json.dumps(
                    {
                        "attempt": attempt,
                        "epoch": trainer.epoch,
                        "step": trainer.step,
                        "idx": idx.tolist(),
                    }
                )
                + "\n"
            )
        logits = model(x)  # one forward per micro-batch: sync BatchNorm is a collective
        loss = nn.functional.cross_entropy(logits, y)
        if event is not None and rt.rank == event[1] and trainer.step == event[2]:
            if event[0] == "nan" and not fired:
                fired.append(True)
                loss = loss * float("nan")
            elif event[0] == "inf" and not fired:
                fired.append(True)
                loss = loss + float("inf")  # the value is inf, the gradient that of the finite loss
            elif event[0] == "ignored" and not fired:
                fired.append(True)
                # mean over none: NaN
                loss = nn.functional.cross_entropy(logits, torch.full_like(y, -100))
            elif event[0] == "raise" and attempt == 0:
                raise RuntimeError(f"planned failure in user code on rank {rt.rank}")
            elif event[0] == "signal" and not trainer._stop_signal:
                os.kill(os.getpid(), signal.SIGUSR1)
        return loss

    def metrics(model, batch):
        x, y, _ = batch
        logits = model(x)
        return {
            "loss": nn.functional.cross_entropy(logits, y, reduction="none"),
            "accuracy": (logits.argmax(1) == y).float(),
        }

    SabotagedTrainer.drop = drop
    trainer = SabotagedTrainer(
        model,
        optimizer,
        AugmentedData(n_samples) if augment else IndexedData(n_samples),
        config,
        val_data=IndexedData() if early_stopping_patience or val_every_steps else None,
        scheduler=scheduler,
        batch_loss_fn=batch_loss,
        metric_fn=metrics,
        callbacks=callbacks,
    )
    if shared_buffers:
        one_copy_per_key(trainer.strategy)
    if trainer_hook is not None:
        trainer_hook(trainer)
    preempted = None
    try:
        trainer.fit()
    except ddpkit.Preempted as stop:  # the default on a stop signal, once the snapshot is saved
        if not catch_preempted:
            raise
        preempted = stop.code
    full = trainer.strategy.full_state_dict() if rt.distributed else None  # collective: every rank
    final = {
        "preempted": preempted,
        # Under zero and fsdp the optimizer's own state is this rank's shard: compare the gathered
        # "full" state.
        "model": (
            {k: v.clone() for k, v in ddpkit.unwrap(trainer.model).state_dict().items()}
            if strategy == "ddp"
            else full["model"]
        ),
        "optimizer": trainer.optimizer.state_dict() if strategy == "ddp" else None,
        "scheduler": trainer.scheduler.state_dict(),
        "step": trainer.step,
        "resumed_from": trainer.resumed_from,
        "attempt": attempt,
        "epoch": trainer.epoch,
        "stopped_by": trainer.stopped_by,
        "skipped_steps": trainer.skipped_steps,
        "scale": trainer.scaler.get_scale() if trainer.scaler is not None else None,
        "full": full,
    }
    if out and rt.is_main:
        torch.save(final, out)
    if out:
        torch.save(rank_state(trainer), f"{out}.rank{rt.rank}")
    return final


def train_on_ranks(world: int, run_dir: str | os.PathLike[str], **kwargs: Any) -> dict:
    """:func:`train` on ``world`` ranks of :func:`ddpkit.testing.run_on_ranks`, its collectives
    waiting as long as under ``ddpkit run`` (5 minutes); rank 0's final state."""
    job = functools.partial(train, str(run_dir), **kwargs)
    return run_on_ranks(job, world, collective_timeout=300, timeout=1800)[0]


def under_launcher(
    tmp: Path,
    name: str,
    *args: str,
    env: dict[str, str] | None,
    restarts: int = 2,
    timeout: float = 300,
    sample_log: str | None = "log",
) -> tuple[dict, Job]:
    """This job under ``ddpkit run --nproc 2 --max-restarts RESTARTS``, to its end: run directory
    ``tmp/name``, the samples each rank trains on logged to ``tmp/name-<sample_log>`` (made now;
    None: not logged), the final states to ``tmp/name.pt`` and ``tmp/name.pt.rank<r>``, then
    ``args``. Rank 0's final state and the :class:`~ddpkit.testing.Job`."""
    logs = []
    if sample_log is not None:
        (tmp / f"{name}-{sample_log}").mkdir()
        logs = ["--sample-log", str(tmp / f"{name}-{sample_log}")]
    job = run_job(
        __file__, str(tmp / name), *logs, "--out", str(tmp / f"{name}.pt"), *args, env=env,
        launcher_args=("--max-restarts", str(restarts)), timeout=timeout, run_dir=tmp / name,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    return torch.load(tmp / f"{name}.pt", weights_only=False), job


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--kill-in-snapshot", type=int, default=None)
    p.add_argument("--sample-log", default=None)
    p.add_argument("--raise-at", type=int, nargs=2, metavar=("RANK", "STEP"), default=None)
    p.add_argument("--signal-at", type=int, nargs=2, metavar=("RANK", "STEP"), default=None)
    p.add_argument("--no-raise-on-stop-signal", action="store_true")
    p.add_argument("--augment", action="store_true")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--unseeded-samples", action="store_true")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default=None)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--snapshot-sync", action="store_true")
    p.add_argument("--no-sync-bn", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--damage-newest", action="store_true")
    p.add_argument("--kill-after-write", action="store_true")
    p.add_argument("--fill-disk-at", type=int, default=None)
    p.add_argument("--shared-buffers", action="store_true")
    p.add_argument("--val-every-steps", type=int, default=None)
    p.add_argument("--patience", type=int, default=None)
    p.add_argument("--drop", default=None)
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    event = (
        ("raise", *a.raise_at) if a.raise_at else ("signal", *a.signal_at) if a.signal_at else None
    )
    train(
        a.run_dir,
        global_batch=a.global_batch,
        epochs=a.epochs,
        max_steps=a.max_steps,
        kill_rank=a.kill_rank,
        kill_step=a.kill_step,
        kill_in_snapshot=a.kill_in_snapshot,
        sample_log=a.sample_log,
        out=a.out,
        event=event,
        raise_on_stop_signal=not a.no_raise_on_stop_signal,
        catch_preempted=False,
        augment=a.augment,
        num_workers=a.workers,
        unseeded_samples=a.unseeded_samples,
        lr=a.lr,
        strategy=a.strategy,
        snapshot_async=not a.snapshot_sync,
        sync_batchnorm=not a.no_sync_bn,
        grad_accum=a.grad_accum,
        damage_newest=a.damage_newest,
        kill_after_write=a.kill_after_write,
        fill_disk_at=a.fill_disk_at,
        shared_buffers=a.shared_buffers,
        val_every_steps=a.val_every_steps,
        early_stopping_patience=a.patience,
        drop=a.drop,
        compile=a.compile,
    )
    ddpkit.shutdown()
