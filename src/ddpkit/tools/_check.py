"""``ddpkit check``: do N ranks train the same model as one process on the same global batch? If
not, why? Each known cause has a switch that removes it; a cause is named when the mismatch comes
back without its switch. A Trainer script is run as its Trainer (its config, scheduler, loss);
rounding is told from a real difference by the runs again in float64, where rounding is 2**-29 of
float32's (docs/bench-and-check.md).
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, Dataset, default_collate

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError, check_types
from ddpkit._internals.compiler import import_dynamo
from ddpkit._launch.cli import options
from ddpkit._launch.cli.options import MAX_NPROC, argument
from ddpkit.data import ShardedBatchSampler, to_device
from ddpkit.data._loader import SampleSeeder, batch_len
from ddpkit.distributed._collectives import all_gather_object, broadcast_object
from ddpkit.distributed._runtime import get_runtime, init
from ddpkit.distributed._seeding import mix_seed, seed_everything
from ddpkit.distributed._spawn import spawn
from ddpkit.nn._dropout import BatchLayout, DropoutRefused, batch_layout, convert_dropout
from ddpkit.strategies import DDPConfig, strategy_config
from ddpkit.strategies._prepare import prepare_model, unwrap
from ddpkit.tools._compare import (
    EXACT,
    QUANTITIES,
    REACH,
    Tolerance,
    Verdict,
    compare,
)
from ddpkit.tools._workload import BUILTINS, HOOK, MAX_STEPS, Workload, load_workload

SCRIPT_FAILED = 3
"""The exit code when the script raised (0: the runs agree; 1: they differ; 2: bad options)."""


@dataclass(kw_only=True)
class CheckConfig:
    """What ``ddpkit check`` runs."""

    script: str | None = None
    """The training script defining ``ddpkit_workload()``; None for the built-in digits CNN."""
    script_args: tuple[str, ...] = ()
    """The script's own arguments (its ``sys.argv[1:]``)."""
    nproc: int = 2
    """Ranks of the distributed run (gloo on the CPU)."""
    steps: int = 4
    """Optimizer steps compared."""
    rtol: float = 1e-4
    """Relative difference (``|a - b| / |b|`` over a whole tensor) beyond which two runs differ, in
    float32 units: the runs are judged in float64 with ``rtol * EXACT`` (in the script's own
    arithmetic with ``rtol`` where float64 cannot run it)."""
    seed: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        if not 2 <= self.nproc <= MAX_NPROC:
            raise ConfigError(f"--nproc {self.nproc}: compare with 2 to {MAX_NPROC} ranks")
        if not 1 <= self.steps <= MAX_STEPS:
            raise ConfigError(
                f"--steps {self.steps}: run 1 to {MAX_STEPS}; a difference shows in the first few"
            )
        if not 0 < self.rtol < 1:
            raise ConfigError(f"--rtol {self.rtol}: give a relative tolerance between 0 and 1")
        if not 0 <= self.seed < 2**63:  # torch.manual_seed takes 64 bits
            raise ConfigError(f"--seed {self.seed}: use a whole number from 0 to 2**63 - 1")


@dataclass(frozen=True)
class Cause:
    """A way N ranks can train another model than one process does, and its fix."""

    key: str
    """The switch that removes it."""
    what: str
    fix: str


