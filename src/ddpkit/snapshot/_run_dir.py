"""The run directory and the run it holds. It belongs to one job at a time: the group's rank 0
holds ``run_dir/.lock`` (:mod:`ddpkit._fs.lock`) for the life of ``fit()``; the phases of one script
(``run_dir/<phase>/``) share it, held by the process until it ends, so that no other job takes the
folder between them. ``resume=False`` moves the previous run's files aside. What a run was built
with is written to ``config.json`` and recorded in every snapshot (:class:`RunRecord`), with the one
check that a snapshot resumes only that run (:meth:`RunRecord.check`), naming every difference.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._fs.lock import FolderLock
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import broadcast_object
from ddpkit.distributed._runtime import Runtime
from ddpkit.snapshot import _codec as codec


def run_dir_lock(run_dir: str | os.PathLike) -> FolderLock:
    """An exclusive advisory lock on ``run_dir/.lock``, naming its holder (host, pid) inside."""
    return FolderLock(
        run_dir,
        what="run_dir",
        job="job",
        user="run",
        hazard="two jobs on one run directory would interleave their records and resume from each "
        "other's snapshots",
    )


PREVIOUS_RUN = (
    "snapshots", "best.pt", "best.safetensors", "best_weights.pt", "final.safetensors",
    "final_weights.pt", "metrics.jsonl", "metrics.rewound.jsonl", "epochs.csv", "tensorboard",
    "loggers.json", "config.json", "curves.png",
)  # fmt: skip
"""What ``resume=False`` moves aside: the previous run's state and records (``mlflow.db`` and
``wandb/`` hold many runs: they stay)."""
RUN_FILES = (*PREVIOUS_RUN, "mlflow.db", "wandb")
"""What a run writes in its run directory (besides ``.lock``): none of it may be a symbolic link."""


_HELD: dict[Path, FolderLock] = {}
"""The run directories of phases this process has locked, until it ends."""
TRAINERS: weakref.WeakKeyDictionary[Any, tuple[Path, str | None]] = weakref.WeakKeyDictionary()
"""Each live Trainer of this process, and the (run_dir, phase) it trains in."""


def refuse_shared(run_dir: str | os.PathLike, phase: str | None) -> tuple[Path, str | None]:
    """The key a Trainer registers under in :data:`TRAINERS`; a :class:`ConfigError` naming
    ``phase=`` while another live Trainer of this process has ``run_dir`` with the same phase, or
    with a phase where this one has none or the reverse. Two without a phase pass: the second
    resumes the first's run, or the run record's check refuses it."""
    root = Path(run_dir).resolve()

    def others() -> list[str | None]:
        same = [p for r, p in list(TRAINERS.values()) if r == root]
        return [p for p in same if (phase and p == phase) or (p is None) != (phase is None)]

    if others():
        gc.collect()  # one that is unreachable, held only by a reference cycle, has ended
    if clash := others():
        other = f"phase={clash[0]!r}" if clash[0] else "no phase"
        raise ConfigError(
            f"run_dir {str(run_dir)!r} is already used by another Trainer of this process "
            f"({other}): two trainings in one folder would resume each other's snapshots. Give "
            "each training of the script its own TrainerConfig(phase=...) (it then writes in "
            "run_dir/<phase>/: phase='teacher', phase='student'), or its own run_dir; to resume "
            "a run in the same process, let go of its first Trainer (del trainer)"
        )
    return root, phase


def claim(
    run_dir: str | os.PathLike,
    *,
    is_main: bool,
    fresh: bool,
    group: Group = None,
    root: str | os.PathLike | None = None,
) -> FolderLock | None:
    """Lock ``run_dir`` on the group's main rank; with ``fresh`` (``resume=False``) move the
    previous run aside. Refused on every rank when the run directory or what the run writes there
    is another user's or a symbolic link. ``root``: ``run_dir`` is a phase's folder in it, and the
    lock is ``root``'s, held by this process until it ends (None is returned)."""
    lock: FolderLock | None = None
    error: Exception | None = None
    if is_main:
        path, top = Path(run_dir), Path(root or run_dir)
        held = _HELD.get(top.resolve())
        taken = held or run_dir_lock(top)
        try:
            # before the lock file is made: nothing is created in another user's folder
            fs.check_owned(top, "run_dir", follow=True, kind="run_dir")
            if held is None:
                taken.acquire()
            for name in RUN_FILES if path == top else ("", *RUN_FILES):
                what = "the snapshots folder" if name == "snapshots" else ""
                fs.check_owned(path / name, what, follow=False, kind="run_dir")
            if fresh:
                _set_aside_previous_run(path)
            if root is None and held is None:
                lock = taken
            else:
                _HELD[top.resolve()] = taken
        except (ConfigError, OSError) as err:
            if held is None:
                taken.release()
            error = err
            if isinstance(err, OSError):  # an OSError on every rank: a search tells it by errno
                message = f"cannot take run_dir {str(path)!r}: {err.strerror or err}"
                error = OSError(err.errno, message)
    error = broadcast_object(error, group=group)  # raised on every rank alike
    if error is not None:
        raise error
    return lock


