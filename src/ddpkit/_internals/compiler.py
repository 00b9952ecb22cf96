"""``torch.compile``'s internals (``torch._dynamo``, inductor's C++ compiler probe), the autograd
engine's ``queue_callback`` and device threads, and the CPU's fused attention kernels."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from ddpkit._errors import ConfigError
from ddpkit._internals.contract import Internal

DYNAMO = "torch._dynamo"


def import_dynamo() -> Any:
    """``torch._dynamo``, imported (~1 s; DDP's constructor imports it)."""
    import importlib

    return importlib.import_module(DYNAMO)


def set_ddp_optimizer() -> None:
    """Have Dynamo split a compiled DDP model's graph at its buckets (all-reduces overlap)."""
    import_dynamo().config.optimize_ddp = True


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None when there is none; a probe
    torch no longer has is a ConfigError naming it."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"ddpkit cannot ask torch {torch.__version__} for its C++ compiler "
            f"(torch._inductor.cpp_builder.get_cpp_compiler: {err}); set compile=False, or use a "
            "torch ddpkit supports (`ddpkit env` lists what differs)"
        ) from None
    try:
        return str(get_cpp_compiler())
    except Exception:  # inductor's own error types when none is found
        return None


def _check_dynamo() -> str | None:
    config = import_dynamo().config
    return None if hasattr(config, "optimize_ddp") else "torch._dynamo.config has no optimize_ddp"


def _check_cpp_compiler() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except (ImportError, AttributeError) as err:
        return f"cannot import it ({err})"
    return None if callable(get_cpp_compiler) else "it is not a function"


def _engine() -> Any:
    variable = getattr(torch.autograd, "Variable", None)
    return getattr(variable, "_execution_engine", None)


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Have the backward pass that runs now (call it from a hook inside it) call ``callback`` once
    every gradient is accumulated; False where the engine lacks ``queue_callback`` or refuses it."""
    queue = getattr(_engine(), "queue_callback", None)
    if queue is None:
        return False
    try:
        queue(callback)
    except (AssertionError, RuntimeError):
        return False
    return True


def _check_queue_callback() -> str | None:
    engine = _engine()
    if engine is None:
        return "torch.autograd.Variable has no _execution_engine"
    return None if callable(getattr(engine, "queue_callback", None)) else "it has no queue_callback"


_CPU_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)


def cpu_attention_ops() -> tuple[Any, Any]:
    """The CPU's fused attention kernels: (forward, backward), None where this torch lacks one."""
    forward, backward = _CPU_ATTENTION
    return getattr(torch.ops.aten, forward, None), getattr(torch.ops.aten, backward, None)


def _check_cpu_attention() -> str | None:
    missing = [name for name in _CPU_ATTENTION if not hasattr(torch.ops.aten, name)]
    return f"torch.ops.aten has no {', '.join(missing)}" if missing else None


def autograd_device_threads() -> bool:
    """Whether this process's autograd engine started its device threads (``pt_autograd_*``, at the
    first backward on a machine with a GPU): a child forked after that cannot run a backward."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            if f.read().startswith("pt_autograd"):
                return True
    return False


def _check_autograd_threads() -> str | None:
    if not torch.cuda.is_available() or not os.path.isdir("/proc/self/task"):
        return None  # no device threads to start, or no thread names to read
    torch.ones(1, requires_grad=True).sum().backward()
    return None if autograd_device_threads() else "no thread named pt_autograd_* after a backward"


INTERNALS = [
    Internal(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "torch",
        "attention's FLOPs on the CPU are counted (MFU); where it is gone, whatever torch's "
        "counter gives",
        _check_cpu_attention,
    ),
    Internal(
        "torch._dynamo.config.optimize_ddp",
        "torch",
        "a compiled DDP model overlaps its gradient all-reduces with the backward pass",
        _check_dynamo,
    ),
    Internal(
        "torch._inductor.cpp_builder.get_cpp_compiler",
        "torch",
        "compile=True on the CPU says at once when there is no C++ compiler",
        _check_cpp_compiler,
    ),
    Internal(
        "torch.autograd.Variable._execution_engine.queue_callback",
        "torch",
        "the step timings mark the moment a step's last gradient is ready with one call a "
        "backward; where it is gone, the gradients' synchronisation is counted as compute",
        _check_queue_callback,
    ),
    Internal(
        "the autograd engine's device threads, named pt_autograd_<device>",
        "torch",
        "ddpkit.spawn starts its ranks as new interpreters, not forks, once a backward ran in the "
        "caller on a machine with a GPU; where the name changed, it forks them and each rank's "
        "backward fails as torch says",
        _check_autograd_threads,
    ),
]
