"""What ``build_loader`` and the Trainer cost a step, on three models paired in one job.

Each model trains in the same job of ``--nproc`` ranks (gloo, CPU), through four loops, one epoch
of each per round, in an order that rotates and reverses from round to round, so that noise from
other work on the machine falls on all. The loops of a model train one model with one optimizer,
the Trainer's (DDP-wrapped as ``prepare_model`` wraps it): two instances of one model differ by a
few percent in step time by where their tensors landed.

- ``hand``: the DDP tutorials' loop over ``DataLoader(dataset, batch_size,
  sampler=DistributedSampler(dataset))``;
- ``hand+build_loader``: the same loop over ``ddpkit.build_loader(dataset, batch_size,
  num_workers=0)``: the Trainer's data guarantees (one global order, seeded samples, a position to
  resume from);
- ``hand+build_loader, seed_samples=False``: the same without the seeding, which shows its cost in
  the main process;
- ``trainer``: ``ddpkit.Trainer`` with its defaults.

The models (``--models``, all three by default):

- ``tiny``: pytorch/examples' ddp-tutorial-series case: a ``Dataset`` holding a list of
  ``(rand(20), rand(1))`` pairs, an MLP 20-384-384-1, MSE, batch 32 per rank (~1.2 ms steps on 2
  CPU ranks): where a cost of microseconds a step shows;
- ``cnn``: the DDP tutorials' digits CNN on MNIST-shaped data, batch 24 per rank (~18 ms steps);
- ``transformer``: a causal language model of 16 torch encoder layers of width 32 over 16 tokens
  (196 parameter tensors), batch 8 per rank.

Step time is the time between consecutive optimizer steps on rank 0 (a post-step hook): loading the
batch, forward, backward and its all-reduce, the update, bookkeeping. Per round, the median step of
each loop; reported, for each pair, the median over rounds of the per-round ratio with a
distribution-free 95% interval, and of the difference. Targets: on ``cnn`` and ``transformer``,
``trainer / hand+build_loader`` at most 1.01; on ``tiny``, ``trainer / hand`` at most 1.15 and
``hand+build_loader / hand`` at most 1.05.

    python bench/loader_overhead.py                         # 2 ranks, all three models
    python bench/loader_overhead.py --models tiny --rounds 400
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import io
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from trainer_overhead import median_interval, steady_malloc

import ddpkit
import ddpkit.platforms._cpus
from ddpkit.demo._models import DigitsCNN
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._trainer import Trainer, TrainerConfig

LOOPS = ("hand", "hand+build_loader", "hand+build_loader, seed_samples=False", "trainer")
PAIRS = [
    ("hand+build_loader", "hand"),
    ("trainer", "hand"),
    ("trainer", "hand+build_loader"),
    ("hand+build_loader", "hand+build_loader, seed_samples=False"),
]


class MyTrainDataset(Dataset):
    """pytorch/examples' ddp-tutorial-series dataset: random pairs in a list, read as they are."""

    def __init__(self, size: int) -> None:
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


