"""A resume from memory at another world size: the old world's slots and copies a node holds
(:class:`OldWorld`: found, offered, read, swept once the new world has copies of its own).

Under ``ddp`` every rank holds the model and optimizer: each rank of the new world reads them from
an old slot on its node, and every old rank's own part (streams, buffers) from the rank that holds
it. Under ``fsdp`` and ``zero`` each old rank holds its own shards: each saved tensor is a *box*
of its global tensor (its offsets, its own sizes, the global sizes: a DTensor's shard, or a whole
tensor at offset 0), recorded with the copy, and each rank of the new world fills the boxes of its
own state from the old boxes that overlap them (:func:`plan`), sent to it point to point by the
rank that reads each old rank's copy (:func:`exchange`). DCP reshards a disk snapshot the same
way; this does it from memory, where no rank can read another node's files.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.distributed._collectives import all_gather_object
from ddpkit.snapshot import _replicas as replicas_lib
from ddpkit.snapshot import _slots as slots_lib
from ddpkit.snapshot._choice import Choice
from ddpkit.snapshot._state import Check, KeyPath, agreed, leaves, of_param_groups
from ddpkit.strategies._base import PER_RANK, Strategy

if TYPE_CHECKING:
    from ddpkit.snapshot._memory import MemoryStore

Got = tuple[dict[KeyPath, Any], dict[str, Any], Any]
"""A read's state: tensors by path, the values (parameter groups, states), the own parts."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor of a strategy's state."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class OldWorld:
    """The slots and copies of ``store``'s run this node holds from other world sizes (a job
    restarted at another size keeps its old world's), and the resume from them."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def files(self) -> tuple[list[slots_lib.Found], list[replicas_lib.Held]]:
        """The whole slots and copies of the old worlds on this node."""
        s = self.store
        damaged = s.slots.damaged  # what found() said of this world's slots stays said
        found = [f for f in s.slots.found(any_size=True) if f.world_size != s.world_size]
        s.slots.damaged = damaged
        held, _ = replicas_lib.held_copies(s.slots.folder, s.slots.job, s.slots.run)
        return found, [h for h in held if h.world_size != s.world_size]

    def offer(self) -> dict[str, dict[str, dict[str, list[tuple[int, ...]]]]]:
        """The positions of the whole slots, copies of own parts and whole copies this node holds,
        by old world size, kind (``slots``, ``parts``, ``copies``) and old rank (what
        :func:`~ddpkit.snapshot._choice.choose_resized` and
        :func:`~ddpkit.snapshot._choice.choose_resharded` read)."""
        sizes: dict[str, dict[str, dict[str, list[tuple[int, ...]]]]] = {}
        found, held = self.files()
        kinds = (
            ("slots", found),
            ("parts", [h for h in held if h.own_part]),
            ("copies", [h for h in held if not h.own_part]),
        )
        for kind, items in kinds:
            for x in items:
                if x.position not in self.store.skipped:
                    by_size = sizes.setdefault(str(x.world_size), {k: {} for k, _ in kinds})
                    by_size[kind].setdefault(str(x.rank), []).append(x.position)
        return sizes

    def removable(self) -> list[Path]:
        """The old worlds' files on this node but those under a name this world's ranks of the
        node write (they overwrite them; one removed could be one a rank has just made again)."""
        s = self.store
        ours = {f"{s.slots.run}-rank{r}-" for r in s.node}
        if s.placement is not None:
            ours |= {f"{s.slots.run}-replica{p}-" for r in s.node
                     for p in s.placement.sources(r)}  # fmt: skip
        found, held = self.files()
        paths = [f.path for f in found] + [h.path for h in held]
        return [p for p in paths if p.name.rpartition("-")[0] + "-" not in ours]

    def sweep(self, paths: list[Path] | None = None) -> None:
        """Remove ``paths`` (by default :meth:`removable`). Every rank of the node may remove a
        file."""
        for path in self.removable() if paths is None else paths:
            with contextlib.suppress(OSError, ConfigError):
                fs.remove(path)

    def read(
        self, choice: Choice, strategy: Strategy, check: Check
    ) -> tuple[Got | None, list[str]]:
        """The state at ``choice`` (taken at ``choice.world_size``) on every rank, or what some
        rank found wrong with it (collective); the third of the state: every old rank's own part,
        in their order."""
        if self.store.own_part:
            return self._read_replicated(choice, strategy, check)
        return self._read_sharded(choice, strategy, check)

    def _read_replicated(
        self, choice: Choice, strategy: Strategy, check: Check
    ) -> tuple[Got | None, list[str]]:
        """``ddp``: the model and optimizer from a slot of ``choice`` on this node (old rank 0's
        where it is here), the per-rank part (buffers) old rank 0's as a disk snapshot's, and every
        old rank's own part (its streams) from the rank that gives it (``choice.givers``; one
        all-gather)."""
        s = self.store
        size, position = choice.world_size, choice.position
        assert size is not None
        given: dict[int, tuple[Any, dict[KeyPath, Any] | None]] = {}

        def read() -> Got:
            old, held = self.files()
            found = [f for f in old if f.world_size == size and f.position == position]
            if not found:
                raise slots_lib.BadSlot(f"no slot of step {choice.step} is left on its node")
            reader = min(found, key=lambda f: f.rank)
            got = s.read_slot(reader.path, strategy, check, size)
            for rank in (r for r, giver in enumerate(choice.givers) if giver == s.rank):
                whose = (rank, size, position, True)
                copy = next((h for h in held if (h.rank, h.world_size, h.position, h.own_part)
                             == whose), None)  # fmt: skip
                slot = next((f for f in found if f.rank == rank), None)
                done = got if slot is reader else None
                given[rank] = self._own_part(choice, rank, copy, slot, done, strategy, check)
            return got

        got, problem = s.attempt(read, malformed=True)
        answers: list[Any] = all_gather_object((problem, given), group=s.group)
        problems = agreed([p for p, _ in answers])
        if got is None or problems:
            return None, problems
        return _with_old_parts(got, [parts for _, parts in answers], size, choice.step)

    def _own_part(
        self,
        choice: Choice,
        rank: int,
        copy: replicas_lib.Held | None,
        slot: slots_lib.Found | None,
        read: Got | None,
        strategy: Strategy,
        check: Check,
    ) -> tuple[Any, dict[KeyPath, Any] | None]:
        """Old rank ``rank``'s own part at ``choice`` and, for old rank 0, its per-rank tensors:
        from a ``copy`` of it on this node, else from its ``slot`` here (``read`` where it was
        read)."""
        size, position = choice.world_size, choice.position
        assert size is not None
        if copy is not None:
            name = f"the copy of rank {rank}'s own part in {copy.path}"
            part = replicas_lib.parsed_copy(slots_lib.slot_bytes(copy.path), name, rank, position)
            if part is None:
                raise slots_lib.BadSlot(f"{name} changed while it was read")
            per_rank: dict[KeyPath, Any] = {}
            own = replicas_lib.own_part_of(part, per_rank)
        elif slot is not None:
            saved, _, own = read or self.store.read_slot(slot.path, strategy, check, size)
            per_rank = {p: t for p, t in saved.items() if p[0] == PER_RANK}
        else:
            raise slots_lib.BadSlot(f"rank {rank}'s own part of step {choice.step} went")
        return own, per_rank if rank == 0 else None

    def _give(
        self, choice: Choice, strategy: Strategy, check: Check, read: dict[int, Got]
    ) -> dict[int, tuple[Any, Any, Any]]:
        """The old ranks' states this rank gives (``choice.givers``), read into ``read`` from a
        slot or a whole copy on its node, and what every rank is told of each: the places and
        dtypes of its tensors, its own part, its values."""
        size, position = choice.world_size, choice.position
        assert size is not None
        found, held = self.files()
        paths = {(f.rank, f.position): f.path for f in found if f.world_size == size}
        for h in held:
            if h.world_size == size and not h.own_part:
                paths.setdefault((h.rank, h.position), h.path)
        for old in (r for r, giver in enumerate(choice.givers) if giver == self.store.rank):
            whose = (old, position)
            if whose not in paths:
                raise slots_lib.BadSlot(f"rank {old}'s state of step {choice.step} went")
            read[old] = self.store.read_slot(
                paths[whose], strategy, check, size, sharded=True, whose=whose
            )
        told = {}
        for old, (saved, dynamic, own) in read.items():
            values = {k: dynamic[k] for k in ("param_groups", "states", "global_micro_batch")}
            values["strategy_values"] = {tuple(p): v for p, v in dynamic["strategy_values"]}
            told[old] = (layout_of(saved, dynamic["boxes"]), own, values)
        return told

    def _read_sharded(
        self, choice: Choice, strategy: Strategy, check: Check
    ) -> tuple[Got | None, list[str]]:
        """``fsdp``, ``zero``: each old rank's state read whole on the rank that gives it
        (``choice.givers``, from a slot or a whole copy on its node), and every rank's own part of
        each tensor put together from the pieces of the old ranks' parts that overlap it (point to
        point). The values (parameter groups, states) old rank 0's; each value of the strategy's
        state the lowest old rank's that has it."""
        s = self.store
        size = choice.world_size
        assert size is not None
        state = strategy.state_dict()
        mine = {p: v for p, v in leaves(state) if isinstance(v, torch.Tensor)}
        boxes = {p: box_of(v) for p, v in mine.items()}
        want = layout_of({p: local(v) for p, v in mine.items()}, boxes)
        read: dict[int, Got] = {}
        told, problem = s.attempt(lambda: self._give(choice, strategy, check, read), malformed=True)
        answers: list[Any] = all_gather_object((problem, told, want), group=s.group)
        if problems := agreed([p for p, _, _ in answers]):
            return None, problems
        olds = {old: info for _, t, _ in answers for old, info in t.items()}
        layouts = {old: layout for old, (layout, _, _) in olds.items()}
        pieces, missing = plan(layouts, [w for _, _, w in answers], choice.givers, s.rank)
        # each value the lowest old rank's that has it (a zero rank that owned no parameter has no
        # UNSTEPPED); one that none has is missing, as a disk snapshot without it is refused
        values = [olds[r][2]["strategy_values"] for r in range(size)]
        plain = [
            p
            for p, v in leaves(state)
            if not isinstance(v, torch.Tensor) and not of_param_groups(p)
        ]  # the parameter groups' values are restored with the groups
        missing += [".".join(map(str, p)) for p in plain if not any(p in v for v in values)]
        # each rank checks its own state is covered: every rank hears of any gap
        if lacking := [m for some in all_gather_object(missing[:1], group=s.group) for m in some]:
            return None, [f"the copies of step {choice.step} on {size} ranks hold no {lacking[0]}"]
        saved = {p: torch.empty_like(local(v)) for p, v in mine.items()}

        def source(old: int, path: KeyPath) -> tuple[torch.Tensor, Box]:
            return read[old][0][path], read[old][1]["boxes"][path]

        into = {p: (saved[p], boxes[p]) for p in mine}
        exchange(pieces, choice.givers, s.rank, source, into, s.group)
        dynamic: dict[str, Any] = dict(olds[0][2])
        dynamic["strategy_values"] = [(p, next(v[p] for v in values if p in v)) for p in plain]
        return (saved, dynamic, [olds[r][1] for r in range(size)]), []


