"""The installed torch's version, and features refused below the version that has them.

ddpkit supports torch from 2.6 (``pyproject.toml``). A feature that needs a newer torch asks
:func:`require_torch` first, so a user on an older torch reads which version it needs rather than a
``TypeError`` from inside torch.
"""

from __future__ import annotations

import re

import torch

from ddpkit._errors import ConfigError
from ddpkit._internals.contract import Internal

FLOOR = (2, 6)
"""The oldest torch ddpkit is tested on (CI's floor cell)."""


def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``2.6.0+cu124``, ``2.16.0a0+git1234``,
    ``2.13.0``."""
    found = re.match(r"\s*(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found.group(1)), int(found.group(2))


TORCH_VERSION = parse_version(torch.__version__)


def torch_at_least(version: tuple[int, int]) -> bool:
    return TORCH_VERSION >= version


def require_torch(feature: str, version: tuple[int, int], instead: str = "") -> None:
    """Raise a ConfigError naming ``feature``, the torch it needs and the one installed, below
    ``version``."""
    if TORCH_VERSION >= version:
        return
    needed = ".".join(map(str, version))
    hint = f", or {instead}" if instead else ""
    raise ConfigError(
        f"{feature} needs torch >= {needed}; this is torch {torch.__version__}: upgrade torch{hint}"
    )


INTERNALS: list[Internal] = []  # public version strings only
