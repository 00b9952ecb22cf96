"""Snapshots in memory that lie: a 2-rank job under ``ddpkit run`` whose rank 0 damages its newest
slot (a weight changed, or a manifest rewritten with its CRC-32 so that a tensor lies past the data
region), then dies of SIGKILL. Every rank skips the damaged state, saying why, and resumes from the
slot before it, or from the disk when both of rank 0's slots lie; the run ends bit for bit as an
uninterrupted one."""

from __future__ import annotations

import pytest

from tests.jobs.snapshot.memory_jobs import check_exact, run
from tests.trainer_checks import use_reference

# The memory job as a module, its rank 0 damaging its slot of a step before its kill: ddpkit run -m.
DAMAGED = {"script": "tests.jobs.scripts.damaged_memory_job", "launcher": ("-m",)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("weight", "its tensors' bytes fail their checksum"),
        ("manifest", "lies past the end of the data region"),
    ],
)
def test_a_lying_slot_is_skipped_and_every_rank_resumes_from_the_one_before_bitwise(
    tmp_path, memory_env, memory_reference, mode, expected
):
    reference = use_reference(memory_reference, tmp_path)
    env = memory_env | {"DDPKIT_TEST_DAMAGE": f"{mode}:12"}
    final, job = run(tmp_path, mode, env=env, **DAMAGED)
    out = job.stdout + job.stderr
    assert final["attempt"] == 1, out[-3000:]
    assert "skipping the snapshot in memory at step 12" in out and expected in out, out[-3000:]
    # the file named
    assert "-rank0-" in out.split("skipping the snapshot in memory at step 12")[1].splitlines()[0]
    # Rank 1 holds steps 12 and 11, rank 0 a lying 12 and a whole 11: every rank takes 11.
    assert final["resumed_from"] == 11 and [r["file"] for r in job.events("resume")] == ["memory"]
    check_exact(tmp_path, mode, final, reference, f"a {mode} lie in the newest slot")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_when_every_slot_lies_the_ranks_resume_from_the_disk_bitwise(
    tmp_path, memory_env, memory_reference
):
    reference = use_reference(memory_reference, tmp_path)
    env = memory_env | {"DDPKIT_TEST_DAMAGE": "both:14"}
    final, job = run(tmp_path, "both", "--disk-every-steps", "4", env=env, **DAMAGED)
    out = job.stdout + job.stderr
    assert (
        "skipping the snapshot in memory at step 14" in out
        and "skipping the snapshot in memory at step 13" in out
    )
    # The newest disk snapshot whole at the kill: step 12's, or step 8's if the kill came before
    # 12's marker.
    (file,) = [r["file"] for r in job.events("resume")]
    assert (
        final["attempt"] == 1
        and file == f"step-{final['resumed_from']:08d}"
        and final["resumed_from"] in (8, 12)
    )
    check_exact(tmp_path, "both", final, reference, "both slots lying")
