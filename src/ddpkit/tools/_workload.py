"""What ``ddpkit bench`` and ``ddpkit check`` train: the user's model, data, loss and optimizer,
from a script's ``ddpkit_workload()`` (its main block not run), from the Trainer a script without
it builds, or a built-in workload (docs/bench-and-check.md).
"""

from __future__ import annotations

import ast
import runpy
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddpkit._errors import ConfigError
from ddpkit.data import ShardedBatchSampler
from ddpkit.data._loader import batch_len
from ddpkit.training._config import TrainerConfig
from ddpkit.training._evaluation import BatchLossFn, CountFn, LossFn, cross_entropy

HOOK = "ddpkit_workload"
"""The function a script defines for ``ddpkit bench script.py`` and ``ddpkit check script.py``."""
MAX_STEPS = 100_000  # the most steps (and warm-up steps, rounds) bench or check runs

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LoaderFactory = Callable[[Dataset, int, int, int], Iterable[Any]]


def _adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=2e-3)


@dataclass(kw_only=True)
class Workload:
    """One training set-up: what the hook returns (a 4-tuple fills the first four fields)."""

    model: nn.Module
    """A freshly built model, on the CPU; the tools move and wrap it."""
    dataset: Dataset
    """Training samples ``(inputs, targets)``; the same on every rank."""
    loss_fn: LossFn = F.cross_entropy
    """``loss_fn(model(inputs), targets)``: a scalar, the mean over the batch."""
    optimizer: OptimizerFactory = _adam
    """Builds the optimizer from the (wrapped) model's parameters."""
    batch_size: int = 32
    """Samples per rank per step; one process takes ``batch_size x ranks`` in ``ddpkit check``."""
    drop_last: bool = True
    """For ddpkit's sampler: drop an epoch's last, smaller global batch."""
    loader: LoaderFactory | None = None
    """The script's own loader, ``loader(dataset, batch_size, rank, world_size)``, read in the
    training process and iterated again when an epoch ends; by default ddpkit's
    :class:`~ddpkit.data.ShardedBatchSampler`."""
    batch_loss_fn: BatchLossFn | None = None
    """``batch_loss_fn(model, batch)``, in place of ``loss_fn``, for any other batch shape."""
    count_fn: CountFn | None = None
    """The items (tokens) a batch's mean loss is over (Trainer's ``count_fn``); None: samples."""
    sync_batchnorm: bool = False
    """The script normalises over the global batch: the check's runs do too."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """How ddpkit's loaders put samples into a batch; None: torch's default."""
    name: str = "workload"
    trainer: Captured | None = None
    """The Trainer as the script builds it (its arguments), for a script without the hook:
    ``ddpkit check`` runs that Trainer; ``ddpkit bench`` times the step of its model, loss and
    optimizer, and refuses one with ``step_fn`` (``model`` is then its models in an
    ``nn.ModuleDict``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes printed with the results."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ConfigError(
                f"{HOOK}() returned a model of type {type(self.model).__name__}: give an nn.Module"
            )
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size}: the per-rank batch must be >= 1")

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.batch_loss_fn is not None:
            return self.batch_loss_fn(model, batch)
        inputs, targets = batch
        return self.loss_fn(model(inputs), targets)

    def count(self, batch: Any) -> int:
        """What the batch's mean loss weighs: its items under ``count_fn``, else its samples."""
        if self.count_fn is not None:
            return int(self.count_fn(batch))
        return batch_len(batch)

    def check_sizes(self, world_size: int) -> None:
        """Refuse, before any rank starts, data without a global batch of ``world_size`` ranks."""
        if self.loader is None:
            data = cast(Sized, self.dataset)
            ShardedBatchSampler(
                data, self.batch_size, drop_last=self.drop_last, world_size=world_size, rank=0
            )


def digits_workload() -> Workload:
    """The DDP tutorials' CNN on scikit-learn's 8x8 digits, Adam."""
    from ddpkit.demo._datasets import digits
    from ddpkit.demo._models import DigitsCNN

    return Workload(
        model=DigitsCNN(image_size=8),
        dataset=digits("train"),
        name="DDP tutorials' CNN on sklearn digits",
    )