def _set_aside_previous_run(run_dir: Path) -> None:
    # left, an old run's later snapshots would be resumed first
    snapshots = run_dir / "snapshots"
    present = [
        name
        for name in PREVIOUS_RUN
        if os.path.lexists(run_dir / name)
        and not (name == "snapshots" and snapshots.is_dir() and not any(snapshots.iterdir()))
    ]
    if not present:
        return
    aside = run_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    fs.make_dir(aside, root=run_dir)
    for name in present:
        # moves a link itself, never what it points to
        fs.rename(run_dir / name, aside / name, root=run_dir)
    print(
        f"ddpkit: resume=False: the previous run's {', '.join(present)} moved to {aside}; this "
        "run starts them afresh",
        flush=True,
    )


# -- What a run was built with, and the check that a snapshot resumes only that run.

RESUMABLE_CHANGES = frozenset({
    "run_dir", "resume", "epochs", "max_steps", "num_workers", "eval_batch_size",
    "raise_on_stop_signal", "on_data_change", "new_rank_state",
    "weights_format",
    "snapshot.every_steps", "snapshot.every_epochs", "snapshot.keep", "snapshot.async_write",
    "snapshot.memory", "snapshot.memory_every_steps", "snapshot.replicas",
    "logging.every_steps", "logging.progress", "logging.tensorboard", "logging.trackers",
    "early_stopping.patience",
    "strategy.bucket_cap_mb", "strategy.gradient_as_bucket_view", "strategy.static_graph",
    "strategy.find_unused_parameters", "strategy.parameters_as_bucket_view",
    "strategy.reshard_after_forward",
})  # fmt: skip
"""Config fields a resume may change: when and how the run stops, records and saves, and how fast
the strategy communicates, not what the next step computes (docs/snapshots.md)."""

# precision: see precision_change
_NOT_COMPARED = frozenset({"batch_size", "global_batch_size", "precision"})

PRECISIONS = ("fp32", "bf16", "fp16")

# Optimizer settings that schedulers move during training or that only choose an implementation.
_OPTIMIZER_IMPLEMENTATION = frozenset(
    {"params", "foreach", "fused", "capturable", "differentiable"}
)


def named_settings(optimizers: Mapping[str, torch.optim.Optimizer]) -> list[dict[str, str]]:
    """:func:`optimizer_settings` of several optimizers by name, in the order of their names, each
    group's ``optimizer`` its optimizer's name."""
    return [
        group | {"optimizer": codec.fingerprint(name)}
        for name in sorted(optimizers)
        for group in optimizer_settings(optimizers[name])
    ]


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, str]]:
    """The hyper-parameters of each param group as the script built them (before any scheduler
    step), and the group sizes, each as its :func:`~ddpkit.snapshot._codec.fingerprint`."""
    return [
        {k: codec.fingerprint(v) for k, v in group.items() if k not in _OPTIMIZER_IMPLEMENTATION}
        | {"params": codec.fingerprint(len(group["params"]))}
        for group in optimizer.param_groups
    ]


def optimizer_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any] | None]:
    """The same as JSON values (``str()`` of others), as snapshots before :func:`optimizer_settings`
    recorded them, and compared only with those; None for a group that JSON refuses."""
    out: list[dict[str, Any] | None] = []
    for group in optimizer.param_groups:
        values = {k: v for k, v in group.items() if k not in _OPTIMIZER_IMPLEMENTATION}
        try:
            out.append(
                json.loads(json.dumps(values, default=str)) | {"params": len(group["params"])}
            )
        except (TypeError, ValueError):
            out.append(None)
    return out