def _with_old_parts(
    got: Got,
    given: list[dict[int, tuple[Any, dict[KeyPath, Any] | None]]],
    size: int,
    step: int,
) -> tuple[Got | None, list[str]]:
    """A slot's state read at another world size with the old ranks' own parts ``given`` by every
    rank: old rank 0's per-rank tensors in place of the slot's, as a disk snapshot at another size
    gives them (the same on every rank), and every old rank's own part in order; else why not."""
    saved, dynamic, _ = got
    owns: list[Any] = [None] * size
    for parts in given:
        for rank, (own, per_rank) in parts.items():
            owns[rank] = own
            if per_rank is None:
                continue
            if missing := sorted({p for p in saved if p[0] == PER_RANK} - per_rank.keys()):
                name = ".".join(map(str, missing[0]))
                return None, [f"rank 0's own part of step {step} holds no {name}"]
            for path, tensor in per_rank.items():
                mine = saved.get(path)
                if mine is None or (mine.shape, mine.dtype) != (tensor.shape, tensor.dtype):
                    name = ".".join(map(str, path))
                    why = f"rank 0's own part of step {step} holds no {name} like the model's"
                    return None, [why]
                saved[path] = tensor
    return (saved, dynamic, owns), []


# -- the boxes of a sharded state, and their pieces ------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""Where a tensor lies in its global tensor: offsets, its own sizes, the global sizes."""

