""":mod:`ddpkit._fs`: no write follows a link, temporaries are new files of unpredictable names in
the destination folder, and a folder of another user is refused naming its owner."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError

VICTIM = b"a file of someone else's, outside the folder\n"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_bytes(VICTIM)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "folder"
    path.mkdir()
    return path


def test_a_raw_create_and_truncate_writes_through_a_link(folder, victim):
    # Control: the pattern a search's lock used (open O_RDWR|O_CREAT, then ftruncate) overwrites the
    # victim.
    (folder / ".lock").symlink_to(victim)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 0)
    os.write(fd, b"{}")
    os.close(fd)
    assert victim.read_bytes() == b"{}"


@pytest.mark.parametrize(
    "call",
    [
        lambda p: fs.open_fd(p, os.O_RDWR | os.O_CREAT),
        lambda p: fs.open_append(p),
        lambda p: fs.open_exclusive(p),
        lambda p: fs.read_bytes(p),
        lambda p: fs.truncate(p, 0),
    ],
    ids=["open_fd", "open_append", "open_exclusive", "read_bytes", "truncate"],
)
def test_a_file_opened_through_the_module_is_never_a_link(folder, victim, call):
    link = folder / "name"
    link.symlink_to(victim)
    with pytest.raises((ConfigError, FileExistsError)) as refused:
        call(link)
    if refused.type is ConfigError:
        assert f"{str(link)!r} is a symbolic link (to {str(victim)!r})" in str(refused.value)
    assert victim.read_bytes() == VICTIM and link.is_symlink()


@pytest.mark.parametrize(
    "write",
    [
        lambda p: fs.write_atomic(p, b"new"),
        lambda p: fs.write_with(p, lambda f: f.write(b"new")),
        lambda p: fs.write_with(p, np.frombuffer(b"new", np.uint8).tofile),
    ],
    ids=["write_atomic", "write_with", "tofile"],
)
def test_a_file_replaced_whole_replaces_a_link_and_leaves_its_target(folder, victim, write):
    link = folder / "out.bin"
    link.symlink_to(victim)
    write(link)
    assert victim.read_bytes() == VICTIM
    assert not link.is_symlink() and link.read_bytes() == b"new"
    assert os.listdir(folder) == ["out.bin"]  # no temporary left


def test_temporaries_are_unpredictable_and_a_planted_one_is_never_written(
    folder, victim, monkeypatch
):
    # Every name a temporary could have is planted as a link to the victim: the writer skips them
    # (O_EXCL) and never writes through one. Then: two writes use two different names.
    tokens = iter(["aaaa", "aaaa", "bbbb", "cccc"])
    monkeypatch.setattr(fs.secrets, "token_hex", lambda n: next(tokens))
    (folder / ".out.bin.aaaa.tmp").symlink_to(victim)
    fs.write_atomic(folder / "out.bin", b"new")
    assert victim.read_bytes() == VICTIM and (folder / "out.bin").read_bytes() == b"new"
    assert sorted(os.listdir(folder)) == [".out.bin.aaaa.tmp", "out.bin"]
    seen = []
    monkeypatch.undo()
    real = os.replace
    monkeypatch.setattr(fs.os, "replace", lambda a, b, **kw: (seen.append(a), real(a, b, **kw)))
    fs.write_atomic(folder / "x", b"1")
    fs.write_atomic(folder / "x", b"2")
    assert len(set(seen)) == 2 and all(len(name) >= len(".x..tmp") + 16 for name in seen)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(folder):
    (folder / "out.bin").write_bytes(b"old")

    def fails(f):
        f.write(b"half")
        raise RuntimeError("the library failed")

    with pytest.raises(RuntimeError):
        fs.write_with(folder / "out.bin", fails)
    assert os.listdir(folder) == ["out.bin"] and (folder / "out.bin").read_bytes() == b"old"


def test_folders_below_the_root_are_never_links(folder, victim):
    (folder / "snapshots").symlink_to(victim.parent, target_is_directory=True)
    for call in (
        lambda: fs.write_atomic(folder / "snapshots" / "marker", b"x", root=folder),
        lambda: fs.make_dirs(folder / "snapshots" / "step-1", root=folder),
        lambda: fs.remove(folder / "snapshots" / "victim.txt", root=folder),
        lambda: fs.remove_tree(folder / "snapshots" / "x", root=folder),
        lambda: fs.rename(folder / "snapshots" / "victim.txt", folder / "moved", root=folder),
    ):
        with pytest.raises(ConfigError, match="snapshots' is a symbolic link"):
            call()
    assert sorted(os.listdir(victim.parent)) == ["victim.txt"] and victim.read_bytes() == VICTIM
    # Control: without the root the folder is opened as the caller named it (a run directory may be
    # a link).
    fs.write_atomic(folder / "snapshots" / "marker", b"x")
    assert (victim.parent / "marker").read_bytes() == b"x"


def test_remove_and_rename_act_on_a_link_itself(folder, victim):
    (folder / "a").symlink_to(victim)
    fs.rename(folder / "a", folder / "b", root=folder)
    assert (folder / "b").is_symlink()
    fs.remove(folder / "b", root=folder)
    fs.remove_tree(folder / "gone", root=folder)  # absent: nothing to do
    assert os.listdir(folder) == [] and victim.read_bytes() == VICTIM
    with pytest.raises(ConfigError, match="not inside"):
        fs.remove(folder / ".." / "elsewhere" / "victim.txt", root=folder)


@as_root
@pytest.mark.parametrize("owned", ["folder", "file", "subfolder"])
def test_a_folder_or_file_of_another_user_is_refused_naming_the_owner(folder, owned):
    (folder / "sub").mkdir()
    (folder / "sub" / "out.bin").write_bytes(b"theirs")
    target = {"folder": folder, "file": folder / "sub" / "out.bin", "subfolder": folder / "sub"}[
        owned
    ]
    os.chown(target, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as refused:
        if owned == "file":
            fs.open_append(folder / "sub" / "out.bin", root=folder)
        else:
            fs.write_atomic(folder / "sub" / "new.bin", b"x", root=folder)
    message = str(refused.value)
    assert f"{str(target)!r} belongs to nobody (uid {NOBODY}), not to you (root, uid 0)" in message
    assert "\n" not in message and not (folder / "sub" / "new.bin").exists()
    assert (folder / "sub" / "out.bin").read_bytes() == b"theirs"
    os.chown(target, 0, 0)  # control: handed back, the same write goes through
    fs.write_atomic(folder / "sub" / "new.bin", b"x", root=folder)


def test_a_shared_sticky_folder_is_written_and_a_plain_file_where_a_folder_goes_is_named(tmp_path):
    # root's /tmp, sticky: usable
    fs.write_atomic(Path("/tmp") / f"ddpkit-fs-test-{os.getpid()}", b"x")
    fs.remove(Path("/tmp") / f"ddpkit-fs-test-{os.getpid()}")
    (tmp_path / "step").write_text("a file")
    with pytest.raises(FileExistsError, match="step"):
        fs.make_dirs(tmp_path / "step", root=tmp_path)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: fs.open_append(p).close(),
        lambda p: fs.open_append(p, read=True).close(),
        lambda p: fs.read_bytes(p),
        lambda p: fs.truncate(p, 0),
        lambda p: os.close(fs.open_fd(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)),
    ],
    ids=["append", "append-read", "read", "truncate", "create"],
)
def test_a_fifo_planted_under_a_files_name_is_refused_not_waited_on(folder, call):
    # Opening a FIFO blocks until its other end is opened: a job would wait on it for ever. The call
    # runs in a thread so that a regression fails here instead of hanging the suite (the FIFO is
    # then opened to free it).
    import threading

    fifo = folder / "metrics.jsonl"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call(fifo)
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=5)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))  # frees the blocked open
        thread.join(timeout=5)
        pytest.fail("the open waited on the FIFO")
    assert len(errors) == 1 and isinstance(errors[0], ConfigError), errors
    assert "is not a regular file" in str(errors[0]) and "metrics.jsonl" in str(errors[0])


def test_a_file_opened_through_the_module_blocks_as_usual(folder):
    path = folder / "metrics.jsonl"
    with fs.open_append(path) as f:
        assert os.get_blocking(f.fileno())
    fd = fs.open_fd(path, os.O_RDONLY | os.O_NONBLOCK)  # asked for: kept
    try:
        assert not os.get_blocking(fd)
    finally:
        os.close(fd)


def test_a_path_outside_its_root_is_a_config_error(folder):
    with pytest.raises(ConfigError, match="is not inside"):
        fs.write_atomic(folder / "a" / "b", b"x", root=folder / "c")
    assert not (folder / "a").exists()