def lm_workload() -> Workload:
    """``examples/lm.py``'s small GPT on the stdlib's sources, the loss a token mean, AdamW."""
    from ddpkit.demo._datasets import CHARS, IGNORE_INDEX, python_source
    from ddpkit.demo._models import TinyGPT

    def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    return Workload(
        model=TinyGPT(len(CHARS)),
        dataset=python_source("train", max_chars=60_000),
        loss_fn=token_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95)),
        batch_size=8,
        count_fn=lambda batch: (batch[1] != IGNORE_INDEX).sum(),
        name="small GPT on the stdlib's sources (char-level)",
    )


BUILTINS: dict[str, Callable[[], Workload]] = {"digits": digits_workload, "lm": lm_workload}
"""Workloads named instead of a script."""

_modules: dict[str, dict[str, Any]] = {}


def _load_script(path: str) -> dict[str, Any]:
    """The globals of the script at ``path``, run once, not as ``__main__`` (as
    :func:`run_until_trainer` runs it); the caller holds :func:`intercept`."""
    file = str(Path(path).resolve())
    if file not in _modules:
        _modules[file] = runpy.run_path(file, run_name="_ddpkit_workload")
    return _modules[file]


def read_source(path: str) -> tuple[bool, list[int]]:
    """Whether the script at ``path`` defines :data:`HOOK` at its top level, and the lines where it
    calls a ``...Trainer(...)``: read from its source, without running it."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no such file; give the training script that defines {HOOK}()")
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except SyntaxError as err:
        raise ConfigError(f"{path} is not Python: {err}") from None
    hook = any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == HOOK
        for node in tree.body
    )
    trainers = sorted(  # Trainer(...) (a Name's id) and ddpkit.Trainer(...) (an Attribute's attr)
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", "")).endswith("Trainer")
    )
    return hook, trainers


def load_workload(script: str | None, world_size: int = 1, args: Sequence[str] = ()) -> Workload:
    """``script``'s :data:`HOOK`'s workload, or that of the Trainer it builds (for ``world_size``
    ranks); or a built-in one, named by ``script`` (``None``: :func:`digits_workload`). The script
    sees ``sys.argv == [script, *args]``."""
    if script is None:
        return digits_workload()
    if script in BUILTINS and not Path(script).exists():
        return BUILTINS[script]()
    has_hook, trainers = read_source(script)
    no_workload = (
        f"{script} defines no function {HOOK}() and builds no ddpkit.Trainer: add one that "
        "returns (model, dataset, loss_fn, optimizer_factory) or a "
        f"ddpkit.tools.Workload, or name a built-in workload ({', '.join(BUILTINS)}); "
        "see `ddpkit bench -h`"
    )
    if not has_hook and not trainers:
        raise ConfigError(f"{no_workload} (read from its source, which was not run)")
    imported = None
    try:
        # a script that trains at import (no main guard) stops where it builds its Trainer
        with intercept(script, args):
            hook = _load_script(script).get(HOOK)
    except Captured as found:
        hook, imported = None, found
    if not callable(hook):
        trainer = imported or run_until_trainer(script, args)
        if trainer is None:
            raise ConfigError(no_workload)
        captured = workload_of(trainer, script, world_size)
        if len(trainers) > 1:
            captured.extra["workload"] += (
                f" (the first it builds; its source builds Trainers at lines "
                f"{', '.join(map(str, trainers))}: define {HOOK}() to check another)"
            )
        return captured
    argv, sys.argv = sys.argv, [script, *args]  # a hook may read its options too
    try:
        out = hook()
    finally:
        sys.argv = argv
    if isinstance(out, Workload):
        return out
    if isinstance(out, tuple) and len(out) == 4:
        given = dict(zip(("model", "dataset", "loss_fn", "optimizer"), out))
        return Workload(**given, name=Path(script).name)
    raise ConfigError(
        f"{script}: {HOOK}() returned {type(out).__name__}; return (model, dataset, loss_fn, "
        "optimizer_factory) or a ddpkit.tools.Workload"
    )


class Captured(BaseException):
    """Raised in place of building a Trainer (a BaseException: a script's ``except Exception``
    does not swallow it); carries what the script gave it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("a Trainer was built")
        self.args, self.kwargs = args, kwargs

    @property
    def given(self) -> dict[str, Any]:
        """Every argument by name (the Trainer takes its first four by position too)."""
        return dict(zip(("model", "optimizer", "train_data", "config"), self.args)) | self.kwargs


