"""Snapshots as folders: every rank writes its own part with ``torch.distributed.checkpoint`` (DCP),
and a marker with checksums, written last, makes the folder count.

Layout of ``run_dir/snapshots``::

    step-00000120/
        __0_0.distcp, __1_0.distcp   each rank's tensors: its shards (zero/fsdp)
                                     and what is its own (below)
        metadata.json                DCP's index: which tensor (or piece) is where;
                                     what a resume reads
        .metadata                    the same index as DCP pickles it, for torch's
                                     own tools (never read here)
        values.pt                    the other values: counters, scheduler, random
                                     states, config (rank 0)
        complete.json                the marker: the step, size and sha256 of
                                     every file above

A folder is a snapshot only once ``complete.json`` exists, and the marker is written (atomically, by
rank 0) only after every rank's files are on disk: a process killed at any instant leaves the
previous snapshot as the newest whole one. A folder's name is not trusted: ``step-N`` is the
snapshot of step N only if it is no link and its marker records step N
(:func:`~ddpkit.snapshot._folders.scan`). On load, a snapshot whose files are missing or altered,
and a newer folder named like one that is none, is reported by name and the one before it is used.
DCP reshards on load, so a snapshot taken on N ranks resumes on M.

What differs between ranks is saved per rank: see :mod:`ddpkit.snapshot._layout`. At the same world
size every rank loads its own copy back; at another, every rank loads rank 0's.

Nothing here unpickles data from disk (:mod:`ddpkit.snapshot._storage`): DCP's files hold tensors
only, read with ``weights_only``; the index is read from JSON; every other value of the state
(optimizer hyper-parameters, a scheduler's state, the callbacks') is encoded by
:mod:`ddpkit.snapshot._codec` into ``values.pt`` and the rank files, which load with
``torch.load(weights_only=True)`` and are then decoded. What the codec cannot hold is refused by
:meth:`SnapshotManager.save`, naming it, before any file of the snapshot is written, so a resume
never meets a value it cannot read. A snapshot folder from elsewhere can give the run any tensors
and the values the codec holds, but cannot run code; one holding anything else is refused by name.

Asynchronous saving (``async_write``): the state is copied to host memory (the only part the
training loop waits for), then a background thread writes the copy, checksums it and writes the
marker. The thread's collectives run on a process group of their own (same ranks, gloo): two threads
issuing collectives on one group could pair a rank's checkpoint message with another rank's gradient
all-reduce. One write is in flight at a time; the next save, and the end of training, wait for it.

A write that fails (a full disk) raises :class:`SnapshotWriteError` on every rank, naming the OS
error, the file and the previous snapshot, which is left whole; the partial folder is removed. In
the background, the error is raised by the next :meth:`SnapshotManager.wait` (the next save, or the
end of training).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._internals.versions import GROUP_SNAPSHOTS, require_torch
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import broadcast_object, first_failure, gather_object
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _folders as folders
from ddpkit.snapshot import _loading as loading
from ddpkit.snapshot._folders import INDEX, MARKER, OWN, VALUES, Found, digest, folder_name
from ddpkit.snapshot._layout import differences, stored_parts
from ddpkit.snapshot._staging import stage, writer_group

# torch.distributed.checkpoint (and DTensor, which it imports; and ddpkit.snapshot._storage, built
# on it) is imported where it is used: it pulls in sympy and costs ~0.9 s per process, which `import
# ddpkit` (a hand-written loop, the launcher) need not pay.


class SnapshotWriteError(RuntimeError):
    """A snapshot could not be written; the message names why, where, and the snapshot a restart
    resumes from. When an OS error was the reason (a full disk), it is the cause (``__cause__``), on
    every rank."""


Failed = tuple[str, "int | None", "str | None"]
"""A failed write as every rank learns it: the message, and the OS error's number and file, if
any."""


def _raise(failed: Failed) -> NoReturn:
    message, code, filename = failed
    if code is None:
        raise SnapshotWriteError(message)
    # Rebuilt on every rank from what the failing rank reported: code that tells the machine's
    # errors from a program's (a search stops on a full disk rather than failing a trial) finds the
    # OS error as the cause.
    raise SnapshotWriteError(message) from OSError(code, os.strerror(code), filename)


class SnapshotManager:
    """Writes and finds the snapshots of one folder, for the ranks of ``group`` (every rank calls
    every method).

    ``keep_last``: whole snapshots kept; older ones, and the debris of writes killed before their
    marker, go.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        group: Group = None,
        keep_last: int = 2,
        async_write: bool = False,
    ):
        self.folder = Path(folder)
        self.group = group
        self.keep_last = max(1, keep_last)
        self.async_write = async_write
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed and importlib.util.find_spec("numpy") is None:
            # torch's checkpoint exchanges its plans with object collectives, which need numpy
            # (torch does not declare it): without it every rank's first save would fail inside
            # torch, after the step.
            raise ConfigError(
                "snapshots of a job of several ranks are written by torch.distributed.checkpoint, "
                "whose object collectives need numpy, which is not installed: pip install numpy"
            )
        if self.distributed and group is not None and dist.get_global_rank(group, 0) != 0:
            # Before 2.7, DCP gathers its plans to the group's first rank addressed by its rank in
            # the group, as if it were the job's: on any other group the save fails ("not part of
            # group").
            require_torch(
                "snapshots of a group of ranks that does not hold the job's rank 0 "
                "(ddpkit.split_world, a search's candidates)",
                GROUP_SNAPSHOTS,
            )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staged: Any = None  # host copy of the last asynchronous save, reused by the next
        self.last_write_seconds: float | None = None

    @property
    def _rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0

    @property
    def _size(self) -> int:
        return dist.get_world_size(self.group) if self.distributed else 1

    def save(
        self,
        step: int,
        state: dict[str, Any],
        extra: dict[str, Any],
        *,
        replicated: bool = False,
        own: Any = None,
    ) -> None:
        """Snapshot ``step``: ``state`` (every rank's own part, for DCP: its tensors, shards and the
        :data:`~ddpkit.strategies._base.PER_RANK` part; its other values go to ``values.pt``) and
        ``extra`` (rank 0's, in ``values.pt``). ``replicated``: the tensors of ``state`` outside its
        per-rank part are the same on every rank (``Strategy.replicated``), and each rank writes a
        share of them. ``own``: plain values and tensors of this rank alone, which it writes to a
        file of its own (:meth:`read_own`): no rank gathers them, and a load reads only its own.

        Returns once the state is safe from the training loop: written (synchronous), or copied to
        host memory with the write under way (asynchronous). Raises :class:`SnapshotWriteError` if
        it is not.
        """
        self.wait()
        path = self.folder / folder_name(step)
        tensors, values = stored_parts(state, self._rank, self._size if replicated else 1)
        own_bytes = self._check_values(values, extra, own)
        # Rank 0 empties the folder before its word reaches the others, so no rank writes into it
        # before it is clean. Values that are not tensors (hyper-parameters by parameter) may differ
        # between ranks (zero:
        # each rank's own parameters'), so every rank's go to rank 0's values.pt: rank 0's whole,
        # and of each other rank only what rank 0's lack or hold otherwise. Replicated, that is
        # nothing, and neither the gather to rank 0 nor the file every rank reads on a load grows
        # with the ranks.
        word = (self._clear(path, step), values) if self._rank == 0 else None
        if self.distributed:
            word = broadcast_object(word, group=self.group)
        assert word is not None
        cleared, common = word
        if cleared is not None:
            _raise(cleared)
        differing = differences(values, common)
        every_rank = gather_object(differing, group=self.group) if self.distributed else [differing]
        extra_bytes = b""
        if self._rank == 0:
            held: list[torch.Tensor] = []
            saved = {
                "world_size": self._size,
                "values": common,
                "differences": every_rank,
                "extra": extra,
            }
            extra_bytes = codec.file_bytes(codec.encode(saved, held), held)
        if not self.async_write:
            self._write(path, step, tensors, extra_bytes, own_bytes, self.group)
            return
        group = writer_group(self.group) if self.distributed else None
        # A copy in host memory: training may change the originals from here on. The previous write
        # is done (wait() above), so its buffers are free to reuse.
        self._staged = staged = stage(tensors, self._staged)
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(path, step, staged, extra_bytes, own_bytes, group),
            # Not a daemon: an interpreter that exits (an exception, SystemExit) first finishes the
            # write.
            name=f"ddpkit-snapshot-{step}",
            daemon=False,
        )
        self._thread.start()

    def _check_values(
        self, values: dict[Any, Any], extra: dict[str, Any], own: Any
    ) -> bytes | None:
        """This rank's ``own`` file, once every rank has encoded what it saves: a value no snapshot
        can hold (:mod:`ddpkit.snapshot._codec`) is refused on every rank, naming it, before any
        file of the snapshot is written. Collective (one all-reduce) when distributed."""
        refusal, own_bytes = None, None
        try:
            for key, value in values.items():
                codec.encode(value, [], ".".join(map(str, key)))
            if self._rank == 0:
                codec.encode(extra, [])
            if own is not None:
                held: list[torch.Tensor] = []
                own_bytes = codec.file_bytes(codec.encode(own, held, "own"), held)
        except codec.UnsupportedValue as err:
            refusal = str(err)
        if self.distributed:
            refusal = first_failure(refusal, group=self.group)
        if refusal is not None:
            raise codec.UnsupportedValue(refusal)
        return own_bytes

    def _clear(self, path: Path, step: int) -> Failed | None:
        """Rank 0: make ``path`` an empty folder; the failure (:meth:`_failure`) if it cannot."""
        from ddpkit.snapshot import _storage as dcp_files  # see the note on lazy imports at the top

        # Debris of a write of this step that was killed before its marker (perhaps at another world
        # size, with other ranks' files): start clean, so the marker lists exactly what is there.
        try:
            fs.remove_tree(path, root=self.folder)
            fs.make_dirs(path, root=self.folder)
        except OSError as err:
            return self._failure(path, step, [(0, dcp_files.os_failure(err, path, self.folder))])
        except ConfigError as err:  # a link or another user's folder where the snapshots go
            return self._failure(path, step, [(0, dcp_files.Failure(str(err)))])
        return None

    def _write_in_background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as err:  # raised in the training thread by the next wait()
            self._error = err

    def _write(
        self,
        path: Path,
        step: int,
        tensors: dict[str, Any],
        extra: bytes,
        own: bytes | None,
        group: Group,
    ) -> None:
        """Every rank writes its files; rank 0 then writes the marker, or, if any rank failed,
        removes the folder; every rank raises the same :class:`SnapshotWriteError` then. Collective
        over ``group``."""
        import torch.distributed.checkpoint as dcp  # see the note on lazy imports at the top
        from torch.distributed.checkpoint.api import CheckpointException

        from ddpkit.snapshot import _storage as dcp_files

        t0 = time.perf_counter()
        rank = dist.get_rank(group) if self.distributed else 0
        writer = dcp_files.Writer(path)
        digests, failure, failed = {}, None, False
        try:
            if not self.distributed:
                loading.quiet_single_process_warning()
            dcp.save(tensors, storage_writer=writer, process_group=group)
            # dcp.save returns on every rank once every rank's files and the index are written
            # (fsynced); when one rank fails, it raises on every rank.
            mine = sorted(path.glob(f"__{rank}_*.distcp"))
            if own is not None:
                fs.write_atomic(path / OWN.format(rank), own)
                mine.append(path / OWN.format(rank))
            if rank == 0:
                fs.write_atomic(path / VALUES, extra)
                mine += [path / ".metadata", path / INDEX, path / VALUES]
            digests = digest(mine)
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            failed, failure = True, dcp_files.rank_failure(err, writer.failures, rank, path)
            if not writer.failures and not isinstance(err, OSError):
                # Not the machine's fault (a full disk is named without it): the message below
                # carries one line of the error, and the rank's stderr keeps where it came from.
                traceback.print_exc()
        part = (digests, failure, failed)
        parts = gather_object(part, group=group) if self.distributed else [part]
        failed_write = self._finish(path, step, parts) if parts is not None else None
        if self.distributed:
            failed_write = broadcast_object(failed_write, group=group)
        if failed_write is not None:
            _raise(failed_write)
        self.last_write_seconds = time.perf_counter() - t0

    def _finish(self, path: Path, step: int, parts: list[tuple[dict, Any, bool]]) -> Failed | None:
        """Rank 0, once every rank is done with ``path``: the marker, or the failure
        (:meth:`_failure`)."""
        from ddpkit.snapshot import _storage as dcp_files

        failures = [(r, f) for r, (_, f, _) in enumerate(parts) if f is not None]
        if any(failed for _, _, failed in parts):
            failures = failures or [
                (0, dcp_files.Failure("the write failed on another rank; see its traceback"))
            ]
        else:
            files = {name: d for digests, _, _ in parts for name, d in digests.items()}
            marker = {"step": step, "files": files}
            try:
                fs.write_atomic(path / MARKER, json.dumps(marker, indent=1).encode())
            except OSError as err:
                failures = [(0, dcp_files.os_failure(err, path / MARKER, path))]
            else:
                self._prune(newest=step)
                return None
        # Every rank is past its writes: the partial folder can go, and give back the space it took.
        fs.remove_tree(path, root=self.folder)
        return self._failure(path, step, failures)

    def _failure(self, path: Path, step: int, failures: list[tuple[int, Any]]) -> Failed:
        """What every rank raises: the message (what failed where,
        :func:`ddpkit.snapshot._storage.describe`, and what is left), and the first OS error's
        number and file, if a rank met one."""
        from ddpkit.snapshot import _storage as dcp_files

        previous = next((f for f in self.candidates() if f.step != step), None)
        if previous is not None:
            kept = (
                f"the previous snapshot, {previous.path}, is whole and untouched: a restart "
                "resumes from it"
            )
        else:
            kept = "there is no earlier snapshot: a restart starts from the beginning"
        advice = ""
        if any(f.disk_full for _, f in failures):
            advice = (
                ". Free space there, keep fewer snapshots (SnapshotConfig.keep), or give the "
                "run another run_dir"
            )
        what = dcp_files.describe(failures)
        message = (
            f"ddpkit: snapshot {path} was not written: {what}. Its partial folder is "
            f"removed; {kept}{advice}"
        )
        os_error = next((f for _, f in failures if f.errno is not None), None)
        if os_error is None:
            return message, None, None
        return message, os_error.errno, str(path / os_error.file) if os_error.file else str(path)

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raise its error here if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, SnapshotWriteError):
                raise SnapshotWriteError(f"{err} (written in the background)") from err
            raise RuntimeError(
                f"ddpkit: writing a snapshot in the background failed: {err!r}"
            ) from err

    # -- finding and loading -----------------------------------------------------------------------

    def candidates(self) -> list[Found]:
        """Snapshot folders with a marker, newest first; not yet verified."""
        return folders.candidates(self.folder)

    def verify(self, found: Found) -> str | None:
        """None if ``found`` is whole, else what is wrong with it. ``values.pt``, read first, must
        be listed; the index and the data files it names are checked against the marker when they
        are read."""
        return folders.verify(found, required=(VALUES,))

    def _prune(self, newest: int) -> None:
        folders.prune(self.folder, self.keep_last, newest)

    def latest(self, warn: Callable[[str], None] = print) -> Found | None:
        """The newest whole snapshot, the same on every rank (rank 0 checks the files and tells the
        others). A damaged one, and anything newer named like one that is none (a link, a copy or
        rename of another step's folder: :func:`~ddpkit.snapshot._folders.scan`), is named through
        ``warn`` and passed over."""
        self.wait()
        choice = None
        if self._rank == 0:
            for found, problem in folders.scan(self.folder):
                if problem == folders.PARTIAL:  # a write killed before its marker: not a snapshot
                    continue  # yet, and the next prune removes it
                if problem is None:
                    problem = self.verify(found)
                if problem is None:
                    choice = found
                    break
                warn(
                    f"ddpkit: skipping snapshot {found.path}: it {problem}; trying the one before "
                    "it"
                )
        if self.distributed:
            choice = broadcast_object(choice, group=self.group)
        return choice

    def load(
        self,
        found: Found,
        template: Callable[[], dict[str, Any]],
        map_location: Any = None,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state, extra)`` of a snapshot: :func:`ddpkit.snapshot._loading.load`, on this
        manager's ranks."""
        return loading.load(
            found,
            template,
            group=self.group,
            distributed=self.distributed,
            map_location=map_location,
            check=check,
        )

    def read_own(self, found: Found, ranks: list[int], map_location: Any = None) -> list[Any]:
        """The ``own`` values that ``ranks`` saved in ``found`` (:meth:`save`):
        :func:`ddpkit.snapshot._folders.read_own`."""
        return folders.read_own(found, ranks, map_location)
