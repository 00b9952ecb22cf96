"""A hand-written DDP loop over a ``build_loader`` loader, for the launcher's stall watch; the first
argument picks what rank 1 does at step ``AT`` (the second argument, default 5), the third how long
(default 300 s).

- ``stop``: stops itself with SIGSTOP, between steps.
- ``sleep``: sleeps in user code between steps.
- ``loader``: its loader's worker sleeps loading a sample of that step.
- ``snapshot``: sleeps while it saves a snapshot (ddpkit marks the phase as its snapshots do).
- ``kill``: kills itself with SIGKILL, in the first attempt only (a restart then trains to the end).
- ``none``: nothing; every rank trains to the end.
- ``trainer-sleep``: the same loop run by a ``Trainer``, whose step-end callback sleeps on rank 1.
- ``trainer-snapshot``: a ``Trainer`` saving a snapshot every 5 steps; rank 1's state takes SECONDS
  to save in the snapshot of step AT (an ``extra_state`` whose ``state_dict`` sleeps).
- ``forward``: the loop over ``prepare_model``'s DDP; rank 1 sleeps inside the forward of step
  AT + 1, while rank 0 waits for it in DDP's all-reduce of the gradients. ``forward-raw``: the same
  over torch's DDP, built by hand. ``trainer-forward``: the same in a ``Trainer``.
- ``trainer-validation``: a ``Trainer`` that validates at step AT; rank 1's validation samples take
  SECONDS in all (a slower shard, not a stall).
- ``trainer-export``: a ``Trainer`` that validates at step AT and keeps the best weights; rank 0's
  export of them takes SECONDS (asleep: a slow disk), while rank 1 waits.

Healthy pauses (no rank is stalled; each must finish):

- ``same-sleep`` / ``same-cpu``: after step AT every rank sleeps (or computes) SECONDS + 1.5 s x its
  rank, then the loop goes on: the same long work everywhere, finished a second or two apart.
- ``main-first``: before the loop, rank 0 sleeps SECONDS alone in ``ddpkit.main_first()`` (a
  download) while rank 1 waits.
- ``barrier-cpu``: after step AT rank 0 computes SECONDS before ``ddpkit.barrier()``, where rank 1
  waits: slow, not stalled.
- ``slow``: after step AT rank 1 computes SECONDS while rank 0 waits for it.

And what must be named: ``desync``: after step AT rank 0 alone calls ``torch.distributed.broadcast``
(a logging branch taken on one rank), the most common way ranks come to wait in different
collectives. ``idle-rank-0``: over ``prepare_model``'s DDP, after the backward of step AT rank 0
polls for a file that never comes (SECONDS) while rank 1 waits in ``torch.distributed.barrier()``:
rank 0 is the one named. ``p2p-deadlock``: after step AT each rank calls ``recv`` from the other
(named: a deadlock); ``p2p-ordered``, its control: rank 0 sends first, rank 1 receives first.

Every step all-reduces the loss with ``ddpkit.all_reduce`` (a marked collective). The run lasts
``STEPS`` steps (the fourth argument, default 12); the Trainer's modes take a run folder as the
fifth.
"""

import os
import signal
import sys
import time

import torch

import ddpkit
from ddpkit.distributed import _progress as progress

mode = sys.argv[1]
at = int(sys.argv[2]) if len(sys.argv) > 2 else 5
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 300.0
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 12
rt = ddpkit.init()
stalling = rt.rank == 1


read = 0  # samples this process (rank 1's loader worker) has read


class Net(torch.nn.Linear):
    """A linear model whose forward sleeps on rank 1 at its call ``at + 1`` (``*forward``)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Net.calls += 1
        if mode.endswith("forward") or mode == "forward-raw":
            if stalling and Net.calls == at + 1:
                print(f"rank 1 stalls ({mode}) after step {at} at {time.time():.3f}", flush=True)
                time.sleep(seconds)
        return super().forward(x)


class SlowShard(torch.utils.data.Dataset):
    """Validation samples: rank 1's take SECONDS in all."""

    def __len__(self) -> int:
        return 2 * 16

    def __getitem__(self, i: int):
        if stalling:
            if i == 16:  # rank 1's first sample
                print(f"rank 1 stalls ({mode}) after step {at} at {time.time():.3f}", flush=True)
            time.sleep(seconds / 16)
        return torch.zeros(4), torch.tensor([1.0])


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4 * 2 * 64

    def __getitem__(self, i: int):
        global read
        read += 1
        if mode == "loader" and stalling and read == 4 * at + 1:  # the first sample of step AT + 1
            time.sleep(seconds)
        return torch.full((4,), float(i)), torch.tensor([1.0])


def spin(seconds: float) -> None:
    """Compute (CPU time moves) for ``seconds``."""
    end = time.monotonic() + seconds
    x = torch.ones(64, 64)
    while time.monotonic() < end:
        x = (x @ x).clamp(-1, 1)


