"""The job's folder the agent makes on each node (``ddpkit._launch.agent.jobdir``): private, in
shared memory where it has room, stale folders of dead agents swept (and a folder another agent is
setting up left alone), else on disk with the reason the job keeps no snapshots in memory; one
variable names it to the workers, whose every channel reads it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ddpkit._launch import proctree
from ddpkit._launch.agent import jobdir
from ddpkit.distributed import _channels as channels
from ddpkit.snapshot import _slots as slots


@pytest.fixture
def base(tmp_path, monkeypatch):
    """This user's private folder of job folders under a fresh root, no job's variable set."""
    monkeypatch.setenv(jobdir.ROOT_ENV, str(tmp_path / "shm"))
    monkeypatch.delenv(channels.JOB_DIR_ENV, raising=False)
    monkeypatch.delenv(jobdir.OFF_ENV, raising=False)
    base = tmp_path / "shm" / f"ddpkit-memory-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True)
    yield base
    jobdir.close_job_folder()


def test_the_job_folder_is_private_and_stale_folders_of_dead_agents_are_swept(base, tmp_path):
    # A folder whose agent was SIGKILLed (the pid is dead), and one of a live agent (another job on
    # the node).
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = base / "stale", base / "live"
    for folder, pid in ((stale, dead.pid), (live, os.getppid())):
        folder.mkdir()
        (folder / "owner").write_text(f"{pid} {proctree.start_time(pid)}\n")
        (folder / "memory").mkdir()
    folder = jobdir.open_job_folder(tmp_path / "disk")
    assert folder.parent == base and channels.job_folder() == folder
    assert not stale.exists() and live.exists()
    assert oct(folder.stat().st_mode & 0o777) == oct(base.stat().st_mode & 0o777) == "0o700"
    # every channel is in it, and the workers find the agent in it
    for name in (channels.PROGRESS, channels.INBOX, channels.STACKS, channels.MEMORY):
        assert (folder / name).is_dir() and channels.channel(name) == folder / name
    assert channels.agent_pid() == os.getpid()
    memory, key = slots.memory_folder()
    assert memory == folder / "memory" and key.endswith(f":{folder.name}")
    jobdir.close_job_folder()
    assert not folder.exists() and channels.job_folder() is None


def test_a_folder_another_agent_is_setting_up_is_not_swept_but_an_abandoned_one_is(base, tmp_path):
    # Two jobs start on one node: the other agent has made its ".<nonce>" folder and not yet
    # written its owner in it. Control: swept by the owner check alone, it is removed under the
    # other agent, whose memory snapshots are then off.
    setting_up, abandoned = base / ".1111", base / ".2222"
    setting_up.mkdir()
    abandoned.mkdir()
    old = time.time() - jobdir.SETUP_SECONDS - 1
    os.utime(abandoned, (old, old))
    assert jobdir.open_job_folder(tmp_path / "disk").parent == base
    assert setting_up.exists() and not abandoned.exists()


def test_a_folder_renamed_by_another_agent_during_the_sweep_is_passed_over(
    base, tmp_path, monkeypatch
):
    # The other agent renames its ".<nonce>" into place between this sweep's listing and its look
    # at the folder. Control: the vanished folder's FileNotFoundError sent the job to disk.
    moving = base / ".3333"
    moving.mkdir()
    owner_alive = jobdir._owner_alive

    def renamed_meanwhile(folder):
        if folder == moving:
            moving.rename(base / "3333")
        return owner_alive(folder)

    monkeypatch.setattr(jobdir, "_owner_alive", renamed_meanwhile)
    assert jobdir.open_job_folder(tmp_path / "disk").parent == base


def test_a_base_folder_open_to_others_sends_the_job_to_disk_with_the_reason(base, tmp_path):
    os.chmod(base, 0o777)
    folder = jobdir.open_job_folder(tmp_path / "disk")
    assert folder == tmp_path / "disk" and (folder / channels.PROGRESS).is_dir()
    memory, why = slots.memory_folder()
    assert memory is None and "open to others" in why
    assert channels.agent_pid() == os.getpid()


def test_with_memory_snapshots_off_the_folder_stays_in_shared_memory_without_them(
    base, tmp_path, monkeypatch
):
    monkeypatch.setenv(jobdir.OFF_ENV, "0")
    folder = jobdir.open_job_folder(tmp_path / "disk")
    assert folder.parent == base and (folder / channels.PROGRESS).is_dir()
    memory, why = slots.memory_folder()
    assert memory is None and why == f"{jobdir.OFF_ENV}=0"
