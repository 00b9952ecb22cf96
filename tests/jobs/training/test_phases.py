"""Three trainings in one script (a teacher, then two students distilled from it), each a
``phase`` of one run directory, under ``ddpkit run --nproc 2 --max-restarts 2`` with rank 1
SIGKILLed inside the second student: the restarted script trains the finished phases no more,
restores their final state, and every phase ends bit for bit where an uninterrupted run's does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.testing import read_records, run_job
from tests.trainer_checks import differences

JOB = str(Path(__file__).parents[1] / "scripts" / "phases_job.py")
PHASES = ("teacher", "student1", "student2")


def launch(tmp: Path, name: str, kill_step: int, mode: str = "phases") -> list[dict[str, Any]]:
    args = (str(tmp / name), str(tmp / f"{name}-run"), str(kill_step), mode)
    done = run_job(JOB, *args, launcher_args=("--max-restarts", "2"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(tmp / f"{name}.rank{r}", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_kill_in_the_second_student_restores_the_finished_phases_and_resumes_it(tmp_path):
    reference = launch(tmp_path, "reference", -1)
    killed = launch(tmp_path, "killed", 7)  # 3 epochs of 4 steps; snapshots at 4, 5, 8, 10, 12
    assert (reference[0]["attempt"], killed[0]["attempt"]) == (0, 1)
    for rank in (0, 1):
        assert not differences(killed[rank]["states"], reference[rank]["states"]), rank
        assert killed[rank]["metrics"] == reference[rank]["metrics"]  # fit()'s, finished or not
    run = tmp_path / "killed-run"
    for phase in PHASES:
        # one train record a step, each step once: trained once (rewound records moved aside)
        assert [r["step"] for r in read_records(run / phase) if r["kind"] == "train"] == list(
            range(1, 13)
        )
    for phase in ("teacher", "student1"):
        stops = [
            r.get("resumed_finished") for r in read_records(run / phase) if r.get("event") == "stop"
        ]
        assert stops == [None, True], phase
    resumes = [r["step"] for r in read_records(run / "student2") if r.get("event") == "resume"]
    assert resumes in ([4], [5])
    # Control: with a finished phase's model and optimizer put back as built after its fit(), the
    # first student (and the teacher's optimizer) end elsewhere.
    skipped = launch(tmp_path, "no-restore", 7, "no_restore")
    assert skipped[0]["attempt"] == 1
    for rank in (0, 1):
        assert differences(
            skipped[rank]["states"]["student1"], reference[rank]["states"]["student1"]
        )
        assert differences(skipped[rank]["states"]["teacher"], reference[rank]["states"]["teacher"])


@pytest.mark.slow
def test_a_second_training_without_phase_in_the_run_directory_is_refused_naming_phase(tmp_path):
    args = (str(tmp_path / "out"), str(tmp_path / "run"), "-1", "no_phase")
    done = run_job(JOB, *args, timeout=300)
    assert done.returncode != 0
    # the first student, at the teacher's snapshot: refused before any step
    assert "was taken by a run with another config than this one" in done.stderr
    assert "TrainerConfig(phase=...)" in done.stderr
    assert [r["kind"] for r in read_records(tmp_path / "run") if r["kind"] == "epoch"] == [
        "epoch"
    ] * 3
    assert not (tmp_path / "out.rank0").exists()
    # Control: the same script with phases runs to its end (the reference of the test above).
