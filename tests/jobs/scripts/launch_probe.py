"""A job for launcher tests; the first argument picks what it does.

- ``args ARGS...``: print the arguments the script received, on every rank.
- ``no-init``: build a loader without calling ``ddpkit.init()`` (a mistake the launcher's variables
  reveal).
- ``pids DIR``: write each rank's pid to ``DIR/rankN.pid``, then wait to be killed (at most 120 s).
- ``hold-usr1 DIR``: like ``pids``, then wait for a SIGUSR1 sent from outside; exit 75 (pre-empted)
  once every rank has one, as a Trainer stopped by a signal does.
- ``hold-term DIR``: like ``hold-usr1``, for SIGTERM (the script handles it itself, as a Trainer
  does).
- ``preempted``: on the first attempt exit 75 on every rank at once (as a pre-empted Trainer); on a
  later one (a restart or a requeue) finish with 0. Prints the attempt.
- ``hang``: rank 1 sleeps in user code while rank 0 waits for it in an all-reduce.
- ``mismatch``: rank 0 all-reduces 3 numbers, rank 1 two.
- ``info``: print rank, world size, launcher, restart count and rendezvous port, and check an
  all-reduce.
- ``family HOW DIR``: each rank starts ``sleep`` (in its process group), a forked child that ignores
  SIGTERM, and ``sleep`` in a session of its own, and writes their pids to
  ``DIR/attempt<N>-rank<R>.pids`` (its own to ``.worker``); on a restart it first prints which of
  the previous attempt's are still alive. Then by HOW: ``end`` finishes, ``fail`` fails on rank 1,
  ``fail-first`` fails on rank 1 in the first attempt only, ``hold`` waits to be killed.
- ``wait-for DIR``: write the rank's pid to ``DIR/rank<R>.pid``; once ``DIR/go`` exists (at most 120
  s), print rank, world size, the sum of an all-reduce, and whether the job's secret is in its
  environment.
"""

import os
import sys
import time
from pathlib import Path

import torch

import ddpkit
from ddpkit._errors import Preempted
from ddpkit.distributed._signals import pending_stop_signal

mode, rest = sys.argv[1], sys.argv[2:]
if mode == "no-init":
    loader = ddpkit.build_loader(
        torch.utils.data.TensorDataset(torch.arange(12.0)), batch_size=2, num_workers=0
    )
    print(f"trained on {sum(len(b[0]) for b in loader)} samples", flush=True)
    sys.exit(0)

rt = ddpkit.init()
if mode == "args":
    print(f"rank={rt.rank} argv={rest}", flush=True)
elif mode in ("pids", "hold-usr1", "hold-term"):
    if mode == "hold-term":
        import signal

        terms = []
        signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    Path(rest[0], f"rank{rt.rank}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if mode == "hold-term" and terms and ddpkit.all_reduce(1) == rt.world_size:
            print(f"rank={rt.rank} stopping on SIGTERM", flush=True)
            raise Preempted(step=0, signal_name="SIGTERM")
        if mode == "hold-usr1" and pending_stop_signal() is not None:
            # Agree that every rank got it, as the Trainer does at its next step.
            if ddpkit.all_reduce(1) == rt.world_size:
                print(f"rank={rt.rank} stopping on {pending_stop_signal().name}", flush=True)
                raise Preempted(step=0, signal_name=pending_stop_signal().name)
        time.sleep(0.05)
    sys.exit(3)
elif mode == "preempted":
    print(f"rank={rt.rank} attempt={rt.restart_count}", flush=True)
    ddpkit.barrier()
    if rt.restart_count == 0:
        raise Preempted(step=0, signal_name="SIGUSR1")
elif mode == "hang":

    def stuck_in_user_code():
        time.sleep(300)

    if rt.rank == 1:
        stuck_in_user_code()
    ddpkit.all_reduce(1)
elif mode == "mismatch":
    import torch.distributed as dist

    dist.all_reduce(torch.ones(3 if rt.rank == 0 else 2))
elif mode == "family":
    import signal
    import subprocess

    how, folder = rest[0], Path(rest[1])

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in (
                "Z",
                "X",
            )
        except FileNotFoundError:
            return False

    if rt.restart_count:
        files = folder.glob(f"attempt{rt.restart_count - 1}-rank*.pids")
        before = [int(pid) for f in files for pid in f.read_text().split()]
        print(
            f"rank={rt.rank} attempt={rt.restart_count} alive from the attempt before: "
            f"{[pid for pid in before if alive(pid)]} of {len(before)}",
            flush=True,
        )
    sleeper = subprocess.Popen(["sleep", "1000"])
    # ignored from the fork on: no window to die in
    term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stubborn = os.fork()
    if stubborn == 0:
        time.sleep(1000)
        os._exit(0)
    signal.signal(signal.SIGTERM, term)
    detached = subprocess.Popen(["sleep", "1001"], start_new_session=True)
    tmp = folder / f".attempt{rt.restart_count}-rank{rt.rank}"
    tmp.write_text(f"{sleeper.pid} {stubborn} {detached.pid}")
    tmp.rename(folder / f"attempt{rt.restart_count}-rank{rt.rank}.pids")
    (folder / f"attempt{rt.restart_count}-rank{rt.rank}.worker").write_text(str(os.getpid()))
    ddpkit.barrier()
    if rt.rank == 1 and (how == "fail" or how == "fail-first" and rt.restart_count == 0):
        raise RuntimeError("planned failure")
    deadline = time.monotonic() + 120
    while how == "hold" and time.monotonic() < deadline:
        time.sleep(0.05)
elif mode == "wait-for":
    Path(rest[0], f"rank{rt.rank}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not Path(rest[0], "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    total = ddpkit.all_reduce(rt.rank + 1)
    print(
        f"rank={rt.rank} world={rt.world_size} sum={total} "
        f"secret={'DDPKIT_RDZV_SECRET' in os.environ}",
        flush=True,
    )
elif mode == "info":
    from ddpkit.distributed._environment import read_launch_env

    total = ddpkit.all_reduce(rt.rank + 1)
    print(
        f"rank={rt.rank} world={rt.world_size} launcher={rt.launcher} restarts={rt.restart_count} "
        f"port={read_launch_env().master_port} sum={total} tag={' '.join(rest)}",
        flush=True,
    )
ddpkit.shutdown()
