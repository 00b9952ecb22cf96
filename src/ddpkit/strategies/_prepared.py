"""A model from :func:`~ddpkit.prepare_model` and its optimizers, with the state a
:class:`~ddpkit.strategies._base.Strategy` gives a snapshot: what :class:`ddpkit.Snapshots` saves of
a hand-written loop's model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit.strategies._base import join_own, separate_own
from ddpkit.strategies._prepare import unwrap


class _Optimizers:
    """Several optimizers seen as one, where the snapshots in memory read one: their parameter
    groups in turn (the groups themselves, so an update reaches the optimizer), and their states."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}


class LoopModel:
    """Model(s) from :func:`~ddpkit.prepare_model` (or bare modules) and their optimizers, with the
    state a :class:`~ddpkit.strategies._base.Strategy` gives a snapshot: parameters and optimizer
    state by parameter name (the same names in DDP or not), each rank's own buffers in the per-rank
    part."""

    name = "ddp"
    replicated = True

    def __init__(
        self, models: Mapping[str, nn.Module], optimizers: list[torch.optim.Optimizer]
    ) -> None:
        # torch's distributed checkpoint reads ``bare`` (DDP's modules unwrapped): the keys are the
        # same, and a prepare_model result's state_dict() hooks (no "module." at any world size)
        # would confuse its name map.
        if list(models) == [""]:
            self.model, bare = models[""], unwrap(models[""])
            ignored = tuple(getattr(self.model, "parameters_to_ignore", ()))
        # DCP names a wrapped model's parameters without DDP's "module.", under the ModuleDict's
        # names
        else:
            self.model, bare = (
                nn.ModuleDict(models),
                nn.ModuleDict({k: unwrap(m) for k, m in models.items()}),
            )
            ignored = tuple(
                f"{k}.{p}"
                for k, m in models.items()
                for p in getattr(m, "parameters_to_ignore", ())
            )
        self.bare, self.ignored, self.optimizers = bare, ignored, optimizers
        self.optimizer: Any = optimizers[0] if len(optimizers) == 1 else _Optimizers(optimizers)
        params = {id(p) for p in self.model.parameters()}
        for i, opt in enumerate(optimizers):
            if any(id(p) not in params for g in opt.param_groups for p in g["params"]):
                raise ConfigError(
                    f"optimizer {i} holds a parameter of no model given to Snapshots: pass every "
                    "model its optimizers train (model={'name': model, ...})"
                )

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint import state_dict as dsd

        from ddpkit.strategies._ddp import state_options

        if self.optimizers:
            model_state, optim_state = dsd.get_state_dict(
                self.bare, self.optimizers, options=state_options()
            )
        else:
            model_state, optim_state = (
                dsd.get_model_state_dict(self.bare, options=state_options()),
                {},
            )
        return separate_own({"model": model_state, "optim": optim_state}, self.bare, self.ignored)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint import state_dict as dsd

        from ddpkit.strategies._ddp import state_options

        state = join_own(state)
        if self.optimizers:
            dsd.set_state_dict(
                self.bare,
                self.optimizers,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=state_options(),
            )
        else:
            dsd.set_model_state_dict(self.bare, state["model"], options=state_options())