CAUSES: tuple[Cause, ...] = (
    Cause(
        "batchnorm",
        "BatchNorm without global statistics: each rank normalises its own slice of the batch",
        "sync_batchnorm=True (prepare_model(model, sync_batchnorm=True) or "
        "TrainerConfig(sync_batchnorm=True))",
    ),
    Cause(
        "dropout",
        "dropout drawing per rank: each rank draws the masks of its own slice from its own RNG",
        "global_batch_dropout=True (TrainerConfig), or the forward inside "
        "`with ddpkit.nn.global_batch(loader):` in a hand-written loop",
    ),
    Cause(
        "augmentation",
        "augmentation drawing per rank: the dataset draws random numbers from the process's RNG, "
        "so a sample is augmented differently at another world size",
        "draw a sample's randomness from a generator seeded by the sample: "
        "torch.Generator().manual_seed(ddpkit.distributed.mix_seed(seed, epoch, index)) "
        "in __getitem__",
    ),
    Cause(
        "data_order",
        "a different data order: the ranks' batches are not the slices of the single process's "
        "global batch",
        "ddpkit.build_loader(dataset, batch_size, seed=...) (ShardedBatchSampler) with the same "
        "seed on every rank",
    ),
    Cause(
        "unused_parameters",
        "unused parameters: some parameters get no gradient, and DDP waits for them",
        "find_unused_parameters=True (prepare_model(model, find_unused_parameters=True) or "
        "TrainerConfig(strategy=DDPConfig(find_unused_parameters=True))), or remove the unused "
        "parameters",
    ),
    Cause(
        "initial_state",
        "initial weights that differ between ranks: tensors DDP does not broadcast (plain tensor "
        "attributes, not parameters or buffers) start different on each rank",
        "ddpkit.seed_everything(seed) with the same seed on every rank before building the model, "
        "and self.register_buffer(name, tensor) so DDP broadcasts it",
    ),
    Cause(
        "nondeterminism",
        "non-deterministic ops: one process run twice from the same seed does not repeat itself",
        "torch.use_deterministic_algorithms(True) (on CUDA also CUBLAS_WORKSPACE_CONFIG=:4096:8)",
    ),
    Cause(
        "uneven_mean",
        "a loss averaged per rank when samples (or the tokens a loss averages over) are uneven: "
        "DDP averages the ranks' means, which is not the mean over the global batch when ranks "
        "hold different numbers of them",
        "drop_last=True (build_loader, TrainerConfig: every rank gets batch_size samples), or "
        "weight each rank's mean loss by its share: loss * n_rank * world_size / n_global (per "
        "token: the Trainer's count_fn)",
    ),
)
_KEYS = tuple(c.key for c in CAUSES)
TRAINER_KEYS = ("batchnorm", "dropout", "augmentation", "initial_state", "nondeterminism")
"""The switches a Trainer's check turns: its config's ``sync_batchnorm``, ``global_batch_dropout``
and ``seed_samples``, a broadcast, deterministic algorithms; and ``find_unused_parameters`` in its
``ddp`` strategy (not a step_fn's, whose models' DDP options are the script's)."""
NOT_SWITCHED = (
    "not switched for a Trainer: data order (its sampler already slices the global batch), uneven "
    "means (it weighs each micro-batch by its share)"
)


class SampleSeeded(Dataset):
    """Fetches sample ``i`` of epoch ``e`` seeded as ``build_loader`` seeds it (by plain index, for
    a script's own loader): a sample's augmentation belongs to the sample, not to the rank that
    fetches it."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seeder, self.epoch = dataset, SampleSeeder(seed), 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.seeder.load([(self.epoch, index)], self.dataset.__getitem__, [index])[0]


def _batches(loader: Any, data: Dataset) -> Iterator[Any]:
    for epoch in itertools.count():
        if isinstance(data, SampleSeeded):
            data.epoch = epoch
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ConfigError(
                "the loader gave no batch: the dataset is smaller than one global batch"
            )


def train_steps(
    script: str | None,
    fixes: frozenset[str],
    steps: int,
    per_rank_batch: int | None,
    seed: int,
    args: Sequence[str] = (),
    exact: bool = False,
    nudged: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` steps with the switches in ``fixes`` on (``exact``: in float64, autocast
    off; ``nudged``: every initial weight moved by a unit in its last place, a seeded direction
    each); this process's records. Collective where there is a process group. A script's error is
    recorded (a DDP error is a finding), and so is the refusal of a switch of the check's own."""
    records: dict[str, Any] = {q: [] for q in QUANTITIES}
    records["error"] = records["traceback"] = records["refused"] = None
    records["differing_tensors"] = []
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms("nondeterminism" in fixes or before)
    dtype = torch.get_default_dtype()
    ours = False  # the dropout switch is the check's, not the script's own
    try:
        with _KeepFloat64() if exact else nullcontext():
            seed_everything(seed)
            if exact:  # the script builds its models (a teacher in a closure too) in float64
                torch.set_default_dtype(torch.float64)
            w = load_workload(script, max(get_runtime().world_size, 1), args)
            given = w.trainer.given["config"] if w.trainer is not None else None
            ours = "dropout" in fixes and not (given is not None and given.global_batch_dropout)
            _train(w, fixes, steps, per_rank_batch or w.batch_size, seed, records, exact, nudged)
    except DropoutRefused as err:
        if not ours:
            _record_error(records, err)
        records["refused"] = (str(err).splitlines() or [""])[0]
    except ConfigError:
        raise
    except Exception as err:
        _record_error(records, err)
    finally:
        torch.use_deterministic_algorithms(before)
        torch.set_default_dtype(dtype)
    return records


