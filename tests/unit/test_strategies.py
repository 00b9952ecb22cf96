"""The strategies' configs: a bad option is named, and fsdp asks for bf16 autocast, not fp16."""

from __future__ import annotations

import pytest

import ddpkit
import ddpkit.strategies
from ddpkit.errors import ConfigError
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
