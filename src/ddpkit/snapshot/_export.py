"""One file of a model's weights for use outside ddpkit: the plain model's state dict, its own
parameter names.

A snapshot is a folder of shards (:mod:`ddpkit.snapshot._manager`) that only DCP reads back;
``best.pt`` wraps the weights in a dict with the metric. What inference code, ``transformers``'
``from_pretrained`` or a hand-written ``load_state_dict`` wants is the state dict of the model as
the script built it, whole, under the names its modules give. The strategies give exactly that
(:meth:`~ddpkit.strategies.Strategy.model_weights`: ``ddp`` and ``zero`` unwrap the DDP module, so
there is no ``module.`` prefix; ``fsdp`` gathers the full tensors from the shards onto rank 0); this
module writes it, on one rank, whole or not at all (a rename over the name).

Two formats:

- ``safetensors`` (the ``safetensors`` extra): ``safetensors.torch.load_file(path)``; a flat,
  memory-mappable file that holds tensors only, and ``{"format": "pt"}`` in its metadata, which
  ``from_pretrained`` asks for. A tensor of a dtype that the installed safetensors cannot write and
  read back (complex128, float8_e8m0fnu) is refused at the save, by name, rather than written into a
  file that does not load.
- ``pt``: ``torch.load(path, weights_only=True)``: the state dict itself.

Tied weights (an embedding and the output layer sharing one tensor, as in GPT-2 and nanoGPT) appear
under both names in a state dict. safetensors refuses tensors that share memory; dropping one name
would make ``load_state_dict(strict=True)`` fail on the missing key, so the second name gets a copy
of its own: the file loads strictly into a fresh model (which ties the two again itself), at the
cost of the tied tensor's size once more on disk. The metadata's ``tied`` entry lists each copied
name and the name it was tied to.
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
from ddpkit.snapshot._codec import alone
from ddpkit.snapshot._region import DTYPES

FORMATS = ("safetensors", "pt")


def weights_path(run_dir: Path, which: str, fmt: str) -> Path:
    """Where a run writes its ``final`` or ``best`` weights: ``final.safetensors``,
    ``best.safetensors``, or ``final_weights.pt``, ``best_weights.pt`` (``best.pt`` is the best
    weights with their metric, in a dict)."""
    return run_dir / (f"{which}.safetensors" if fmt == "safetensors" else f"{which}_weights.pt")


def safetensors_available() -> bool:
    return importlib.util.find_spec("safetensors") is not None


def resolve_format(requested: str | None) -> tuple[str | None, str | None]:
    """The format a run writes its weights in, and a notice when it is not the one asked for:
    ``safetensors`` without the package falls back to ``pt`` (the weights are still written, with
    torch alone)."""
    if requested == "safetensors" and not safetensors_available():
        return "pt", (
            "ddpkit: the safetensors package is not installed, so the weights files are written "
            "with torch.save (.pt); pip install 'ddpkit[safetensors]' for .safetensors, or set "
            "weights_format='pt' to silence this"
        )
    return requested, None


def plain_tensors(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state``'s tensors on the CPU, contiguous, and none sharing memory with another; and the
    tied names.

    Returns the tensors and ``{copied name: the name it shared memory with}``. A tensor that shares
    memory with an earlier one (a tied weight, or two views of one buffer) is copied.
    """
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
        out[name] = alone(tensor)
    # A view gets a copy of its own; a whole tensor (most weights) is written without a copy.
    return out, tied


@functools.cache
def _safetensors_dtypes() -> frozenset[torch.dtype]:
    """The dtypes that the installed safetensors writes and reads back as they were: some it writes
    and then cannot read (float8_e8m0fnu), some it refuses with a bare KeyError (complex128)."""
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


def weights_bytes(
    state: Mapping[str, Any], fmt: str, metadata: Mapping[str, Any] | None = None
) -> bytes:
    """The file's contents: ``state`` (a plain state dict) in format ``fmt``, with ``metadata``
    (JSON values; in a safetensors file's header, in a ``pt`` file nowhere: it holds the state dict
    alone)."""
    tensors, tied = plain_tensors(state)
    if fmt == "pt":
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        return buffer.getvalue()
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
    return save(tensors, metadata=header)


def save_weights(
    path: Path, state: Mapping[str, Any], fmt: str, metadata: Mapping[str, Any] | None = None
) -> None:
    """Write ``state`` to ``path`` whole or not at all (a new file renamed over the name; a link
    there is replaced, never written through). Call it on one rank."""
    data = weights_bytes(state, fmt, metadata)
    fs.write_atomic(path, data)  # its folder made first where missing


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a file :func:`save_weights` wrote, by its suffix (``.safetensors`` or ``.pt``)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True, map_location="cpu")


def save_model_weights(
    weights: Callable[[], Mapping[str, Any]],
    path: Path,
    fmt: str,
    *,
    is_main: bool,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Gather the whole model's weights (``weights``, e.g. ``strategy.model_weights``: a collective
    under fsdp, so every rank calls this) and write them to ``path`` on the main rank."""
    state = weights()
    if is_main:
        save_weights(path, state, fmt, metadata)


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
    ``fmt`` is None. Every rank calls it (gathering the weights may be a collective)."""
    if fmt is not None:
        metadata = {"epoch": epoch, "step": step}
        save_model_weights(
            weights, weights_path(run_dir, "final", fmt), fmt, is_main=is_main, metadata=metadata
        )