def _train(
    w: Workload,
    fixes: frozenset[str],
    steps: int,
    batch: int,
    seed: int,
    records: dict[str, Any],
    exact: bool,
    nudged: bool,
) -> None:
    """:func:`train_steps`' training, of the loaded workload ``w``."""
    if exact:  # a model kept from an earlier run of the script's module too
        w.model.double()
    if nudged:
        _nudge(w.model)
    if w.trainer is not None:
        _run_trainer(w, fixes, steps, batch, records, exact)
        return
    model, optimizer, batches = _prepared(w, fixes, batch, seed, records)
    model.train()
    for step in range(steps):
        taken = _in_float64(next(batches)) if exact else next(batches)
        _step(w, model, optimizer, taken, fixes, mix_seed(seed, step), records)


_LOWER = (torch.float32, torch.float16, torch.bfloat16)


class _KeepFloat64(TorchFunctionMode):
    """A float64 tensor cast to a narrower float (a loss's ``logits.float()``, ``.to(torch.half)``)
    stays float64: the script's float64 runs keep float64's rounding throughout."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        source = args[0] if args else None
        if isinstance(source, torch.Tensor) and source.dtype == torch.float64:
            if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
                return source
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = tuple(torch.float64 if a in _LOWER else a for a in args)
                if kwargs.get("dtype") in _LOWER:
                    kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@torch.no_grad()
def _nudge(model: nn.Module) -> None:
    """Move every floating-point parameter's elements by a unit in their last place, up or down
    (seeded): the same model to rounding, from which the same sums land elsewhere."""
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.is_floating_point():
            up = torch.randint(0, 2, p.shape, generator=g).bool().to(p.device)
            p.copy_(torch.where(up, p.nextafter(p + 1), p.nextafter(p - 1)))


def _record_error(records: dict[str, Any], err: BaseException) -> None:
    records["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
    records["traceback"] = traceback.format_exc()


def _in_float64(batch: Any) -> Any:
    """``batch`` with its floating-point tensors in float64."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _in_float64(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_in_float64(v) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def _prepared(
    w: Workload, fixes: frozenset[str], batch: int, seed: int, records: dict[str, Any]
) -> tuple[nn.Module, torch.optim.Optimizer, Iterator[Any]]:
    """The model inside DDP, its optimizer and the batches, with the switches in ``fixes``; notes
    the tensors that differ between ranks once the model is built."""
    rt = get_runtime()
    model = w.model
    if "dropout" in fixes:
        convert_dropout(model)
    _same_start(model, fixes, records)
    model = prepare_model(
        model,
        sync_batchnorm="batchnorm" in fixes or w.sync_batchnorm,
        find_unused_parameters="unused_parameters" in fixes,
    )
    optimizer = w.optimizer(model.parameters())
    data = SampleSeeded(w.dataset, seed) if "augmentation" in fixes else w.dataset
    if w.loader is None or "data_order" in fixes:
        sampler = ShardedBatchSampler(cast(Sized, data), batch, seed=seed, drop_last=w.drop_last)
        loader: Any = DataLoader(
            data, batch_sampler=sampler, num_workers=0, collate_fn=w.collate_fn
        )
    else:
        loader = w.loader(data, batch, rt.rank, rt.world_size)
    return model, optimizer, _batches(loader, data)


