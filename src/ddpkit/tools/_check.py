"""``ddpkit check``: do N ranks train the same model as one process on the same global batch? If
not, why? Each known cause has a switch that removes it; a cause is named when the mismatch comes
back without its switch (docs/bench-and-check.md).
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import math
import sys
import tempfile
import traceback
from collections.abc import Iterable, Iterator, Sequence, Sized
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

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
from ddpkit.nn._dropout import BatchLayout, batch_layout, convert_dropout
from ddpkit.strategies._prepare import prepare_model, unwrap
from ddpkit.tools._workload import BUILTINS, HOOK, MAX_STEPS, Workload, load_workload

SCRIPT_FAILED = 3
"""The exit code when the script raised (0: the runs agree; 1: they differ; 2: bad options)."""
QUANTITIES = ("loss", "grad", "weights")
# A parameter whose gradient is this small next to the whole gradient gets only rounding noise (a
# bias BatchNorm cancels), which Adam turns into full-size steps: left out of the weights.
SILENT_GRADIENT = 1e-6


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
    """Relative difference (``|a - b| / |b|`` over a whole tensor) beyond which two runs differ."""
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
STEP_FN_KEYS = ("batchnorm", "dropout", "augmentation", "initial_state", "nondeterminism")
"""The switches a step_fn Trainer's check turns: its config's ``sync_batchnorm``,
``global_batch_dropout`` and ``seed_samples``, a broadcast, deterministic algorithms."""
NOT_SWITCHED = (
    "not switched for a step_fn Trainer: data order (its sampler already slices the global batch), "
    "uneven means (step.backward already weighs each micro-batch by its share), unused parameters "
    "(its models' DDP options are the script's)"
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


def _rel(a: Any, b: Any) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return math.inf
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0 if torch.equal(a.nan_to_num(), b.nan_to_num()) else math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@dataclass
class Comparison:
    """How two runs of the same steps differ."""

    diffs: list[dict[str, float]]
    """Per step, the relative difference of each quantity."""
    error: str | None = None
    """What a run that raised raised."""
    silent: int = 0
    """Parameters left out of the weights' comparison (``SILENT_GRADIENT``)."""
    model: list[str] = field(default_factory=list)
    """Per step, the model whose weights differ most (a step_fn Trainer's, by name)."""

    def first(self, rtol: float) -> tuple[int, str, float] | None:
        """(step, quantity, relative difference) of the first difference beyond ``rtol``."""
        for step, d in enumerate(self.diffs):
            for q in ("grad", "loss", "weights"):
                if d.get(q, 0.0) > rtol:
                    return step, q, d[q]
        return None

    def worst(self) -> float:
        return max((max(d.values()) for d in self.diffs), default=0.0)

    def differs(self, rtol: float) -> bool:
        return self.error is not None or self.first(rtol) is not None


def _silent_mask(reference: dict[str, Any], steps: int) -> tuple[torch.Tensor | None, int]:
    """The weights' elements to compare: those of parameters whose gradient was above rounding
    noise at every step so far in the reference; and how many parameters are left out."""
    sizes = reference.get("sizes")
    if not sizes or not steps:
        return None, 0
    grads = reference["grad"][:steps]
    keep = [
        all(float(g[end - n : end].norm()) > SILENT_GRADIENT * float(g.norm()) for g in grads)
        for n, end in zip(sizes, itertools.accumulate(sizes))
    ]
    mask = torch.cat([torch.full((n,), k) for n, k in zip(sizes, keep)])
    return mask, keep.count(False)


