"""Where a resume from memory goes (:class:`Choice`), decided alike on every rank from what each
offers: the newest position every rank holds or has a copy of on a living rank (:func:`choose`), or,
after a restart at another world size, one the old world's slots and copies left on the nodes
give (:func:`choose_resized`, :func:`choose_resharded`); and why none is, where copies were lost
with their nodes (:func:`uncovered`). Pure logic: :class:`ddpkit.snapshot._memory.MemoryStore`
gathers the offers and reads what is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Choice:
    """Where every rank resumes: a position (epoch, step, cursor), and for each rank that does not
    hold it, the rank that holds a copy of its state there and sends it (``sources``: pairs of
    needy rank and holder; none: every rank holds it)."""

    position: tuple[int, ...]
    sources: tuple[tuple[int, int], ...] = ()
    world_size: int | None = None
    """The world size the copies were taken at, where it is not this one; else None."""
    givers: tuple[int, ...] = ()
    """At another world size: for each rank of that world, the rank of this one that reads its own
    part (random streams, buffers) for every rank (``ddp``), or its whole state and sends each rank
    the pieces it takes (``fsdp``, ``zero``)."""

    @property
    def step(self) -> int:
        return self.position[1]


def choose(
    offers: list[dict[str, Any]], disk_step: int = -1, *, over_own: bool = False
) -> Choice | None:
    """The newest position every rank can resume from, newer than ``disk_step``, or None (the same
    on every rank). ``offers[r]``: rank r's ``own`` positions, and the positions of the copies it
    holds of other ranks' states (``replicas``: {rank: positions}). A rank that does not hold a
    position takes it from the first rank holding a copy of its state there; ``over_own``: a copy
    holds a rank's own part alone (``ddp``), read over its holder's own slot there."""
    own = [{tuple(p) for p in o["own"]} for o in offers]
    held = [
        {int(r): {tuple(p) for p in ps} for r, ps in o.get("replicas", {}).items()} for o in offers
    ]
    everywhere = set().union(*own, *(ps for h in held for ps in h.values()))
    for position in sorted(everywhere, reverse=True):
        if position[1] <= disk_step:
            return None
        sources: list[tuple[int, int]] = []
        for rank, mine in enumerate(own):
            if position in mine:
                continue
            holders = [
                h
                for h, copies in enumerate(held)
                if position in copies.get(rank, ()) and (not over_own or position in own[h])
            ]
            if not holders:
                break
            sources.append((rank, holders[0]))
        else:
            return Choice(position, tuple(sources))
    return None


def choose_resized(offers: list[dict[str, Any]], world_size: int) -> Choice | None:
    """Where every rank resumes from copies taken at a larger world size (``ddp``: every rank holds
    the model and optimizer, and its own part apart): the newest position, no older than a slot of
    this world, at which every rank of this world finds a whole slot on its node (any old rank's)
    and every rank of the old world has its own part held by some rank (a copy of it, or its slot);
    None where there is none (the same on every rank). ``offers[r]["sizes"]``: by old world size,
    the positions of the ``slots`` and own ``parts`` rank r finds, by old rank."""
    # a copy of its own part (a few KiB) first, else its slot; a larger world's new ranks would
    # hold none of it on their node
    return _from_old_world(offers, world_size, ("parts", "slots"), on_every_node=True)


def choose_resharded(offers: list[dict[str, Any]], world_size: int) -> Choice | None:
    """Where every rank resumes from copies taken at another world size under a sharded strategy
    (``fsdp``, ``zero``: each old rank's shards are in its slot and in its whole copies on other
    nodes, and are sent to the ranks of this world that take them): the newest position, no older
    than a slot of this world, at which every rank of the old world has its slot or a whole copy of
    it on some rank of this one, which reads it (``givers``, a slot's holder first); None where
    there is none (the same on every rank). ``offers[r]["sizes"]`` as :func:`choose_resized` reads
    them, with the whole ``copies`` by old rank."""
    return _from_old_world(offers, world_size, ("slots", "copies"), on_every_node=False)


def _from_old_world(
    offers: list[dict[str, Any]], world_size: int, kinds: tuple[str, str], on_every_node: bool
) -> Choice | None:
    """:func:`choose_resized` and :func:`choose_resharded`: each old rank given by a rank holding
    it of the first of ``kinds``, else of the second; ``on_every_node``: every rank of this world
    holds a slot of the position on its node, and the old world is larger."""
    newest_here = max((tuple(p)[1] for o in offers for p in o["own"]), default=-1)
    best: Choice | None = None
    for size in sorted({int(w) for o in offers for w in o.get("sizes", {})}):
        if size == world_size or (on_every_node and size < world_size):
            continue
        # by kind, by rank of this world: {old rank: positions}
        held = {
            kind: [
                {int(r): set(map(tuple, ps))
                 for r, ps in o.get("sizes", {}).get(str(size), {}).get(kind, {}).items()}
                for o in offers
            ]
            for kind in {*kinds, "slots"}
        }  # fmt: skip
        everywhere = {p for by in held.values() for h in by for ps in h.values() for p in ps}
        for position in sorted(everywhere, reverse=True):
            if position[1] < newest_here or (best is not None and position <= best.position):
                break
            if on_every_node and not all(
                any(position in p for p in s.values()) for s in held["slots"]
            ):
                continue  # a rank of this world would read the model from another node's memory
            givers = []
            for r in range(size):
                first, then = ([n for n, h in enumerate(held[kind]) if position in h.get(r, ())]
                               for kind in kinds)  # fmt: skip
                holders = first or then
                if not holders:
                    break
                givers.append(holders[r % len(holders)])  # spread over a node's ranks
            else:
                best = Choice(position, world_size=size, givers=tuple(givers))
                break
    return best


def newest_elsewhere(offers: list[dict[str, Any]]) -> int:
    """The newest step of the slots and copies taken at another world size that any rank offers
    (``offers[r]["sizes"]``, as :func:`choose_resized` reads them); -1 where there is none."""
    return max(
        (p[1] for o in offers for held in o["sizes"].values() for kind in held.values()
         for ps in kind.values() for p in ps),
        default=-1,
    )  # fmt: skip


def uncovered(offers: list[dict[str, Any]], copies: int) -> str | None:
    """Why no position in memory holds every rank's state, where some rank holds one (more nodes
    lost at once than the copies cover); None where memory holds nothing."""
    newest = max((tuple(p) for o in offers for p in o["own"]), default=None)
    if newest is None:
        return None
    missing = [
        r
        for r, o in enumerate(offers)
        if list(newest) not in o["own"]
        and not any(list(newest) in h["replicas"].get(str(r), []) for h in offers)
    ]
    if not missing:
        return None
    return (
        f"no step in memory holds every rank's state: at step {newest[1]}, neither rank(s) "
        f"{missing} nor a living rank holds theirs (more nodes lost at once than replicas="
        f"{copies} covers)"
    )
