""":mod:`ddpkit._fs`: a file opened to write in place has no other hard link. ``O_NOFOLLOW`` stops a
symbolic link, not a second name of the same file; such a file is refused (``linked="refuse"``, the
default) or first replaced by a copy of its own (``linked="replace"``), and the file at the other
name keeps its bytes."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

import pytest

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError

ORIGINAL = b"the original's records\n"


@pytest.fixture
def original(tmp_path: Path) -> Path:
    path = tmp_path / "original" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_bytes(ORIGINAL)
    return path


@pytest.fixture
def linked(tmp_path: Path, original: Path) -> Path:
    """A second name of ``original``, in another folder (what ``cp -al`` makes)."""
    path = tmp_path / "copy" / "metrics.jsonl"
    path.parent.mkdir()
    os.link(original, path)
    return path


def _append(path: Path, **kw) -> None:
    with fs.open_append(path, **kw) as f:
        f.write("the copy's record\n")


def test_control_an_append_that_follows_no_symbolic_link_still_writes_through_a_hard_link(
    original, linked
):
    # The defect: O_NOFOLLOW opens the second name as any file, and the write lands in the original.
    fd = os.open(linked, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    os.write(fd, b"x\n")
    os.close(fd)
    assert original.read_bytes() == ORIGINAL + b"x\n"


def test_control_with_the_check_off_the_module_writes_through_a_hard_link(
    original, linked, monkeypatch
):
    monkeypatch.setattr(fs, "other_names", lambda st: False)
    _append(linked)
    assert original.read_bytes() != ORIGINAL


@pytest.mark.parametrize(
    "call",
    [
        lambda p: os.close(fs.open_fd(p, os.O_RDWR | os.O_CREAT)),
        lambda p: os.close(fs.open_fd(p, os.O_WRONLY | os.O_TRUNC)),
        lambda p: fs.open_append(p).close(),
        lambda p: fs.open_append(p, read=True).close(),
        lambda p: fs.truncate(p, 0),
    ],
    ids=["rdwr-create", "truncating", "append", "append-read", "truncate"],
)
def test_an_in_place_open_of_a_hard_linked_file_is_refused_in_one_line(original, linked, call):
    with pytest.raises(ConfigError) as refused:
        call(linked)
    message = str(refused.value)
    assert "\n" not in message and str(linked) in message, message
    assert "1 other hard link (" in message and "Remove it once no job uses it" in message, message
    assert original.read_bytes() == ORIGINAL and linked.read_bytes() == ORIGINAL
    assert original.stat().st_nlink == 2  # refused: nothing renamed either


def test_an_append_replaces_a_hard_linked_file_by_a_copy_and_leaves_the_other_name_whole(
    original, linked
):
    os.chmod(original, 0o640)
    _append(linked, linked="replace")
    assert original.read_bytes() == ORIGINAL
    # the history goes on in the copy
    assert linked.read_bytes() == ORIGINAL + b"the copy's record\n"
    assert original.stat().st_nlink == 1 and linked.stat().st_nlink == 1
    assert stat.S_IMODE(linked.stat().st_mode) == 0o640
    assert [p.name for p in linked.parent.iterdir()] == ["metrics.jsonl"]  # no temporary left
    inode = linked.stat().st_ino
    _append(linked, linked="replace")  # a file of one name: appended to in place, not copied again
    assert linked.stat().st_ino == inode and original.read_bytes() == ORIGINAL


def test_a_read_modify_write_sees_the_copied_bytes(original, linked):
    with fs.open_append(linked, read=True, linked="replace") as f:
        f.seek(0)
        assert f.read() == ORIGINAL.decode()
        f.write("more\n")
    assert original.read_bytes() == ORIGINAL and linked.read_bytes() == ORIGINAL + b"more\n"


def test_a_truncating_open_gives_the_name_a_new_empty_file(original, linked):
    with os.fdopen(
        fs.open_fd(linked, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, linked="replace"), "wb"
    ) as f:
        f.write(b"new\n")
    assert original.read_bytes() == ORIGINAL and linked.read_bytes() == b"new\n"


def test_a_read_of_a_hard_linked_file_is_allowed(original, linked):
    assert fs.read_bytes(linked) == ORIGINAL


def test_a_file_replaced_whole_by_rename_needs_no_check(original, linked):
    # The rename gives the name a new file; the other name keeps the old one.
    fs.write_atomic(linked, b"replaced\n")
    assert original.read_bytes() == ORIGINAL and linked.read_bytes() == b"replaced\n"


def test_unshare_gives_a_library_a_file_of_its_own_to_open_in_place(tmp_path, original, linked):
    fs.unshare(linked)
    with open(linked, "ab") as f:  # what a library (Optuna, SQLite) does with the name afterwards
        f.write(b"theirs\n")
    assert original.read_bytes() == ORIGINAL
    inode = original.stat().st_ino
    fs.unshare(original)  # one name already: left as it is
    assert original.stat().st_ino == inode
    fs.unshare(tmp_path / "original" / "absent")
    assert not (tmp_path / "original" / "absent").exists()


def test_a_symbolic_link_is_still_refused_whatever_linked_says(original, tmp_path):
    link = tmp_path / "original" / "link"
    link.symlink_to(original)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        fs.open_append(link, linked="replace")
    assert original.read_bytes() == ORIGINAL


# -- each in-place open of the package, with its kind's choice -------------------------------------


def _metrics(folder: Path) -> None:
    from ddpkit.tracking._metrics import MetricsWriter

    writer = MetricsWriter(folder, enabled=True)
    writer.epoch_end(2, {"epoch": 1, "step": 2})
    writer.close()


def _journal(folder: Path) -> None:
    from ddpkit.search._study import repair_journal

    repair_journal(folder / "study.journal")
    # Optuna's own append, by name, after the repair
    with open(folder / "study.journal", "ab") as f:
        f.write(b'{"op_code": 0}\n')


def _snapshot_file(folder: Path) -> None:
    from ddpkit.snapshot._dcp import _open_stream

    with _open_stream(folder / "__0_0.distcp", "wb") as f:
        f.write(b"tensors\n")


@pytest.mark.parametrize(
    "call, name, kept",
    [
        (_metrics, "metrics.jsonl", True),
        (_metrics, "epochs.csv", True),
        (_journal, "study.journal", True),
        (_snapshot_file, "__0_0.distcp", False),
    ],
    ids=["metrics.jsonl", "epochs.csv", "journal", "snapshot-file"],
)
def test_each_in_place_write_of_the_package_leaves_the_other_name_whole(
    tmp_path, monkeypatch, call, name, kept
):
    """Records a copied folder goes on with keep their bytes in the copy (``kept``); files rewritten
    whole start empty. With the check off (control), each writes into the other name."""
    held = (
        b'{"op_code": 4}\n'
        if name == "study.journal"
        else (b"epoch,step\r\n0,0\r\n" if name == "epochs.csv" else ORIGINAL)
    )
    for check in ("on", "off"):
        folder, other = tmp_path / check / "copy", tmp_path / check / "original"
        folder.mkdir(parents=True), other.mkdir()
        (other / name).write_bytes(held)
        os.link(other / name, folder / name)
        if check == "off":
            monkeypatch.setattr(fs, "other_names", lambda st: False)
        call(folder)
        if check == "off":
            assert (other / name).read_bytes() != held, (
                "the control no longer writes through the link"
            )
            continue
        assert (other / name).read_bytes() == held
        assert (folder / name).stat().st_nlink == 1
        assert (folder / name).read_bytes().startswith(held) == kept


# -- lock files: replaced only while held ----------------------------------------------------------


def _lock(folder: Path):
    from ddpkit._fs.lock import FolderLock

    return FolderLock(
        folder, what="run_dir", job="job", user="run", hazard="two jobs would write the same files"
    )


def _shared_lock(tmp_path: Path) -> tuple[Path, Path]:
    """Two folders whose ``.lock`` is one file (a folder copied with ``cp -al``)."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir(), copy.mkdir()
    (original / ".lock").write_bytes(b'{"host": "h", "pid": 1, "since": "then"}')
    os.link(original / ".lock", copy / ".lock")
    return original, copy


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_lock_file_with_a_second_name_is_replaced_while_held_and_the_other_left_whole(
    tmp_path, monkeypatch, check
):
    original, copy = _shared_lock(tmp_path)
    held = (original / ".lock").read_bytes()
    if check == "off":  # control: the holder's name is written through the link
        monkeypatch.setattr(fs, "other_names", lambda st: False)
    lock = _lock(copy)
    lock.acquire()
    try:
        if check == "off":
            assert (original / ".lock").read_bytes() != held
            return
        assert (original / ".lock").read_bytes() == held
        assert os.stat(original / ".lock").st_nlink == 1 and os.stat(copy / ".lock").st_nlink == 1
        assert json.loads((copy / ".lock").read_bytes())["pid"] == os.getpid()
        other = _lock(original)  # the two folders no longer exclude each other
        other.acquire()
        other.release()
        # the copy's own lock holds
        with pytest.raises(ConfigError, match="is in use by another job"):
            _lock(copy).acquire()
    finally:
        lock.release()


