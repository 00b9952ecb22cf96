"""A hand-written DDP loop over a ``build_loader`` loader whose rank 1 parts from the others at step
``AT`` (the second argument, default 5), for the launcher's stall watch and its failure summary; the
first argument picks how:

- ``barrier``: rank 1 calls ``ddpkit.barrier()`` where rank 0 calls the step's
  ``ddpkit.all_reduce``: both wait in collective #AT, under different ops.
- ``held``: rank 1 blocks inside the step's ``ddpkit.all_reduce``, once marked, without being
  stopped: both wait in all_reduce #AT, one op, as in a collective the network holds up.
- ``stopped``: the same, rank 1 stopping itself there (SIGSTOP).
- ``exit``: rank 1 calls ``sys.exit(0)`` after step AT; rank 0 trains on.
- ``none``: nothing; every rank trains to the end and exits 0.

Every step all-reduces the loss with ``ddpkit.all_reduce`` (a marked collective); the run lasts 12
steps.
"""

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

import ddpkit

mode = sys.argv[1]
at = int(sys.argv[2]) if len(sys.argv) > 2 else 5
rt = ddpkit.init()
parting = rt.rank == 1

if mode in ("held", "stopped") and parting:
    plain = dist.all_reduce
    calls = 0

    def all_reduce(*args, **kwargs):
        # ddpkit's all_reduce marks the collective, then calls this: stop inside it at step AT
        global calls
        calls += 1
        if calls == at:
            print(f"rank 1 stops in all_reduce #{at}", flush=True)
            if mode == "stopped":
                os.kill(os.getpid(), signal.SIGSTOP)
            threading.Event().wait()  # held: asleep, as behind a network that holds it up
        return plain(*args, **kwargs)

    dist.all_reduce = all_reduce

loader = ddpkit.build_loader(
    [(torch.full((4,), float(i)), torch.tensor([1.0])) for i in range(4 * 2 * 16)],
    batch_size=4,
    shuffle=False,
)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(loader, start=1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if parting and step == at and mode == "barrier":
        print(f"rank 1 calls a barrier at step {step}", flush=True)
        ddpkit.barrier()
    ddpkit.all_reduce(loss.item())
    if parting and step == at and mode == "exit":
        print(f"rank 1 exits 0 after step {step}", flush=True)
        sys.exit(0)
    if step == 12:
        break
print(f"rank {rt.rank} done after {step} steps", flush=True)
