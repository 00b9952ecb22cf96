"""The disk store: snapshots as ``run_dir/snapshots/step-N/`` folders, written by every rank through
torch.distributed.checkpoint (DCP, tensors only: :mod:`ddpkit.snapshot._dcp`) and the codec (other
values: ``values.pt``, each rank's ``rank{r}.pt``), made whole by a marker rank 0 writes last
(:mod:`ddpkit.snapshot._folders`). A failed write raises :class:`SnapshotWriteError` on every rank.
A state's :data:`~ddpkit.strategies._base.PER_RANK` part is saved as rank 0's in the shared key's
place, rank ``r``'s under ``per_rank.rank<r>`` (:func:`stored_path`).
"""

from __future__ import annotations

import copy
import errno
import functools
import heapq
import importlib.util
import inspect
import json
import os
import pickle
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError, checked_arguments
from ddpkit._internals.versions import require_torch
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import broadcast_object, first_failure, gather_object
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _folders as folders
from ddpkit.snapshot._folders import INDEX, MARKER, OWN, VALUES, Found, folder_name
from ddpkit.snapshot._state import (
    STREAMS_PART,
    Check,
    KeyPath,
    Parts,
    Resumed,
    leaves,
    nest,
    set_at,
)
from ddpkit.strategies._base import PER_RANK, Strategy

# torch.distributed.checkpoint (and ddpkit.snapshot._dcp) is imported where it is used (sympy)
Failed = tuple[str, "int | None", "str | None"]
"""A failed write as every rank learns it: the message, and the OS error's number and file."""


class SnapshotWriteError(RuntimeError):
    """A snapshot could not be written; the message names why, where, and the snapshot a restart
    resumes from. An OS error (a full disk) is the ``__cause__``, on every rank."""


def _raise(failed: Failed) -> NoReturn:
    message, code, filename = failed
    if code is None:
        raise SnapshotWriteError(message)
    # rebuilt on every rank: a search tells a full disk from a mistake by the cause's errno
    raise SnapshotWriteError(message) from OSError(code, os.strerror(code), filename)


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Failure:
    """One rank's part in a failed write."""

    what: str
    file: str | None = None  # relative to the snapshot's folder when inside it
    errno: int | None = None  # the OS error's number, when the failure was one


def os_failure(err: OSError, file: Any, folder: Path) -> Failure:
    file = Path(err.filename or file)
    shown = str(file.relative_to(folder)) if file.is_relative_to(folder) else str(file)
    what = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
    return Failure(what, shown, err.errno)


def rank_failure(
    err: BaseException, kept: list[tuple[Path, OSError]], rank: int, folder: Path
) -> Failure | None:
    """This rank's part in a failed write: the first OS error its files met, else its own
    exception; None when DCP reports other ranks' only."""
    if kept:
        return os_failure(kept[0][1], kept[0][0], folder)
    # DCP's CheckpointException: every failed rank's exception
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        if rank not in failures:
            return None
        err = failures[rank][0]
    if isinstance(err, OSError):
        return os_failure(err, folder, folder)
    text = str(err).strip().splitlines()
    return Failure(f"{type(err).__name__}: {text[0] if text else ''}")


def describe(failures: list[tuple[int, Failure]]) -> str:
    """``no space left on device (rank 0 writing __0_0.distcp, rank 1 writing __1_0.distcp)``, or
    each rank's own reason where they differ."""

    def where(rank: int, f: Failure) -> str:
        return f"rank {rank} writing {f.file}" if f.file else f"rank {rank}"

    whats = {f.what for _, f in failures}
    if len(whats) == 1:
        return f"{whats.pop()} ({', '.join(where(r, f) for r, f in failures)})"
    return "; ".join(f"{where(r, f)}: {f.what}" for r, f in failures)