_PIECES = 4  # the message tag (the replicas' transfers use 1 to 3)


def box_of(value: torch.Tensor) -> Box:
    """Where this rank's part of ``value`` lies: a DTensor's local shard, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        # the chunk DCP saves for this rank (padding of an uneven shard left out)
        (chunk,) = value.__create_chunk_list__()
        return tuple(chunk.offsets), tuple(chunk.sizes), tuple(value.shape)
    return (0,) * value.dim(), tuple(value.shape), tuple(value.shape)


def checked_boxes(raw: Any, shapes: list[tuple[int, ...]]) -> list[Box]:
    """The boxes a copy's manifest lists for its tensors of ``shapes``; ValueError where they do
    not lie within their global tensors or do not match the tensors."""
    if not isinstance(raw, list) or len(raw) != len(shapes):
        raise ValueError("it lists no place in the global tensors for each of its tensors")
    boxes = []
    for item, shape in zip(raw, shapes):
        if not (isinstance(item, list) and len(item) == 3 and all(
            isinstance(part, list) and all(type(x) is int for x in part) for part in item
        )):  # fmt: skip
            raise ValueError(f"a place is not three lists of whole numbers: {str(item)[:80]}")
        offsets, sizes, whole = (tuple(part) for part in item)
        if sizes != tuple(shape) or not len(offsets) == len(whole) == len(sizes):
            raise ValueError(f"a tensor of sizes {list(shape)} says it is {list(sizes)}")
        if any(o < 0 or o + s > w for o, s, w in zip(offsets, sizes, whole)):
            raise ValueError(f"a tensor at {list(offsets)} of {list(sizes)} overruns {list(whole)}")
        boxes.append((offsets, sizes, whole))
    return boxes


def _volume(sizes: tuple[int, ...]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _overlap(a: Box, b: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The offsets and sizes of the global region two boxes share; None where they share none."""
    low = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    high = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= lo for lo, h in zip(low, high)):
        return None
    return low, tuple(h - lo for lo, h in zip(low, high))


