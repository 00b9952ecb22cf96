"""What a run records: metrics files, progress, experiment trackers, and curves. The trackers and
the curves are imported when first used."""

from typing import Any

__all__ = ["MLflowLogger", "WandbLogger", "plot", "read_curves"]

_LAZY = {
    "MLflowLogger": "_trackers",
    "WandbLogger": "_trackers",
    "plot": "_curves",
    "read_curves": "_curves",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ddpkit.tracking' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"ddpkit.tracking.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
