"""Where training stands, and when a snapshot of it is due: the counters (:class:`TrainState`),
every rank's own state (:class:`RankStreams`), the snapshot settings (:class:`SnapshotConfig`),
every decision "is a snapshot due now?" (:class:`SnapshotSchedule`), and the state as the front door
hands it to a store and a store hands it back (:class:`Parts`, :class:`Resumed`), with the tree
helpers both stores walk it with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch

from ddpkit._errors import ConfigError, check_fields, check_types
from ddpkit.distributed._collectives import all_gather_object
from ddpkit.distributed._runtime import Runtime
from ddpkit.distributed._seeding import rng_state, set_rng_state, stream_seed
from ddpkit.snapshot import _codec as codec
from ddpkit.strategies._base import Strategy

NewRankState = Literal["refuse", "copy", "fresh"]
"""What a rank beyond a snapshot's world size gets of a part each rank keeps its own of."""
NEW_RANK_STATES: tuple[str, ...] = ("refuse", "copy", "fresh")


@dataclass
class TrainState:
    """The Trainer's counters."""

    epoch: int = 0
    """Epochs completed."""
    step: int = 0
    """Optimizer steps taken."""
    cursor: int = 0
    """Samples of the current epoch already trained on, over all ranks (whole global batches)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite loss or non-finite gradients (not fp16 overflows)."""

    @property
    def position(self) -> tuple[int, int, int]:
        return self.epoch, self.step, self.cursor

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, int(state[f.name]))


