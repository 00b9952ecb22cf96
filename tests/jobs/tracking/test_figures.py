"""A run's speed figures in real 2-rank gloo jobs: a validation inside a log window is left out of
the window's time and recorded on its own; a Trainer with ``step_fn`` records its step's phases and
names a slow rank. Controls: the same jobs with the fix switched off show the defect."""

from __future__ import annotations

import json
import time
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.testing import run_on_ranks
from ddpkit.tracking._speed import StepTimings
from tests.jobs.scripts.several_val_job import gan_step  # the same noise width (4)

STEPS, EVERY, VAL_EVERY = 12, 4, 6
PER_RANK = 2  # samples per rank a step (a global batch of 4)
TRAIN_TICK, VAL_TICK = 1.0, 100.0
VAL_SAMPLES = 8


class Clock:
    """The Trainer's clock in these jobs: it moves only when a sample is read, by its dataset's
    tick, so that each window's and each validation's seconds are known exactly whatever the
    machine's load."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class Ticking(torch.utils.data.Dataset):
    def __init__(self, n: int, tick: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.tick = tick

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        Clock.now += self.tick
        return self.x[i], self.y[i]


def _records(trainer: Any) -> list[dict]:
    if not trainer.runtime.is_main:
        return []
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _validating(run_dir: str, fixed: bool) -> list[dict]:
    """12 steps, a window every 4, a validation every 6 (steps 6 and 12: inside the second and the
    third windows), on the injected clock. ``fixed=False``: the window's time as before the fix,
    its validation counted in."""
    import ddpkit.tracking._speed as speed_module
    import ddpkit.training._trainer as trainer_module
    from ddpkit.training._config import (
        EarlyStoppingConfig,
        LoggingConfig,
        SnapshotConfig,
        TrainerConfig,
    )
    from ddpkit.training._trainer import Trainer

    clock = types.ModuleType("time")
    clock.__dict__.update(time.__dict__)
    clock.perf_counter = Clock.perf_counter  # type: ignore[attr-defined]
    trainer_module.time = speed_module.time = clock  # type: ignore[attr-defined]
    if not fixed:
        speed_module.Speed.window_seconds = lambda self, start, end: end - start  # type: ignore
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    config = TrainerConfig(
        run_dir=run_dir,
        max_steps=STEPS,
        epochs=100,
        global_batch_size=2 * PER_RANK,
        num_workers=0,
        val_every_steps=VAL_EVERY,
        early_stopping=EarlyStoppingConfig(metric="val/loss", patience=None),
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(every_steps=EVERY, progress=False),
    )
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), Ticking(64, TRAIN_TICK), config,
        val_data=Ticking(VAL_SAMPLES, VAL_TICK), loss_fn=F.mse_loss,
    )  # fmt: skip
    trainer.fit()
    return _records(trainer)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control"])
def test_a_validation_is_left_out_of_its_windows_time_and_recorded_on_its_own(tmp_path, fixed):
    """Every window reads its training alone: PER_RANK samples a step of TRAIN_TICK seconds each,
    exactly, whether a validation ran in it or not, and each validation's VAL_TICK seconds per
    sample of its rank's share are in its own record. Control: the window's time as before, with
    the validation in it, reads the windows that hold one slower by the validation's seconds."""
    records = run_on_ranks(_validating, 2, (str(tmp_path / "run"), fixed))[0]
    train = [r for r in records if r["kind"] == "train"]
    ranks = [r for r in records if r["kind"] == "ranks"]
    validations = [r for r in records if r.get("event") == "validation"]
    assert [r["step"] for r in train] == [4, 8, 12]
    # each validation (steps 6 and 12): each rank's half of the samples
    val_seconds = VAL_SAMPLES // 2 * VAL_TICK
    step_seconds = PER_RANK * TRAIN_TICK
    held = {8: val_seconds, 12: val_seconds} if not fixed else {}  # what each window counts in
    for t, r in zip(train, ranks):
        ms = 1000 * (step_seconds + held.get(t["step"], 0.0) / EVERY)
        assert t["ms_per_step"] == ms and r["step_ms"] == [ms, ms], (t, r)
        assert t["samples_per_s"] == pytest.approx(2 * PER_RANK / (ms / 1000), rel=1e-12)
    if not fixed:  # the defect: the windows with a validation read 51x slower
        assert train[1]["samples_per_s"] < train[0]["samples_per_s"] / 50
    assert [(r["step"], r["seconds"]) for r in validations] == [(6, val_seconds), (12, val_seconds)]