def _same_start(model: nn.Module, fixes: frozenset[str], records: dict[str, Any]) -> None:
    """With ``initial_state`` in ``fixes``, rank 0's plain tensors broadcast; notes the tensors that
    differ between ranks once the model is built."""
    plain = {  # tensors kept as plain attributes: DDP does not broadcast them
        f"{prefix}.{name}" if prefix else name: value
        for prefix, module in model.named_modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    }
    if "initial_state" in fixes:
        for t in plain.values():
            t.copy_(broadcast_object(t))
    digests = {name: float(t.double().sum()) for name, t in plain.items()}
    every = all_gather_object(digests)
    records["differing_tensors"] = sorted(
        n for n in digests if any(d.get(n) != digests[n] for d in every)
    )


def _run_trainer(
    w: Workload,
    fixes: frozenset[str],
    steps: int,
    batch: int,
    records: dict[str, Any],
    exact: bool,
) -> None:
    """Train the script's Trainer (``w.trainer``) ``steps`` optimizer steps as the script built it
    (its config, scheduler, loss, callbacks), with ``batch`` samples a rank per micro-batch, the
    switches in ``fixes`` in its config, in a run directory of its own that is removed after;
    records each step's global loss, every model's weights and (one model) its gradients."""
    from ddpkit.training._trainer import Trainer  # its compiler stack, only where it runs

    assert w.trainer is not None
    rt = get_runtime()
    kwargs = w.trainer.given
    config = kwargs["config"]
    _same_start(w.model, fixes, records)
    strategy = strategy_config(config.strategy)
    if "unused_parameters" in fixes and isinstance(strategy, DDPConfig):
        strategy = replace(strategy, find_unused_parameters=True)
    collate = config.collate_fn
    where = broadcast_object(tempfile.mkdtemp(prefix="ddpkit-check-") if rt.is_main else "")
    kwargs["config"] = replace(
        config, run_dir=where, resume=False, max_steps=steps, epochs=max(config.epochs, steps),
        batch_size=batch, global_batch_size=None, num_workers=0, weights_format=None,
        strategy=strategy, sync_batchnorm=config.sync_batchnorm or "batchnorm" in fixes,
        global_batch_dropout=config.global_batch_dropout or "dropout" in fixes,
        seed_samples=config.seed_samples or "augmentation" in fixes,
        precision="fp32" if exact else config.precision,
        collate_fn=_collate_in_float64(collate) if exact else collate,
        logging=replace(config.logging, progress=False, tensorboard=False, trackers=()),
        snapshot=replace(config.snapshot, every_steps=None, every_epochs=0, memory=False),
    )  # fmt: skip
    if "dropout" in fixes and not config.global_batch_dropout:
        convert_dropout(w.model)  # a refusal before the Trainer's own, which says the same
    several = kwargs.get("step_fn") is not None
    kwargs["callbacks"] = [*kwargs.get("callbacks", ()), _Recorder(records, grads=not several)]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress and summary
            Trainer(**kwargs).fit()
        all_gather_object(None)  # every rank is done with the folder
    finally:
        if rt.is_main:
            with contextlib.suppress(OSError, ConfigError):
                fs.remove_tree(Path(where))


def _collate_in_float64(collate: Any) -> Any:
    def in_float64(samples: list[Any]) -> Any:
        return _in_float64((collate or default_collate)(samples))

    return in_float64


class _Recorder:
    """A Trainer's callback: after each step, the global loss (every micro-batch's loss, by
    samples), every model's weights, and with ``grads`` (one model: its step keeps them until the
    next) its gradients; a step_fn's models' weights by name too."""

    def __init__(self, records: dict[str, Any], grads: bool) -> None:
        self.records, self.grads = records, grads
        records["models"] = []

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        own = sum(float(loss) * float(n) for loss, n in zip(output.losses, output.sizes))
        every = all_gather_object((own, float(output.samples)))
        self.records["loss"].append(sum(s for s, _ in every) / max(sum(n for _, n in every), 1))
        models = getattr(trainer.strategy, "models", None) or {"": trainer.strategy.model}
        params = {n: list(unwrap(m).parameters()) for n, m in models.items()}
        weights = {n: _flat(ps) for n, ps in params.items()}
        self.records["weights"].append(torch.cat(list(weights.values())))
        if not self.grads:
            self.records["models"].append(weights)
            return
        ps = [p for group in params.values() for p in group]
        self.records["no_grad"] = sum(p.grad is None for p in ps)
        self.records["sizes"] = [p.numel() for p in ps]
        self.records["grad"].append(
            _flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in ps)
        )


