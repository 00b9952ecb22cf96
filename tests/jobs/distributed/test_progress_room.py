"""A progress record where node-local shared memory has no room: the rank goes on without one (and
says so), never dies of SIGBUS at its first mark; ``ddpkit run`` puts the records on disk when
``/dev/shm`` is nearly full."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from ddpkit.testing import run_job
from tests.tmpfs import fill, small_tmpfs

pytestmark = pytest.mark.heavy

MARK = """
import os, sys
{patch}
from ddpkit.distributed import _progress as progress
progress.mark(progress.Phase.LOOP)
progress.begin_step(1)
print("marked", progress.watched())
"""


def _mark(env: dict, folder, patch: str = "") -> subprocess.CompletedProcess:
    env = env | {"DDPKIT_JOB_DIR": str(folder), "RANK": "0"}  # its records under progress/
    code = MARK.format(patch=patch)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_rank_without_room_for_its_record_goes_on_unwatched(tmp_path, clean_env):
    with small_tmpfs(tmp_path / "shm", "64k") as shm:
        (shm / "progress").mkdir()
        fill(shm)
        done = _mark(clean_env, shm)
        assert done.returncode == 0, done.stderr
        assert "marked False" in done.stdout
        assert "rank 0 keeps no progress record (No space left on device" in done.stderr
        # Control: the file only sized (sparse), its page mapped: the first store dies.
        undone = _mark(
            clean_env, shm, "os.posix_fallocate = lambda fd, at, size: os.ftruncate(fd, size)"
        )
        assert undone.returncode == -signal.SIGBUS, (undone.returncode, undone.stderr[-2000:])


def test_ddpkit_run_puts_the_records_on_disk_when_shared_memory_is_nearly_full(tmp_path, clean_env):
    from tests.jobs.launch.stall_jobs import STALL_JOB

    with small_tmpfs(tmp_path / "shm", "64k") as shm:
        fill(shm, leave=4096)  # room for the job's folder, not for a page a rank
        done = run_job(
            STALL_JOB, "none", "3", "1", "4", env=clean_env | {"DDPKIT_MEMORY_ROOT": str(shm)},
            cwd=tmp_path, timeout=240,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 done after 4 steps" in done.stdout
    assert (tmp_path / "ddpkit-logs").is_dir()
