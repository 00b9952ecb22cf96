"""prepare_model's state_dict keys in one process: the hooks on a module shaped as DDP (its model
under ``module``), whose own model has a child named ``module`` too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.strategies._prepare import keys_of_the_module


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)  # the name DDP keeps its model under
        self.head = nn.Linear(2, 1)


def wrapped(hooks: bool = True) -> nn.Module:
    """A stand-in for DDP around ``Model``: the hooks ask only for ``.module``."""
    outer = nn.Module()
    outer.module = Model()
    if hooks:
        keys_of_the_module(outer)  # type: ignore[arg-type]
    return outer


def test_the_keys_are_the_models_and_both_kinds_load_even_with_a_child_named_module():
    torch.manual_seed(0)
    model = wrapped()
    state = model.state_dict()
    assert (
        list(state)
        == list(Model().state_dict())
        == ["module.weight", "module.bias", "head.weight", "head.bias"]
    )
    # the model's keys, then DDP's own
    for saved in (state, {f"module.{k}": v for k, v in state.items()}):
        other = wrapped()
        other.load_state_dict(saved, strict=True)
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), state.values()))
    # Control: without the hooks the wrapper's keys are DDP's, and the model's fail strict loading.
    plain = wrapped(hooks=False)
    assert list(plain.state_dict())[0] == "module.module.weight"
    with pytest.raises(RuntimeError, match="Missing key"):
        plain.load_state_dict(state, strict=True)
