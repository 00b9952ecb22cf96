"""Slow ranks named, throughput and MFU, in real 2-rank gloo jobs (tests/jobs/scripts/speed_job.py).

Every rank's samples sleep a little (a step is mostly waiting, so another process's load on a shared
CPU barely moves it); rank 1 is made slow in its data or in its forward, and must be named with that
phase.
"""

from __future__ import annotations

import functools

import pytest

from ddpkit.testing import read_records, run_on_ranks
from tests.jobs.scripts.speed_job import (
    CLASSES,
    FEATURES,
    GLOBAL_BATCH,
    HIDDEN,
    TOKENS_PER_SAMPLE,
    train,
)


def _kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def test_a_rank_with_slow_data_is_named_with_the_phase_data(tmp_path, capfd):
    records = run_on_ranks(
        functools.partial(train, str(tmp_path / "run"), slow="data", peak_flops=1e11), 2
    )[0]
    out = capfd.readouterr().out
    ranks = _kind(records, "ranks")
    assert len(ranks) == 4  # 16 steps, a window every 4
    for r in ranks:
        assert (r["slow"], r["slowest_rank"], r["slowest_phase"]) == (True, 1, "data"), r
        assert r["data_ms"][1] > 1.5 * r["data_ms"][0]
        # rank 0 waits for rank 1 at the gradients' all-reduce
        assert r["comm_ms"][0] > r["comm_ms"][1]
    assert "slow rank 1 +" in out and "(data)" in out  # the progress line
    # the run's summary
    assert "slowest rank 1: " in out and "mostly data; slow in 4 of 4 windows" in out
    # MFU with a peak given by hand (on the CPU there is none otherwise): the FLOPs of a sample, as
    # counted, times the samples a second, over both ranks' peaks.
    flops_per_sample = 2 * (FEATURES * HIDDEN + HIDDEN * CLASSES) * 2 + 2 * HIDDEN * CLASSES
    for t in _kind(records, "train"):
        assert t["mfu"] == pytest.approx(
            flops_per_sample * t["samples_per_s"] / (1e11 * 2), rel=1e-9
        )


def test_a_rank_with_slow_compute_is_named_with_the_phase_compute(tmp_path, capfd):
    records = run_on_ranks(functools.partial(train, str(tmp_path / "run"), slow="compute"), 2)[0]
    out = capfd.readouterr().out
    for r in _kind(records, "ranks"):
        assert (r["slow"], r["slowest_rank"], r["slowest_phase"]) == (True, 1, "compute"), r
    assert "(compute)" in out and "mostly compute" in out


def test_control_equal_ranks_name_nobody_and_the_rates_are_global(tmp_path, capfd):
    records = run_on_ranks(functools.partial(train, str(tmp_path / "run"), tokens=True), 2)[0]
    ranks = _kind(records, "ranks")
    # The first window holds each rank's start-up (DDP's first iteration), which differs between
    # processes. On a machine loaded by other work one window may find a rank held up by the
    # scheduler; equal ranks are named in none but such a stray one (the slow case above: every
    # window).
    named = [r for r in ranks[1:] if r["slow"]]
    assert len(named) <= max(1, len(ranks[1:]) // 3), ranks
    train_records = _kind(records, "train")
    for before, t in zip(train_records, train_records[1:]):
        # Samples a second over all ranks: the global batch x the window's steps over the time
        # between the two records (another clock than the Trainer's). A count of one rank's samples
        # would be half of it.
        expected = GLOBAL_BATCH * (t["step"] - before["step"]) / (t["time"] - before["time"])
        assert t["samples_per_s"] == pytest.approx(expected, rel=0.15)
    for t in train_records:
        assert t["tokens_per_s"] == pytest.approx(TOKENS_PER_SAMPLE * t["samples_per_s"], rel=1e-9)
        assert "mfu" not in t  # on the CPU, no peak: no MFU rather than a guess


def test_step_timings_off_records_none_of_it(tmp_path, capfd):
    records = run_on_ranks(
        functools.partial(train, str(tmp_path / "run"), slow="data", step_timings=False), 2
    )[0]
    out = capfd.readouterr().out
    assert not _kind(records, "ranks")
    assert all("samples_per_s" not in t for t in _kind(records, "train"))
    assert "slow rank" not in out and "samples/s" not in out


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single",
)  # fmt: skip


def _counted(calls: list[str], name: str, real, *args, **kwargs):
    calls.append(name)
    return real(*args, **kwargs)


def _count_collectives(run_dir: str, every: int, step_timings: bool) -> tuple[int, int]:
    """The torch.distributed collectives this rank's fit calls through the public API (DDP's own
    all-reduce of the gradients runs in its reducer, not through these), and the ``ranks`` records
    written."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig
    from ddpkit.training._trainer import Trainer

    calls = []
    for name in _COLLECTIVES:
        real = getattr(dist, name)
        setattr(dist, name, functools.partial(_counted, calls, name, real))
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = nn.Linear(8, 1)
    config = TrainerConfig(
        run_dir=run_dir,
        max_steps=16,
        epochs=100,
        global_batch_size=4,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(every_steps=every, progress=False, step_timings=step_timings),
    )
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, config,
        loss_fn=nn.functional.mse_loss,
    )  # fmt: skip
    trainer.fit()
    ranks = [r for r in read_records(trainer.run_dir) if r["kind"] == "ranks"]
    return len(calls), len(ranks)


def test_the_step_timings_travel_in_the_agreement_and_add_no_collective(tmp_path):
    def counts(name, every, timings):
        return run_on_ranks(_count_collectives, 2, (str(tmp_path / name), every, timings))

    on, off = counts("on", 4, True), counts("off", 4, False)
    assert [n for n, _ in on] == [n for n, _ in off], (on, off)
    assert on[0][1] == 4 and off[0][1] == 0  # 16 steps, a window every 4: every rank's rows
    # Control: the count sees the agreement's collective: twice the windows, four more of them.
    twice = counts("twice", 2, True)
    assert [n for n, _ in twice] == [n + 4 for n, _ in on], (twice, on)