def _step(
    w: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    fixes: frozenset[str],
    key: int,
    records: dict[str, Any],
) -> None:
    rt = get_runtime()
    batch = to_device(batch, rt.device)
    counts = all_gather_object(batch_len(batch))  # each rank's place in the global batch
    items = all_gather_object(w.count(batch))  # what each rank's mean loss is over
    n, n_global = items[rt.rank], sum(items)
    layout = BatchLayout(global_size=sum(counts), offset=sum(counts[: rt.rank]), key=key)
    with batch_layout(layout) if "dropout" in fixes else nullcontext():
        loss = w.loss(model, batch)
    # each rank's mean weighted by its share: DDP's average is the global mean (count_fn: always)
    weigh = "uneven_mean" in fixes or w.count_fn is not None
    scaled = loss * (n * rt.world_size / n_global) if weigh else loss
    optimizer.zero_grad(set_to_none=True)
    scaled.backward()
    params = list(unwrap(model).parameters())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    records["no_grad"] = sum(p.grad is None for p in params)
    records["sizes"] = [p.numel() for p in params]
    records["grad"].append(_flat(grads))
    records["loss"].append(sum(all_gather_object(loss.item() * n)) / n_global)
    optimizer.step()
    records["weights"].append(_flat(params))


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened into one, in float64 on the CPU (compared across runs); a sharded
    tensor (fsdp's) whole, gathered from every rank."""
    whole = [getattr(t, "full_tensor", lambda t=t: t)() for t in tensors]
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in whole])


Setup = tuple[frozenset[str], bool]
"""A run's switches, and whether it is in float64."""


def _ranks_run(
    script: str | None, setups: list[Setup], steps: int, seed: int, args: Sequence[str]
) -> list[dict[str, Any]]:
    init(device="cpu")  # gloo on the CPU: any number of ranks fits on one machine
    return [train_steps(script, fixes, steps, None, seed, args, exact) for fixes, exact in setups]


def _failed(cfg: CheckConfig, where: str, trace: str) -> tuple[int, list[str]]:
    """The script raised: its traceback, and no verdict on the ranks."""
    return SCRIPT_FAILED, [
        f"ddpkit check: FAILED: {cfg.script or 'the workload'} raised {where}; nothing was "
        "compared:",
        trace.rstrip(),
    ]


def _setups(keys: Sequence[str] = _KEYS) -> list[frozenset[str]]:
    everything = frozenset(keys)
    return [frozenset(), everything, *(everything - {k} for k in keys)]


def run_check(cfg: CheckConfig) -> tuple[int, list[str]]:
    """Run the check; (exit code, report lines). 0: the runs agree; 1: they differ."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels, summing in the same order
    try:
        return _check(cfg)
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Judged:
    """Where the runs are judged: in float64 (``exact``), or in the script's own arithmetic."""

    exact: bool
    tol: Tolerance
    notes: list[str]


