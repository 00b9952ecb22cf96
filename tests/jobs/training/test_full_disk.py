"""A disk that fills between snapshots stops every rank at the ranks' next agreement, each naming
the file that could not be written, the reason, and the snapshot a restart resumes from; not rank 0
alone with a bare ``OSError`` while the others wait for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.testing import run_job
from tests.tmpfs import small_tmpfs

pytestmark = pytest.mark.heavy

JOB = Path(__file__).parents[1] / "scripts" / "full_disk_job.py"


def test_a_full_disk_stops_every_rank_naming_the_file_and_the_snapshot(tmp_path, clean_env):
    with small_tmpfs(tmp_path / "run", "2m") as run_dir:
        done = run_job(JOB, str(run_dir), "7", env=clean_env, cwd=tmp_path, timeout=240)
        old = run_job(JOB, str(run_dir / "old"), "7", "--old", env=clean_env, cwd=tmp_path,
                      timeout=240)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "done" not in done.stdout, out[-3000:]
    said = [line for line in out.splitlines() if "cannot write" in line and "metrics.jsonl" in line]
    assert said and "No space left on device" in said[0], out[-3000:]
    assert "a restart resumes from the snapshot of step 6" in said[0], said[0]
    # every rank stopped with it, rank 1 too (its own words, not a lost peer's)
    summary = out[out.rindex("worker(s) failed") :]
    assert "ddpkit: cannot write" in summary.split("then rank", 1)[1], summary
    # Control: raised where it happens, rank 0 alone: a bare OSError, no file, no snapshot named.
    old_out = old.stdout + old.stderr
    assert old.returncode != 0 and "No space left on device" in old_out, old_out[-3000:]
    assert "cannot write" not in old_out and "a restart resumes from" not in old_out
