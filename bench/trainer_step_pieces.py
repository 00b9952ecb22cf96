"""The Trainer's per-step bookkeeping, piece by piece, on the tiny model of
``trainer_overhead.py --model tiny``.

A whole-loop comparison (trainer_overhead.py) measures the Trainer's extra time per step, but on a
machine shared with other work its interval is tens of microseconds wide. Each piece here is timed
alone, many calls in a row, as the fastest of seven repeats (timeit's way: other work only adds
time), so that microseconds show. It reads the Trainer's private helpers as they are at this commit;
the pieces are what a step of ``Trainer._train_epoch`` runs that a hand-written loop does not.

    python bench/trainer_step_pieces.py
"""

from __future__ import annotations

import datetime
import platform
import timeit
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from ddpkit.data import ShardedBatchSampler
from ddpkit.data._loader import batch_len as _batch_len
from ddpkit.strategies._ddp import FiniteCheck as _FiniteCheck
from ddpkit.strategies._ddp import (
    nan_gradient_if_nonfinite as _nan_gradient_if_nonfinite,
)
from ddpkit.training._loss_window import LossWindow as _LossWindow


def fastest_us(fn, number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def main() -> None:
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    window = _LossWindow(on_host=True)

    def window_step() -> None:
        window.add(loss, 64)
        window.end_step(True)
        if len(window.losses) >= 20:  # the agreement clears it every log_every_steps
            window.clear()

    def contexts() -> None:
        with nullcontext():  # no_sync or not
            with nullcontext(), nullcontext():  # autocast (fp32), batch layout (no global dropout)
                pass

    flag, one = torch.zeros(1), torch.ones(1)
    finite = _FiniteCheck(params)
    pieces = {
        "FiniteCheck(params)(grads): NaN/inf verdict on the gradients": fastest_us(
            lambda: finite(grads)
        ),
        "  of which the fused check itself": fastest_us(
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, one)
        ),
        "_nan_gradient_if_nonfinite (CPU, finite loss)": fastest_us(
            lambda: _nan_gradient_if_nonfinite(loss, params[0], True)
        ),
        "  of which anchor.reshape(-1)[0], built before the check": fastest_us(
            lambda: params[0].reshape(-1)[0]
        ),
        "_LossWindow.add + end_step (loss.item())": fastest_us(window_step),
        "_batch_len(batch)": fastest_us(lambda: _batch_len((x, y))),
        # bf16/fp16 or global batch dropout: an fp32 step without it enters none
        "three context managers per micro-batch": fastest_us(contexts),
    }
    n = 64 * 200
    data = TensorDataset(torch.zeros(n, 1), torch.zeros(n))
    ours = ShardedBatchSampler(n, 64, rank=0, world_size=2)
    theirs = BatchSampler(DistributedSampler(data, num_replicas=2, rank=0), 64, drop_last=False)
    per_batch = {}
    for name, sampler in (
        ("ShardedBatchSampler", ours),
        ("BatchSampler(DistributedSampler)", theirs),
    ):
        batches = sum(1 for _ in sampler)
        per_batch[name] = fastest_us(lambda s=sampler: sum(1 for _ in s), number=20) / batches

    print(
        f"date {datetime.date.today()}  {platform.machine()}  python {platform.python_version()}  "
        f"torch {torch.__version__}  1 thread; fastest of 7 repeats of 20,000 calls (samplers: 20 "
        "epochs)"
    )
    for name, us in pieces.items():
        print(f"  {name:60} {us:7.2f} us")
    top = [us for name, us in pieces.items() if not name.startswith("  ")]
    print(f"  {'sum of the Trainer-only pieces per step':60} {sum(top):7.2f} us")
    for name, us in per_batch.items():
        print(f"  sampler {name:52} {us:7.2f} us per batch")


if __name__ == "__main__":
    main()
