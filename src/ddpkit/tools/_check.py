"""``ddpkit check``: do N ranks train the same model as one process on the same global batch? If
not, why?

The script's training (see :mod:`ddpkit.tools._workload`) runs for a few steps as one process with
the global batch, and as N ranks (ddpkit.spawn, gloo on the CPU) with ``1/N`` of it each, DDP
averaging the gradients. Step by step, the global loss, rank 0's all-reduced gradients and its
weights after the step are compared.

On a mismatch, each known cause has a switch that removes it (sync BatchNorm, global-batch dropout,
...). The runs are repeated with every switch on; if they then agree, each switch is turned off in
turn, and a cause is named when the mismatch comes back without its switch. The single process is
run twice in every set-up, so non-determinism shows as the process disagreeing with itself.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import traceback
from collections.abc import Iterator, Sequence, Sized
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

try:  # numpy is optional, as in ddpkit.distributed._seeding
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

from ddpkit._errors import ConfigError, check_types
from ddpkit._internals.compiler import import_dynamo
from ddpkit._launch.options import MAX_NPROC, split_argv
from ddpkit._launch.spawn import spawn
from ddpkit.data import ShardedBatchSampler, to_device
from ddpkit.data._loader import batch_len
from ddpkit.distributed._collectives import all_gather_object, broadcast_object
from ddpkit.distributed._runtime import get_runtime, init
from ddpkit.distributed._seeding import mix_seed, seed_everything
from ddpkit.nn._dropout import BatchLayout, batch_layout, convert_dropout
from ddpkit.strategies._prepare import prepare_model, unwrap
from ddpkit.tools._check_causes import CAUSES, SampleSeeded, deterministic, plain_tensors
from ddpkit.tools._compare import QUANTITIES, Verdict, compare
from ddpkit.tools._workload import BUILTINS, HOOK, load_workload

_KEYS = tuple(c.key for c in CAUSES)


@dataclass(kw_only=True)
class CheckConfig:
    """What ``ddpkit check`` runs."""

    script: str | None = None
    """The training script defining ``ddpkit_workload()``; None for the built-in digits CNN."""
    script_args: tuple[str, ...] = ()
    """The script's own arguments (its ``sys.argv[1:]``), as ``ddpkit run`` passes them."""
    nproc: int = 2
    """Ranks of the distributed run (gloo on the CPU)."""
    steps: int = 4
    """Optimizer steps compared."""
    rtol: float = 1e-4
    """Relative difference (``|a - b| / |b|`` over a whole tensor) beyond which two runs differ.
    float32 sums in another order differ by ~1e-7 per step; this leaves room for a few steps of
    Adam."""
    seed: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        if self.nproc < 2:
            raise ConfigError(f"--nproc {self.nproc}: compare with at least 2 ranks")
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: run at least one step")
        if not 0 < self.rtol < 1:
            raise ConfigError(f"--rtol {self.rtol}: give a relative tolerance between 0 and 1")
        if self.nproc > MAX_NPROC:
            raise ConfigError(f"--nproc {self.nproc}: at most {MAX_NPROC} ranks")
        if self.steps > MAX_STEPS:
            raise ConfigError(
                f"--steps {self.steps}: at most {MAX_STEPS}; a difference shows in the first few"
            )
        if not 0 <= self.seed < 2**63:  # torch.manual_seed takes 64 bits
            raise ConfigError(f"--seed {self.seed}: use a whole number from 0 to 2**63 - 1")


MAX_STEPS = 100_000
SCRIPT_FAILED = 3
"""``ddpkit check``'s exit code when the script itself raised: no comparison was made (0: the runs
agree; 1: they differ; 2: bad options)."""


# -- one training run ------------------------------------------------------------------------------