class RankStreams:
    """Every rank's own state: its random streams (python, numpy, torch CPU and CUDA), its loader's
    generator, and ``own`` parts (objects with ``state_dict()`` / ``load_state_dict()`` each rank
    keeps its own of). ``state_dict()`` gathers them (a collective). At another world size each
    stream is reseeded from ``(seed, step, rank)``, and an own part gets every old rank's state
    through its ``load_rank_states(states, rank)``, else old rank ``r``'s, and a rank beyond the old
    world what ``new_rank_state`` says (the part's own attribute first): ``refuse``, ``copy`` (rank
    0's) or ``fresh`` (with a warning; :attr:`fresh_parts`).
    """

    def __init__(
        self,
        runtime: Runtime,
        generator: torch.Generator,
        seed: int,
        train: TrainState,
        own: Mapping[str, Any] | None = None,
        new_rank_state: NewRankState = "refuse",
        warn: Callable[[str], None] = print,
    ) -> None:
        self.runtime, self.generator, self.seed, self.train = runtime, generator, seed, train
        self.own: dict[str, Any] = dict(own or {})
        self.new_rank_state, self.warn = new_rank_state, warn
        self.reseeded_from: int | None = None
        """The world size of a snapshot whose streams were reseeded rather than restored."""
        self.fresh_parts: list[str] = []
        """Own parts this rank started afresh at another world size."""

    def mine(self) -> dict[str, Any]:
        """This rank's own state (no collective): what the snapshots in memory copy for it."""
        return {
            "rng": rng_state(),
            "loader_generator": self.generator.get_state(),
            "own": {name: _own(part.state_dict(), name) for name, part in self.own.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.runtime.world_size,
            # every rank's on every rank; a disk snapshot has each rank write its own instead
            "ranks": all_gather_object(self.mine(), group=self.runtime.group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rt = self.runtime
        if state["world_size"] == rt.world_size:
            mine = state["ranks"][rt.rank]
            set_rng_state(mine["rng"])
            self.generator.set_state(mine["loader_generator"])
            self._check_own(mine)
            for name, part in self.own.items():
                part.load_state_dict(mine["own"][name])
            return
        # needs the counters loaded first
        seed = stream_seed("reseed", self.seed, self.train.step, rt.rank)
        torch.manual_seed(seed)
        self.generator.manual_seed(seed)
        self.reseeded_from = state["world_size"]
        ranks = state["ranks"]
        self._check_own(ranks[0])
        policies = {name: self._policy(part) for name, part in self.own.items()}
        # decided alike on every rank, so that all refuse or none does
        refused = sorted(n for n, p in policies.items() if p == "refuse")
        if rt.world_size > len(ranks) and refused:
            raise ConfigError(
                f"resuming a {len(ranks)}-rank snapshot on {rt.world_size} ranks: ranks "
                f"{len(ranks)}..{rt.world_size - 1} have no state of their own for {refused} in "
                "it. Set TrainerConfig(new_rank_state='copy') to give them rank 0's (state the "
                "same on every rank, such as a model) or 'fresh' to start them afresh (or a "
                f"`new_rank_state` attribute on the part), or resume on {len(ranks)} ranks"
            )
        for name, part in self.own.items():
            if hasattr(part, "load_rank_states"):
                part.load_rank_states([r["own"][name] for r in ranks], rt.rank)
            elif rt.rank < len(ranks):
                part.load_state_dict(ranks[rt.rank]["own"][name])
            elif policies[name] == "copy":
                part.load_state_dict(ranks[0]["own"][name])
            else:
                self.fresh_parts.append(name)
        fresh = sorted(n for n, p in policies.items() if p == "fresh")
        # said alike on every rank: ``warn`` prints once (rank 0)
        if rt.world_size > len(ranks) and fresh:
            self.warn(
                f"ddpkit: WARNING: resuming a {len(ranks)}-rank snapshot on {rt.world_size} ranks: "
                f"{fresh} start afresh on ranks {len(ranks)}..{rt.world_size - 1} "
                "(new_rank_state='fresh')"
            )

    def _policy(self, part: Any) -> str:
        if hasattr(part, "load_rank_states"):
            return "own"
        policy = getattr(part, "new_rank_state", None) or self.new_rank_state
        if policy not in NEW_RANK_STATES:
            raise ConfigError(
                f"{type(part).__name__}.new_rank_state={policy!r} is not one of "
                f"{list(NEW_RANK_STATES)}"
            )
        return str(policy)

    def _check_own(self, mine: Mapping[str, Any]) -> None:
        saved = mine["own"]
        missing = sorted(set(self.own) - set(saved))
        if missing:
            raise ConfigError(
                f"the snapshot holds no state of {missing} (it holds {sorted(saved)}): a callback "
                "or extra_state entry added since, or renamed? Resume with the same callbacks and "
                "extra_state names"
            )


def _own(value: Any, name: str) -> Any:
    """A copy of a part's ``state_dict()`` as a load gives it back (:func:`codec.copied`); a value
    the codec cannot hold is left for the snapshot to refuse on every rank together (refused here,
    on one rank, it would leave the others waiting)."""
    try:
        return codec.copied(value, f"own.{name}")
    except codec.UnsupportedValue:
        return value


_ALWAYS_SAVED = ("max_steps", "signal", "early_stopping")
"""Stops (``ddpkit.training.StopReason``) that snapshot whatever the intervals."""


@dataclass(kw_only=True)
class SnapshotConfig:
    """When the Trainer snapshots, how many it keeps, and how it writes them."""

    every_steps: int | None = None
    """Also snapshot every this many optimizer steps (None: at epoch ends only)."""
    every_epochs: int = 1
    """Snapshot every this many epochs; 0 turns epoch-end snapshots off."""
    keep: int = 2
    """Whole snapshots kept in ``run_dir/snapshots``; older ones are removed once a newer one is
    whole."""
    async_write: bool = True
    """Write in a background thread: the step waits only while the state is copied to host
    memory."""
    memory: bool = False
    """Also copy the state into shared memory on the node after steps (under ``ddpkit run``, which
    keeps a folder there for the job): a restarted worker resumes from it when it is newer than the
    newest disk snapshot, so a failure loses at most ``memory_every_steps`` steps
    (:mod:`ddpkit.snapshot._memory`)."""
    memory_every_steps: int | None = None
    """Copy to memory every this many optimizer steps; None: every step, unless the first copies
    hold the loop longer than 5% of a step, then the smallest interval that keeps them within."""
    replicas: int | None = None
    """Copies of each rank's copy in memory, its own included, kept on as many nodes: each of the
    other K-1 held by a rank of another node, sent beside training, so that a lost node (any K-1)
    resumes from memory under every strategy. None: 2 where the job spans nodes; 1: none leaves the
    node (docs/snapshots.md, "Copies on other nodes")."""

    def __post_init__(self) -> None:
        check_types(self)
        check_fields(
            self,
            {
                "every_steps": self.every_steps is None or self.every_steps >= 1,
                "every_epochs": self.every_epochs >= 0,
                "keep": self.keep >= 1,
                "memory_every_steps": self.memory_every_steps is None
                or self.memory_every_steps >= 1,
                "replicas": self.replicas is None or self.replicas >= 1,
            },
        )


@dataclass
class SnapshotSchedule:
    """Says when a snapshot (on disk, or in memory) is due: the same answer on every rank."""

    every_steps: int | None = None
    every_epochs: int = 1
    memory_every_steps: int = 1
    """The interval of the copies in memory (the memory store sets it once chosen)."""
    notice: str | None = None
    """A pre-emption notice not yet acted on: the next :meth:`after_step` or :meth:`at_epoch_end` is
    due."""
    saved_at: tuple[int, int, int] | None = field(default=None, repr=False)
    """The position (epoch, step, cursor) last written to disk, or ``None``."""

    @classmethod
    def of(cls, config: SnapshotConfig) -> SnapshotSchedule:
        return cls(config.every_steps, config.every_epochs, config.memory_every_steps or 1)

    def _step_due(self, step: int) -> bool:
        return self.every_steps is not None and step % self.every_steps == 0

    def after_step(self, step: int, taken: bool, last_in_epoch: bool) -> bool:
        """A disk snapshot right after optimizer step ``step`` (the count once it is taken) inside
        an epoch. At the epoch's last step: no, :meth:`at_epoch_end` decides, counting this step."""
        return taken and not last_in_epoch and (self._step_due(step) or self.notice is not None)

    def at_epoch_end(
        self, epochs_done: int, step: int, last_step_taken: bool, stopping: bool
    ) -> bool:
        """A disk snapshot at the end of epoch number ``epochs_done`` (counted from 1), whose last
        step made the count ``step``: due by the epochs' interval, by the steps' (the epoch's last
        step), or a stop."""
        by_epochs = self.every_epochs > 0 and epochs_done % self.every_epochs == 0
        return (
            by_epochs
            or (last_step_taken and self._step_due(step))
            or stopping
            or self.notice is not None
        )

    def at_stop(self, reason: str | None) -> bool:
        """A disk snapshot where training ends: always after ``max_steps``, a stop signal or early
        stopping; after the last epoch or a callback's stop, when snapshots are on at all (either
        interval)."""
        if reason in _ALWAYS_SAVED:
            return True
        return self.every_steps is not None or self.every_epochs > 0

    def in_memory(self, step: int, taken: bool) -> bool:
        """A copy in memory after optimizer step ``step``."""
        return taken and step % self.memory_every_steps == 0

    def new_position(self, position: tuple[int, int, int]) -> bool:
        """Whether ``position`` has not been written yet (:meth:`written`): an epoch end and a stop
        at the same step write once."""
        return position != self.saved_at

    def written(self, position: tuple[int, int, int]) -> None:
        """``position`` is on disk (saved, or the snapshot a run resumed from)."""
        self.saved_at, self.notice = position, None


# -- What passes between the front door and its stores.

STREAMS_PART = "rng"
"""The part of a snapshot's states that holds each rank's random streams (a :class:`RankStreams`):
a store keeps each rank's own (:attr:`Parts.own`) and gives them back under this name."""


@dataclass(frozen=True)
class Parts:
    """A step's state as the front door hands it to a store: built on each rank with no
    collective, the same on every rank but the strategy's own parts and :attr:`own`."""

    position: tuple[int, int, int]
    """(epoch, step, cursor) of the state."""
    strategy: Strategy
    """The model and optimizer (a hand loop's :class:`~ddpkit.strategies._prepare.LoopModel`
    too): a store reads its ``state_dict()`` (tensors by name, DTensor shards, each rank's own
    values under ``per_rank``) and, to copy it again cheaply, its ``model`` and ``optimizer``."""
    values: dict[str, Any]
    """The rest, rank 0's kept: ``states`` (each part's ``state_dict()``; under
    :data:`STREAMS_PART`, the world size alone), ``record`` (the run's) and
    ``global_micro_batch``."""
    own: Any
    """This rank's own streams and parts (:meth:`RankStreams.mine`)."""

    @property
    def step(self) -> int:
        return self.position[1]


Check = Callable[[Mapping[str, Any], str], None]
"""What a store runs on a state it found, before any tensor is read: ``check(saved, where)``, where
``saved`` holds the snapshot's ``record``, ``states`` and ``global_micro_batch`` and ``where`` names
the snapshot; it raises to refuse the state."""


@dataclass(frozen=True)
class Resumed:
    """A state a store read back: ``state`` as :meth:`~ddpkit.Snapshots.load_state_dict` takes it,
    ``source`` as said to the user, ``file`` as the ``resume`` event names it, and whether it was
    read from ``disk`` (or from memory)."""

    state: dict[str, Any]
    source: str
    file: str
    disk: bool


class Damaged(RuntimeError):
    """A state that some rank found damaged on reading it: every rank passes over it."""


def agreed(problems: list[tuple[str, str] | None]) -> list[str]:
    """What every rank found wrong with its read (``MemoryStore.attempt``): a refused
    config or another run's state raised on every rank alike, else the damage named."""
    found = [p for p in problems if p is not None]
    for kind, text in found:
        if kind == "config":
            raise ConfigError(text)
        if kind == "refused":
            raise RuntimeError(text)
    return [text for _, text in found]


KeyPath = tuple[Any, ...]
"""Where a value sits in a nested state dict: its keys from the top."""


def leaves(tree: dict[str, Any], prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """(path, value) of every value of a nested dict that is not itself a dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def nest(items: list[tuple[KeyPath, Any]]) -> dict[str, Any]:
    """The nested dict whose :func:`leaves` are ``items``."""
    root: dict[str, Any] = {}
    for path, value in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if path[-1] in node:
            raise ValueError(
                f"two values are saved as {'.'.join(map(str, path))}: keep a rank's own values out "
                "of the shared part"
            )
        node[path[-1]] = value
    return root


def of_param_groups(path: KeyPath) -> bool:
    """Whether a value of a strategy's state is one of its parameter groups' (its learning rate, its
    betas), which a slot saves apart and a load puts back before it reads the state."""
    under_optim = len(path) == 2 and path[0] == "optim" and str(path[1]).startswith("param_groups.")
    return under_optim or path == ("param_groups",)


def set_at(tree: dict[str, Any], path: KeyPath, value: Any) -> None:
    """Put ``value`` at ``path`` of ``tree``, whose dicts down to it exist."""
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