def test_a_lock_held_in_a_folder_copied_while_its_job_runs_is_refused_saying_so(tmp_path):
    original, copy = tmp_path / "original", tmp_path / "copy"
    copy.mkdir()
    lock = _lock(original)
    lock.acquire()  # of one name when taken; then the folder is copied with cp -al
    os.link(original / ".lock", copy / ".lock")
    try:
        with pytest.raises(ConfigError) as refused:
            _lock(copy).acquire()
        message = str(refused.value)
        assert "\n" not in message and f"pid {os.getpid()}" in message, message
        assert (
            "or a job of another folder whose .lock is this same file, as after cp -al" in message
        ), message
    finally:
        lock.release()


def test_a_taker_that_locks_the_old_file_after_it_was_replaced_does_not_hold_the_lock(
    tmp_path, monkeypatch
):
    # B opens the shared file, then A takes the lock (and replaces the name's file), then B's flock
    # of the old file succeeds (control: recorded below); B must find the name's file changed and
    # take that one: held.
    from ddpkit._fs import lock as lock_module

    _, copy = _shared_lock(tmp_path)
    real_flock, got, taken, started = fcntl.flock, [], [], []

    def flock(fd: int, op: int) -> None:
        if not started:
            started.append(True)
            # A, between B's open and B's flock
            taken.append(lock_module.take(copy / ".lock", wait=False))
            real_flock(fd, op)  # B on the old file: nothing holds it any more
            got.append(os.fstat(fd).st_ino)
            return
        real_flock(fd, op)

    monkeypatch.setattr(lock_module.fcntl, "flock", flock)
    old = os.stat(copy / ".lock").st_ino
    fd_b, held_b = lock_module.take(copy / ".lock", wait=False)
    (fd_a, held_a) = taken[0]
    try:
        assert got == [old]  # control: B did lock the old file, which the name no longer leads to
        assert held_a and os.fstat(fd_a).st_ino == os.stat(copy / ".lock").st_ino != old
        # B found A's file, held
        assert not held_b and os.fstat(fd_b).st_ino == os.fstat(fd_a).st_ino
    finally:
        os.close(fd_a), os.close(fd_b)


