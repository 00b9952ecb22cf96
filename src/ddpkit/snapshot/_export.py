"""The model's weights for use outside ddpkit (docs/snapshots.md, "Weights for use outside
ddpkit"): ``final.safetensors`` (or ``final_weights.pt``), and the best epoch's in ``best.pt`` and
``best.safetensors``, each the plain model's state dict written whole on one rank. ``best.pt`` also
holds the best ``epoch``, ``step``, ``metric`` and ``value``, which a resumed run reads back.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.distributed import _progress as marks
from ddpkit.snapshot._codec import DTYPES, alone

FORMATS = ("safetensors", "pt")


def weights_path(run_dir: Path, which: str, fmt: str) -> Path:
    """Where a run writes its ``final`` or ``best`` weights: ``final.safetensors``,
    ``best.safetensors``, or ``final_weights.pt``, ``best_weights.pt``."""
    return run_dir / (f"{which}.safetensors" if fmt == "safetensors" else f"{which}_weights.pt")


def safetensors_available() -> bool:
    return importlib.util.find_spec("safetensors") is not None


def resolve_format(requested: str | None) -> tuple[str | None, str | None]:
    """The format a run writes its weights in, and a notice when it is not the one asked for
    (``safetensors`` without the package falls back to ``pt``)."""
    if requested == "safetensors" and not safetensors_available():
        return "pt", (
            "ddpkit: the safetensors package is not installed, so the weights files are written "
            "with torch.save (.pt); pip install 'ddpkit[safetensors]' for .safetensors, or set "
            "weights_format='pt' to silence this"
        )
    return requested, None


def plain_tensors(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state``'s tensors on the CPU, each owning its bytes, and ``{copied name: the name it shared
    memory with}``: a tensor sharing memory with an earlier one (a tied weight) is copied."""
    out: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    owners: dict[int, str] = {}  # a storage's address -> the first name that used it
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"the weights hold {name!r}, a {type(value).__name__}: only tensors can be written"
            )
        tensor = value.detach().to("cpu")
        address = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        if address and address in owners:
            tied[name] = owners[address]
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif address:
            owners[address] = name
        out[name] = alone(tensor)  # a view gets a copy of its own
    return out, tied


@functools.cache
def _safetensors_dtypes() -> frozenset[torch.dtype]:
    """The dtypes that the installed safetensors writes and reads back as they were (not
    float8_e8m0fnu, complex128)."""
    from safetensors.torch import load, save

    found = set()
    for dtype in DTYPES.values():
        try:
            with warnings.catch_warnings():  # torch warns on making a complex32 tensor: a probe's
                warnings.simplefilter("ignore")  # noise, not the user's
                probe = torch.zeros(2, dtype=dtype)
            if load(save({"x": probe}))["x"].dtype == dtype:
                found.add(dtype)
        except Exception:  # noqa: BLE001 - whatever safetensors raises for a dtype it lacks
            continue
    return frozenset(found)


def save_weights(
    path: Path, state: Mapping[str, Any], fmt: str, metadata: Mapping[str, Any] | None = None
) -> None:
    """Write ``state`` (a plain state dict) to ``path`` in format ``fmt``, whole or not at all, with
    ``metadata`` (JSON values) in a safetensors file's header (not in a ``pt`` file). One rank."""
    tensors, tied = plain_tensors(state)
    if fmt == "pt":
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        fs.write_atomic(path, buffer.getvalue())
        return
    if fmt != "safetensors":
        raise ConfigError(f"weights_format={fmt!r} is not valid: give one of {FORMATS} (or None)")
    from safetensors.torch import save

    for name, tensor in tensors.items():
        if tensor.dtype not in _safetensors_dtypes():
            raise ConfigError(
                f"the weights hold {name!r}, a tensor of dtype {tensor.dtype}, which a safetensors "
                "file cannot hold (or not read back): set weights_format='pt', or convert it to "
                "another dtype"
            )
    header = {"format": "pt"} | {k: json.dumps(v) for k, v in (metadata or {}).items()}
    if tied:
        header["tied"] = json.dumps(tied)
    fs.write_atomic(path, save(tensors, metadata=header))