class SmallTransformer(nn.Module):
    """A causal language model: embeddings, 16 torch encoder layers of width 32 (2 heads), a linear
    head; 196 parameter tensors."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 16, context: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        # a plain attribute, not a buffer: DDP would broadcast a buffer before every forward
        self.mask = nn.Transformer.generate_square_subsequent_mask(context)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model_case(name: str, samples: int) -> tuple[nn.Module, Dataset, Callable, int, str]:
    """The model, a dataset of ``samples`` samples, the loss, the batch per rank, a description."""
    g = torch.Generator().manual_seed(0)
    if name == "tiny":
        return mlp(384), MyTrainDataset(samples), nn.functional.mse_loss, 32, "MLP 20-384-384-1"
    if name == "cnn":
        data = TensorDataset(
            torch.randn(samples, 1, 28, 28, generator=g),
            torch.randint(0, 10, (samples,), generator=g),
        )
        return DigitsCNN(28), data, nn.functional.cross_entropy, 24, "the digits CNN"
    tokens = torch.randint(0, 64, (samples, 17), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    model = SmallTransformer()
    tensors = len(list(model.parameters()))
    return model, data, lm_loss, 8, f"a transformer of {tensors} parameter tensors"


def hand_epoch(model: nn.Module, optimizer, loader: DataLoader, loss_fn: Callable, epoch: int):
    """The tutorial's _run_epoch: set_epoch where there is a DistributedSampler, then zero_grad,
    loss, backward, step."""
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)
    for source, targets in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(source), targets)
        loss.backward()
        optimizer.step()


def model_runs(name: str, steps: int, world: int, stamps: list[float]) -> tuple[dict, str, int]:
    """Each loop of model ``name`` as a function of the round: one epoch of ``steps`` steps."""
    torch.manual_seed(0)
    net, data, loss_fn, batch_size, what = model_case(name, steps * 32 * world)
    run_dir = ddpkit.broadcast_object(
        tempfile.mkdtemp(prefix="ddpkit-bench-") if ddpkit.get_runtime().is_main else ""
    )
    config = TrainerConfig(
        run_dir=run_dir,
        batch_size=batch_size,
        epochs=1,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(progress=False),
    )
    trainer = Trainer(
        net, torch.optim.SGD(net.parameters(), lr=1e-3), data, config, loss_fn=loss_fn
    )
    trainer.optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    model, opt = trainer.model, trainer.optimizer
    runs: dict[str, Callable[[int], None]] = {}
    for loop, loader in (
        ("hand", DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data))),
        ("hand+build_loader", ddpkit.build_loader(data, batch_size, num_workers=0)),
        (
            "hand+build_loader, seed_samples=False",
            ddpkit.build_loader(data, batch_size, num_workers=0, seed_samples=False),
        ),
    ):
        runs[loop] = functools.partial(hand_epoch, model, opt, loader, loss_fn)

    def trainer_epoch(epoch: int) -> None:
        trainer.epoch = trainer.cursor = 0  # the same single epoch again
        trainer.stopped_by = None  # as a new Trainer has it: fit() ends with the reason it stopped
        with contextlib.redirect_stdout(io.StringIO()):  # its summary of each fit()
            trainer.fit()

    runs["trainer"] = trainer_epoch
    return runs, f"{what}, batch {batch_size}/rank", len(list(net.parameters()))


def bench(models: list[str], steps: int, rounds: int) -> dict:
    rt = ddpkit.init()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    threads = torch.get_num_threads()
    pinned = len(cores) >= rt.world_size * threads
    if pinned:  # a rank that migrates between cores adds noise to every loop
        os.sched_setaffinity(0, set(cores[rt.rank * threads : (rt.rank + 1) * threads]))
    steady = steady_malloc()
    stamps: list[float] = []
    cases = {m: model_runs(m, steps[m], rt.world_size, stamps) for m in models}

    def timed(model: str, loop: str, epoch: int) -> float:
        stamps.clear()
        ddpkit.barrier()
        cases[model][0][loop](epoch)
        ddpkit.barrier()
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    for m in models:  # warm-up, excluded
        for loop in LOOPS:
            timed(m, loop, 0)
    out: dict[str, dict[str, list[float]]] = {m: {loop: [] for loop in LOOPS} for m in models}
    for r in range(rounds):
        k = r % len(LOOPS)
        order = list(LOOPS[k:] + LOOPS[:k])
        for m in models:
            # every loop in every place, both ways round
            for loop in order if r % 2 == 0 else order[::-1]:
                out[m][loop].append(timed(m, loop, r + 1))
    return {
        "steps": out,
        "what": {m: cases[m][1] for m in models},
        "pinned": pinned,
        "threads": threads,
        "steady_malloc": steady,
    }


def run_line() -> str:
    """When and where a run was made: the date, the machine, its load, Python and torch."""
    return (
        f"date {datetime.datetime.now():%Y-%m-%d %H:%M}  machine {platform.machine()}, "
        f"{ddpkit.platforms._cpus.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}  "
        f"python {platform.python_version()}  torch {torch.__version__}"
    )


def pair_line(top: str, bottom: str, steps: dict[str, list[float]]) -> str:
    ratios = sorted(t / b for t, b in zip(steps[top], steps[bottom]))
    lo, hi = median_interval(ratios)
    diffs = sorted((t - b) * 1e3 for t, b in zip(steps[top], steps[bottom]))
    dlo, dhi = median_interval(diffs)
    return (
        f"  {top} / {bottom}: ratio {statistics.median(ratios):.3f}, 95% interval "
        f"{lo:.3f}-{hi:.3f}; {statistics.median(diffs):+.0f} us/step ({dlo:+.0f} to {dhi:+.0f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--models", default="tiny,cnn,transformer", help="comma-separated")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=0, help="steps per timed epoch (0: per model)")
    a = p.parse_args()
    models = a.models.split(",")
    steps = {m: a.steps or (20 if m == "tiny" else 8) for m in models}
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it: once here rather than in every rank)

    res = ddpkit.spawn(functools.partial(bench, models, steps, a.rounds), a.nproc)[0]
    print(run_line())
    print(
        f"config: {a.nproc} rank(s) (gloo, CPU, {res['threads']} thread(s) each, "
        f"{'pinned' if res['pinned'] else 'not pinned'}, "
        f"{'fixed' if res['steady_malloc'] else 'adaptive'} malloc thresholds), no loader "
        f"workers, {a.rounds} interleaved rounds, warm-up excluded"
    )
    for m in models:
        steps_ms = {loop: [s * 1e3 for s in xs] for loop, xs in res["steps"][m].items()}
        print(f"{m}: {res['what'][m]}, {steps[m]} steps a round")
        for loop in LOOPS:
            print(f"  {loop:40s} {statistics.median(steps_ms[loop]):.3f} ms/step (median)")
        print("  step time, median over rounds of the per-round ratio (95% interval), and of the")
        print("  difference:")
        for top, bottom in PAIRS:
            print(pair_line(top, bottom, steps_ms))


if __name__ == "__main__":
    main()
