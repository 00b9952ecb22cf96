"""torch.distributed.checkpoint's file-system storage, where ddpkit reaches past its public API: a
writer's file system (``FileSystemWriter.fs``) and ``_StorageInfo``."""

from __future__ import annotations

import dataclasses
from typing import Any

from ddpkit._internals.contract import Internal


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """The ``_StorageInfo`` of ``length`` bytes at ``offset`` in data file ``relative_path``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def transformed(info: Any) -> bool:
    """Whether an item was written through a stream transform (never one of ddpkit's)."""
    return bool(getattr(info, "transform_descriptors", None))


def set_file_system(writer: Any, file_system: Any) -> None:
    """Have a ``FileSystemWriter`` open, rename and remove its files through ``file_system``."""
    writer.fs = file_system


def _check_storage_info() -> str | None:
    from torch.distributed.checkpoint import filesystem

    info = getattr(filesystem, "_StorageInfo", None)
    if info is None or not dataclasses.is_dataclass(info):
        return "torch.distributed.checkpoint.filesystem has no _StorageInfo dataclass"
    names = [f.name for f in dataclasses.fields(info)][:3]
    if names != ["relative_path", "offset", "length"]:
        return f"its first fields are {names}"
    return None


def _check_writer_fs() -> str | None:
    import tempfile

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    with tempfile.TemporaryDirectory() as folder:
        found = getattr(FileSystemWriter(folder), "fs", None)
    if not isinstance(found, FileSystem):
        return f"a FileSystemWriter's .fs is {type(found).__name__}"
    return None


# the methods of FileSystem ddpkit's overrides, with the arguments DCP calls them with
_OVERRIDDEN = {
    "create_stream": ["path", "mode"],
    "rename": ["path", "new_path"],
    "mkdir": ["path"],
    "rm_file": ["path"],
}


def _check_file_system_methods() -> str | None:
    import inspect

    from torch.distributed.checkpoint.filesystem import FileSystem

    for name, arguments in _OVERRIDDEN.items():
        method = getattr(FileSystem, name, None)
        if not callable(method):
            return f"FileSystem has no {name}"
        found = [p for p in inspect.signature(method).parameters if p not in ("self", "cls")]
        if found != arguments:
            return f"FileSystem.{name} takes ({', '.join(found)}), not ({', '.join(arguments)})"
    if not hasattr(FileSystem.create_stream, "__wrapped__"):
        return "FileSystem.create_stream is no longer a context manager"
    return None


INTERNALS = [
    Internal(
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch",
        "a resume reads each tensor's place from ddpkit's JSON index instead of unpickling "
        ".metadata",
        _check_storage_info,
    ),
    Internal(
        "torch.distributed.checkpoint.FileSystemWriter.fs",
        "torch",
        "snapshot files are written through ddpkit._fs (no links followed) and a full disk is "
        "named as such",
        _check_writer_fs,
    ),
    Internal(
        "torch.distributed.checkpoint.filesystem.FileSystem.create_stream / rename / mkdir / "
        "rm_file",
        "torch",
        "the methods ddpkit's snapshot file system overrides, to open no link and keep each "
        "write's OSError",
        _check_file_system_methods,
    ),
]
