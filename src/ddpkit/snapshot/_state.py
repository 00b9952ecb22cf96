"""Where training stands: the counters a snapshot restores next to the model and optimizer, and
every rank's own state (its random streams, and the parts each rank keeps its own of)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch

from ddpkit._errors import ConfigError
from ddpkit.distributed._collectives import all_gather_object
from ddpkit.distributed._runtime import Runtime
from ddpkit.distributed._seeding import rng_state, set_rng_state, stream_seed
from ddpkit.snapshot import _codec as codec

NewRankState = Literal["refuse", "copy", "fresh"]
"""What a rank beyond a snapshot's world size gets of a part each rank keeps its own of
(``TrainerConfig.new_rank_state``)."""
NEW_RANK_STATES: tuple[str, ...] = ("refuse", "copy", "fresh")


@dataclass
class TrainState:
    """The Trainer's counters."""

    epoch: int = 0
    """Epochs completed."""
    step: int = 0
    """Optimizer steps taken."""
    cursor: int = 0
    """Samples of the current epoch already trained on, over all ranks (a whole number of global
    batches)."""
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
    generator, and ``own`` parts, objects with ``state_dict()`` / ``load_state_dict()`` of which
    each rank keeps its own (the unagreed training losses, the callbacks' and the script's
    ``extra_state``).

    ``state_dict()`` gathers them (a collective). At the same world size each rank gets its own back
    and the run continues bit for bit; at another, rank ``r``'s stream has no counterpart in the old
    run, so each is reseeded from ``(seed, step, rank)``: reproducible, and equal to the
    uninterrupted run only within tolerance. An own part then gets every old rank's state through
    ``load_rank_states(states, rank)`` where it has that method; otherwise rank ``r`` takes old rank
    ``r``'s state, and a rank beyond the old world size gets what ``new_rank_state`` says (the
    part's own ``new_rank_state`` attribute first): ``refuse`` (every rank refuses the resume,
    naming the parts), ``copy`` (rank 0's state) or ``fresh`` (its state as built, with a warning
    naming the parts; :attr:`fresh_parts`). Never silently fresh: a model kept in ``extra_state``
    would keep its initial weights on the new rank and train a different model there.
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
        """The world size of the snapshot whose streams were reseeded rather than restored, if
        so."""
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
            # Every rank's on every rank (Trainer.state_dict); a disk snapshot has each rank write
            # its own instead.
            "ranks": all_gather_object(self.mine(), group=self.runtime.group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rt = self.runtime
        if state["world_size"] == rt.world_size:
            mine = state["ranks"][rt.rank]
            set_rng_state(mine["rng"])
            self.generator.set_state(mine["loader_generator"])
            self._load_own(mine)
            return
        # needs the counters loaded first
        seed = stream_seed("reseed", self.seed, self.train.step, rt.rank)
        torch.manual_seed(seed)
        self.generator.manual_seed(seed)
        self.reseeded_from = state["world_size"]
        ranks = state["ranks"]
        self._check_own(ranks[0])
        if "own" not in ranks[0]:
            return
        policies = {name: self._policy(part) for name, part in self.own.items()}
        # Decided alike on every rank (the same parts, the same world sizes), so that all refuse or
        # none does.
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
        saved = mine.get("own")
        if saved is None:  # a snapshot of a version without own parts: they start afresh
            return
        missing = sorted(set(self.own) - set(saved))
        if missing:
            raise ConfigError(
                f"the snapshot holds no state of {missing} (it holds {sorted(saved)}): a callback "
                "or extra_state entry added since, or renamed? Resume with the same callbacks and "
                "extra_state names"
            )

    def _load_own(self, mine: Mapping[str, Any]) -> None:
        self._check_own(mine)
        for name, part in self.own.items():
            if "own" in mine:
                part.load_state_dict(mine["own"][name])


def _own(value: Any, name: str) -> Any:
    """A copy of a part's ``state_dict()`` as a resume gives it back (:func:`codec.copied`): a
    snapshot in memory or gathered by ``state_dict()`` holds what a disk snapshot's load would give,
    tensors on the CPU (gathered to every rank and pickled, a device tensor would be re-created on
    the device of the rank that saved it), and no type is lost on the way. A value the codec cannot
    hold is left as it is: the snapshot refuses it on every rank together, naming it
    (``SnapshotManager``), where refusing here would leave the other ranks waiting."""
    try:
        return codec.copied(value, f"own.{name}")
    except codec.UnsupportedValue:
        return value