def compare(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    """``a`` against ``b`` (the reference), step by step, over the steps both completed; the
    weights of models by name (a step_fn Trainer's) model by model, the largest counted."""
    n = min(len(a["loss"]), len(b["loss"]))
    diffs = []
    silent = 0
    worst_model = []
    for i in range(n):
        mask, silent = _silent_mask(b, i + 1)
        wa, wb = a["weights"][i], b["weights"][i]
        if mask is not None:
            wa, wb = wa[mask], wb[mask]
        d = {"loss": _rel(a["loss"][i], b["loss"][i]), "weights": _rel(wa, wb)}
        if i < min(len(a["grad"]), len(b["grad"])):  # a step_fn Trainer's are not kept
            d["grad"] = _rel(a["grad"][i], b["grad"][i])
        if a.get("models") and b.get("models"):
            by_model = {
                name: _rel(w, b["models"][i].get(name, torch.zeros(0)))
                for name, w in a["models"][i].items()
            }
            worst_model.append(max(by_model, key=lambda name: by_model[name]))
            d["weights"] = max(by_model.values())
        diffs.append(d)
    return Comparison(diffs, a["error"] or b["error"], silent, worst_model)


@dataclass
class Verdict:
    """A set-up's outcome: the N-rank run against one process, and one process against itself."""

    ranks: Comparison
    repeat: Comparison

    def differs(self, rtol: float) -> bool:
        return self.ranks.differs(rtol) or self.repeat.differs(rtol)

    def size(self) -> float:
        if self.ranks.error or self.repeat.error:
            return math.inf
        return max(self.ranks.worst(), self.repeat.worst())


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
) -> dict[str, Any]:
    """Train ``steps`` steps with the switches in ``fixes`` on; this process's records. Collective
    where there is a process group. A script's error is recorded (a DDP error is a finding)."""
    records: dict[str, Any] = {q: [] for q in QUANTITIES}
    records["error"] = records["traceback"] = None
    records["differing_tensors"] = []
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms("nondeterminism" in fixes or before)
    try:
        seed_everything(seed)
        w = load_workload(script, max(get_runtime().world_size, 1), args)
        batch = per_rank_batch or w.batch_size
        if w.trainer is not None:
            _run_trainer(w, fixes, steps, batch, records)
            return records
        model, optimizer, batches = _prepared(w, fixes, batch, seed, records)
        model.train()
        for step in range(steps):
            _step(w, model, optimizer, next(batches), fixes, mix_seed(seed, step), records)
    except ConfigError:
        raise
    except Exception as err:
        records["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
        records["traceback"] = traceback.format_exc()
    finally:
        torch.use_deterministic_algorithms(before)
    return records


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
    w: Workload, fixes: frozenset[str], steps: int, batch: int, records: dict[str, Any]
) -> None:
    """Train the script's step_fn Trainer (``w.trainer``) ``steps`` steps with ``batch`` samples a
    rank per micro-batch, the switches in ``fixes`` in its config, in a run directory of its own
    that is removed after; records each step's global loss and every model's weights, by name."""
    from ddpkit.training._trainer import Trainer  # its compiler stack, only where it runs

    assert w.trainer is not None
    rt = get_runtime()
    kwargs = w.trainer.given
    config = kwargs["config"]
    _same_start(w.model, fixes, records)
    where = broadcast_object(tempfile.mkdtemp(prefix="ddpkit-check-") if rt.is_main else "")
    kwargs["config"] = replace(
        config, run_dir=where, resume=False, max_steps=steps, epochs=max(config.epochs, steps),
        batch_size=batch, global_batch_size=None, num_workers=0, weights_format=None,
        sync_batchnorm=config.sync_batchnorm or "batchnorm" in fixes,
        global_batch_dropout=config.global_batch_dropout or "dropout" in fixes,
        seed_samples=config.seed_samples or "augmentation" in fixes,
        logging=replace(config.logging, progress=False, tensorboard=False, trackers=()),
        snapshot=replace(config.snapshot, every_steps=None, every_epochs=0),  # max_steps' only
    )  # fmt: skip
    kwargs["callbacks"] = [*kwargs.get("callbacks", ()), _Recorder(records)]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress and summary
            Trainer(**kwargs).fit()
        all_gather_object(None)  # every rank is done with the folder
    finally:
        if rt.is_main:
            with contextlib.suppress(OSError, ConfigError):
                fs.remove_tree(Path(where))


class _Recorder:
    """A Trainer's callback: after each step, the global loss (every ``step.backward`` loss, by
    samples) and every model's weights."""

    def __init__(self, records: dict[str, Any]) -> None:
        self.records = records
        records["models"] = []

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        own = sum(float(loss) * float(n) for loss, n in zip(output.losses, output.sizes))
        every = all_gather_object((own, float(output.samples)))
        self.records["loss"].append(sum(s for s, _ in every) / max(sum(n for _, n in every), 1))
        models = {n: _flat(unwrap(m).parameters()) for n, m in trainer.strategy.models.items()}
        self.records["models"].append(models)
        self.records["weights"].append(torch.cat(list(models.values())))


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
    """The tensors flattened into one, in float64 on the CPU (compared across runs)."""
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def _ranks_run(
    script: str | None, setups: list[frozenset[str]], steps: int, seed: int, args: Sequence[str]
) -> list[dict[str, Any]]:
    init(device="cpu")  # gloo on the CPU: any number of ranks fits on one machine
    return [train_steps(script, fixes, steps, None, seed, args) for fixes in setups]


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
    # find_unused_parameters only where a parameter went without a gradient: DDP cannot honour it
    # for an output it cannot search for tensors
    keys = [k for k in _KEYS if k != "unused_parameters" or reference.get("no_grad")]
    if w.trainer is not None:
        keys = list(STEP_FN_KEYS)
    setups = _setups(keys)
    w.check_sizes(cfg.nproc)
    run = functools.partial(_ranks_run, cfg.script, setups, cfg.steps, cfg.seed, cfg.script_args)
    ranks = spawn(run, cfg.nproc)[0]  # new interpreters where the run above started GPU threads
    verdicts = []
    for fixes, dist_run in zip(setups, ranks):
        one = reference if not fixes else one_process(fixes)
        # with deterministic algorithms on the repeat can only agree, unless they do not cure it,
        # which the all-on set-up shows
        repeat = "nondeterminism" not in fixes or fixes == frozenset(keys)
        again = one_process(fixes) if repeat else one
        verdicts.append(Verdict(compare(dist_run, one), compare(again, one)))
    lines = [
        f"ddpkit check: {cfg.script or w.name}: 1 process (batch {global_batch}) vs {cfg.nproc} "
        f"ranks (batch {w.batch_size} each, gloo), {cfg.steps} steps, tolerance {cfg.rtol:g} "
        "relative",
        *([f"  workload: {w.extra['workload']}"] if "workload" in w.extra else []),
        *([f"  {NOT_SWITCHED}"] if w.trainer is not None else []),
        _table(reference, ranks[0], verdicts[0], cfg),
    ]
    if verdicts[0].ranks.silent:
        lines.append(
            f"({verdicts[0].ranks.silent} parameter(s) with gradients at rounding level, e.g. a "
            "bias that BatchNorm cancels, are left out of the weights' comparison: an adaptive "
            "optimizer such as Adam turns their rounding noise into full-size steps)"
        )
    if ranks[1]["traceback"] is not None:  # every known cause switched off: not DDP's finding
        return _failed(
            cfg,
            f"in the {cfg.nproc}-rank run, with every known cause switched off",
            ranks[1]["traceback"],
        )
    return _verdict(cfg, keys, verdicts, ranks[0], lines)


