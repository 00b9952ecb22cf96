"""A run directory belongs to one job at a time, and a snapshot resumes only the run that wrote it.

Two mistakes train the wrong thing and still exit 0 unless caught here:

- two jobs on one ``run_dir`` interleave their records and resume from each other's snapshots: the group's
  rank 0 holds an advisory lock (:func:`fcntl.flock`) on ``run_dir/.lock`` for the life of ``fit()``. The
  kernel drops it when the process ends, however it ends, so a crashed or SIGKILLed job leaves nothing
  behind and a restarted one takes it again at once;
- a script rerun with another config (another learning rate, a resized layer) on a run directory that
  already holds snapshots would "resume" the old run: :func:`check_resumable` compares what the snapshot was
  taken with against what this run asks for, and refuses with the fields that differ and the ways out.

A run directory that belongs to another user, or that holds a symbolic link where the run writes, is refused
too (:mod:`ddpkit.snapshot.files`): a job's writes and deletions stay inside its own run directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit.distributed.collectives import broadcast_object
from ddpkit.errors import ConfigError
from ddpkit.snapshot import files as run_files

RESUMABLE_CHANGES = frozenset({
    "run_dir", "resume", "epochs", "max_steps", "progress", "log_every_steps", "keep_snapshots", "num_workers",
    "tensorboard", "eval_batch_size", "snapshot_every_steps", "snapshot_every_epochs", "early_stopping_patience",
    "raise_on_stop_signal", "loggers", "best_metric", "ddp_kwargs",
})  # fmt: skip
"""TrainerConfig fields a resume may change: when and how the run stops, records and saves, not what the next
step computes. (``batch_size`` and ``global_batch_size`` are checked as the global batch they make, which may
stay the same at another world size.) ``num_workers`` is here because a sample's random draws are a function of
``(seed, epoch, index)``, not of the worker that loads it."""

_NOT_COMPARED = frozenset({"batch_size", "global_batch_size"})

# Optimizer settings that schedulers move during training or that only choose an implementation.
_OPTIMIZER_IMPLEMENTATION = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


class RunDirLock:
    """An exclusive advisory lock on ``run_dir/.lock``, naming its holder (host, pid) inside the file."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigError` naming the job that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Never through a link, never another user's file: the holder's name is written into it.
        fd = run_files.open_fd(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"run_dir {str(self.path.parent)!r} is in use by another job ({holder}): two jobs on one run "
                "directory would interleave their records and resume from each other's snapshots. Wait for it "
                "to end, or give this run another run_dir"
            ) from None
        # Holder first written after the lock is ours: a job that finds it locked reads a whole record.
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


RUN_FILES = ("snapshots", "metrics.jsonl", "epochs.csv", "config.json", "best.pt", "tensorboard", "loggers.json",
             "mlflow.db", "wandb", "curves.png")
"""What a run writes in its run directory (besides ``.lock``): none of it may be a symbolic link."""

PREVIOUS_RUN = ("snapshots", "best.pt", "metrics.jsonl", "epochs.csv", "tensorboard", "loggers.json",
                "config.json", "curves.png")
"""What ``resume=False`` moves aside: the previous run's state and records, which the new run's would otherwise
join at the same steps. (``mlflow.db`` and ``wandb/`` are stores of many runs; the new run is a new run in
them, as ``loggers.json`` is moved.)"""


def claim(run_dir: str | os.PathLike, *, is_main: bool, fresh: bool, group: Any = None) -> RunDirLock | None:
    """Lock ``run_dir`` on the group's main rank; with ``fresh`` (``resume=False``) move the previous run aside.

    Refused (on every rank) when the run directory or its ``snapshots/`` belongs to another user, or when
    anything the run writes there is a symbolic link. Collective over ``group``: the main rank's verdict is
    broadcast, so every rank raises together rather than the others waiting in their first all-reduce for a
    rank that has left.
    """
    lock, error = None, None
    if is_main:
        path = Path(run_dir)
        lock = RunDirLock(path)
        try:
            # Checked before the lock file is made: nothing is created in another user's folder.
            run_files.check_owned(path, "run_dir", follow=True)
            lock.acquire()
            for name in RUN_FILES:
                run_files.check_owned(path / name, "the snapshots folder" if name == "snapshots" else "",
                                      follow=False)
            if fresh:
                _set_aside_previous_run(path)
        except (ConfigError, OSError) as err:
            lock.release()
            lock, error = None, str(err)
    error = broadcast_object(error, group=group)
    if error is not None:
        raise ConfigError(error)
    return lock


def _set_aside_previous_run(run_dir: Path) -> None:
    # Left in place, an old run's snapshots of later steps would be "newer" than this run's and be pruned last
    # or resumed first, and its records would be followed by this run's at the same steps (two curves drawn as
    # one); deleting them would destroy what the user may still want. The folder they go to has the layout of
    # a run directory: `ddpkit plot` draws it.
    snapshots = run_dir / "snapshots"
    present = [name for name in PREVIOUS_RUN if os.path.lexists(run_dir / name)
               and not (name == "snapshots" and snapshots.is_dir() and not any(snapshots.iterdir()))]
    if not present:
        return
    aside = run_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    aside.mkdir()
    for name in present:
        os.rename(run_dir / name, aside / name)  # a rename moves a link itself, never what it points to
    print(f"ddpkit: resume=False: the previous run's {', '.join(present)} moved to {aside}; this run starts "
          "them afresh", flush=True)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown: it has not written its name yet"


