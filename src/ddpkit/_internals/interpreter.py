"""The process's own machinery below Python's standard library: CPython's interpreter exit, and,
through ``ctypes``, Linux's ``prctl``, the command-line memory and the CUDA driver's state."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import os
import sys
import threading
import types
from collections.abc import Sequence

from ddpkit._internals.contract import Internal, warn_lost


def warn_interpreter_once(internal: str, lost: str) -> None:
    """:func:`~ddpkit._internals.contract.warn_lost` for one of CPython's internals."""
    warn_lost(internal, "CPython", lost)


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
LINUX = sys.platform.startswith("linux")


def prctl(option: int, value: int | str) -> bool:
    """Linux's ``prctl(option, value)``; False where it fails or this is not Linux."""
    if not LINUX:
        return False
    arg: int | ctypes.c_char_p = (
        ctypes.c_char_p(os.fsencode(value)) if isinstance(value, str) else value
    )
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(option, arg, 0, 0, 0) == 0)


def _command_line_memory() -> tuple[int, int] | None:
    """``arg_start`` and ``arg_end`` of this process (from ``/proc/self/stat``), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # counted from the state, field 3
    except (OSError, IndexError, ValueError):
        return None
    return (start, end) if 0 < start < end else None


def set_command_line(args: Sequence[str]) -> bool:
    """Show ``args`` as this process's command line (``ps``), cut to the room the process started
    with, through ``/proc/self/mem``; False where it cannot."""
    where = _command_line_memory()
    if where is None:
        return False
    start, end = where
    room = end - start
    data = b"\0".join(map(os.fsencode, args))[: room - 1] + b"\0"  # the bytes given
    try:
        with open("/proc/self/cmdline", "rb") as f:
            shown = f.read()
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            if mem.read(room) != shown:
                return False
            mem.seek(start)
            return mem.write(data.ljust(room, b"\0")) == room
    except (OSError, ValueError):
        return False


def cuda_driver_initialised() -> bool:
    """True when this process has initialised the CUDA driver."""
    try:
        lib = _loaded_libcuda()
        return lib is not None and bool(lib.cuDeviceGetCount(ctypes.byref(ctypes.c_int())) == 0)
    except OSError:
        return False


def _loaded_libcuda() -> ctypes.CDLL | None:
    """``libcuda.so.1``, where this process has loaded it."""
    with open("/proc/self/maps") as f:
        return ctypes.CDLL("libcuda.so.1") if "libcuda.so" in f.read() else None


def finalize_as_interpreter() -> None:
    """What ``Py_FinalizeEx`` does before the process ends, in its order: join the non-daemon
    threads, run the ``atexit`` handlers, flush the files still open and the standard streams."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        # None where the descriptor was closed; a closed pipe: nothing to lose
        with contextlib.suppress(Exception):
            stream.flush()


_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def flush_open_files() -> int:
    """Flush every buffered file object still open for writing (found among the objects the garbage
    collector tracks, by exact type); how many."""
    gc.unfreeze()  # what a script froze (gc.freeze, before forking loader workers) is listed too
    flushed = 0
    for obj in gc.get_objects():
        if type(obj) in _BUFFERED:
            # closed, detached (.closed raises), not writable, a broken pipe: nothing to keep
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
                    flushed += 1
    return flushed


def _lacks(module: types.ModuleType, name: str) -> str | None:
    """What differs where ``module`` has no function ``name`` (None: it has)."""
    return None if callable(getattr(module, name, None)) else f"{module.__name__} has no {name}"


def _check_prctl() -> str | None:
    if not LINUX:
        return None  # not used elsewhere
    try:
        return None if callable(ctypes.CDLL(None).prctl) else "the C library has no prctl"
    except (OSError, AttributeError) as err:
        return f"the C library's prctl cannot be found: {err}"


def _check_command_line() -> str | None:
    if not LINUX:
        return None
    where = _command_line_memory()
    if where is None:
        return "/proc/self/stat has no arg_start/arg_end"
    start, end = where
    try:
        with open("/proc/self/cmdline", "rb") as f:
            shown = f.read()
        with open("/proc/self/mem", "rb", buffering=0) as mem:
            mem.seek(start)
            held = mem.read(end - start)
    except OSError as err:
        return f"the command line's memory cannot be read through /proc/self/mem ({err})"
    if held != shown:
        return "/proc/self/cmdline is not the memory between arg_start and arg_end"
    return None


def _check_cuda_probe() -> str | None:
    """Where this process has loaded the CUDA driver (else the probe is not used)."""
    try:
        lib = _loaded_libcuda()
        found = lib is None or callable(lib.cuDeviceGetCount)
        return None if found else "libcuda has no cuDeviceGetCount"
    except (OSError, AttributeError) as err:
        return f"libcuda.so.1's cuDeviceGetCount cannot be found: {err}"


def finalize_problem() -> str | None:
    """Why :func:`finalize_as_interpreter` cannot run here (None: it can)."""
    return _lacks(threading, "_shutdown") or _lacks(atexit, "_run_exitfuncs")


def current_frames() -> dict[int, types.FrameType]:
    """Every thread's current frame by thread ident (``sys._current_frames``)."""
    return sys._current_frames()


INTERNALS = [
    Internal(
        "sys._current_frames",
        "CPython",
        "a stack request is answered with every thread's frames; where it is gone, none",
        lambda: _lacks(sys, "_current_frames"),
    ),
    Internal(
        "threading._shutdown",
        "CPython",
        "a forked worker, and `ddpkit run` as it ends, join their non-daemon threads as the "
        "interpreter does at exit",
        lambda: _lacks(threading, "_shutdown"),
    ),
    Internal(
        "atexit._run_exitfuncs",
        "CPython",
        "a forked worker, and `ddpkit run`, run their atexit handlers before they end",
        lambda: _lacks(atexit, "_run_exitfuncs"),
    ),
    Internal(
        "libc prctl (ctypes)",
        "CPython",
        "workers die with their launcher (PR_SET_PDEATHSIG), the agent adopts what workers leave "
        "(PR_SET_CHILD_SUBREAPER), a guard's name",
        _check_prctl,
    ),
    Internal(
        "libcuda cuDeviceGetCount (ctypes)",
        "CPython",
        "the fork server refuses to fork when importing initialised the CUDA driver (a fork could "
        "not use CUDA)",
        _check_cuda_probe,
    ),
    Internal(
        "the command-line memory of /proc/self/stat (ctypes)",
        "CPython",
        "a forked worker's guard shows a command line of its own (`pkill -f` finds the worker, "
        "not its guard)",
        _check_command_line,
    ),
]