def _check(cfg: CheckConfig) -> tuple[int, list[str]]:
    import_dynamo()  # DDP's constructor imports it (seconds): once, before the forks
    try:  # bad input fails here, not inside every rank
        w = load_workload(cfg.script, cfg.nproc, cfg.script_args)
    except (ConfigError, KeyboardInterrupt):
        raise
    except BaseException:  # SystemExit too: a script's argparse error
        return _failed(cfg, "while its workload was built", traceback.format_exc())
    global_batch = w.batch_size * cfg.nproc
    one_process = functools.partial(
        train_steps, cfg.script, steps=cfg.steps, per_rank_batch=global_batch, seed=cfg.seed,
        args=cfg.script_args,
    )  # fmt: skip
    reference = one_process(frozenset())
    if reference["traceback"] is not None:
        return _failed(cfg, "in the 1-process run", reference["traceback"])
    judged, one, again = _judged(cfg, reference, one_process)
    w.check_sizes(cfg.nproc)
    # The base set-up in the script's own arithmetic (the table) and, to judge it, in float64;
    # each switch only where they differ.
    runs: list[Setup] = [(frozenset(), False), *([(frozenset(), True)] if judged.exact else [])]
    on_ranks = _on_ranks(cfg, runs)
    shown_ranks, base_ranks = on_ranks[0], on_ranks[-1]
    base = Verdict(compare(base_ranks, one), compare(again, one))
    shown = Verdict(compare(shown_ranks, reference), compare(reference, reference))
    lines = [
        f"ddpkit check: {cfg.script or w.name}: 1 process (batch {global_batch}) vs {cfg.nproc} "
        f"ranks (batch {w.batch_size} each, gloo){_micro(w)}, {cfg.steps} steps, tolerance "
        f"{cfg.rtol:g} relative"
        + (
            f" (in float64: {judged.tol.floor:.1e} or {REACH} x rounding's reach, the larger)"
            if judged.exact
            else ""
        ),
        *([f"  workload: {w.extra['workload']}"] if "workload" in w.extra else []),
        *([f"  {NOT_SWITCHED}"] if w.trainer is not None else []),
        *judged.notes,
        _table(reference, shown_ranks, shown, base if judged.exact else None, cfg),
    ]
    if base.ranks.silent:
        lines.append(
            f"({base.ranks.silent} parameter(s) with gradients at rounding level, e.g. a bias "
            "that a BatchNorm or a softmax cancels, are left out of the weights' comparison: an "
            "adaptive optimizer such as Adam turns their rounding noise into full-size steps)"
        )
    if not base.differs(judged.tol):
        return 0, [*lines, _agreement(cfg, base, shown, judged)]
    # find_unused_parameters only where a parameter went without a gradient: DDP cannot honour it
    # for an output it cannot search for tensors; a step_fn's models' options are the script's
    keys = [k for k in _KEYS if k != "unused_parameters" or reference.get("no_grad")]
    if w.trainer is not None:
        several = w.trainer.given.get("step_fn") is not None
        keys = [k for k in keys if k in TRAINER_KEYS or (k == "unused_parameters" and not several)]
    keys, everything, refused = _switchable(keys, one_process, judged.exact)
    setups = _setups(keys)[1:]
    ranks = _on_ranks(cfg, [(fixes, judged.exact) for fixes in setups])
    if ranks[0]["traceback"] is not None:  # every known cause switched off: not DDP's finding
        return _failed(
            cfg,
            f"in the {cfg.nproc}-rank run, with every known cause switched off",
            ranks[0]["traceback"],
        )
    verdicts = [base]
    for fixes, dist_run in zip(setups, ranks):
        one = everything if fixes == frozenset(keys) else one_process(fixes, exact=judged.exact)
        # with deterministic algorithms on the repeat can only agree, unless they do not cure it,
        # which the all-on set-up shows
        repeat = "nondeterminism" not in fixes or fixes == frozenset(keys)
        again = one_process(fixes, exact=judged.exact) if repeat else one
        verdicts.append(Verdict(compare(dist_run, one), compare(again, one)))
    return _verdict(cfg, keys, verdicts, base_ranks, [*lines, *refused], judged, bool(refused))


def _micro(w: Workload) -> str:
    """A Trainer's micro-batches a step, where there are several."""
    accum = w.trainer.given["config"].grad_accum_steps if w.trainer is not None else 1
    return f", {accum} micro-batches a step" if accum > 1 else ""


def _on_ranks(cfg: CheckConfig, runs: list[Setup]) -> list[dict[str, Any]]:
    """Rank 0's records of ``runs`` on ``cfg.nproc`` ranks, new interpreters (the 1-process runs
    in this one may have started GPU threads)."""
    run = functools.partial(_ranks_run, cfg.script, runs, cfg.steps, cfg.seed, cfg.script_args)
    return spawn(run, cfg.nproc)[0]


