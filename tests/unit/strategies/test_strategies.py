"""The strategies' configs: a bad option is named, and fsdp asks for bf16 autocast, not fp16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
import ddpkit.strategies
from ddpkit._errors import ConfigError
from ddpkit.strategies import STRATEGIES, strategy_config


@pytest.mark.parametrize(
    "name, options, flag",
    [
        ("fsd", {}, "strategy"),
        ("ddp", {"bucket_size": 4}, "bucket_size"),
        ("ddp", {"comm_hook": "int8"}, "comm_hook"),
        ("fsdp", {"param_dtype": "fp8"}, "param_dtype"),
        ("zero", {"shard_blocks": ["Block"]}, "shard_blocks"),
    ],
)
def test_strategy_config_errors_name_the_option(name, options, flag):
    with pytest.raises(ConfigError, match=flag):
        strategy_config(name, options)
    # The typed config refuses the same (an unknown option is Python's own TypeError, naming it).
    with pytest.raises((ConfigError, TypeError), match=flag):
        config = STRATEGIES[name][0](**options) if name in STRATEGIES else name
        ddpkit.TrainerConfig(batch_size=4, strategy=config)


def test_fsdp_needs_bf16_not_fp16_autocast():
    with pytest.raises(ConfigError, match="precision"):
        ddpkit.TrainerConfig(batch_size=4, strategy="fsdp", precision="fp16")


def test_fsdp_on_the_cpu_is_refused_below_its_torch_naming_the_version(monkeypatch):
    """A torch whose fully_shard cannot run on CPU tensors gets a message naming the version it
    needs, not an AttributeError from inside torch."""
    import types

    from ddpkit._internals import versions
    from ddpkit.strategies._fsdp import FSDPStrategy

    monkeypatch.setattr(versions, "TORCH_VERSION", (2, 6))
    cpu_rank = types.SimpleNamespace(distributed=True, device=torch.device("cpu"))
    with pytest.raises(
        ConfigError, match=r"strategy 'fsdp' on the CPU \(gloo\) needs torch >= 2\.7.*'ddp'"
    ):
        FSDPStrategy(nn.Linear(2, 2), None, runtime=cpu_rank)  # type: ignore[arg-type]
    # control: from 2.7 on, no refusal for the version
    monkeypatch.setattr(versions, "TORCH_VERSION", (2, 7))
    with pytest.raises(AttributeError):  # it goes on, and trips on the stand-in runtime instead
        FSDPStrategy(nn.Linear(2, 2), None, runtime=cpu_rank)  # type: ignore[arg-type]