def _take_and_hold(path: Path, start, taken, release) -> None:
    from ddpkit._fs import lock as lock_module

    start.wait()
    fd, held = lock_module.take(path, wait=False)
    taken.put(held)
    release.wait()  # holding it (or not) until every taker has answered
    os.close(fd)


@pytest.mark.heavy
def test_of_eight_processes_racing_for_a_shared_lock_file_exactly_one_holds_it(tmp_path):
    # Real processes and the kernel's flock. The window the re-check after the lock closes is too
    # narrow for them to hit (take() without it: 0 rounds of 100 with two holders): the interleaving
    # test above is its control.
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for round_ in range(5):
        (tmp_path / str(round_)).mkdir()
        _, copy = _shared_lock(tmp_path / str(round_))
        start, release, taken = context.Barrier(8), context.Event(), context.Queue()
        workers = [
            context.Process(target=_take_and_hold, args=(copy / ".lock", start, taken, release))
            for _ in range(8)
        ]
        for worker in workers:
            worker.start()
        answers = [taken.get(timeout=60) for _ in workers]
        release.set()
        for worker in workers:
            worker.join(timeout=60)
        assert sorted(answers) == [False] * 7 + [True], answers
        assert os.stat(tmp_path / str(round_) / "original" / ".lock").st_nlink == 1