def _verdict(
    cfg: CheckConfig,
    keys: list[str],
    verdicts: list[Verdict],
    base_ranks: dict[str, Any],
    lines: list[str],
) -> tuple[int, list[str]]:
    """The exit code and the report's last lines: agreement, or the mismatch and its causes."""
    base, fixed = verdicts[0], verdicts[1]
    if not base.differs(cfg.rtol):
        lines.append(
            f"OK: {cfg.nproc} ranks train the same model as one process "
            f"(largest relative difference {base.size():.1e}, tolerance {cfg.rtol:g})"
        )
        return 0, lines
    lines.append(_describe_mismatch(base, cfg))
    if base_ranks["differing_tensors"]:
        lines.append(
            f"  tensors that differ between ranks after the model is built: "
            f"{', '.join(base_ranks['differing_tensors'])}"
        )
    if fixed.differs(cfg.rtol):
        lines.append(
            f"UNEXPLAINED: with every known cause switched off the runs still differ "
            f"({_what(fixed, cfg)}); none of ddpkit's known causes accounts for it"
        )
        return 1, lines
    causes = [c for c in CAUSES if c.key in keys]
    found = [(c, v) for c, v in zip(causes, verdicts[2:]) if v.differs(cfg.rtol)]
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
            f"{fixed.size():.1e}); all but '{cause.key}', they differ ({_what(v, cfg)})",
        ]
    return 1, lines


def _what(v: Verdict, cfg: CheckConfig) -> str:
    if v.ranks.error:
        return f"the {cfg.nproc}-rank run raised {v.ranks.error}"
    if v.repeat.error:
        return f"the single process raised {v.repeat.error}"
    repeat = v.repeat.first(cfg.rtol)
    if repeat is not None:
        step, q, d = repeat
        return f"one process run twice: {q} {d:.1e} at step {step}"
    ranks = v.ranks.first(cfg.rtol)
    assert ranks is not None  # asked only about a verdict that differs
    step, q, d = ranks
    return f"{q} {d:.1e} at step {step}"


def _describe_mismatch(v: Verdict, cfg: CheckConfig) -> str:
    parts = []
    for label, c in (
        (f"{cfg.nproc} ranks vs 1 process", v.ranks),
        ("1 process vs itself", v.repeat),
    ):
        first = c.first(cfg.rtol)
        if first is not None:
            step, q, d = first
            sizes = ", ".join(
                f"{k} {c.diffs[step][k]:.1e}" for k in QUANTITIES if k in c.diffs[step]
            )
            if c.model:  # models by name: the one whose weights differ most
                sizes += f" (most in model {c.model[step]!r})"
            parts.append(
                f"{label}: first differ at step {step} ({q} by {d:.1e} relative; {sizes}; largest "
                f"{c.worst():.1e})"
            )
        if c.error:
            parts.append(f"{label}: a run raised {c.error}")
    return "MISMATCH: " + "; ".join(dict.fromkeys(parts))


def _table(one: dict[str, Any], ranks: dict[str, Any], v: Verdict, cfg: CheckConfig) -> str:
    rows = [
        f"{'step':>4}  {'loss, 1 process':>15}  {f'loss, {cfg.nproc} ranks':>15}  "
        f"{'rel. diff: loss':>15}  {'gradients':>9}  {'weights':>9}"
    ]
    for i, d in enumerate(v.ranks.diffs):
        grad = f"{d['grad']:.1e}" if "grad" in d else "-"  # a step_fn Trainer's: not kept
        rows.append(
            f"{i:>4}  {one['loss'][i]:>15.6f}  {ranks['loss'][i]:>15.6f}  {d['loss']:>15.1e}  "
            f"{grad:>9}  {d['weights']:>9.1e}"
        )
    return "\n".join(rows)


OPTIONS = [
    argument("--nproc", type=int, default=2, help="ranks of the distributed run (default 2)"),
    argument("--steps", type=int, default=4, help="optimizer steps compared (default 4)"),
    argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)"),
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
