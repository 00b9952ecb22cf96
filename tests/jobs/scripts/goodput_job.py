"""The goodput benchmark's job: the DDP tutorials' CNN on MNIST-shaped data, as the DDP tutorials
train it or with the Trainer.

``--mode tutorial``: a hand-written DDP loop as the DDP tutorials write it (DistributedSampler, rank
0 saves model and optimizer with ``torch.save`` at every epoch end, every rank resumes from that
file); run under torchrun. ``--mode trainer``: ddpkit's Trainer (snapshots on disk every epoch;
``--memory``: snapshots in memory too, at the interval the Trainer chooses); run under
``ddpkit run``.

Each rank appends to ``--timeline`` one JSON line per event of its life (the clock is
``time.time()``, the same on every process of the machine): ``proc_start`` (the kernel's start time
of the process), ``script`` (this file's first line), ``imports``, ``init`` (process group up),
``data`` (the data set read), ``built`` (model, loader, Trainer), ``loaded`` (the snapshot read, if
any: ``step`` is where training resumes), ``first_step``, ``step`` (every ``--log-every`` steps and
the last; ``step`` counts optimizer steps over the whole run) and ``done``.
"""

import json
import os
import time

T_SCRIPT = time.time()

import argparse  # noqa: E402


def proc_start() -> float:
    """When the kernel started this process (10 ms resolution): before the interpreter and its
    imports. From the uptime (10 ms) rather than the boot time in /proc/stat (whole seconds)."""
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    uptime = float(open("/proc/uptime").read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


class Timeline:
    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", buffering=1) if path else None
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def __call__(self, event: str, t: float | None = None, **extra) -> None:
        if self.file is not None:
            record = {
                "event": event,
                "t": time.time() if t is None else t,
                "rank": self.rank,
                "attempt": self.attempt,
                "pid": os.getpid(),
                **extra,
            }
            self.file.write(json.dumps(record) + "\n")


class Marks:
    """A Trainer callback putting its events on the timeline: ``loaded`` (training starts, after any
    resume), ``first_step``, and ``step`` every ``every`` steps; ``after_step(trainer)`` runs after
    each step."""

    def __init__(self, mark: Timeline, every: int = 1, after_step=None) -> None:
        self.mark, self.every, self.after_step, self.first = mark, every, after_step, True

    def on_fit_start(self, trainer) -> None:
        self.mark("loaded", step=trainer.step)

    def on_step_end(self, trainer, taken, output) -> None:
        if self.first:
            self.first = False
            self.mark("first_step", step=trainer.step)
        if trainer.step % self.every == 0:
            self.mark("step", step=trainer.step)
        if self.after_step is not None:
            self.after_step(trainer)


def synthetic_mnist(n: int, seed: int = 0) -> tuple:
    """``n`` MNIST-shaped samples (1x28x28 floats, 10 classes a fixed linear teacher assigns): the
    DDP tutorials' data without a download, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    teacher = torch.randn(28 * 28, 10, generator=g)
    return x, (x.flatten(1) @ teacher).argmax(1)


def read_data(a):
    """The data set: mapped from ``--data`` (made once by ``--make-data``), as a job reads its data
    set from a file at each start, or made here (``--samples``) where no file is given."""
    import torch

    if a.data:
        x, y = torch.load(a.data, mmap=True, weights_only=True)
    else:
        x, y = synthetic_mnist(a.samples)
    return torch.utils.data.TensorDataset(x, y)


def tutorial_loop(a, mark: Timeline) -> None:
    """The DDP tutorials' loop: DistributedSampler, DDP, rank 0 saves at every epoch end, resume
    from that file."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ddpkit.demo._models import DigitsCNN

    mark("imports")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mark("init")
    data = read_data(a)
    mark("data")
    torch.manual_seed(0)
    model = DDP(DigitsCNN(28))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler, num_workers=0)
    mark("built")
    path = os.path.join(a.run_dir, "snapshot.pt")
    first_epoch = 0
    if os.path.exists(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        first_epoch = saved["epoch"]
    steps_per_epoch = len(loader)
    mark("loaded", step=first_epoch * steps_per_epoch)
    step = first_epoch * steps_per_epoch
    for epoch in range(first_epoch, a.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == first_epoch * steps_per_epoch + 1:
                mark("first_step", step=step)
            if step % a.log_every == 0:
                mark("step", step=step)
        if rank == 0:  # the DDP tutorials' snapshot: rank 0, whole file, at the end of the epoch
            os.makedirs(a.run_dir, exist_ok=True)
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1,
                },
                path + ".tmp",
            )
            os.replace(path + ".tmp", path)
        dist.barrier()
    mark("step", step=step)
    mark("done", step=step)
    dist.destroy_process_group()


def trainer_loop(a, mark: Timeline) -> None:
    import torch

    import ddpkit
    from ddpkit.demo._models import DigitsCNN
    from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig
    from ddpkit.training._trainer import Trainer

    mark("imports")
    ddpkit.init()
    mark("init")

    data = read_data(a)
    mark("data")
    torch.manual_seed(0)
    model = DigitsCNN(28)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = TrainerConfig(
        run_dir=a.run_dir,
        epochs=a.epochs,
        batch_size=a.batch_size,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=1, every_steps=a.disk_every_steps, memory=a.memory),
        logging=LoggingConfig(progress=False, every_steps=100),
    )
    trainer = Trainer(model, optimizer, data, config, callbacks=[Marks(mark, a.log_every)])
    mark("built")
    trainer.fit()
    mark("step", step=trainer.step)
    stalls = trainer.memory.stalls if trainer.memory is not None else []
    mark("done", step=trainer.step, memory_stalls=stalls[-200:])
    ddpkit.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--mode", choices=("tutorial", "trainer"), default="trainer")
    p.add_argument("--memory", action="store_true", help="trainer: keep the snapshots in memory on")
    p.add_argument("--disk-every-steps", type=int, default=None)
    p.add_argument("--samples", type=int, default=60000)
    p.add_argument(
        "--data", default=None, help="the data set's file (--make-data); else made at each start"
    )
    p.add_argument(
        "--make-data", default=None, metavar="FILE", help="write --samples samples to FILE and exit"
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timeline", default=None)
    a = p.parse_args()
    if a.make_data:
        import torch

        torch.save(synthetic_mnist(a.samples), a.make_data)
        return
    mark = Timeline(a.timeline)
    mark("proc_start", proc_start())
    mark("script", T_SCRIPT)
    (tutorial_loop if a.mode == "tutorial" else trainer_loop)(a, mark)


if __name__ == "__main__":
    main()
