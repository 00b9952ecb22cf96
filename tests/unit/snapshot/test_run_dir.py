"""The run directory's lock in one process: it names its holder and is released, also where a
forked child holds a copy of its descriptor."""

from __future__ import annotations

import os

import pytest

from ddpkit._errors import ConfigError
from ddpkit.snapshot._run_dir import run_dir_lock


def test_the_lock_in_one_process_names_its_holder_and_is_released(tmp_path):
    first = run_dir_lock(tmp_path)
    first.acquire()
    with pytest.raises(
        ConfigError, match=rf"in use by another job \(host .+, pid {os.getpid()}, since"
    ):
        # flock: a second open file is refused even in the same process
        run_dir_lock(tmp_path).acquire()
    first.release()
    with run_dir_lock(tmp_path):  # control: once released it can be taken again
        pass


def _hold_until_told(go) -> None:
    go.wait(60)


@pytest.mark.parametrize("release", ["release", "control: close only"])
def test_a_released_lock_is_free_though_a_forked_child_holds_its_descriptor(tmp_path, release):
    # a loader worker forked while the Trainer held run_dir's lock keeps a copy of the descriptor
    import multiprocessing

    context = multiprocessing.get_context("fork")
    first = run_dir_lock(tmp_path)
    first.acquire()
    go = context.Event()
    child = context.Process(target=_hold_until_told, args=(go,))
    child.start()
    try:
        if release == "release":
            first.release()
            with run_dir_lock(tmp_path):
                pass
        else:
            assert first._fd is not None
            os.close(first._fd)  # the lock goes with the child's copy only
            first._fd = None
            with pytest.raises(ConfigError, match="in use by another job"):
                run_dir_lock(tmp_path).acquire()
    finally:
        go.set()
        child.join()
