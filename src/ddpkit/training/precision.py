"""The compute precision a config names: autocast's context and the fp16 gradient scaler."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """``torch.autocast`` for ``bf16`` and ``fp16`` on ``device``'s type; nothing for ``fp32``."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for ``fp16`` (its small exponent range underflows small gradients); none otherwise: bf16 has
    fp32's range."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