@dataclass(frozen=True)
class Piece:
    """A region of the global tensor at ``path`` that old rank ``old`` holds and rank ``needy`` of
    the new world takes into its own part of it."""

    needy: int
    path: KeyPath
    old: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _span(box: Box) -> tuple[int, int]:
    """A box's span along dim 0 (a scalar's: [0, 1))."""
    return (box[0][0], box[0][0] + box[1][0]) if box[0] else (0, 1)


class _Index:
    """The distinct boxes of each path and the ranks holding each, sorted by their start along
    dim 0 with the largest end so far: the boxes that meet a region are found by bisection, not
    by a scan of every rank's (a scan is what is left where the boxes are not cut along dim 0)."""

    def __init__(self, held: dict[int, dict[KeyPath, tuple[Box, str]]]) -> None:
        owners: dict[KeyPath, dict[tuple[Box, str], list[int]]] = {}
        for rank in sorted(held):
            for path, kept in held[rank].items():
                ranks = owners.setdefault(path, {}).get(kept)
                if ranks is None:
                    owners[path][kept] = [rank]
                else:
                    ranks.append(rank)
        self._paths: dict[KeyPath, tuple[list[int], list[int], list[Any]]] = {}
        for path, boxes in owners.items():
            items = sorted((_span(box), box, dtype, ranks) for (box, dtype), ranks in boxes.items())
            starts = [item[0][0] for item in items]
            ends = list(itertools.accumulate((item[0][1] for item in items), max))
            self._paths[path] = (starts, ends, [item[1:] for item in items])

    def overlapping(self, path: KeyPath, box: Box) -> list[tuple[Box, str, list[int]]]:
        """The distinct boxes of ``path`` whose span along dim 0 meets ``box``'s, with their
        ranks, in the order of their start."""
        if path not in self._paths:
            return []
        starts, ends, items = self._paths[path]
        low, high = _span(box)
        found = []
        for k in range(bisect.bisect_left(starts, high) - 1, -1, -1):
            if ends[k] <= low:
                break  # no box from here down reaches the region
            held, dtype, ranks = items[k]
            found.append((held, dtype, ranks))
        return found[::-1]


def _pieces_for(
    needy: int, wanted: dict[KeyPath, tuple[Box, str]], olds: _Index, givers: tuple[int, ...]
) -> tuple[list[Piece], list[str]]:
    """The pieces rank ``needy`` of the new world takes, in the order of its state, and what of it
    no old box holds. Of a box several old ranks hold alike (a replicated tensor), the one read on
    ``needy`` itself, else one spread over the needy ranks."""
    pieces: list[Piece] = []
    missing: list[str] = []
    for path, (box, dtype) in wanted.items():
        taken: list[Piece] = []
        for held, held_dtype, ranks in olds.overlapping(path, box):
            if held_dtype != dtype or held[2] != box[2]:
                continue
            if path[0] == PER_RANK:  # a rank's own tensors: old rank 0's, as from a disk snapshot
                ranks = [r for r in ranks if r == 0]
                if not ranks:
                    continue
            mine = [r for r in ranks if givers[r] == needy]
            old = mine[0] if mine else ranks[needy % len(ranks)]
            shared = _overlap(box, held)
            if shared is not None:
                taken.append(Piece(needy, path, old, *shared))
        # distinct old boxes that overlap (a lying copy) would count a region twice and hide a gap
        regions = [(p.offsets, p.sizes, box[2]) for p in taken]
        if sum(_volume(p.sizes) for p in taken) != _volume(box[1]) or any(
            _overlap(a, b) is not None for a, b in itertools.combinations(regions, 2)
        ):
            missing.append(f"{'.'.join(map(str, path))} of rank {needy}")
        pieces += taken
    return pieces, missing