def optimizer_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyper-parameters of each param group as the script built them (JSON values), and the group sizes.

    Taken when the Trainer is built, before any step: a scheduler has moved ``lr`` by the time a snapshot is
    written, so the value a resumed run asks for is compared with the value the first run asked for.
    """
    out = []
    for group in optimizer.param_groups:
        values = {k: v for k, v in group.items() if k not in _OPTIMIZER_IMPLEMENTATION}
        out.append(json.loads(json.dumps(values, default=str)) | {"params": len(group["params"])})
    return out


def check_resumable(
    saved: Mapping[str, Any],
    config: Any,
    model_shapes: Mapping[str, tuple[tuple[int, ...], str]],
    hparams: list[dict[str, Any]],
    snapshot: str,
    modules: Mapping[str, str] | None = None,
) -> None:
    """Refuse a snapshot taken with another config, model or optimizer than this run's, naming the differences.

    ``saved`` is the snapshot's state (its ``config``, ``model_shapes`` (or whole ``model``), ``module_types``
    and ``optimizer_hparams`` entries are read); ``config`` this run's TrainerConfig as a JSON dict;
    ``model_shapes`` this run's :func:`tensor_shapes` of its model; ``hparams`` this run's
    :func:`optimizer_hparams`; ``modules`` this run's :func:`module_types`. Snapshots written before a field
    existed are not compared on it.
    """
    problems = []
    old_config = saved.get("config") or {}
    for name, value in config.items():
        if name in RESUMABLE_CHANGES or name in _NOT_COMPARED or name not in old_config:
            continue
        if old_config[name] != value:
            problems.append(f"TrainerConfig.{name}: {old_config[name]!r} in the snapshot, {value!r} now")
    old_hparams = saved.get("optimizer_hparams")
    if old_hparams is not None:
        if len(old_hparams) != len(hparams):
            problems.append(f"optimizer: {len(old_hparams)} param groups in the snapshot, {len(hparams)} now")
        for i, (old, new) in enumerate(zip(old_hparams, hparams)):
            for key in sorted(old.keys() | new.keys()):
                if old.get(key) != new.get(key):
                    problems.append(f"optimizer param group {i} {key}: {old.get(key)!r} in the snapshot, "
                                    f"{new.get(key)!r} now")
    old_shapes = saved.get("model_shapes") or tensor_shapes(saved.get("model") or {})
    problems += _model_differences(old_shapes, model_shapes)
    if modules is not None and saved.get("module_types") is not None:
        problems += _module_differences(saved["module_types"], modules)
    if problems:
        allowed = ", ".join(sorted(RESUMABLE_CHANGES - {"run_dir", "resume"}))
        listed = "\n  ".join(problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else []))
        raise ConfigError(
            f"{snapshot} was taken by a run with another config than this one:\n  {listed}\n"
            "Resuming it would continue that run, not train this one. Give this run a new run_dir, or pass "
            "TrainerConfig(resume=False) to start afresh in this one (the previous run's snapshots and records are "
            "moved aside), or "
            f"change only what a resume may change ({allowed})"
        )


def tensor_shapes(state: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each tensor of a state dict; a sharded tensor (DTensor) gives its global shape."""
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in state.items() if isinstance(v, torch.Tensor)}


def module_types(model: torch.nn.Module) -> dict[str, str]:
    """The class name of every submodule by name (``""``: the model itself).

    What a resume checks its model's structure against: the same shapes with another activation, or another
    normalisation, would load and train on silently. Hyper-parameters a module holds (a dropout rate, a
    negative slope) are not part of it, nor the module a class is defined in: a script's classes are in
    ``__main__`` when it is run and in its own module when imported. fsdp's ``fully_shard`` swaps each sharded
    module's class for a subclass (``FSDPLinear``); the class the script built is recorded.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported only where fsdp is used: costs ~0.9 s
    sharded = getattr(fsdp, "FSDPModule", None)
    out = {}
    for name, module in model.named_modules():
        cls = type(module)
        if sharded is not None and isinstance(module, sharded):
            cls = next(c for c in cls.__mro__ if not issubclass(c, sharded))
        out[name] = cls.__qualname__
    return out


def _module_differences(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    def listed(names: list[str]) -> str:
        return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")

    out = []
    missing, extra = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    if missing:
        out.append(f"model: submodules not in the snapshot: {listed(missing)}")
    if extra:
        out.append(f"model: submodules only in the snapshot: {listed(extra)}")
    for name in [n for n in new if n in old and old[n] != new[n]]:
        out.append(f"model {name or '(the model itself)'}: {old[name]} in the snapshot, {new[name]} now")
    return out


def _model_differences(old: Mapping[str, tuple], new: Mapping[str, tuple]) -> list[str]:
    out = []
    missing, extra = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    if missing:
        out.append(f"model: not in the snapshot: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        out.append(f"model: only in the snapshot: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    for name in sorted(old.keys() & new.keys()):
        (old_shape, old_dtype), (shape, dtype) = old[name], new[name]
        if tuple(old_shape) != tuple(shape) or old_dtype != dtype:
            out.append(f"model {name}: {tuple(old_shape)} {old_dtype} in the snapshot, {tuple(shape)} {dtype} now")
    return out