class DiskStore:
    """Writes and finds the snapshots of one folder, for the ranks of ``group``; every rank calls
    every method. ``keep_last``: whole snapshots kept. ``async_write``: :meth:`save` returns once
    the state is copied to host memory, and a thread writes it (on a gloo group of its own)."""

    @checked_arguments
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
            # DCP exchanges its plans with object collectives, which need numpy
            raise ConfigError(
                "snapshots of a job of several ranks are written by torch.distributed.checkpoint, "
                "whose object collectives need numpy, which is not installed: pip install numpy"
            )
        if self.distributed and group is not None and dist.get_global_rank(group, 0) != 0:
            # before 2.7 DCP gathers its plans to the group's first rank as if it were the job's
            require_torch(
                "snapshots of a group of ranks that does not hold the job's rank 0 "
                "(ddpkit.split_world, a search's candidates)",
                (2, 7),
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

    def save_step(self, parts: Callable[[], Parts]) -> None:
        """Snapshot the step's ``parts()`` (:meth:`save`): the strategy's state, the other values
        (rank 0's) and this rank's own streams."""
        step = parts()
        strategy = step.strategy
        self.save(
            step.step, strategy.state_dict(), step.values, replicated=strategy.replicated,
            own=step.own,
        )  # fmt: skip

    def load_step(self, found: Found, strategy: Strategy, check: Check) -> Resumed:
        """The state of ``found`` (:meth:`latest`), its tensors read into ``strategy``'s state once
        ``check`` has accepted its values; each rank's own streams in the streams' part: this
        rank's at the same world size, every rank's at another."""
        where = str(found.path)
        sharded, extra = self.load(
            found, strategy.state_dict, "cpu", lambda saved: check(saved, where)
        )
        streams = extra["states"].get(STREAMS_PART)
        if streams is not None:
            size = streams["world_size"]
            wanted = [self._rank] if size == self._size else list(range(size))
            ranks: list[Any] = [None] * size
            for r, own in zip(wanted, self.read_own(found, wanted, map_location="cpu")):
                ranks[r] = own
            streams["ranks"] = ranks
        return Resumed(extra | {"strategy": sharded}, where, found.path.name, disk=True)

    def newest_marked(self) -> int:
        """The step of the newest folder with a marker, not verified (-1: none), on every rank."""
        found = self.candidates() if self._rank == 0 else []
        step = found[0].step if found else -1
        return broadcast_object(step, group=self.group)

    def save(
        self,
        step: int,
        state: dict[str, Any],
        extra: dict[str, Any],
        *,
        replicated: bool = False,
        own: Any = None,
    ) -> None:
        """Snapshot ``step``: ``state`` (every rank's own part: tensors to DCP, other values to
        ``values.pt``) and ``extra`` (rank 0's, in ``values.pt``). ``replicated``: the tensors of
        ``state`` outside its per-rank part are the same on every rank, each rank writing a share.
        ``own``: values of this rank alone, in a file of its own (:meth:`read_own`). Returns once
        the state is written, or copied to host memory (``async_write``); else
        :class:`SnapshotWriteError`."""
        self.wait()
        path = self.folder / folder_name(step)
        tensors, values = stored_parts(state, self._rank, self._size if replicated else 1)
        own_bytes = self._check_values(values, extra, own)
        # Rank 0 empties the folder before its word reaches the others. Every rank's non-tensor
        # values go to values.pt: rank 0's whole, of the others only what differs from rank 0's.
        word: Any = (self._clear(path, step), values) if self._rank == 0 else None
        cleared, common = broadcast_object(word, group=self.group)
        if cleared is not None:
            _raise(cleared)
        differing = differences(values, common)
        every_rank = gather_object(differing, group=self.group)
        extra_bytes = b""
        if self._rank == 0:
            held: list[torch.Tensor] = []
            saved = {"world_size": self._size, "values": common, "differences": every_rank}
            extra_bytes = codec.file_bytes(codec.encode(saved | {"extra": extra}, held), held)
        if not self.async_write:
            self._write(path, step, tensors, extra_bytes, own_bytes, self.group)
            return
        group = writer_group(self.group) if self.distributed else None
        # the previous write is done (wait() above): its host buffers are free to reuse
        self._staged = staged = stage(tensors, self._staged)
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(path, step, staged, extra_bytes, own_bytes, group),
            name=f"ddpkit-snapshot-{step}",
            daemon=False,  # an interpreter that exits first finishes the write
        )
        self._thread.start()

    def _check_values(
        self, values: dict[Any, Any], extra: dict[str, Any], own: Any
    ) -> bytes | None:
        """This rank's ``own`` file, once every rank has encoded what it saves: a value the codec
        cannot hold is refused on every rank, by name, before any file is written (collective)."""
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
        refusal = first_failure(refusal, group=self.group)
        if refusal is not None:
            raise codec.UnsupportedValue(refusal)
        return own_bytes

    def _clear(self, path: Path, step: int) -> Failed | None:
        """Rank 0: make ``path`` an empty folder (the debris of a killed write of this step, perhaps
        of another world size, goes); the failure if it cannot."""
        try:
            fs.remove_tree(path, root=self.folder)
            fs.make_dirs(path, root=self.folder)
        except OSError as err:
            return self._failure(path, step, [(0, os_failure(err, path, self.folder))])
        except ConfigError as err:  # a link or another user's folder where the snapshots go
            return self._failure(path, step, [(0, Failure(str(err)))])
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
        """Every rank writes its files; rank 0 then writes the marker or, if any rank failed,
        removes the folder, and every rank raises the same :class:`SnapshotWriteError`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from ddpkit.snapshot import _dcp

        t0 = time.perf_counter()
        rank = dist.get_rank(group) if self.distributed else 0
        writer = _dcp.Writer(path)
        digests, failure, failed = {}, None, False
        try:
            if not self.distributed:
                quiet_single_process_warning()
            # returns on every rank once every rank's files and the index are fsynced
            dcp.save(tensors, storage_writer=writer, process_group=group)
            mine = sorted(path.glob(f"__{rank}_*.distcp"))
            if own is not None:
                fs.write_atomic(path / OWN.format(rank), own)
                mine.append(path / OWN.format(rank))
            if rank == 0:
                fs.write_atomic(path / VALUES, extra)
                mine += [path / ".metadata", path / INDEX, path / VALUES]
            digests = {
                p.name: {"size": p.stat().st_size, "sha256": folders.sha256(p)} for p in mine
            }
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            failed, failure = True, rank_failure(err, writer.failures, rank, path)
            if not writer.failures and not isinstance(err, OSError):
                traceback.print_exc()  # not the machine's fault: where it came from
        part = (digests, failure, failed)
        parts = gather_object(part, group=group)
        failed_write = self._finish(path, step, parts) if parts is not None else None
        failed_write = broadcast_object(failed_write, group=group)
        if failed_write is not None:
            _raise(failed_write)
        self.last_write_seconds = time.perf_counter() - t0

    def _finish(self, path: Path, step: int, parts: list[tuple[dict, Any, bool]]) -> Failed | None:
        """Rank 0, once every rank is done with ``path``: the marker, or the failure."""
        failures = [(r, f) for r, (_, f, _) in enumerate(parts) if f is not None]
        if any(failed for _, _, failed in parts):
            failures = failures or [
                (0, Failure("the write failed on another rank; see its traceback"))
            ]
        else:
            files = {name: d for digests, _, _ in parts for name, d in digests.items()}
            marker = {"step": step, "files": files}
            try:
                fs.write_atomic(path / MARKER, json.dumps(marker, indent=1).encode())
            except OSError as err:
                failures = [(0, os_failure(err, path / MARKER, path))]
            else:
                folders.prune(self.folder, self.keep_last, newest=step)
                return None
        fs.remove_tree(path, root=self.folder)  # every rank is past its writes
        return self._failure(path, step, failures)

    def _failure(self, path: Path, step: int, failures: list[tuple[int, Any]]) -> Failed:
        """What every rank raises: what failed where, what is left, and the first OS error's number
        and file, if a rank met one."""
        previous = next((f for f in self.candidates() if f.step != step), None)
        if previous is not None:
            kept = (
                f"the previous snapshot, {previous.path}, is whole and untouched: a restart "
                "resumes from it"
            )
        else:
            kept = "there is no earlier snapshot: a restart starts from the beginning"
        advice = ""
        if any(f.errno in _DISK_FULL for _, f in failures):
            advice = (
                ". Free space there, keep fewer snapshots (SnapshotConfig.keep), or give the "
                "run another run_dir"
            )
        message = (
            f"ddpkit: snapshot {path} was not written: {describe(failures)}. Its partial "
            f"folder is removed; {kept}{advice}"
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

    def abandon(self, wait: float) -> bool:
        """A failed run's store let go: the write in flight (if any) waited for ``wait`` seconds at
        most, its error dropped; whether none runs on."""
        thread, self._thread, self._error = self._thread, None, None
        if thread is not None:
            thread.join(wait)
        return thread is None or not thread.is_alive()

    def candidates(self) -> list[Found]:
        """Snapshot folders with a marker, newest first; not yet verified."""
        return [found for found, problem in folders.scan(self.folder) if problem is None]

    def latest(self, warn: Callable[[str], None] = print) -> Found | None:
        """The newest whole snapshot, the same on every rank (rank 0 checks the files); a damaged
        one, and a newer stray, is named through ``warn`` and passed over."""
        self.wait()
        choice = None
        if self._rank == 0:
            for found, problem in folders.scan(self.folder):
                if problem == folders.PARTIAL:  # a killed write's debris: the next prune's
                    continue
                if problem is None:
                    problem = folders.verify(found, required=(VALUES,))
                if problem is None:
                    choice = found
                    break
                warn(
                    f"ddpkit: skipping snapshot {found.path}: it {problem}; trying the one before "
                    "it"
                )
        return broadcast_object(choice, group=self.group)

    def load(
        self,
        found: Found,
        template: Callable[[], dict[str, Any]],
        map_location: Any = None,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(state, extra)`` of a snapshot. ``template()`` gives the current state, whose tensors
        DCP fills in place and whose other values are replaced by the saved ones. ``check(extra)``
        runs before any tensor is read and may refuse it. Each rank reads with no collective; one
        rank's failure is raised on every rank."""
        from ddpkit.snapshot import _dcp

        saved = folders.read_values(found.path, map_location)
        if check is not None:
            check(saved["extra"])
        index = _dcp.read_marked_index(found.path)
        state = template()
        same = saved["world_size"] == self._size
        source = self._rank if same else 0  # whose copy of the per-rank part
        # Other values: this rank's own at the same world size; else rank 0's, and where rank 0 had
        # none (zero: another rank's parameters' hyper-parameters), the first rank's that had one.
        values = (
            [saved["differences"][source], saved["values"]]
            if same
            else [saved["values"], *saved["differences"]]
        )
        tensors = []
        for path, value in leaves(state):
            where = stored_path(path, source)
            if isinstance(value, torch.Tensor):
                tensors.append((where, value))
                continue
            held = [v[where] for v in values if where in v]
            if not held:
                raise ConfigError(
                    f"{found.path} holds no value for {'.'.join(map(str, path))}: it was written "
                    "for another model or optimizer"
                )
            set_at(state, path, held[0])
        self._read_tensors(found, index, nest(tensors))
        return state, saved["extra"]

    def _read_tensors(self, found: Found, index: Any, tensors: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from ddpkit.snapshot import _dcp

        # No collective where torch has no_dist (2.7 on): a read needs no other rank's plan. Either
        # way one all-reduce of the outcome makes a rank's failure every rank's, never a hang.
        local = self.distributed and "no_dist" in inspect.signature(dcp.load).parameters
        if local or not self.distributed:
            quiet_single_process_warning()
        failure: str | None = None
        error: BaseException | None = None
        try:
            dcp.load(
                tensors,
                storage_reader=_dcp.Reader(found.path, index),
                planner=_dcp.TensorsOnlyPlanner(),
                process_group=self.group,
                **({"no_dist": True} if local else {}),
            )
        except CheckpointException as err:  # a BaseException: every rank's traceback
            origin = min(err.failures)
            first = err.failures[origin][0]
            # the lowest failed rank's, named where a collective load makes it another rank's
            other = self.distributed and not local and origin != self._rank
            named = f" (on rank {origin})" if other else ""
            failure, error = f"{type(first).__name__}: {first}{named}", err
        except Exception as err:
            if not local:
                raise
            failure, error = f"{type(err).__name__}: {err}", err
        if local:
            failure = first_failure(failure, group=self.group)
        if failure is not None:
            raise RuntimeError(
                f"ddpkit: loading snapshot {found.path} failed: {failure}"
            ) from error

    def read_own(self, found: Found, ranks: list[int], map_location: Any = None) -> list[Any]:
        """The ``own`` values that ``ranks`` saved in ``found`` (:meth:`save`)."""
        return folders.read_own(found, ranks, map_location)


@functools.cache
def quiet_single_process_warning() -> None:
    """Filter DCP's warning that it assumes "the intent is to save in a single process" (a world of
    one, or ``no_dist``): it is. A filter of the process (the save runs in the writer's thread)."""
    warnings.filterwarnings(
        "ignore",
        message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent "
        "is to",
    )


def stored_path(path: KeyPath, rank: int) -> KeyPath:
    """Where the value at ``path`` is stored for the copy of ``rank``: a value of the per-rank part
    under its rank's name, except rank 0's, which takes the shared key's place."""
    if path[0] != PER_RANK:
        return path
    return path[1:] if rank == 0 else (PER_RANK, f"rank{rank}", *path[1:])


def stored_parts(
    state: dict[str, Any], rank: int, replicated_over: int = 1
) -> tuple[dict[str, Any], dict[KeyPath, Any]]:
    """The tensors of ``state`` as DCP saves them (nested, at their :func:`stored_path`), and its
    other values by stored path; over ``replicated_over`` ranks, the :func:`writer_of_shared`
    share of the shared tensors only."""
    # (stored path, value, whether it is of the per-rank part)
    items = [(stored_path(p, rank), v, p[0] == PER_RANK) for p, v in leaves(state)]
    tensors = [(p, v, own) for p, v, own in items if isinstance(v, torch.Tensor)]
    if replicated_over > 1:
        writer = writer_of_shared(
            [(p, v.numel() * v.element_size()) for p, v, own in tensors if not own], replicated_over
        )
        tensors = [(p, v, own) for p, v, own in tensors if own or writer[p] == rank]
    return nest([(p, v) for p, v, _ in tensors]), {
        p: v for p, v, _ in items if not isinstance(v, torch.Tensor)
    }


def differences(values: dict[KeyPath, Any], common: dict[KeyPath, Any]) -> dict[KeyPath, Any]:
    """The values that ``common`` (rank 0's) lacks or holds otherwise, to the bit (-0.0 is not 0.0):
    the same type and the same pickle."""

    def same(a: Any, b: Any) -> bool:
        return type(a) is type(b) and (a is b or pickle.dumps(a) == pickle.dumps(b))

    return {k: v for k, v in values.items() if k not in common or not same(common[k], v)}


def writer_of_shared(sizes: list[tuple[KeyPath, int]], ranks: int) -> dict[KeyPath, int]:
    """Which rank writes each tensor that every one of ``ranks`` ranks holds alike: the largest
    first, each to the rank with the fewest bytes so far (ties to the lower rank)."""
    loads = [(0, r) for r in range(ranks)]  # a heap of (bytes so far, rank)
    writer = {}
    for path, nbytes in sorted(sizes, key=lambda item: (-item[1], str(item[0]))):
        written, r = heapq.heappop(loads)
        writer[path] = r
        heapq.heappush(loads, (written + nbytes, r))
    return writer


def stage(value: Any, cache: Any) -> Any:
    """``value`` copied into host memory, reusing the tensors of ``cache`` (the previous copy) where
    they fit. DTensors keep their placement; their local shard is copied."""
    if isinstance(value, dict):
        cache = cache if isinstance(cache, dict) else {}
        return {k: stage(v, cache.get(k)) for k, v in value.items()}
    if isinstance(value, list):
        same = isinstance(cache, list) and len(cache) == len(value)
        return [stage(v, c) for v, c in zip(value, cache if same else [None] * len(value))]
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        buffer = stage(local, cache.to_local() if isinstance(cache, DTensor) else None)
        return DTensor.from_local(
            buffer,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        fits = (
            isinstance(cache, torch.Tensor)
            and cache.shape == value.shape
            and cache.dtype == value.dtype
            and cache.device.type == "cpu"
        )
        buffer = cache if fits else torch.empty(value.shape, dtype=value.dtype, device="cpu")
        return buffer.copy_(value.detach())
    return copy.deepcopy(value)


_groups: dict[tuple[int, ...], Any] = {}  # ranks -> (the world it was made in, the group)


def writer_group(group: Group) -> Any:
    """A gloo group over the ranks of ``group`` for the background writer (two threads issuing
    collectives on one group could pair a checkpoint message with another rank's all-reduce). Made
    once per set of ranks and world, by those ranks alone (a :func:`~ddpkit.split_world` group must
    not wait for the rest of the job); a world made again gets new ones."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
    made = _groups.get(ranks)
    if made is None or made[0] is not world:
        group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        made = _groups[ranks] = (world, group)
    return made[1]