def _judged(
    cfg: CheckConfig, reference: dict[str, Any], one_process: Callable[..., dict[str, Any]]
) -> tuple[_Judged, dict[str, Any], dict[str, Any]]:
    """Where the runs are judged, and the 1-process run there, twice. In float64 where the script
    runs there, within rounding's reach measured there where one process repeats itself bit for
    bit (a script that does not would show its own noise as rounding's reach); else in its own
    arithmetic (``reference``, in it) with ``cfg.rtol``, saying why."""
    in_float64 = one_process(frozenset(), exact=True)
    if in_float64["error"] is not None:
        note = (
            f"  judged in the script's own arithmetic: in float64 it raised {in_float64['error']} "
            "(rounding then passes for a difference where it exceeds the tolerance: a ReLU "
            "input within rounding of 0 falls on either side)"
        )
        return _Judged(False, Tolerance(cfg.rtol), [note]), reference, one_process(frozenset())
    again = one_process(frozenset(), exact=True)
    reach: tuple[dict[str, float], ...] = ()
    if not compare(again, in_float64).worst():
        reach = tuple(compare(one_process(frozenset(), exact=True, nudged=True), in_float64).diffs)
    return _Judged(True, Tolerance(cfg.rtol * EXACT, reach), []), in_float64, again


def _switchable(
    keys: list[str], one_process: Callable[..., dict[str, Any]], exact: bool
) -> tuple[list[str], dict[str, Any], list[str]]:
    """The switches that can be turned on this script, the 1-process run with all of them on, and
    a report line for each refused one (left out)."""
    refused: list[str] = []
    while True:
        everything = one_process(frozenset(keys), exact=exact)
        if everything["refused"] is None or "dropout" not in keys:
            return keys, everything, refused
        keys = [k for k in keys if k != "dropout"]
        refused.append(
            "  not switched: dropout (global-batch dropout refused this model: "
            f"{everything['refused']})"
        )


def _agreement(cfg: CheckConfig, base: Verdict, shown: Verdict, judged: _Judged) -> str:
    where = "in float64" if judged.exact else "in the script's arithmetic"
    d, bound = base.closest(judged.tol)
    rounding = f"; in the script's arithmetic {shown.size():.1e}, rounding" if judged.exact else ""
    return (
        f"OK: {cfg.nproc} ranks train the same model as one process (the relative difference "
        f"nearest its tolerance {where}: {d:.1e}, tolerance {bound:.1e}{rounding})"
    )


def _verdict(
    cfg: CheckConfig,
    keys: list[str],
    verdicts: list[Verdict],
    base_ranks: dict[str, Any],
    lines: list[str],
    judged: _Judged,
    refused: bool = False,
) -> tuple[int, list[str]]:
    """Exit code 1 and the report's last lines: the mismatch and its causes (``verdicts``: the base
    set-up's, every switch on, every switch but each in turn; ``refused``: the dropout switch could
    not be turned)."""
    base, fixed, tol = verdicts[0], verdicts[1], judged.tol
    lines.append(_describe_mismatch(base, cfg, judged))
    if base_ranks["differing_tensors"]:
        lines.append(
            f"  tensors that differ between ranks after the model is built: "
            f"{', '.join(base_ranks['differing_tensors'])}"
        )
    if fixed.differs(tol):
        unexplained = "none of ddpkit's known causes accounts for it"
        if refused:
            unexplained = "dropout drawing per rank may, which could not be switched off here"
        lines.append(
            f"UNEXPLAINED: with every known cause switched off the runs still differ "
            f"({_what(fixed, cfg, tol)}); {unexplained}"
        )
        return 1, lines
    causes = [c for c in CAUSES if c.key in keys]
    found = [(c, v) for c, v in zip(causes, verdicts[2:]) if v.differs(tol)]
    if not found:
        lines.append(
            "cause: the runs agree with every switch on, but no single switch brings the mismatch "
            "back (causes that each suffice alone); switches: " + ", ".join(keys)
        )
    for cause, v in found:
        lines += [
            f"cause: {cause.what}",
            f"  fix: {cause.fix}",
            "  evidence: every switch on, the runs agree (largest difference "
            f"{fixed.size():.1e}); all but '{cause.key}', they differ ({_what(v, cfg, tol)})",
        ]
    return 1, lines