def save_final_weights(
    weights: Callable[[], Mapping[str, Any]],
    run_dir: Path,
    fmt: str | None,
    *,
    is_main: bool,
    epoch: int,
    step: int,
) -> None:
    """``run_dir/final.safetensors`` (or ``final_weights.pt``) when training ends; nothing when
    ``fmt`` is None. Every rank calls it: ``weights()`` may be a collective (fsdp)."""
    if fmt is not None:
        state = weights()
        if is_main:  # alone, while the others go on to fit()'s last agreement
            with marks.phase(marks.Phase.EXPORT):
                save_weights(
                    weights_path(run_dir, "final", fmt), state, fmt, {"epoch": epoch, "step": step}
                )


def is_better(value: float, best: float | None, mode: str) -> bool:
    """True if ``value`` improves on ``best`` (None: nothing yet) in direction ``mode`` (``min`` or
    ``max``); an equal value does not (an epoch retrained after a crash gives it again)."""
    return best is None or (value < best if mode == "min" else value > best)


class BestWeights:
    """Writes ``path`` when ``metric`` improves (``mode`` ``min`` or ``max``), where ``enabled``."""

    def __init__(
        self,
        path: str | Path,
        metric: str | None,
        mode: str,
        enabled: bool,
        export_path: Path | None = None,
        export_format: str | None = None,
    ) -> None:
        # export_path: also write the weights alone there, in export_format
        self.path, self.metric, self.mode = Path(path), metric, mode
        self.export_path, self.export_format = export_path, export_format
        # Every rank tracks the best value (the epoch's metrics are agreed, so every rank decides
        # alike and can join the gather of sharded weights); only an enabled rank writes the file.
        self.enabled = enabled and metric is not None
        self.value: float | None = None
        self.epoch: int | None = None
        self.step: int | None = None
        self.at_step = False  # the best is a step's (validation every N steps): the summary says so

    def load(self) -> None:
        """Take the best so far from the file (for a resumed run only)."""
        if self.enabled and self.path.exists():
            saved = torch.load(self.path, weights_only=True)
            if saved.get("metric") == self.metric:
                self.value, self.epoch, self.step = (
                    saved["value"],
                    saved["epoch"],
                    saved.get("step"),
                )

    def update(
        self,
        metrics: Mapping[str, Any],
        weights: Callable[[], Mapping[str, torch.Tensor]],
        epoch: int,
        step: int,
    ) -> bool:
        """Save ``weights()`` if ``metrics[metric]`` beats the best so far; True if it did. Every
        rank calls it: ``weights()`` may be a collective (fsdp)."""
        metric = self.metric
        if metric is None:  # not tracking
            return False
        if metric not in metrics:
            raise ConfigError(
                f"early_stopping.metric={metric!r} is not among the epoch's metrics "
                f"{sorted(metrics)}"
            )
        value = float(metrics[metric])
        if not is_better(value, self.value, self.mode):
            return False
        self.value, self.epoch, self.step = value, epoch, step
        state = weights()
        if self.enabled:
            # rank 0 alone writes while the others wait: the stall watch's long allowance
            with marks.phase(marks.Phase.EXPORT):
                self._write(state, metric, value, epoch, step)
        return True

    def _write(
        self, state: Mapping[str, Any], metric: str, value: float, epoch: int, step: int
    ) -> None:
        state = {k: v.detach().cpu() for k, v in state.items()}
        info = {"epoch": epoch, "step": step, "metric": metric, "value": value}
        # best.pt last: a crash between the two leaves the old best value, whose beater writes both
        if self.export_path is not None and self.export_format is not None:
            save_weights(self.export_path, state, self.export_format, info)
        buffer = io.BytesIO()
        torch.save({"model": state, **info}, buffer)
        fs.write_atomic(self.path, buffer.getvalue())
