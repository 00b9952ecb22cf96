"""The workload of a script that only builds a :class:`~ddpkit.Trainer` and calls ``fit()``: no hook
needed.

The script runs as ``__main__`` with the arguments the command was given after it (``sys.argv`` is
the script's path and those, as under ``ddpkit run``) while ``Trainer.__init__`` is replaced by one
that records what it was given and raises :class:`Captured`, a ``BaseException`` (a script's
``except Exception`` does not swallow it): the script stops where the Trainer would be built, before
anything is wrapped, launched or written, and its model, optimizer, training data and loss become a
workload (:func:`ddpkit.tools._workload.workload_of`). Running the script again builds a fresh
model, as the tools need once per run. The learning-rate scheduler is not stepped: a few steps at
the learning rate the optimizer has when the Trainer is built are compared.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddpkit._errors import ConfigError
from ddpkit.training._trainer import Trainer


class Captured(BaseException):
    """Raised in place of building a Trainer; carries what the script gave it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("a Trainer was built")
        self.args, self.kwargs = args, kwargs


@contextmanager
def intercept(script: str, args: Sequence[str] = ()) -> Iterator[None]:
    """Within: building a Trainer raises :class:`Captured`, and ``sys.argv`` is
    ``[script, *args]``."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    original, argv = Trainer.__init__, sys.argv

    def capture(self: Trainer, *args: Any, **kwargs: Any) -> None:
        raise Captured(args, kwargs)

    def refuse_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        # a hand-written loop: stopped before its first step changes anything
        raise ConfigError(
            f"{script} takes an optimizer step before building a ddpkit.Trainer (a hand-written "
            "loop): define ddpkit_workload() returning its model, data, loss and optimizer, and "
            "keep the loop under `if __name__ == '__main__':`"
        )

    Trainer.__init__ = capture  # type: ignore[method-assign]  # restored below
    hook = register_optimizer_step_pre_hook(refuse_step)
    sys.argv = [script, *args]
    try:
        yield
    finally:
        Trainer.__init__ = original  # type: ignore[method-assign]
        hook.remove()
        sys.argv = argv


def run_until_trainer(script: str, args: Sequence[str] = ()) -> Captured | None:
    """Run ``script`` as ``__main__`` until it builds a Trainer; what it gave the Trainer (None: it
    built none)."""
    file = Path(script).resolve()
    sys.path.insert(0, str(file.parent))  # the script's own imports of its neighbours
    try:
        with intercept(script, args):
            runpy.run_path(str(file), run_name="__main__")
    except Captured as found:
        return found
    except SystemExit as exit_:
        given = f"with arguments {list(args)}" if args else "with no arguments"
        raise ConfigError(
            f"{script} exited ({exit_.code}) before building a Trainer, run {given}: pass the "
            "arguments it needs after the script's name"
        ) from None
    finally:
        sys.path.remove(str(file.parent))
    return None
