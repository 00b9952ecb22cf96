"""Several models and optimizers under ``ddp``: a GAN's generator and discriminator, a student
beside a frozen teacher, two optimizers over one model.

Each model with parameters to train is wrapped in its own DistributedDataParallel (a frozen one only
moves to the device: DDP refuses a module with nothing to all-reduce). Each optimizer gets its own
verdict, clipping and non-finite marker from a :class:`~ddpkit.strategies._ddp.DDPStrategy` over the
model that holds its parameters (``SeveralModels.views``), so a non-finite loss or gradient of one
optimizer is agreed on every rank without touching the others'. A snapshot holds every model and
optimizer, keyed ``<model name>.<parameter>``: torch's distributed state dicts of one ``ModuleDict``
of the models with the list of optimizers.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit.distributed._runtime import Runtime
from ddpkit.strategies import _hooks as hooks
from ddpkit.strategies._base import GradientVerdict, join_own, separate_own
from ddpkit.strategies._ddp import DDPConfig, DDPStrategy, state_options
from ddpkit.strategies._prepare import no_sync, prepare_model, unwrap


class SeveralModels:
    """Named models and named optimizers, each model replicated with DDP; see the module
    docstring."""

    name = "ddp"
    replicated = True

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer],
        *,
        runtime: Runtime,
        config: DDPConfig | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        self.config, self.runtime = config or DDPConfig(), runtime
        kwargs = self.config.ddp_kwargs()
        self.models: dict[str, nn.Module] = {}
        for name, model in models.items():
            if any(p.requires_grad for p in model.parameters()):
                model = prepare_model(
                    model,
                    sync_batchnorm=sync_batchnorm,
                    runtime=runtime,
                    seed_ranks=False,
                    **kwargs,
                )
                if self.config.comm_hook is not None and runtime.distributed:
                    hooks.register(
                        model, self.config.comm_hook, runtime.group,
                        powersgd_rank=self.config.powersgd_rank,
                        powersgd_start_iter=self.config.powersgd_start_iter,
                    )  # fmt: skip
            else:  # frozen (a teacher): nothing to all-reduce, so no DDP
                model = model.to(runtime.device)
            self.models[name] = model
        self.optimizers = dict(optimizers)
        self.model: nn.Module = nn.ModuleDict(self.models)  # for the Trainer's walks over modules
        # what snapshots hold
        self.modules = nn.ModuleDict({name: unwrap(m) for name, m in self.models.items()})
        stepped = self._owners()
        self.views = {name: self._view(name, opt) for name, opt in self.optimizers.items()}
        # Per optimizer, the parameters of its model that no optimizer holds: a skip clears their
        # gradients with its own (no NaN stays), and leaves those of another optimizer over the same
        # model, which has its own verdict still to come.
        self.outside = {
            name: [p for p in view.model.parameters() if id(p) not in stepped]
            for name, view in self.views.items()
        }
        self.optimizer = next(iter(self.optimizers.values()))  # the learning rate the records show

    def _owners(self) -> dict[int, str]:
        """The optimizer holding each parameter, by ``id``; a parameter in two is refused: one
        optimizer's step sets its gradient to None before the other's, and a snapshot keys optimizer
        state by parameter name, so it holds only one optimizer's."""
        owners: dict[int, str] = {}
        for name, optimizer in self.optimizers.items():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    first = owners.setdefault(id(p), name)
                    if first != name:
                        raise ConfigError(
                            f"parameter {self._name_of(p)} is in optimizers {first!r} and "
                            f"{name!r}: give each parameter to one optimizer (leave it out of "
                            "one of them)"
                        )
        return owners

    def _name_of(self, param: torch.Tensor) -> str:
        for model_name, model in self.modules.items():
            for name, p in model.named_parameters():
                if p is param:
                    return f"{model_name}.{name}"
        return "(of no model)"

    def _view(self, name: str, optimizer: torch.optim.Optimizer) -> DDPStrategy:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        holders = [m for m in self.models.values() if params <= {id(p) for p in m.parameters()}]
        if not holders:
            raise ConfigError(
                f"optimizer {name!r} holds parameters of no single model: give each optimizer the "
                "parameters of one model (two optimizers may share a model)"
            )
        return DDPStrategy(
            holders[0], optimizer, runtime=self.runtime, config=self.config, prepared=True
        )

    def no_sync(self) -> AbstractContextManager[Any]:
        stack = ExitStack()
        for model in self.models.values():
            stack.enter_context(no_sync(model))
        return stack

    def mark_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        return next(iter(self.views.values())).mark_nonfinite(loss)

    def check_gradients(self, max_norm: float | None = None) -> GradientVerdict:
        verdicts = [view.check_gradients(max_norm) for view in self.views.values()]
        return GradientVerdict(all(v.finite for v in verdicts), None)

    def evaluation(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def join(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizers = list(self.optimizers.values())
        model_state, optim_state = get_state_dict(self.modules, optimizers, options=state_options())
        return separate_own({"model": model_state, "optim": optim_state}, self.modules)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = join_own(state)
        set_state_dict(
            self.modules,
            list(self.optimizers.values()),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=state_options(),
        )

    def model_weights(self) -> dict[str, Any]:
        return self.modules.state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        return join_own(self.state_dict())
