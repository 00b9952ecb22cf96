"""The workload of a script that only builds a :class:`~ddpkit.Trainer` and calls ``fit()``: no hook needed.

The script runs as ``__main__`` with its default arguments (``sys.argv`` is the script's path alone) while
``Trainer.__init__`` is replaced by one that records what it was given and raises :class:`Captured`, a
``BaseException`` (a script's ``except Exception`` does not swallow it): the script stops where the Trainer
would be built, before anything is wrapped, launched or written, and its model, optimizer, training data and
loss become a :class:`~ddpkit.tools.workload.Workload`. Running the script again builds a fresh model, as the
tools need once per run. The learning-rate scheduler is not stepped: a few steps at the learning rate the
optimizer has when the Trainer is built are compared.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.training.config import TrainerConfig
from ddpkit.training.losses import cross_entropy
from ddpkit.training.trainer import Trainer


class Captured(BaseException):
    """Raised in place of building a Trainer; carries what the script gave it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("a Trainer was built")
        self.args, self.kwargs = args, kwargs


@contextmanager
def intercept(script: str) -> Iterator[None]:
    """Within: building a Trainer raises :class:`Captured`, and ``sys.argv`` is ``[script]``."""
    original, argv = Trainer.__init__, sys.argv

    def capture(self: Trainer, *args: Any, **kwargs: Any) -> None:
        raise Captured(args, kwargs)

    Trainer.__init__ = capture  # type: ignore[method-assign]  # restored below
    sys.argv = [script]
    try:
        yield
    finally:
        Trainer.__init__ = original  # type: ignore[method-assign]
        sys.argv = argv


def capture_trainer(script: str, world_size: int, imported: Captured | None = None) -> Any:
    """The workload of the Trainer ``script`` builds (``imported``: as it did when imported), or None."""
    found = imported or run_until_trainer(script)
    return None if found is None else workload_of(found, script, world_size)


def run_until_trainer(script: str) -> Captured | None:
    """Run ``script`` as ``__main__`` until it builds a Trainer; what it gave the Trainer (None: it built none)."""
    file = Path(script).resolve()
    sys.path.insert(0, str(file.parent))  # the script's own imports of its neighbours
    try:
        with intercept(script):
            runpy.run_path(str(file), run_name="__main__")
    except Captured as found:
        return found
    except SystemExit as exit_:
        raise ConfigError(f"{script} exited ({exit_.code}) before building a Trainer, run with no arguments") from None
    finally:
        sys.path.remove(str(file.parent))
    return None


def workload_of(found: Captured, script: str, world_size: int) -> Any:
    """The :class:`~ddpkit.tools.workload.Workload` of a captured Trainer, with the per-rank micro-batch the
    Trainer would use on ``world_size`` ranks."""
    from ddpkit.tools.workload import Workload  # the module that imports this one

    names = ("model", "optimizer", "train_data", "config")
    given = dict(zip(names, found.args)) | {k: v for k, v in found.kwargs.items() if k in names}
    missing = [n for n in names if n not in given]
    if missing:
        raise ConfigError(f"{script}: the Trainer it builds is given no {', '.join(missing)}")
    config: TrainerConfig = given["config"]
    optimizer = given["optimizer"]
    per_rank = config.per_rank_batch(world_size)  # global_batch_size / (ranks x accumulation steps)
    return Workload(
        model=given["model"],
        dataset=given["train_data"],
        loss_fn=found.kwargs.get("loss_fn") or cross_entropy,
        batch_loss_fn=found.kwargs.get("batch_loss_fn"),
        count_fn=found.kwargs.get("count_fn"),
        # The optimizer the script built holds the model's own parameters, which DDP wraps without copying.
        optimizer=lambda params: optimizer,
        batch_size=per_rank,
        drop_last=config.drop_last,
        sync_batchnorm=config.sync_batchnorm,
        name=Path(script).name,
        extra={"workload": "captured from the Trainer the script builds"},
    )
