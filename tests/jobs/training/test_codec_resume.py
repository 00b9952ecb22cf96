"""A 2-rank job whose state holds the values real runs keep (a numpy learning rate; a callback's
deque, Path, datetime and numpy array), SIGKILLed under ``ddpkit run --max-restarts 1``: the restart
resumes from its disk snapshot and ends bit for bit where an uninterrupted run does, with the
callback's state of the same types.

The control: the same job with its values written with ``torch.save`` and read with
``torch.load(weights_only=True)``, as before :mod:`ddpkit.snapshot._codec`, saves and then fails at
the restart.
"""

from __future__ import annotations

import collections
import datetime as dt
import pathlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpkit.testing import Job, run_job
from tests.trainer_checks import bitwise_equal

JOB = str(Path(__file__).parents[1] / "scripts" / "codec_job.py")


def run(tmp: Path, name: str, *args: str, env: dict) -> Job:
    """The job under ``ddpkit run``, one restart allowed: run directory ``tmp/name``, its final
    state to ``tmp/name.pt`` (and each rank's callback state to ``tmp/name.pt.callback<r>``)."""
    (tmp / f"{name}-log").mkdir()
    job = [str(tmp / name), "--out", str(tmp / f"{name}.pt"), "--log", str(tmp / f"{name}-log")]
    restart = ("--max-restarts", "1")
    return run_job(
        JOB, *job, *args, launcher_args=restart, env=env, cwd=tmp, timeout=300, run_dir=tmp / name
    )


def finals(tmp: Path, name: str) -> tuple[dict, list[dict]]:
    """Rank 0's final state, and each rank's callback state."""
    final = torch.load(tmp / f"{name}.pt", weights_only=False)
    callbacks = [torch.load(tmp / f"{name}.pt.callback{r}", weights_only=False) for r in range(2)]
    return final, callbacks


@pytest.mark.slow
@pytest.mark.timeout(600)  # two 2-rank jobs, one restarted
def test_a_run_keeping_numpy_deque_path_datetime_resumes_bitwise_from_disk(tmp_path, clean_env):
    for name, kill in (("reference", ()), ("killed", ("--kill-rank", "1", "--kill-step", "8"))):
        done = run(tmp_path, name, *kill, env=clean_env)
        assert done.returncode == 0, done.stderr[-3000:]
    reference, ref_callbacks = finals(tmp_path, "reference")
    final, callbacks = finals(tmp_path, "killed")
    assert list((tmp_path / "killed-log").glob("killed-*")), "no worker was killed"
    assert final["attempt"] == 1 and final["resumed_from"] == 6, (
        final["attempt"],
        final["resumed_from"],
    )
    # from disk
    assert [e["file"] for e in done.events("resume")] == ["step-00000006"]
    assert bitwise_equal(final, reference), (
        "weights or optimizer state differ from the uninterrupted run"
    )
    lrs = [g["lr"] for g in final["optimizer"]["param_groups"]]
    assert all(type(lr) is np.float64 for lr in lrs), lrs  # the scheduler's product of a numpy lr
    for rank, (got, want) in enumerate(zip(callbacks, ref_callbacks)):
        assert got["loaded_types"] == [
            "history: collections.deque",
            "folder: pathlib.PosixPath",
            "when: datetime.datetime",
            "mean: numpy.ndarray",
        ], f"rank {rank}: {got['loaded_types']}"
        assert type(got["history"]) is collections.deque and got["history"].maxlen == 4
        assert got["history"] == want["history"] and got["folder"] == want["folder"], rank
        assert type(got["folder"]) is pathlib.PosixPath and type(got["when"]) is dt.datetime
        assert got["when"] == want["when"] and got["mean"].tobytes() == want["mean"].tobytes(), rank
    assert ref_callbacks[0]["history"] != ref_callbacks[1]["history"]  # each rank's own came back


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_control_the_same_run_with_values_pickled_as_before_the_codec_fails_at_the_restart(
    tmp_path, clean_env
):
    proc = run(
        tmp_path, "before", "--kill-rank", "1", "--kill-step", "8", "--before-codec", env=clean_env
    )
    assert list((tmp_path / "before-log").glob("killed-*")), "no worker was killed"
    assert proc.returncode != 0, "the run resumed: the control shows nothing"
    output = proc.stdout + proc.stderr
    assert "step-00000006/values.pt holds objects other than tensors and plain values" in output, (
        output[-3000:]
    )