def _batches(loader: Any, data: Dataset) -> Iterator[Any]:
    # epoch after epoch (the loader runs in this process: no prefetching)
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
    """Train ``steps`` steps with the switches in ``fixes`` on; this process's records (rank 0's are
    compared).

    Collective when there is a process group: every rank calls it with the same arguments.
    """
    rt = get_runtime()
    records: dict[str, Any] = {q: [] for q in QUANTITIES}
    records["error"] = records["traceback"] = None
    records["differing_tensors"] = []
    with deterministic("nondeterminism" in fixes):
        try:
            seed_everything(seed)
            w = load_workload(script, max(rt.world_size, 1), args)
            batch = per_rank_batch or w.batch_size
            model = w.model
            if "dropout" in fixes:
                convert_dropout(model)
            plain = plain_tensors(model)
            if "initial_state" in fixes:
                for t in plain.values():
                    t.copy_(broadcast_object(t))
            digests = {name: float(t.double().sum()) for name, t in plain.items()}
            every = all_gather_object(digests)
            records["differing_tensors"] = sorted(
                n for n in digests if any(d.get(n) != digests[n] for d in every)
            )
            ddp_kwargs: dict[str, Any] = (
                {"find_unused_parameters": True} if "unused_parameters" in fixes else {}
            )
            model = prepare_model(
                model, sync_batchnorm="batchnorm" in fixes or w.sync_batchnorm, **ddp_kwargs
            )
            optimizer = w.optimizer(model.parameters())
            data = SampleSeeded(w.dataset, seed) if "augmentation" in fixes else w.dataset
            if w.loader is None or "data_order" in fixes:
                sampler = ShardedBatchSampler(
                    cast(Sized, data), batch, seed=seed, drop_last=w.drop_last
                )
                loader: Any = DataLoader(data, batch_sampler=sampler, num_workers=0)
            else:
                loader = w.loader(data, batch, rt.rank, rt.world_size)
            batches = _batches(loader, data)
            model.train()
            for step in range(steps):
                batch = to_device(next(batches), rt.device)
                # samples: each rank's place in the global batch
                counts = all_gather_object(batch_len(batch))
                # what each rank's mean loss is over: samples or tokens
                items = all_gather_object(w.count(batch))
                n, n_global = items[rt.rank], sum(items)
                layout = BatchLayout(
                    global_size=sum(counts), offset=sum(counts[: rt.rank]), key=mix_seed(seed, step)
                )
                with batch_layout(layout) if "dropout" in fixes else nullcontext():
                    loss = w.loss(model, batch)
                # Each rank's mean, weighted by its share: DDP's average over ranks is then the
                # global mean. A workload that counts items (tokens) is weighted so always, as the
                # Trainer's count_fn does.
                weigh = "uneven_mean" in fixes or w.count_fn is not None
                scaled = loss * (n * rt.world_size / n_global) if weigh else loss
                optimizer.zero_grad(set_to_none=True)
                scaled.backward()
                params = list(unwrap(model).parameters())
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                records["no_grad"] = sum(p.grad is None for p in params)
                records["sizes"] = [p.numel() for p in params]
                records["grad"].append(
                    torch.cat([g.detach().reshape(-1).double().cpu() for g in grads])
                )
                # The global loss: each rank's mean times its samples, summed, over all samples.
                records["loss"].append(sum(all_gather_object(loss.item() * n)) / n_global)
                optimizer.step()
                records["weights"].append(
                    torch.cat([p.detach().reshape(-1).double().cpu() for p in params])
                )
        except ConfigError:
            raise
        # a DDP error is a finding (e.g. unused parameters), not a crash of the check
        except Exception as err:
            records["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
            records["traceback"] = traceback.format_exc()
    return records


def _ranks_run(
    script: str | None, setups: list[frozenset[str]], steps: int, seed: int, args: Sequence[str]
) -> list[dict[str, Any]]:
    init(device="cpu")  # gloo on the CPU: any number of ranks fits on one machine
    return [train_steps(script, fixes, steps, None, seed, args) for fixes in setups]


def _failed(cfg: CheckConfig, where: str, trace: str) -> tuple[int, list[str]]:
    """The script raised: its traceback, and no verdict on the ranks (a numerical comparison of a
    run that did not happen would blame DDP for the script's own error)."""
    return SCRIPT_FAILED, [
        f"ddpkit check: FAILED: {cfg.script or 'the workload'} raised {where}; nothing was "
        "compared:",
        trace.rstrip(),
    ]


# -- comparing -------------------------------------------------------------------------------------


# -- the check -------------------------------------------------------------------------------------


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
    # DDP's constructor imports torch._dynamo, which takes seconds; imported once here, before
    # ddpkit.spawn forks, every rank of every job inherits it.
    import_dynamo()

    # Bad input fails here, with its message, rather than inside every rank.
    try:
        w = load_workload(cfg.script, cfg.nproc, cfg.script_args)
    except (ConfigError, KeyboardInterrupt):
        raise
    except BaseException:  # SystemExit too: a script's argparse error, say
        return _failed(cfg, "while its workload was built", traceback.format_exc())
    global_batch = w.batch_size * cfg.nproc
    reference = train_steps(
        cfg.script, frozenset(), cfg.steps, global_batch, cfg.seed, cfg.script_args
    )
    if reference["traceback"] is not None:
        return _failed(cfg, "in the 1-process run", reference["traceback"])
    # A switch only where it can matter: find_unused_parameters, which DDP cannot honour for a
    # forward whose output it cannot search for tensors (a SimpleNamespace), where a parameter
    # went without a gradient.
    keys = [k for k in _KEYS if k != "unused_parameters" or reference.get("no_grad")]
    setups = _setups(keys)
    if w.loader is None:
        ShardedBatchSampler(
            cast(Sized, w.dataset),
            w.batch_size,
            drop_last=w.drop_last,
            rank=0,
            world_size=cfg.nproc,
        )  # checks the workload's sizes; a map-style dataset has a length
    run = functools.partial(_ranks_run, cfg.script, setups, cfg.steps, cfg.seed, cfg.script_args)
    ranks = spawn(run, cfg.nproc)[0]
    verdicts = []
    for fixes, dist_run in zip(setups, ranks):
        one = (
            reference
            if not fixes
            else train_steps(cfg.script, fixes, cfg.steps, global_batch, cfg.seed, cfg.script_args)
        )
        # the reference itself failed: the script's error
        if one["traceback"] is not None and not fixes:
            return _failed(cfg, "in the 1-process run", one["traceback"])
        # The repeat finds non-determinism; with deterministic algorithms on (all but two set-ups)
        # it can only agree, unless deterministic mode does not cure it, which the all-on set-up
        # shows.
        repeat = "nondeterminism" not in fixes or fixes == frozenset(keys)
        again = (
            train_steps(cfg.script, fixes, cfg.steps, global_batch, cfg.seed, cfg.script_args)
            if repeat
            else one
        )
        verdicts.append(Verdict(compare(dist_run, one), compare(again, one)))
        if fixes == frozenset():
            base_one, base_ranks = one, dist_run
    silent = verdicts[0].ranks.silent
    lines = [
        f"ddpkit check: {cfg.script or w.name}: 1 process (batch {global_batch}) vs {cfg.nproc} "
        f"ranks (batch {w.batch_size} each, gloo), {cfg.steps} steps, tolerance {cfg.rtol:g} "
        "relative",
        *([f"  workload: {w.extra['workload']}"] if "workload" in w.extra else []),
        _table(base_one, base_ranks, verdicts[0], cfg),
    ]
    if silent:
        lines.append(
            f"({silent} parameter(s) with gradients at rounding level, e.g. a bias that BatchNorm "
            "cancels, are left out of the weights' comparison: an adaptive optimizer such as Adam "
            "turns their rounding noise into full-size steps)"
        )
    base, fixed = verdicts[0], verdicts[1]
    # with every known cause switched off: not a finding of DDP's
    if ranks[1]["traceback"] is not None:
        return _failed(
            cfg,
            f"in the {cfg.nproc}-rank run, with every known cause switched off",
            ranks[1]["traceback"],
        )
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
    found = [c for c, v in zip(causes, verdicts[2:]) if v.differs(cfg.rtol)]
    if not found:
        lines.append(
            "cause: the runs agree with every switch on, but no single switch brings the mismatch "
            "back (causes that each suffice alone); switches: " + ", ".join(keys)
        )
        return 1, lines
    for cause, v in zip(causes, verdicts[2:]):
        if cause in found:
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
            sizes = ", ".join(f"{k} {c.diffs[step][k]:.1e}" for k in QUANTITIES)
            parts.append(f"{label}: first differ at step {step} ({q} by {d:.1e} relative; {sizes})")
        if c.error:
            parts.append(f"{label}: a run raised {c.error}")
    return "MISMATCH: " + "; ".join(dict.fromkeys(parts))


def _table(one: dict[str, Any], ranks: dict[str, Any], v: Verdict, cfg: CheckConfig) -> str:
    rows = [
        f"{'step':>4}  {'loss, 1 process':>15}  {f'loss, {cfg.nproc} ranks':>15}  "
        f"{'rel. diff: loss':>15}  {'gradients':>9}  {'weights':>9}"
    ]
    for i, d in enumerate(v.ranks.diffs):
        rows.append(
            f"{i:>4}  {one['loss'][i]:>15.6f}  {ranks['loss'][i]:>15.6f}  {d['loss']:>15.1e}  "
            f"{d['grad']:>9.1e}  {d['weights']:>9.1e}"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ddpkit check",
        description="Train a few steps as one process and as N ranks on the same global batch, "
        "compare losses, gradients and weights step by step, and name the cause of a difference. "
        "Exit code 0: they agree; 1: they differ beyond the tolerance (causes named when found); "
        f"{SCRIPT_FAILED}: the script raised (its traceback is shown).",
        epilog=f"The script defines {HOOK}() returning (model, dataset, loss_fn, "
        "optimizer_factory) or a ddpkit.tools._workload.Workload, or builds a ddpkit.Trainer (run "
        "with its default arguments until then); without a script, the DDP tutorials' CNN on "
        "sklearn digits.",
    )
    p.add_argument(
        "script",
        nargs="?",
        help=f"a training script that defines {HOOK}() or builds a ddpkit.Trainer, or a built-in "
        "workload: " + ", ".join(BUILTINS),
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks of the distributed run (default 2)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps compared (default 4)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--seed", type=int, default=0)
    # The script's own arguments follow it, as under `ddpkit run` (check's options go before the
    # script).
    ours, script_args = split_argv(
        sys.argv[1:] if argv is None else argv, {"--nproc", "--steps", "--rtol", "--seed"}
    )
    p.usage = (
        "ddpkit check [-h] [--nproc NPROC] [--steps STEPS] [--rtol RTOL] [--seed SEED] "
        "[script [ARGS ...]]"
    )
    a = p.parse_args(ours)
    cfg = CheckConfig(
        script=a.script,
        script_args=tuple(script_args),
        nproc=a.nproc,
        steps=a.steps,
        rtol=a.rtol,
        seed=a.seed,
    )
    code, lines = run_check(cfg)
    print("\n".join(lines), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