@contextmanager
def intercept(script: str, args: Sequence[str] = ()) -> Iterator[None]:
    """Within: building a Trainer raises :class:`Captured`, an optimizer step is refused,
    ``sys.argv`` is ``[script, *args]`` and the script's folder leads ``sys.path`` (its own imports
    of its neighbours)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    # imported here: the Trainer imports torch's compiler stack, which a hook does not need
    from ddpkit.training._trainer import Trainer

    original, argv = Trainer.__init__, sys.argv

    def capture(self: Trainer, *args: Any, **kwargs: Any) -> None:
        raise Captured(args, kwargs)

    def refuse_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        raise ConfigError(
            f"{script} takes an optimizer step before building a ddpkit.Trainer (a hand-written "
            "loop): define ddpkit_workload() returning its model, data, loss and optimizer, and "
            "keep the loop under `if __name__ == '__main__':`"
        )

    Trainer.__init__ = capture  # type: ignore[method-assign]  # restored below
    hook = register_optimizer_step_pre_hook(refuse_step)
    sys.argv = [script, *args]
    folder = str(Path(script).resolve().parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        Trainer.__init__ = original  # type: ignore[method-assign]
        hook.remove()
        sys.argv = argv
        sys.path.remove(folder)


def run_until_trainer(script: str, args: Sequence[str] = ()) -> Captured | None:
    """Run ``script`` as ``__main__`` until it builds a Trainer; what it gave it (None: none)."""
    try:
        with intercept(script, args):
            runpy.run_path(str(Path(script).resolve()), run_name="__main__")
    except Captured as found:
        return found
    except SystemExit as exit_:
        given = f"with arguments {list(args)}" if args else "with no arguments"
        raise ConfigError(
            f"{script} exited ({exit_.code}) before building a Trainer, run {given}: pass the "
            "arguments it needs after the script's name"
        ) from None
    return None


def workload_of(found: Captured, script: str, world_size: int) -> Workload:
    """The :class:`Workload` of a captured Trainer, with the per-rank micro-batch the Trainer would
    use on ``world_size`` ranks; the Trainer is kept whole, in :attr:`Workload.trainer`."""
    given = found.given
    missing = [n for n in ("model", "optimizer", "train_data", "config") if n not in given]
    if missing:
        raise ConfigError(f"{script}: the Trainer it builds is given no {', '.join(missing)}")
    config: TrainerConfig = given["config"]
    common: dict[str, Any] = {
        "dataset": given["train_data"], "batch_size": config.per_rank_batch(world_size),
        "drop_last": config.drop_last, "sync_batchnorm": config.sync_batchnorm,
        "collate_fn": config.collate_fn, "name": Path(script).name,
    }  # fmt: skip
    if given.get("step_fn") is not None:
        models = given["model"]
        return Workload(
            model=nn.ModuleDict(dict(models)) if isinstance(models, Mapping) else models,
            trainer=found,
            extra={"workload": "the Trainer the script builds, with its step_fn, run as it is"},
            **common,
        )
    optimizer = given["optimizer"]
    return Workload(
        model=given["model"],
        loss_fn=given.get("loss_fn") or cross_entropy,
        batch_loss_fn=given.get("batch_loss_fn"),
        count_fn=given.get("count_fn"),
        # the script's optimizer holds the model's own parameters, which DDP wraps without copying
        optimizer=lambda params: optimizer,
        trainer=found,
        extra={"workload": "the Trainer the script builds, run as it is"},
        **common,
    )
