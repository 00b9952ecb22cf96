"""``torch.compile``'s configuration, its C++ compiler probe, and a piece of the autograd engine:
the callbacks run at a backward pass's end, which live in torch's private modules.

- ``torch._dynamo``: imported once before forking ranks (DDP's constructor imports it, which takes
  seconds), and its ``config.optimize_ddp``, which splits a compiled DDP model's graph at bucket
  boundaries so that gradient all-reduces overlap the backward pass.
- ``torch._inductor.cpp_builder.get_cpp_compiler``: the C++ compiler inductor builds CPU kernels
  with.
- ``torch.autograd.Variable._execution_engine.queue_callback``: a function the engine calls once the
  backward pass it runs has computed and accumulated every gradient, before ``backward()`` returns
  (:func:`at_backward_end`); DDP and FSDP wait for their gradient collectives in callbacks queued
  the same way. The step timings mark the moment the step's last gradient is ready with it: a hook
  on the loss and one callback a step, where a hook on every parameter costs one Python call per
  parameter.
- ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: the CPU's fused
  attention kernels, which torch's FLOP counter has no formula for (:func:`cpu_attention_ops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddpkit._errors import ConfigError
from ddpkit._internals.contract import Internal

DYNAMO = "torch._dynamo"
"""The module a process imports once so that its forks find it imported (see
:func:`import_dynamo`)."""


def import_dynamo() -> Any:
    """``torch._dynamo``, imported: constructing DDP or an optimizer imports it (~1 s); done once in
    a process that forks ranks, every rank inherits it."""
    import importlib

    return importlib.import_module(DYNAMO)


def set_ddp_optimizer() -> None:
    """Have Dynamo split a compiled DDP model's graph at its buckets (the default today; set, since
    the overlap of all-reduces with the backward pass depends on it)."""
    import_dynamo().config.optimize_ddp = True


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None when there is none.

    A probe torch no longer has (an ImportError or AttributeError) is not taken as "no compiler": it
    raises a ConfigError naming the internal and torch's version."""
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
    # inductor raises its own error types (and may change them) when none is found
    except Exception:
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
    """Have the backward pass that runs now call ``callback`` once it has accumulated every
    gradient, ahead of any callback queued later in it (DDP queues its wait for the all-reduces at
    the last gradient); call it from a hook inside that backward. Returns False (nothing queued)
    where torch no longer has the engine's ``queue_callback``, or where a backward under compiled
    autograd refuses it (``torch._dynamo.config.compiled_autograd`` without ``fullgraph``: an
    AssertionError): the callback is left out, and the backward goes on."""
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
    aten = torch.ops.aten
    forward, backward = (getattr(aten, name, None) for name in _CPU_ATTENTION)
    return forward, backward


def _check_cpu_attention() -> str | None:
    missing = [name for name in _CPU_ATTENTION if not hasattr(torch.ops.aten, name)]
    return f"torch.ops.aten has no {', '.join(missing)}" if missing else None


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
]
