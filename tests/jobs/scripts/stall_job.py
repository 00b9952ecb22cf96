"""A hand-written DDP loop over a ``build_loader`` loader, for the launcher's stall watch; the first argument
picks what rank 1 does at step ``AT`` (the second argument, default 5), the third how long (default 300 s).

- ``stop``: stops itself with SIGSTOP, between steps.
- ``sleep``: sleeps in user code between steps.
- ``loader``: its loader's worker sleeps loading a sample of that step.
- ``snapshot``: sleeps while it saves a snapshot (ddpkit marks the phase as its snapshots do).
- ``kill``: kills itself with SIGKILL, in the first attempt only (a restart then trains to the end).
- ``none``: nothing; every rank trains to the end.

Every step all-reduces the loss with ``ddpkit.all_reduce`` (a marked collective). The run lasts ``STEPS``
steps (the fourth argument, default 12).
"""

import os
import signal
import sys
import time

import torch

import ddpkit
from ddpkit.distributed import progress

mode = sys.argv[1]
at = int(sys.argv[2]) if len(sys.argv) > 2 else 5
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 300.0
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 12
rt = ddpkit.init()
stalling = rt.rank == 1


read = 0  # samples this process (rank 1's loader worker) has read


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4 * 2 * 64

    def __getitem__(self, i: int):
        global read
        read += 1
        if mode == "loader" and stalling and read == 4 * at + 1:  # the first sample of step AT + 1
            time.sleep(seconds)
        return torch.full((4,), float(i)), torch.tensor([1.0])


loader = ddpkit.build_loader(Samples(), batch_size=4, shuffle=False, num_workers=1 if mode == "loader" else 0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(loader, start=1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
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
    if step == steps:
        break
print(f"rank {rt.rank} done after {step} steps", flush=True)