def _what(v: Verdict, cfg: CheckConfig, tol: Tolerance) -> str:
    if v.ranks.error:
        return f"the {cfg.nproc}-rank run raised {v.ranks.error}"
    if v.repeat.error:
        return f"the single process raised {v.repeat.error}"
    repeat = v.repeat.first(tol)
    if repeat is not None:
        step, q, d = repeat
        return f"one process run twice: {q} {d:.1e} at step {step}"
    ranks = v.ranks.first(tol)
    assert ranks is not None  # asked only about a verdict that differs
    step, q, d = ranks
    return f"{q} {d:.1e} at step {step}"


def _describe_mismatch(v: Verdict, cfg: CheckConfig, judged: _Judged) -> str:
    parts = []
    where = "in float64: " if judged.exact else ""
    for label, c in (
        (f"{cfg.nproc} ranks vs 1 process", v.ranks),
        ("1 process vs itself", v.repeat),
    ):
        first = c.first(judged.tol)
        if first is not None:
            step, q, d = first
            sizes = ", ".join(
                f"{k} {c.diffs[step][k]:.1e}" for k in QUANTITIES if k in c.diffs[step]
            )
            if c.model:  # models by name: the one whose weights differ most
                sizes += f" (most in model {c.model[step]!r})"
            parts.append(
                f"{label}: first differ at step {step} ({where}{q} by {d:.1e} relative; {sizes}; "
                f"largest {c.worst():.1e})"
            )
        if c.error:
            parts.append(f"{label}: a run raised {c.error}")
    return "MISMATCH: " + "; ".join(dict.fromkeys(parts))


def _table(
    one: dict[str, Any],
    ranks: dict[str, Any],
    v: Verdict,
    exact: Verdict | None,
    cfg: CheckConfig,
) -> str:
    """Step by step, in the script's own arithmetic, and (``exact``) the largest difference in
    float64."""
    rows = [
        f"{'step':>4}  {'loss, 1 process':>15}  {f'loss, {cfg.nproc} ranks':>15}  "
        f"{'rel. diff: loss':>15}  {'gradients':>9}  {'weights':>9}"
        + (f"  {'float64':>9}" if exact is not None else "")
    ]
    for i, d in enumerate(v.ranks.diffs):
        grad = f"{d['grad']:.1e}" if "grad" in d else "-"  # a step_fn Trainer's: not kept
        row = (
            f"{i:>4}  {one['loss'][i]:>15.6f}  {ranks['loss'][i]:>15.6f}  {d['loss']:>15.1e}  "
            f"{grad:>9}  {d['weights']:>9.1e}"
        )
        if exact is not None and i < len(exact.ranks.diffs):
            row += f"  {max(exact.ranks.diffs[i].values()):>9.1e}"
        rows.append(row)
    return "\n".join(rows)


OPTIONS = [
    argument("--nproc", type=int, default=2, help="ranks of the distributed run (default 2)"),
    argument("--steps", type=int, default=4, help="optimizer steps compared (default 4)"),
    argument("--rtol", type=float, default=1e-4, help="relative tolerance in float32's terms "
             "(default 1e-4; the runs are judged in float64, with it times 2**-29)"),
    argument("--seed", type=int, default=0),
    argument("script", nargs="?", help=f"a training script that defines {HOOK}() or builds a "
             "ddpkit.Trainer, or a built-in workload: " + ", ".join(BUILTINS)),
]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = options.command_parser(
        "ddpkit check",
        "ddpkit check [options] [SCRIPT [ARGS...]]",
        "Train a few steps as one process and as N ranks on the same global batch, compare\n"
        "losses, gradients and weights step by step, and name the cause of a difference. Exit\n"
        "code 0: they agree; 1: they differ beyond the tolerance (causes named when found);\n"
        f"{SCRIPT_FAILED}: the script raised (its traceback is shown).",
        f"The script defines {HOOK}() returning (model, dataset, loss_fn, optimizer_factory)\n"
        "or a ddpkit.tools.Workload, or builds a ddpkit.Trainer (run with its default arguments\n"
        "until then); without a script, the DDP tutorials' CNN on sklearn digits.",
        OPTIONS,
    )
    # the script's own arguments follow it, as under `ddpkit run`
    ns, script_args = options.parse_command(parser, OPTIONS, sys.argv[1:] if argv is None else argv)
    code, lines = run_check(options.config_from(CheckConfig, ns, script_args))
    print("\n".join(lines), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
