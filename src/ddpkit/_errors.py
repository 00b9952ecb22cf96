"""Errors that tell a user what to change, and the exit code of a pre-empted run."""

from __future__ import annotations

import collections.abc
import functools
import inspect
import signal
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

F = TypeVar("F", bound=Callable[..., Any])

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM/SIGUSR1 after saving its snapshot (``EX_TEMPFAIL``: "try
again later"); ``ddpkit run`` passes it through without counting it as a failure to restart."""


class ConfigError(ValueError):
    """A launch, environment or option value that cannot work; the message names what to change."""


def check_types(config: Any) -> None:
    """Raise a ``ConfigError`` naming the first field of the dataclass ``config`` whose value is
    not of its annotated type (an int for a float is fine, a bool for an int is not)."""
    for name, hint in _hints(type(config)).items():  # type: ignore[arg-type]
        _check_value(type(config).__name__, name, getattr(config, name), hint)


def checked_arguments(fn: F) -> F:
    """``fn`` refusing a number, flag or name not of its annotated type, as :func:`check_types`
    does, before it runs; arguments of other classes (a dataset, a model) are left to ``fn``."""
    signature = inspect.signature(fn)
    name = fn.__qualname__.removesuffix(".__init__")

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # a missing or unknown argument: Python's own message, naming fn
            bound = {}
        hints = _argument_hints(fn)
        for arg, value in bound.items():
            if arg in hints:
                _check_value(name, arg, value, hints[arg])
        return fn(*args, **kwargs)

    return checked  # type: ignore[return-value]


@functools.cache
def _argument_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    hints = {}
    for arg, annotation in getattr(fn, "__annotations__", {}).items():
        try:  # a name imported for type checking only stays unchecked
            hints[arg] = typing.get_type_hints(
                types.SimpleNamespace(__annotations__={arg: annotation}), fn.__globals__
            )[arg]
        except Exception:  # noqa: BLE001, S112
            continue
    return {arg: hint for arg, hint in hints.items() if arg != "return" and _plain(hint)}


def _plain(hint: Any) -> bool:
    """A hint of numbers, flags, strings, None and literals only."""
    if get_origin(hint) in (Union, types.UnionType):
        return all(_plain(arg) for arg in get_args(hint))
    return get_origin(hint) is Literal or hint in (int, float, bool, str, type(None))


def _check_value(owner: str, name: str, value: Any, hint: Any) -> None:
    if _matches(value, hint):
        return
    takes = _words(hint)
    kind = type(value).__name__
    shown = repr(value) if len(repr(value)) <= 40 else ""
    article = "an" if kind[0] in "aeiou" else "a"
    got = "None" if value is None else f"{article} {kind} {shown}".rstrip()
    if isinstance(value, str) and ("int" in takes or "number" in takes):  # a command line's value
        got += " (argparse gives strings: pass type=int or type=float)"
    raise ConfigError(f"{owner}({name}={value!r}): {name} takes {takes}, got {got}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    import dataclasses

    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name in hints}


def _matches(value: Any, hint: Any) -> bool:
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin is Union or origin is types.UnionType:
        return any(_matches(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (tuple, list, collections.abc.Sequence):
        args = [a for a in get_args(hint) if a is not Ellipsis]
        ok = isinstance(value, (tuple, list)) and not isinstance(value, str)
        return ok and (not args or all(_matches(v, args[0]) for v in value))
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, collections.abc.Mapping)
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if isinstance(hint, type) and origin is None:
        return isinstance(value, hint)
    return True  # a protocol: not checked here


def _words(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        parts = [_words(a) for a in get_args(hint) if a is not type(None)]
        none = type(None) in get_args(hint)
        return " or ".join(parts) + (" or None (off)" if none else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if origin in (tuple, list, collections.abc.Sequence):
        return "a list or tuple"
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return "a callable"
    names = {bool: "True or False", int: "an int", float: "a number", str: "a str"}
    return names.get(hint, f"a {getattr(hint, '__name__', hint)}")


def check_fields(config: Any, checks: dict[str, bool]) -> None:
    """Raise a ``ConfigError`` naming the first of ``config``'s fields whose check is false."""
    for name, ok in checks.items():
        if not ok:
            raise ConfigError(
                f"{name}={getattr(config, name)!r} is not valid: see {type(config).__name__}.{name}"
            )


class Preempted(SystemExit):
    """Raised by ``Trainer.fit()`` when a stop signal ended training early, once the snapshot is on
    disk. A ``SystemExit``: uncaught, the process exits with
    :data:`~ddpkit._errors.PREEMPTED_EXIT_CODE` and no traceback."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.signal_name = step, signal_name

    @classmethod
    def by(cls, signum: int, step: int) -> Preempted:
        """Stopped by signal ``signum`` (0: one to another rank) after optimizer step ``step``."""
        return cls(step, signal.Signals(signum).name if signum else "a signal to another rank")

    def __str__(self) -> str:
        return (
            f"stopped by {self.signal_name} after optimizer step {self.step}; the snapshot is saved"
        )