NOISE, SLEEP, SLOW = 4, 0.02, 0.05


class SleepyData(torch.utils.data.Dataset):
    """Each sample sleeps ``SLEEP`` (a slow disk: a step is mostly waiting, which another process's
    load on a shared CPU barely moves)."""

    def __init__(self) -> None:
        self.x = torch.randn(64, 2, generator=torch.Generator().manual_seed(1)) + 2.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        time.sleep(SLEEP)
        return (self.x[i],)


class Generator(nn.Module):
    """``sleep``: each forward sleeps that long first (a slower device: blocked in the forward)."""

    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(NOISE, 16), nn.Tanh(), nn.Linear(16, 2))
        self.sleep = sleep

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.sleep:
            time.sleep(self.sleep)
        return self.body(z)


def _several(run_dir: str, fed: bool) -> tuple[list[dict], str | None]:
    """A GAN's step function on 2 ranks, 2 micro-batches a step, rank 1's generator slow (SLOW a
    forward, two forwards a micro-batch). ``fed=False``: the step's phases not fed to the timings,
    as before the fix."""
    import ddpkit
    from ddpkit import LoggingConfig, SnapshotConfig, Trainer, TrainerConfig

    torch.set_num_threads(1)
    rank = ddpkit.get_runtime().rank
    ddpkit.seed_everything(0)
    g = Generator(SLOW if rank == 1 else 0.0)
    d = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizers = {
        "g": torch.optim.Adam(g.parameters(), lr=1e-2),
        "d": torch.optim.SGD(d.parameters(), lr=5e-2),
    }
    config = TrainerConfig(
        run_dir=run_dir, max_steps=12, epochs=100, global_batch_size=8, grad_accum_steps=2,
        num_workers=0, snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(every_steps=EVERY, progress=False),
    )  # fmt: skip
    trainer = Trainer({"g": g, "d": d}, optimizers, SleepyData(), config, step_fn=gan_step)
    if not fed:  # the step's phases go to timings that record nothing
        trainer.train_step.observe.timings = StepTimings(
            nn.Linear(1, 1), torch.device("cpu"), enabled=False
        )
    trainer.fit()
    return _records(trainer), trainer.speed.run.summary()


@pytest.mark.parametrize("fed", [True, False], ids=["fixed", "control"])
def test_a_step_fn_trainer_records_its_phases_and_names_a_slow_rank(tmp_path, fed):
    """Every window has each rank's compute and optimizer time; rank 1, whose generator's forward
    sleeps, is named slow with the phase compute in every window and in the run's summary; rank 0
    waits for it in the backwards' all-reduces (comm). Control: the step's phases not fed to the
    timings, as before, leave compute and optimizer at 0 on every rank and name nobody."""
    records, summary = run_on_ranks(_several, 2, (str(tmp_path / "run"), fed))[0]
    ranks = [r for r in records if r["kind"] == "ranks"]
    assert len(ranks) == STEPS // EVERY
    if not fed:
        for r in ranks:
            assert r["compute_ms"] == r["optimizer_ms"] == [0.0, 0.0], r
            assert r["comm_ms"] == [0.0, 0.0] and not r["slow"], r
        assert summary is not None and "ranks even" in summary
        return
    for r in ranks:
        assert all(ms > 0 for ms in r["compute_ms"] + r["optimizer_ms"]), r
        # 2 micro-batches x 2 generator forwards a step, each sleeping SLOW
        assert r["compute_ms"][1] >= 4 * SLOW * 1000, r
        assert (r["slow"], r["slowest_rank"], r["slowest_phase"]) == (True, 1, "compute"), r
        assert r["comm_ms"][0] > r["comm_ms"][1], r
    assert summary is not None and "slowest rank 1: " in summary and "mostly compute" in summary
    assert f"slow in {len(ranks)} of {len(ranks)} windows" in summary
