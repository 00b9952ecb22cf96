"""What the Trainer costs over a hand-written DDP loop like the seeds', and how long a snapshot stalls training.

Both loops train the seeds' MNIST CNN (two conv+BatchNorm blocks, one linear layer) on MNIST-shaped synthetic
data, with the same per-rank batch, in the same job, in interleaved rounds (hand, trainer, trainer, hand, ...)
so that noise from other work on the machine falls on both. Per round: wall time of a whole epoch / steps;
reported: the median over rounds, and the ratio trainer / hand. Target: ratio <= 1.02 at ~20 ms steps.

    python bench/trainer_overhead.py                  # 2 ranks, gloo, batch 64 per rank
    python bench/trainer_overhead.py --nproc 2 --steps 60 --rounds 16 --batch-size 64
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.trainer import Trainer, TrainerConfig


class Net(nn.Module):
    """The seeds' MNIST CNN."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(x)).flatten(1))


def hand_loop(model: nn.Module, optimizer, loader: DataLoader, sampler: DistributedSampler, epoch: int) -> None:
    """The seeds' loop: set_epoch, forward, loss, zero_grad, backward, step."""
    criterion = nn.CrossEntropyLoss()
    device = ddpkit.get_runtime().device
    sampler.set_epoch(epoch)
    model.train()
    for image, target in loader:
        image, target = image.to(device), target.to(device)
        loss = criterion(model(image), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def bench(steps: int, rounds: int, batch_size: int) -> dict:
    rt = ddpkit.init()
    world = rt.world_size
    g = torch.Generator().manual_seed(0)
    n = steps * batch_size * world
    data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))

    torch.manual_seed(0)
    hand_model = ddpkit.prepare_model(Net())
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)

    torch.manual_seed(0)
    net = Net()
    run_dir = tempfile.mkdtemp(prefix="ddpkit-bench-") if rt.is_main else ""
    config = TrainerConfig(
        run_dir=ddpkit.broadcast_object(run_dir), batch_size=batch_size, epochs=1, num_workers=0,
        snapshot_every_epochs=0, resume=False, progress=False, seed=0,
    )
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=1e-3), data, config)

    def timed(fn) -> float:
        ddpkit.barrier()
        start = time.perf_counter()
        fn()
        ddpkit.barrier()
        return (time.perf_counter() - start) / steps

    def trainer_epoch() -> None:
        trainer.epoch = trainer.cursor = 0  # the same single epoch again
        trainer.fit()

    timed(lambda: hand_loop(hand_model, hand_opt, loader, sampler, 0))  # warm-up, excluded
    timed(trainer_epoch)
    hand, mine = [], []
    for r in range(rounds):
        order = [("hand", hand), ("trainer", mine)] if r % 2 == 0 else [("trainer", mine), ("hand", hand)]
        for name, out in order:
            if name == "hand":
                out.append(timed(lambda: hand_loop(hand_model, hand_opt, loader, sampler, r + 1)))
            else:
                out.append(timed(trainer_epoch))
    stalls = []
    for _ in range(5):
        ddpkit.barrier()
        start = time.perf_counter()
        trainer.step += 1  # a new snapshot name each time
        trainer.save()
        ddpkit.barrier()  # the others wait for rank 0 at the next collective; measure that wait
        stalls.append(time.perf_counter() - start)
    return {"hand": hand, "trainer": mine, "stall": stalls, "world": world}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    a = p.parse_args()
    res = ddpkit.spawn(functools.partial(bench, a.steps, a.rounds, a.batch_size), a.nproc)[0]
    hand_ms = statistics.median(res["hand"]) * 1000
    trainer_ms = statistics.median(res["trainer"]) * 1000
    print(f"date {datetime.date.today()}  machine {platform.machine()} {platform.processor() or ''}, "
          f"{ddpkit.cluster.cpu_count()} cores  python {platform.python_version()}  torch {torch.__version__}")
    print(f"config: {a.nproc} ranks (gloo, CPU, {max(1, ddpkit.cluster.cpu_count() // a.nproc)} thread(s) each), "
          f"seeds' CNN, batch {a.batch_size}/rank, {a.steps} steps x {a.rounds} interleaved rounds, warm-up excluded")
    print(f"hand-written DDP loop : median {hand_ms:7.2f} ms/step  (rounds: "
          + " ".join(f"{x * 1000:.1f}" for x in res["hand"]) + ")")
    print(f"ddpkit Trainer        : median {trainer_ms:7.2f} ms/step  (rounds: "
          + " ".join(f"{x * 1000:.1f}" for x in res["trainer"]) + ")")
    pairs = sorted(t / h for t, h in zip(res["trainer"], res["hand"]))
    print(f"ratio trainer / hand  : {statistics.median(pairs):.3f} median of per-round pairs "
          f"(run back to back; spread {pairs[0]:.3f}-{pairs[-1]:.3f}), {trainer_ms / hand_ms:.3f} of medians; "
          "target <= 1.02")
    print(f"snapshot stall        : median {statistics.median(res['stall']) * 1000:.1f} ms "
          f"(gather RNG states + rank 0 writes {sum(p.numel() for p in Net().parameters()) * 4 / 1e6:.2f} MB "
          "of weights with optimizer state, fsync, rename, manifest)")


if __name__ == "__main__":
    main()
