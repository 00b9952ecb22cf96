"""Which torch has a feature: the installed torch's version, the first version of each feature
ddpkit gates, and :func:`require_torch`, which refuses a feature below its version by name."""

from __future__ import annotations

import re

import torch

from ddpkit._errors import ConfigError
from ddpkit._internals.contract import Internal

FLOOR = (2, 6)
"""The oldest torch ddpkit is tested on (CI's floor cell)."""
FSDP_ON_CPU = (2, 7)
"""The first torch whose ``fully_shard`` runs on CPU tensors."""
LIBUV_LISTEN_FD = (2, 8)
"""The first torch whose libuv store backend serves on a socket handed to it."""
FLIGHT_RECORDER_NAMES = (2, 8)
"""The first torch that names the flight recorder's variables ``TORCH_FR_*``."""


def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``2.6.0+cu124``, ``2.16.0a0+git1234``."""
    found = re.match(r"\s*(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found.group(1)), int(found.group(2))


TORCH_VERSION = parse_version(torch.__version__)


def torch_at_least(version: tuple[int, int]) -> bool:
    return TORCH_VERSION >= version


def require_torch(feature: str, version: tuple[int, int], instead: str = "") -> None:
    """Raise a ConfigError naming ``feature`` and the torch it needs, below ``version``."""
    if TORCH_VERSION >= version:
        return
    needed = ".".join(map(str, version))
    hint = f", or {instead}" if instead else ""
    raise ConfigError(
        f"{feature} needs torch >= {needed}; this is torch {torch.__version__}: upgrade torch{hint}"
    )


INTERNALS: list[Internal] = []  # public version strings only