def say_stalls() -> None:
    print(f"rank 1 stalls ({mode}) after step {at} at {time.time():.3f}", flush=True)


if mode == "main-first":
    if rt.rank == 1:
        say_stalls()  # (rank 1 waits for rank 0: the pause the test times)
    with ddpkit.main_first():
        if rt.rank == 0:
            time.sleep(seconds)


if mode.startswith("trainer"):
    from ddpkit.snapshot._state import SnapshotConfig
    from ddpkit.training._config import EarlyStoppingConfig, LoggingConfig, TrainerConfig
    from ddpkit.training._trainer import Trainer

    class SleepAtStep:
        def on_step_end(self, trainer, taken, output) -> None:
            if stalling and mode == "trainer-sleep" and trainer.step == at:
                print(f"rank 1 stalls ({mode}) after step {at} at {time.time():.3f}", flush=True)
                time.sleep(seconds)

    class SlowState:
        def state_dict(self) -> dict:
            if stalling and mode == "trainer-snapshot" and trainer.step == at:
                print(f"rank 1 stalls ({mode}) after step {at} at {time.time():.3f}", flush=True)
                time.sleep(seconds)
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    validating = mode in ("trainer-validation", "trainer-export")
    if mode == "trainer-export":
        import ddpkit.training._validation as export

        save_weights = export.save_weights

        def slow_save(*args, **kwargs):
            say_stalls()
            time.sleep(seconds)
            save_weights(*args, **kwargs)

        export.save_weights = slow_save
    config = TrainerConfig(
        run_dir=sys.argv[5],
        batch_size=4,
        max_steps=steps,
        shuffle=False,
        num_workers=0,
        weights_format="pt" if mode == "trainer-export" else None,
        early_stopping=EarlyStoppingConfig(
            metric="val/loss" if mode == "trainer-export" else None, patience=100
        ),
        logging=LoggingConfig(progress=False),
        snapshot=SnapshotConfig(every_steps=5, async_write=False),
        val_every_steps=at if validating else None,
        eval_batch_size=16,  # rank 1 reads its shard as one batch of SECONDS
    )
    model = Net(4, 1)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        Samples(),
        config,
        val_data=(SlowShard() if mode == "trainer-validation" else Samples())
        if validating
        else None,
        loss_fn=torch.nn.functional.mse_loss,
        callbacks=[SleepAtStep()],
        extra_state={"slow": SlowState()},
    )
    trainer.fit()
    print(f"rank {rt.rank} done after {trainer.step} steps", flush=True)
    sys.exit(0)

loader = ddpkit.build_loader(
    Samples(), batch_size=4, shuffle=False, num_workers=1 if mode == "loader" else 0
)
if mode in ("forward", "idle-rank-0"):
    model = ddpkit.prepare_model(Net(4, 1))
else:
    model = torch.nn.parallel.DistributedDataParallel(Net(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(loader, start=1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if step == at and mode == "idle-rank-0":
        import torch.distributed as dist

        if rt.rank == 0:  # user code polling for a file: idle, not in any collective
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not os.path.exists("never-written"):
                time.sleep(0.2)
        else:
            say_stalls()
        dist.barrier()
    if step == at and mode in ("p2p-deadlock", "p2p-ordered"):
        import torch.distributed as dist

        if rt.rank == 1:
            say_stalls()
        buffer, peer = torch.zeros(3), 1 - rt.rank
        if mode == "p2p-ordered" and rt.rank == 0:
            dist.send(buffer, peer)
        dist.recv(buffer, peer)
        if mode == "p2p-ordered" and rt.rank == 1:
            dist.send(buffer, peer)
    opt.step()
    ddpkit.all_reduce(loss.item())
    if stalling and step == at:
        print(f"rank 1 stalls ({mode}) after step {step} at {time.time():.3f}", flush=True)
        if mode == "kill" and rt.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "sleep":
            time.sleep(seconds)
        elif mode == "snapshot":
            with progress.phase(progress.Phase.SNAPSHOT):
                time.sleep(seconds)
    if step == at and mode in ("same-sleep", "same-cpu"):
        if rt.rank == 1:
            say_stalls()
        pause = time.sleep if mode == "same-sleep" else spin
        pause(seconds + 1.5 * rt.rank)
    elif step == at and mode == "barrier-cpu":
        if rt.rank == 1:
            say_stalls()
        else:
            spin(seconds)
        ddpkit.barrier()
    elif step == at and mode == "slow" and stalling:
        say_stalls()
        spin(seconds)
    elif step == at and mode == "desync":
        import torch.distributed as dist

        if stalling:
            say_stalls()
        if rt.rank == 0:  # a logging branch taken on rank 0 alone
            dist.broadcast(torch.zeros(3), 0)
    if step == steps:
        break
print(f"rank {rt.rank} done after {step} steps", flush=True)
