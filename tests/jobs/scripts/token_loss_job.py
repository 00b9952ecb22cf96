"""A tiny next-token model on padded sequences of very different lengths: the job of the per-token
loss tests.

Labels past a sequence's length are ``ignore_index`` (-100), so micro-batches hold different numbers
of tokens. ``count_tokens=True`` passes the Trainer ``count_fn`` (the step follows the mean over
every token of the global batch); False leaves the default, each micro-batch's token mean weighted
by its samples: the control.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.testing import read_records, run_on_ranks
from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig
from ddpkit.training._trainer import Trainer

VOCAB, SEQ, N_SEQ = 13, 12, 48
IGNORE = -100


class PaddedSequences(torch.utils.data.Dataset):
    """Random token sequences, each of a length from 1 to ``SEQ``; the labels are the next
    tokens."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, VOCAB, (N_SEQ, SEQ + 1), generator=g)
        self.lengths = torch.randint(1, SEQ + 1, (N_SEQ,), generator=g)

    def __len__(self) -> int:
        return N_SEQ

    def __getitem__(self, i: int):
        x, y = self.tokens[i, :-1].clone(), self.tokens[i, 1:].clone()
        y[self.lengths[i] :] = IGNORE
        return x, y


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def token_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def count_tokens(batch) -> torch.Tensor:
    return (batch[1] != IGNORE).sum()


def train(
    run_dir: str,
    *,
    grad_accum: int = 1,
    count: bool = True,
    global_batch: int = 8,
    epochs: int = 2,
    compile: bool = False,
    strategy: str = "ddp",
    max_steps: int | None = None,
    resume: bool = True,
    drop_momentum: bool = False,
) -> dict:
    """Train; rank 0's final weights, steps, and the first step's recorded training loss (main rank
    only)."""
    ddpkit.init()
    model = build_model()
    config = TrainerConfig(
        run_dir=run_dir,
        epochs=epochs,
        max_steps=max_steps,
        resume=resume,
        compile=compile,
        strategy=strategy,
        global_batch_size=global_batch,
        grad_accum_steps=grad_accum,
        num_workers=0,
        shuffle=False,  # the first step's global batch is samples 0 .. global_batch - 1
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(every_steps=1, progress=False),
    )
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5),
        PaddedSequences(),
        config,
        batch_loss_fn=token_loss,
        count_fn=count_tokens if count else None,
    )
    # the control of the resume test: the snapshot's momentum buffers are not restored
    if drop_momentum:
        load = trainer.load_state_dict

        def load_without_momentum(state):
            load(state)
            trainer.optimizer.state.clear()

        trainer.load_state_dict = load_without_momentum
    metrics = trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.strategy.model_weights().items()}
    # momentum buffers, gathered under every strategy
    optim = trainer.strategy.full_state_dict()["optim"]
    records = read_records(trainer.run_dir) if trainer.runtime.is_main else []
    first = next((r for r in records if r["kind"] == "train"), {})
    graphs = 0
    # proof that the training forward ran compiled: the frames Dynamo compiled in this process
    if compile:
        from torch._dynamo.utils import counters

        graphs = counters["frames"]["ok"]  # frames Dynamo compiled
    return {
        "graphs": graphs,
        "model": weights,
        "optim": optim,
        "step": trainer.step,
        "first_loss": first.get("train/loss"),
        **metrics,
    }


def train_on_ranks(world: int, run_dir: str | os.PathLike[str], **kwargs: Any) -> dict:
    """:func:`train` on ``world`` ranks of :func:`ddpkit.testing.run_on_ranks`, its collectives
    waiting as long as under ``ddpkit run`` (5 minutes); rank 0's result."""
    job = functools.partial(train, str(run_dir), **kwargs)
    return run_on_ranks(job, world, collective_timeout=300, timeout=1800)[0]


def first_batch_token_mean(global_batch: int = 8) -> float:
    """The mean loss over every token of the first step's global batch, with the initial weights:
    what the first step's ``train/loss`` record must say."""
    data = PaddedSequences()
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(global_batch))))
    with torch.no_grad():
        return float(token_loss(build_model(), (x, y)))
