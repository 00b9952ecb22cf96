"""Snapshots as folders: every rank writes its own part with ``torch.distributed.checkpoint`` (DCP), and a
marker with checksums, written last, makes the folder count.

Layout of ``run_dir/snapshots``::

    step-00000120/
        __0_0.distcp, __1_0.distcp   each rank's part of the model and optimizer state (shards under zero/fsdp)
        .metadata                    DCP's index of which tensor (or piece of one) is where
        trainer.pt                   counters, scheduler, scaler, every rank's RNG states, the config (rank 0)
        complete.json                the marker: the step, and size + sha256 of every file above

A folder is a snapshot only once ``complete.json`` exists, and the marker is written (atomically, by rank 0)
only after every rank's files are on disk: a process killed at any instant leaves the previous snapshot as the
newest whole one. On load, a snapshot whose files are missing or altered is reported by name and the one
before it is used. DCP reshards on load, so a snapshot taken on N ranks resumes on M.

Asynchronous saving (``async_write``): the state is copied to host memory (the only part the training loop
waits for), then a background thread writes the copy, checksums it and writes the marker. The thread's
collectives run on a process group of their own (same ranks, gloo): two threads issuing collectives on one
group could pair a rank's checkpoint message with another rank's gradient all-reduce. One write is in flight
at a time; the next save, and the end of training, wait for it.

Single-file snapshots of earlier versions (``step-N.pt`` + ``step-N.json``, :mod:`ddpkit.snapshot`) are still
read, as whole (unsharded) states.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit import snapshot as single_file
from ddpkit.collectives import broadcast_object, gather_object

# torch.distributed.checkpoint (and DTensor, which it imports) is imported where it is used: it pulls in sympy
# and costs ~0.9 s per process, which `import ddpkit` (a hand-written loop, the launcher) need not pay.
MARKER = "complete.json"
EXTRA = "trainer.pt"
_FOLDER = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class Found:
    """A whole snapshot: a ``step-N/`` folder, or a single file of an earlier version (``legacy``)."""

    step: int
    path: Path
    legacy: bool = False


def folder_name(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _digest(paths: list[Path]) -> dict[str, dict[str, Any]]:
    return {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in paths}


def _stage(value: Any, cache: Any) -> Any:
    """``value`` copied into host memory, reusing the tensors of ``cache`` (the previous copy) where they fit.

    torch's caching stager (``BlockingAsyncStager(cache_staged_state_dict=True)``) pins its buffers, which
    needs an accelerator, and its uncached one allocates the whole state afresh at every save: on the CPU the
    page faults of that allocation cost more than the copy (measured: ~4x the stall). So the buffers are kept
    here, and a save after the first only copies. DTensors (fsdp's shards) keep their placement; their local
    shard is copied.
    """
    if isinstance(value, dict):
        cache = cache if isinstance(cache, dict) else {}
        return {k: _stage(v, cache.get(k)) for k, v in value.items()}
    if isinstance(value, list):
        cache = cache if isinstance(cache, list) and len(cache) == len(value) else [None] * len(value)
        return [_stage(v, c) for v, c in zip(value, cache)]
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        buffer = _stage(local, cache.to_local() if isinstance(cache, DTensor) else None)
        return DTensor.from_local(buffer, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        fits = (isinstance(cache, torch.Tensor) and cache.shape == value.shape and cache.dtype == value.dtype
                and cache.device.type == "cpu")
        buffer = cache if fits else torch.empty(value.shape, dtype=value.dtype, device="cpu")
        return buffer.copy_(value.detach())
    return copy.deepcopy(value)


_groups: dict[tuple[int, ...], Any] = {}


def writer_group(group: Any) -> Any:
    """A gloo process group over the ranks of ``group``, for the background writer's collectives.

    Made once per set of ranks, by those ranks alone (``use_local_synchronization``): a Trainer on a group of
    :func:`~ddpkit.split_world` must not need the rest of the job to call in.
    """
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in _groups:
        _groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _groups[ranks]


class Checkpointer:
    """Writes and finds the snapshots of one folder, for the ranks of ``group`` (every rank calls every method).

    ``keep_last``: whole snapshots kept; older ones, and the debris of writes killed before their marker, go.
    """

    def __init__(self, folder: str | Path, *, group: Any = None, keep_last: int = 2, async_write: bool = False):
        self.folder = Path(folder)
        self.group = group
        self.keep_last = max(1, keep_last)
        self.async_write = async_write
        self.distributed = dist.is_available() and dist.is_initialized()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staged: Any = None  # host copy of the last asynchronous save, reused by the next
        self.last_write_seconds: float | None = None

    @property
    def _rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0

    def save(self, step: int, sharded: dict[str, Any], extra: dict[str, Any]) -> None:
        """Snapshot ``step``: ``sharded`` (every rank's own part, for DCP) and ``extra`` (rank 0's, one file).

        Returns once the state is safe from the training loop: written (synchronous), or copied to host
        memory with the write under way (asynchronous).
        """
        self.wait()
        path = self.folder / folder_name(step)
        if self._rank == 0:
            # Debris of a write of this step that was killed before its marker (perhaps at another world
            # size, with other ranks' files): start clean, so the marker lists exactly what is there.
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        if self.distributed:
            dist.barrier(group=self.group)  # no rank writes into the folder before it is clean
        extra_bytes = io.BytesIO()
        if self._rank == 0:  # the same on every rank (or gathered): rank 0's is written
            torch.save(extra, extra_bytes)
        if not self.async_write:
            self._write(path, step, sharded, extra_bytes.getvalue(), self.group)
            return
        group = writer_group(self.group) if self.distributed else None
        # A copy in host memory: training may change the originals from here on. The previous write is done
        # (wait() above), so its buffers are free to reuse.
        self._staged = staged = _stage(sharded, self._staged)
        self._thread = threading.Thread(
            target=self._write_in_background, args=(path, step, staged, extra_bytes.getvalue(), group),
            # Not a daemon: an interpreter that exits (an exception, SystemExit) first finishes the write.
            name=f"ddpkit-snapshot-{step}", daemon=False,
        )
        self._thread.start()

    def _write_in_background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as err:  # raised in the training thread by the next wait()
            self._error = err

    def _write(self, path: Path, step: int, sharded: dict[str, Any], extra: bytes, group: Any) -> None:
        import torch.distributed.checkpoint as dcp  # see the note on lazy imports at the top

        t0 = time.perf_counter()
        dcp.save(sharded, storage_writer=dcp.FileSystemWriter(path), process_group=group,
                 no_dist=not self.distributed)
        rank = dist.get_rank(group) if self.distributed else 0
        # dcp.save returns on every rank once every rank's files and the metadata are written (fsynced).
        mine = sorted(path.glob(f"__{rank}_*.distcp"))
        if rank == 0:
            single_file.write_atomic(path / EXTRA, extra)
            mine += [path / ".metadata", path / EXTRA]
        digests = _digest(mine)
        parts = gather_object(digests, group=group) if self.distributed else [digests]
        if rank == 0:
            files = {name: d for part in parts for name, d in part.items()}
            marker = {"step": step, "files": files}
            single_file.write_atomic(path / MARKER, json.dumps(marker, indent=1).encode())
            self._prune(newest=step)
        self.last_write_seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raise its error here if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("ddpkit: writing a snapshot in the background failed") from err

    # -- finding and loading --------------------------------------------------------------------------

    def candidates(self) -> list[Found]:
        """Snapshots with a marker (folders) or a manifest (single files), newest first; not yet verified."""
        found = [Found(s.step, s.path, legacy=True) for s in single_file.list_snapshots(self.folder)]
        for path in self.folder.glob("step-*") if self.folder.is_dir() else []:
            match = _FOLDER.match(path.name)
            if match and path.is_dir() and (path / MARKER).exists():
                found.append(Found(int(match.group(1)), path))
        return sorted(found, key=lambda f: (f.step, not f.legacy), reverse=True)

    def verify(self, found: Found) -> str | None:
        """None if ``found`` is whole, else what is wrong with it."""
        if found.legacy:
            info = next(s for s in single_file.list_snapshots(self.folder) if s.path == found.path)
            data = single_file.verify(info)
            return data if isinstance(data, str) else None
        try:
            marker = json.loads((found.path / MARKER).read_text())
            files = marker["files"]
        except (OSError, ValueError, KeyError):
            return f"has an unreadable {MARKER}"
        for name, want in files.items():
            file = found.path / name
            if not file.exists():
                return f"is missing {name}"
            if file.stat().st_size != want["size"]:
                return f"has {name} truncated or altered ({file.stat().st_size} bytes, marker says {want['size']})"
            if _sha256(file) != want["sha256"]:
                return f"has {name} not matching its checksum (corrupt)"
        return None

    def latest(self, warn: Callable[[str], None] = print) -> Found | None:
        """The newest whole snapshot, the same on every rank (rank 0 checks the files and tells the others)."""
        self.wait()
        choice = None
        if self._rank == 0:
            for found in self.candidates():
                problem = self.verify(found)
                if problem is None:
                    choice = found
                    break
                warn(f"ddpkit: skipping snapshot {found.path}: it {problem}; trying the one before it")
        return broadcast_object(choice, group=self.group) if self.distributed else choice

    def load(self, found: Found, template: Callable[[], dict[str, Any]], map_location: Any = None,
             check: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """``(sharded, extra)`` of a snapshot. ``template()`` gives the current sharded state, whose tensors DCP
        fills in place with this world size's parts. A single-file snapshot gives ``(None, whole state)``.
        ``check(extra)`` runs before any sharded tensor is read, and may refuse the snapshot by raising."""
        if found.legacy:
            data = found.path.read_bytes()
            state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
            if check is not None:
                check(state)
            return None, state
        # weights_only: the extra state holds tensors and plain values only, so loading it runs no pickled code.
        import torch.distributed.checkpoint as dcp

        extra = torch.load(found.path / EXTRA, map_location=map_location, weights_only=True)
        if check is not None:
            check(extra)
        sharded = template()
        dcp.load(sharded, checkpoint_id=found.path, process_group=self.group, no_dist=not self.distributed)
        return sharded, extra

    def _prune(self, newest: int) -> None:
        import os
        import stat

        whole = [f for f in self.candidates() if not f.legacy]
        keep = {f.path.name for f in whole[: self.keep_last]}
        # Every deletion goes through a descriptor of the folder opened without following links, and each
        # entry is lstat-ed: a link named like a snapshot (to another run's, say) loses only itself, never what
        # it points to; a snapshots/ that is itself a link is refused (ELOOP), not pruned.
        folder = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for name in os.listdir(folder):
                match = _FOLDER.match(name)
                if not match or name in keep or int(match.group(1)) >= newest:
                    continue
                mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    os.unlink(name, dir_fd=folder)
                elif stat.S_ISDIR(mode):
                    # Marker first: a prune killed half-way leaves a folder without one (ignored), never a
                    # marker whose files are gone.
                    step = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
                    try:
                        os.unlink(MARKER, dir_fd=step)
                    except FileNotFoundError:
                        pass
                    finally:
                        os.close(step)
                    # rmtree with dir_fd walks by descriptors and unlinks links inside without following them.
                    shutil.rmtree(name, dir_fd=folder, ignore_errors=True)
        finally:
            os.close(folder)