def tensor_shapes(state: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each tensor of a state dict (a DTensor's global shape)."""
    return {
        k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def module_types(model: torch.nn.Module) -> dict[str, str]:
    """The class name of every submodule by name (``""``: the model itself), not its module (a
    script's classes are in ``__main__`` when it is run); under fsdp, the class before
    ``fully_shard`` swapped it for a subclass (``FSDPLinear``)."""
    # imported only where fsdp is used: costs ~0.9 s
    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded = getattr(fsdp, "FSDPModule", None)
    out = {}
    for name, module in model.named_modules():
        cls = type(module)
        if sharded is not None and isinstance(module, sharded):
            cls = next(c for c in cls.__mro__ if not issubclass(c, sharded))
        out[name] = cls.__qualname__
    return out


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config (``TrainerConfig.to_json()``) as ``{"snapshot.every_steps": ..., ...}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass(frozen=True)
class RunRecord:
    """What this run asks for, as a snapshot records it (``state_dict()``) and a resume checks it
    (:meth:`check`): a Trainer's (:meth:`of`) or a hand loop's (:meth:`of_loop`)."""

    config: dict[str, Any]
    """``TrainerConfig.to_json()``."""
    optimizer_hparams: list[dict[str, Any] | None]
    model_shapes: dict[str, tuple[tuple[int, ...], str]]
    module_types: dict[str, str]
    optimizer_settings: list[dict[str, str]] | None = None
    """What a resume compares the optimizer by (:func:`optimizer_settings`); ``optimizer_hparams``
    is compared only with a snapshot that holds no settings."""
    parts: list[str] | None = None
    """A hand loop's parts by name (``Snapshots``' schedulers, loader, ``extra``)."""
    own: list[str] | None = None
    """A hand loop's parts each rank keeps its own of (``Snapshots(own=...)``)."""

    @classmethod
    def of(
        cls,
        config: Any,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        named: Mapping[str, torch.optim.Optimizer] | None = None,
    ) -> RunRecord:
        """The record of a run: ``optimizer`` as the script built it (before any scheduler step),
        ``model`` unwrapped; ``named``: several optimizers by name, compared by name."""
        return cls(
            config.to_json(),
            optimizer_hparams(optimizer),
            tensor_shapes(model.state_dict()),
            module_types(model),
            optimizer_settings(optimizer) if named is None else named_settings(named),
        )

    @classmethod
    def of_loop(cls, parts: list[str], own: list[str], model: torch.nn.Module) -> RunRecord:
        """The record of a hand loop: its parts, its own parts, and ``model`` unwrapped."""
        shapes = tensor_shapes(model.state_dict())
        return cls({}, [], shapes, module_types(model), None, sorted(parts), sorted(own))

    def state_dict(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.parts is None:  # a Trainer's record: no parts of a hand loop
            del state["parts"], state["own"]
        return state

    def precision_change(self, saved: Mapping[str, Any]) -> tuple[str, str] | None:
        """``(snapshot's precision, this run's)`` when they differ, else None: a resume may change
        it, not bitwise (docs/snapshots.md, "What a resume may change")."""
        old = (saved.get("config") or {}).get("precision")
        new = self.config.get("precision")
        if old is None or old == new:
            return None
        return str(old), str(new)

    def check(self, saved: Mapping[str, Any], snapshot: str) -> None:
        """Refuse the snapshot whose record is ``saved`` unless it was taken by a run like this one,
        naming every difference. Entries a snapshot does not hold are not compared."""
        problems = []
        old, new = flat_config(saved.get("config") or {}), flat_config(self.config)
        for name, value in new.items():
            if name in RESUMABLE_CHANGES or name in _NOT_COMPARED or name not in old:
                continue
            if old[name] != value:
                problems.append(
                    f"TrainerConfig.{name}: {old[name]!r} in the snapshot, {value!r} now"
                )
        settings = saved.get("optimizer_settings")
        if settings is not None and self.optimizer_settings is not None:
            problems += _group_differences(settings, self.optimizer_settings, str)
        elif saved.get("optimizer_hparams") is not None:  # a snapshot from before the settings
            problems += _group_differences(saved["optimizer_hparams"], self.optimizer_hparams, repr)
        problems += _model_differences(
            saved.get("model_shapes") or {}, self.model_shapes, "", _shape
        )
        if saved.get("module_types") is not None:
            problems += _model_differences(saved["module_types"], self.module_types, "submodules ")
        for what in ("parts", "own"):
            was, now = saved.get(what), getattr(self, what)
            if (was is not None or now is not None) and was != now:
                problems.append(f"{what}: {was} in the snapshot, {now} now")
        if problems and self.parts is not None:
            raise ConfigError(
                f"ddpkit: {snapshot} holds another loop's snapshots:\n  "
                + "\n  ".join(problems[:12])
                + "\nBuild Snapshots with the same parts and model, or give another run_dir"
            )
        if problems:
            allowed = ", ".join(sorted(RESUMABLE_CHANGES - {"run_dir", "resume"}))
            listed = "\n  ".join(
                problems[:12]
                + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
            )
            raise ConfigError(
                f"{snapshot} was taken by a run with another config than this one:\n  "
                f"{listed}\nResuming it would continue that run, not train this one. Give this run "
                "a new run_dir (another training of the same script: its own "
                "TrainerConfig(phase=...)), or pass TrainerConfig(resume=False) to start afresh in "
                "this one (the previous run's snapshots and records are moved aside), or change "
                f"only what a resume may change ({allowed})"
            )


def _by_optimizer(groups: list[Any]) -> dict[Any, list[Any]]:
    """Groups by their optimizer's name (None: one optimizer), in order."""
    out: dict[Any, list[Any]] = {}
    for group in groups:
        out.setdefault((group or {}).get("optimizer"), []).append(group)
    return out


def _group_differences(old: list[Any], new: list[Any], show: Callable[[Any], str]) -> list[str]:
    """Each difference of two records' param groups, those of several optimizers paired by name."""
    was_by, now_by = _by_optimizer(old), _by_optimizer(new)
    out = [f"optimizer {n}: in the snapshot, not now" for n in was_by if n not in now_by]
    out += [f"optimizer {n}: now, not in the snapshot" for n in now_by if n not in was_by]
    for name in [n for n in now_by if n in was_by]:
        out += _groups_of_one(name, was_by[name], now_by[name], show)
    return out


def _groups_of_one(
    name: Any, old: list[Any], new: list[Any], show: Callable[[Any], str]
) -> list[str]:
    of = f"optimizer {name}" if name else "optimizer"
    out = []
    if len(old) != len(new):
        out.append(f"{of}: {len(old)} param groups in the snapshot, {len(new)} now")
    for i, (was, now) in enumerate(zip(old, new)):
        if was is None or now is None:  # not recorded (a snapshot's JSON values refused it)
            continue
        where = f"{of} param group {i}"
        for key in sorted(was.keys() | now.keys()):
            if key == "initial_lr" and (key in was) != (key in now):  # set by a scheduler
                run = "the snapshot's run had" if key in was else "this run has"
                out.append(f"{where}: {run} a learning-rate scheduler, the other none")
            elif was.get(key) != now.get(key):
                out.append(
                    f"{where} {key}: {show(was.get(key))} in the snapshot, {show(now.get(key))} now"
                )
    return out


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def _model_differences(
    old: Mapping[str, Any], new: Mapping[str, Any], kind: str = "", show: Callable[[Any], str] = str
) -> list[str]:
    """Names of the model only now or only in the snapshot, and those ``show``-n otherwise."""
    out = []
    missing, extra = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    if missing:
        out.append(f"model: {kind}not in the snapshot: {_listed(missing)}")
    if extra:
        out.append(f"model: {kind}only in the snapshot: {_listed(extra)}")
    for name in sorted(old.keys() & new.keys()):
        was, now = show(old[name]), show(new[name])
        if was != now:
            out.append(f"model {name or '(the model itself)'}: {was} in the snapshot, {now} now")
    return out


def _shape(entry: tuple) -> str:
    return f"{tuple(entry[0])} {entry[1]}"


def write_resolved_config(
    run_dir: Path, config: Any, runtime: Runtime, per_rank_batch: int
) -> None:
    """``run_dir/config.json`` (rank 0): the resolved config, world size, batch and versions."""
    if not runtime.is_main:
        return
    resolved = config.to_json() | {
        "world_size": runtime.world_size,
        "per_rank_batch": per_rank_batch,
        "backend": runtime.backend,
        "device": str(runtime.device),
        "torch": torch.__version__,
    }
    fs.write_atomic(
        run_dir / "config.json", (json.dumps(resolved, indent=2, default=str) + "\n").encode()
    )
