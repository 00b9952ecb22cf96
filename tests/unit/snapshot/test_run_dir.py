"""The run directory's lock in one process: it names its holder and is released."""

from __future__ import annotations

import os

import pytest

from ddpkit._errors import ConfigError
from ddpkit.snapshot._run_dir import RunDirLock


def test_the_lock_in_one_process_names_its_holder_and_is_released(tmp_path):
    first = RunDirLock(tmp_path)
    first.acquire()
    with pytest.raises(
        ConfigError, match=rf"in use by another job \(host .+, pid {os.getpid()}, since"
    ):
        # flock: a second open file is refused even in the same process
        RunDirLock(tmp_path).acquire()
    first.release()
    with RunDirLock(tmp_path):  # control: once released it can be taken again
        pass
