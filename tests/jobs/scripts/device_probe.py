"""A job for the device tests; the first argument picks what it does.

- ``info DIR``: on every rank, the device and backend ddpkit chose and the results of its
  collectives on tensors of that device, written to ``DIR/rank<N>.json``.
- ``where``: (plain python) the device and backend chosen, and the UUID of the GPU the device is,
  printed as JSON.
- ``hang``: (one rank under ``ddpkit run``, CUDA) an all-reduce queued behind a kernel that keeps
  the GPU busy for minutes: the collective cannot finish within the collective timeout, as when a
  peer never joins.
- ``env``: print the flight recorder's variables as this process sees them, as JSON.
- ``dump-and-fail``: write a file where nccl's flight recorder would write this rank's record, then
  fail (the launcher's report of the record, without a GPU).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ddpkit
from ddpkit._launch.cli.run import flight_recorder_vars

mode, rest = sys.argv[1], sys.argv[2:]
BUFFER_SIZE, DUMP_FILE = flight_recorder_vars()
FLIGHT_RECORDER = (BUFFER_SIZE, "TORCH_NCCL_DUMP_ON_TIMEOUT", DUMP_FILE, "TORCH_DISTRIBUTED_DEBUG")


def gpu_uuid(device: torch.device) -> str | None:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


if mode == "where":
    rt = ddpkit.init()
    x = torch.ones(64, 64, device=rt.device)
    print(
        json.dumps(
            {
                "device": str(rt.device),
                "backend": rt.backend,
                "uuid": gpu_uuid(rt.device),
                "tensor": str(x.device),
                "sum": float((x @ x).sum()),
            }
        ),
        flush=True,
    )
    sys.exit(0)
if mode == "env":
    print(json.dumps({k: os.environ.get(k) for k in FLIGHT_RECORDER}), flush=True)
    sys.exit(0)
if mode == "dump-and-fail":
    Path(os.environ[DUMP_FILE] + os.environ["RANK"]).write_text("a record\n")
    sys.exit(3)

rt = ddpkit.init()
cuda = rt.device.type == "cuda"
if mode == "info":
    t = torch.full((3,), float(rt.rank + 1), device=rt.device)
    dist.all_reduce(t)  # in place, on the rank's device: nccl reduces CUDA tensors only
    gathered = ddpkit.gather_tensors(
        torch.arange(rt.rank + 1, dtype=torch.float32, device=rt.device)
    )
    record = {
        "rank": rt.rank,
        "local_rank": rt.local_rank,
        "world_size": rt.world_size,
        "device": str(rt.device),
        "backend": rt.backend,
        "current_device": torch.cuda.current_device() if cuda else None,
        "uuid": gpu_uuid(rt.device),
        "all_reduce": t.tolist(),
        "all_reduce_device": str(t.device),
        "number": ddpkit.all_reduce(rt.rank + 1),
        "metrics": ddpkit.all_reduce(
            {"loss": torch.tensor(0.5, device=rt.device) * (rt.rank + 1), "n": 2}
        ),
        "gathered": gathered.tolist(),
        "gathered_device": str(gathered.device),
        "broadcast": ddpkit.broadcast_object({"from": rt.rank, "device": str(rt.device)}),
    }
    record["metrics"] = {k: float(v) for k, v in record["metrics"].items()}
    ddpkit.barrier()
    Path(rest[0], f"rank{rt.rank}.json").write_text(json.dumps(record))
elif mode == "hang":
    assert cuda and rt.world_size == 1, "hang: one rank on a GPU"
    # the communicator is made, outside the timed collective
    ddpkit.all_reduce(torch.ones(1, device=rt.device))
    torch.cuda.synchronize()
    # A spin kernel (torch's own test helper, the one way to keep a GPU busy for a set number of
    # cycles): the all-reduce queued after it on the same stream cannot start, so it outlives the
    # collective timeout, as it would waiting for a peer. 2.4e10 cycles: about 12 s at 2 GHz, past a
    # timeout of 5 s, and short enough that a teardown waiting for the kernel ends within a minute
    # or so. (ddpkit.all_reduce would first copy its input to the host, which waits behind the
    # kernel before the collective is even queued: torch's own all_reduce queues it at once.)
    torch.cuda._sleep(24_000_000_000)
    t = torch.ones(1, device=rt.device)
    dist.all_reduce(t)
    print("queued the all-reduce behind the busy GPU", flush=True)
    t.cpu()  # waits for it; nccl's watchdog ends the process first
    print("the all-reduce finished: no hang", flush=True)
ddpkit.shutdown()