def plan(
    layouts: dict[int, dict[KeyPath, tuple[Box, str]]],
    wants: list[dict[KeyPath, tuple[Box, str]]],
    givers: tuple[int, ...],
    rank: int | None = None,
) -> tuple[list[Piece], list[str]]:
    """The pieces each new rank takes, and what of its state no old copy holds. ``layouts[old]
    [path]``: old rank ``old``'s box of each tensor and its dtype; ``wants[new]``: the same of each
    rank of the new world; ``givers[old]``: the rank that reads old rank ``old``'s copy. With
    ``rank``: only the pieces ``rank`` takes or gives, and what of its own state is missing (the
    same on the two ranks of a piece; what is missing is not the same on every rank: gather it).
    A rank's own tensors (:data:`PER_RANK`) come from old rank 0's, as a disk snapshot gives them
    at another world size."""
    olds = _Index(layouts)
    needies: set[int] = set(range(len(wants))) if rank is None else {rank}
    if rank is not None:  # the ranks whose state overlaps a box of an old rank this one reads
        new = _Index(dict(enumerate(wants)))
        for old in (o for o, giver in enumerate(givers) if giver == rank):
            for path, (box, _) in layouts.get(old, {}).items():
                for _, _, ranks in new.overlapping(path, box):
                    needies.update(ranks)
    pieces: list[Piece] = []
    missing: list[str] = []
    for needy in sorted(needies):
        got, lacking = _pieces_for(needy, wants[needy], olds, givers)
        if rank is None or needy == rank:
            missing += lacking
        pieces += [p for p in got if rank is None or rank in (needy, givers[p.old])]
    return pieces, missing


def _region(tensor: torch.Tensor, box: Box, piece: Piece) -> torch.Tensor:
    """The view of ``tensor`` (lying at ``box``) that holds ``piece``'s region."""
    view = tensor
    for dim, (at, offset, size) in enumerate(zip(box[0], piece.offsets, piece.sizes)):
        view = view.narrow(dim, offset - at, size)
    return view


def exchange(
    pieces: list[Piece],
    givers: tuple[int, ...],
    rank: int,
    read: Callable[[int, KeyPath], tuple[torch.Tensor, Box]],
    into: dict[KeyPath, tuple[torch.Tensor, Box]],
    group: Any,
) -> None:
    """Every piece read by its giver (``read(old, path)``: old rank ``old``'s tensor and its box,
    on the rank that gives it) written into ``into`` (this rank's tensors and their boxes) on the
    rank that takes it; pieces between two ranks go in one message. Every rank calls it with the
    same ``pieces``."""
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[Piece]] = {}
    for piece in pieces:
        giver = givers[piece.old]
        if giver == rank:
            source = _region(*read(piece.old, piece.path), piece)
            if piece.needy == rank:
                target, box = into[piece.path]
                _region(target, box, piece).copy_(source)
            else:
                outgoing.setdefault(piece.needy, []).append(source.reshape(-1).view(torch.uint8))
        elif piece.needy == rank:
            incoming.setdefault(giver, []).append(piece)
    works: list[Any] = []
    buffers = []
    for needy, parts in sorted(outgoing.items()):
        works.append(dist.isend(torch.cat(parts), peer(needy), group=group, tag=_PIECES))
    for giver, wanted in sorted(incoming.items()):
        sizes = [into[p.path][0].element_size() * _volume(p.sizes) for p in wanted]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        works.append(dist.irecv(buffer, peer(giver), group=group, tag=_PIECES))
        buffers.append((buffer, sizes, wanted))
    for work in works:
        work.wait()
    for buffer, sizes, wanted in buffers:
        for part, piece in zip(buffer.split(sizes), wanted):
            target, box = into[piece.path]
            region = _region(target, box, piece)
            # a copy first: a view as a wider dtype needs an aligned offset, which a piece after
            # one of a narrower dtype may not have
            region.copy_(part.clone().view(target.dtype).view(piece.sizes))


def layout_of(tensors: dict[KeyPath, torch.Tensor], boxes: dict[KeyPath, Box]) -> dict:
    """What a rank tells every rank of a copy it reads, or of its own state: each tensor's box and
    dtype, by path."""
    return {p: (boxes[p], str(t.dtype)) for p, t in tensors.items()}
