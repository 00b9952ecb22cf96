"""The scale benchmark's job (``bench/scale.py``): the control plane of one ddpkit job, timed on
every rank.

The model is ``--tensors`` small parameter tensors (8 floats each, summed into a 4-class linear
head): the number of tensors drives a snapshot's planning and index, not its bytes. Under
``ddpkit run --max-restarts 1`` with memory snapshots on, each rank:

1. starts, imports, joins the process group (``ddpkit.init``), builds the Trainer, trains
   ``--steps`` steps with a copy in memory after each; on the first attempt, rank ``world - 1``
   SIGKILLs itself after step ``--kill-at`` (the restart is then timed by the agent's and the ranks'
   events, as ``bench/goodput.py``);
2. once training ends: ``--repeats`` times each, a disk snapshot of the Trainer's state written
   synchronously (stages: values gathered, planned, written, indexed, marked), the same written
   asynchronously (the stall: until the save returns), found and loaded back (stages: found and
   verified, planned, read), an exact evaluation of ``--eval-samples`` samples, and
   ``split_world(2)`` (the search's groups).

Each stage is timed on every rank by the wall clock and by the process's CPU time (every thread of
it). On a machine with fewer cores than ranks the wall clock counts the waits for a core; a rank's
CPU time is the work it would do on a core of its own. Every event is one JSON line in
``--timeline``.
"""

import os
import time

T_SCRIPT = time.time()

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from goodput_job import Marks, Timeline, proc_start  # noqa: E402  (the goodput benchmark's events, read alike)


class Stages:
    """Marks inside one timed operation: each mark ends a stage, timed by wall clock and process CPU
    time."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float, float]] | None = None

    def start(self) -> None:
        self.marks = [("start", time.perf_counter(), time.process_time())]

    def mark(self, stage: str) -> None:
        if self.marks is not None:
            self.marks.append((stage, time.perf_counter(), time.process_time()))

    def stop(self) -> dict[str, list[float]]:
        """{stage: [wall seconds, cpu seconds]}, each since the mark before it; a stage marked twice
        adds up."""
        marks, self.marks = self.marks or [], None
        out: dict[str, list[float]] = {}
        for (_, w0, c0), (stage, w1, c1) in zip(marks, marks[1:]):
            wall, cpu = out.get(stage, [0.0, 0.0])
            out[stage] = [wall + w1 - w0, cpu + c1 - c0]
        return out


STAGES = Stages()


def instrument() -> None:
    """Wrap the points of ddpkit's snapshot path where one stage ends and the next begins. Nothing
    else changes: each wrapper calls the original."""
    import torch.distributed.checkpoint as dcp

    from ddpkit.snapshot import _dcp as storage
    from ddpkit.snapshot import _disk as manager

    def after(owner, name: str, stage: str, before: str | None = None) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if before is not None:
                STAGES.mark(before)
            result = original(*args, **kwargs)
            STAGES.mark(stage)
            return result

        setattr(owner, name, wrapped)

    # save: DiskStore.save gathers every rank's values (rank 0 empties the folder), then
    # dcp.save plans (each rank's local plan, rank 0's global plan), writes, and rank 0 writes the
    # index; the marker last.
    after(dcp, "save", "indexed")
    after(storage.Writer, "write_data", "written", before="planned")
    after(manager.DiskStore, "_write", "marked", before="values gathered")
    # load: latest() finds and verifies (rank 0 hashes every file), load() reads values.pt and the
    # index, then dcp.load plans and reads.
    after(manager.DiskStore, "latest", "found and verified")
    after(storage.Reader, "read_data", "read", before="planned")

    # A copy in memory: its CPU time (the Trainer keeps its wall time, MemoryStore.stalls).
    from ddpkit.snapshot._memory import MemoryStore

    original = MemoryStore._save_timed

    def save_timed(self, parts):
        c0 = time.process_time()
        original(self, parts)
        COPY_CPU.append(time.process_time() - c0)

    MemoryStore._save_timed = save_timed


COPY_CPU: list[float] = []


def model_of(tensors: int):
    import torch
    from torch import nn

    class ManyTensors(nn.Module):
        """``tensors`` parameters of 8 floats; the first is a linear head's bias-free weight (8 -> 4
        by view), the others add their sum to its input: every tensor gets a gradient."""

        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ParameterList(
                nn.Parameter(torch.randn(8) * 0.1) for _ in range(tensors)
            )
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            shift = torch.stack(list(self.parts)).sum(0)
            return self.head(x + shift)

    return ManyTensors()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--timeline", required=True)
    p.add_argument("--tensors", type=int, default=10)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-at", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eval-samples", type=int, default=1000)
    a = p.parse_args()
    mark = Timeline(a.timeline)
    mark("proc_start", proc_start())
    mark("script", T_SCRIPT)

    import torch

    import ddpkit
    from ddpkit.snapshot._disk import DiskStore
    from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig

    mark("imports")
    rt = ddpkit.init()
    mark("init")
    instrument()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = 16 * rt.world_size * (a.steps + 1)
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    )
    held_out = torch.utils.data.TensorDataset(
        torch.randn(a.eval_samples, 8, generator=g),
        torch.randint(0, 4, (a.eval_samples,), generator=g),
    )
    model = model_of(a.tensors)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def kill_once(trainer) -> None:
        if rt.restart_count == 0 and trainer.step == a.kill_at and rt.rank == rt.world_size - 1:
            mark("kill")
            os.kill(os.getpid(), signal.SIGKILL)

    config = TrainerConfig(
        run_dir=a.run_dir,
        epochs=1000,
        max_steps=a.steps,
        batch_size=16,
        num_workers=0,
        weights_format=None,
        snapshot=SnapshotConfig(every_epochs=0, memory=True, memory_every_steps=1),
        logging=LoggingConfig(progress=False, every_steps=1000),
    )
    trainer = ddpkit.Trainer(
        model, optimizer, data, config, callbacks=[Marks(mark, after_step=kill_once)]
    )
    mark("built")
    trainer.fit()
    mark("trained", step=trainer.step)
    copies = trainer.memory.stalls if trainer.memory is not None else []

    def timed(name: str, run) -> None:
        for i in range(a.repeats):
            STAGES.start()
            run(i)
            STAGES.mark("end")
            mark("timed", what=name, repeat=i, stages=STAGES.stop())

    # What Snapshots.save hands the disk store: the strategy's state (DCP's part), the rest,
    # each rank's own.
    parts = trainer.snapshots.parts()
    state, extra = parts.strategy.state_dict(), parts.values
    shared = {"replicated": trainer.strategy.replicated, "own": parts.own}
    folder = trainer.run_dir / "scale"
    sync = DiskStore(folder / "sync", keep_last=1)
    timed("save", lambda i: sync.save(10_000 + i, state, extra, **shared))
    background = DiskStore(folder / "async", keep_last=1, async_write=True)

    def save_async(i: int) -> None:
        background.save(10_000 + i, state, extra, **shared)
        STAGES.mark("stall")
        background.wait()
        STAGES.mark("written in the background")

    timed("async save", save_async)

    def load(i: int) -> None:
        found = sync.latest()
        sync.load(found, trainer.strategy.state_dict, map_location="cpu")

    timed("load", load)
    timed("evaluate", lambda i: trainer.evaluate(held_out))
    timed("split_world", lambda i: ddpkit.split_world(2))
    mark("done", copies=[[w, c] for w, c in zip(copies, COPY_CPU)])
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
