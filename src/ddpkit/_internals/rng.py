"""Random generators' states read as raw bytes for the loader's watch for draws
(:mod:`ddpkit.data._sample_seeding`): numpy's MT19937 words at ``BitGenerator.ctypes.state_address``
(checked against the public ``state`` once per bit generator), a tensor's bytes at its
``data_ptr()``; and whether torch runs Python code on a tensor's indexing (a function or dispatch
mode, the Python dispatcher, a patched ``__getitem__``), which no public API tells."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

from ddpkit._internals.contract import Internal, warn_lost

MT19937_BYTES = 624 * 4 + 4


class MT19937Words:
    """Reads a numpy MT19937 bit generator's words, once its layout was checked against its public
    ``state``."""

    def __init__(self) -> None:
        self.checked: tuple[int, int] | None = None
        """``(id, state address)`` of the bit generator whose layout was checked."""

    def __call__(self, bitgen: Any) -> bytes | None:
        """The state's bytes (the words, then the position); None where ``bitgen`` is not an MT19937
        or its layout differs."""
        if type(bitgen).__name__ != "MT19937":
            return None
        address = bitgen.ctypes.state_address
        words = ctypes.string_at(address, MT19937_BYTES)
        if self.checked != (id(bitgen), address):
            if _layout_problem(bitgen, words) is not None:
                return None
            self.checked = (id(bitgen), address)
        return words


def _layout_problem(bitgen: Any, words: bytes) -> str | None:
    state = bitgen.state["state"]
    pos = int.from_bytes(words[-4:], sys.byteorder, signed=True)
    if state["key"].tobytes() != words[:-4] or int(state["pos"]) != pos:
        return "the bytes at BitGenerator.ctypes.state_address are not MT19937's key and position"
    return None


def words_position(words: bytes) -> tuple[Any, int]:
    """The key (a uint32 array) and the position of :class:`MT19937Words`' bytes, for
    ``set_state``."""
    import numpy as np

    return np.frombuffer(words[:-4], dtype=np.uint32), int.from_bytes(
        words[-4:], sys.byteorder, signed=True
    )


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU tensor."""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


_C = torch._C
_MODES = "torch._C._len_torch_function_stack, _len_torch_dispatch_stack, DispatchKey"
# TensorBase is a C type: only torch.Tensor's __getitem__ can shadow its own
_INDEXING = vars(getattr(_C, "TensorBase", object)).get("__getitem__")
_PYTHON_DISPATCHER: Any = getattr(getattr(_C, "DispatchKey", None), "PythonDispatcher", None)


def torch_runs_python() -> bool:
    """Indexing a tensor may run Python code in this thread. True, with one warning, where torch's
    private names for this are gone."""
    try:
        return bool(
            _C._len_torch_function_stack()
            or _C._len_torch_dispatch_stack()
            or _C._dispatch_tls_is_dispatch_key_included(_PYTHON_DISPATCHER)
            or _INDEXING is None
            or torch.Tensor.__getitem__ is not _INDEXING
        )
    except (AttributeError, TypeError):
        warn_lost(_MODES, "torch", "reading a dataset proven to draw nothing without its watch")
        return True


def _check_modes() -> str | None:
    from torch._dispatch.python import enable_python_dispatcher
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    if torch_runs_python():
        return "Python code is seen on tensor ops where none was entered"
    for name, context in (
        ("a torch function mode", Function),
        ("a torch dispatch mode", Dispatch),
        ("the Python dispatcher", enable_python_dispatcher),
    ):
        with context():
            if not torch_runs_python():
                return f"{name}, entered, is not seen"
    return None


def _check_mt19937() -> str | None:
    try:
        import numpy as np
    except ImportError:
        return None
    bitgen = np.random.MT19937(7)
    return _layout_problem(bitgen, ctypes.string_at(bitgen.ctypes.state_address, MT19937_BYTES))


def _check_tensor_bytes() -> str | None:
    state = torch.default_generator.get_state()
    return (
        None
        if tensor_bytes(state) == bytes(state.tolist())
        else "a tensor's bytes at data_ptr() differ"
    )


INTERNALS = [
    Internal(
        "numpy.random.MT19937 state struct (key[624], pos) at ctypes.state_address",
        "numpy",
        "the loader's watch for draws reads numpy's words in <1 us; where it differs, through the "
        "public state",
        _check_mt19937,
    ),
    Internal(
        _MODES + ".PythonDispatcher, TensorBase.__getitem__",
        "torch",
        "the loader reads a dataset proven to draw nothing without watching it, except where torch "
        "runs Python code on tensor ops; where gone, every dataset is watched, as before",
        _check_modes,
    ),
    Internal(
        "ctypes.string_at(tensor.data_ptr())",
        "CPython",
        "the loader's watch for draws reads torch's generator state as bytes",
        _check_tensor_bytes,
    ),
]
