"""Copies of each rank's state on other nodes (``SnapshotConfig(replicas=2)``): what they cost a
step, what they send and hold, how fast a lost node is healed from them, and how they grow with the
world. CPU processes over gloo on this machine, each rank a node of its own (its own job folder in
``/dev/shm``, local rank 0), so every copy leaves its "node" over a socket as it would over the
network (loopback here: no network's bandwidth or latency).

``--part steps``: the DDP tutorials' CNN and the 196-tensor transformer of
``bench/loader_overhead.py`` under ``fsdp`` and ``ddp`` on 2 ranks, a copy in memory after every
step, trained with copies on the other node (``replicas=2``) and without (``replicas=1``) in each
round, in an order that rotates and reverses from round to round; per round the median step (the
time between two steps' ends, the copy and any wait for its transfer included), reported as the
median over rounds of the per-round ratio with a distribution-free 95% interval; with the bytes a
rank sends per copy, a transfer's median time beside training and its thread's CPU time, the
save's stall, and what a rank's copies occupy in ``/dev/shm`` (its own two slots and the two copies
it holds of the other rank). ``--every auto``: the interval the Trainer chooses
(``memory_every_steps=None``) instead, the steps after its choice measured. Target: at most 1.02.

``--part recovery``: two ``ddpkit run --nnodes 2 --nproc 1 --recover in-place`` agents on this
machine train the transformer under ``fsdp`` (a disk snapshot every 10 steps); node b (its agent and
worker) is SIGKILLed once rank 0 has finished step 25, and a new node is started in its place at
once, or was started before as a spare that waits for a place. With copies: healed from rank 0's
copy of rank 1's state; without (``replicas=1``): every rank back to the disk snapshot of step 20.
Reported: the ``recover`` record's phases, from the new node's start (its ``ddpkit run``, and its
worker's process) to the first step after, the steps lost, and from the kill to the first step and
to step 25 done again. Target: the first step at most 2 s after the new node's start.

``--part smaller``: three such agents, ``--nnodes 2:3``, the transformer under ``ddp``, ``fsdp``
and ``zero`` (``--smaller``), the same global batch at every world size; node b is
SIGKILLed after step 25 and none replaces it: past ``--join-timeout`` (20 s here) the job restarts
on the two left and resumes from the old world's copies in memory (``replicas=2``), or from the
disk snapshot of step 20 (``replicas=1``). Reported: the steps lost, from the kill to the first
step at two ranks, and from the new workers' start to it (the resume's part).

``--part scale``: W ranks (each a node) for W in ``--sizes``, rounds of a copy of ``--mib`` MiB to
the next rank: a rank's CPU per round (every thread of its process: the criterion of
docs/scale.md, as the machine has fewer cores than ranks), and the restore's agreement (every
rank's offer gathered, the plan chosen); each fitted as a * W^b and carried to 1,024 ranks.

    python bench/replicas.py                          # every part
    python bench/replicas.py --part steps --rounds 9 --steps 60 [--every auto]
    python bench/replicas.py --part recovery --repeats 3
    python bench/replicas.py --part smaller --repeats 2
    python bench/replicas.py --part scale --sizes 2,4,8,16
    python bench/replicas.py --part device           # on a GPU (scripts/gpu_check.sh runs it)

``--part device``: on a GPU, a state copied into a slot the plain way and from the device (pinned
pages, a side stream, the commit in a thread): the host's stall, the time to whole, and how long the
device's next work waits for the copies.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import io
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ddpkit
from ddpkit.distributed._channels import JOB_DIR_ENV, MEMORY

ROOT = Path(__file__).resolve().parents[1]
_here = Path(__file__).parent
sys.path.insert(0, str(_here))  # loader_overhead imports trainer_overhead as a sibling


def _sibling(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, _here / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- steps: the cost of the copies on a step -------------------------------------------------------


def _as_node(roots: list[str]) -> int:
    """This rank a node of its own: local rank 0, its own job folder."""
    rank = int(os.environ["RANK"])
    os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", JOB_DIR_ENV: roots[rank]})
    return rank


class Stamps:
    def __init__(self, folder: Path, run: str, at: int) -> None:
        self.ends: list[float] = []
        self.folder, self.run, self.at, self.held = folder, run, at, 0

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        self.ends.append(time.perf_counter())
        if trainer.step == self.at:  # what this rank's copies occupy, its own and those it holds
            self.held = sum(p.stat().st_size for p in self.folder.glob(f"{self.run}-*.slot"))


def _fit(
    model: str, strategy: str, replicas: int, steps: int, runs: str, folder: Path, every: int | None
) -> dict:
    from ddpkit.snapshot._slots import run_key
    from ddpkit.training._config import LoggingConfig, SnapshotConfig
    from ddpkit.training._trainer import Trainer, TrainerConfig

    loader_overhead = _sibling("loader_overhead")
    torch.manual_seed(0)
    net, data, loss_fn, batch, _ = loader_overhead.model_case(model, steps * 2 * 32)
    run_dir = os.path.join(runs, f"{model}-{strategy}-{replicas}-{time.monotonic_ns()}")
    run_dir = ddpkit.broadcast_object(run_dir)
    config = TrainerConfig(
        run_dir=run_dir, batch_size=batch, epochs=1, max_steps=steps, num_workers=0,
        strategy=strategy,
        snapshot=SnapshotConfig(every_epochs=0, memory=True, memory_every_steps=every,
                                replicas=replicas),
        logging=LoggingConfig(progress=False, every_steps=10_000),
    )  # fmt: skip
    stamps = Stamps(folder, run_key(run_dir), steps - 2)
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=1e-3), data, config,
                      loss_fn=loss_fn, callbacks=[stamps])  # fmt: skip
    memory = trainer.memory
    assert memory is not None and memory.replicas == replicas, "no memory folder, or no copies"
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit()
    # the interval is chosen after 8 copies, 16 where copies go to the other node
    warm = 5 if every is not None else 20
    gaps = [b - a for a, b in zip(stamps.ends[warm:], stamps.ends[warm + 1 :])]
    rounds = [r for r in memory.rounds if r.carried and not r.stopped]
    chosen = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    (interval,) = [r for r in chosen if r.get("event") == "memory_snapshots"] or [{}]
    return {
        "step": statistics.median(gaps),
        # the saves after the choice (none where it is past the run: those before it)
        "stall": statistics.median(memory.stalls[warm:] or memory.stalls[2:]),
        "transfer": statistics.median(r.seconds for r in rounds) if rounds else 0.0,
        "cpu": statistics.median(r.cpu for r in rounds) if rounds else 0.0,
        "every": trainer.snapshots.schedule.memory_every_steps,
        "sent": max((r.sent for r in rounds), default=0),
        "held": stamps.held,
        "cost": interval.get("transfer_cost_ms", 0.0) / 1e3,
    }


def steps_job(
    roots: list[str], runs: str, cases: list[tuple[str, str]], rounds: int, steps: int,
    every: int | None,
):  # fmt: skip
    rank = _as_node(roots)
    ddpkit.init()
    folder = Path(roots[rank], MEMORY)
    out: dict[str, list[dict]] = {}
    for r in range(rounds):
        order = [1, 2] if r % 2 == 0 else [2, 1]
        for model, strategy in cases[r % len(cases) :] + cases[: r % len(cases)]:
            for replicas in order:
                got = _fit(model, strategy, replicas, steps, runs, folder, every)
                out.setdefault(f"{model}|{strategy}|{replicas}", []).append(got)
    return out


def _median_ci(xs: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free 95% interval (order statistics; the range under 6)."""
    s = sorted(xs)
    n = len(s)
    if n < 6:
        return statistics.median(s), s[0], s[-1]
    k = max(0, int(n / 2 - 0.98 * n**0.5))
    return statistics.median(s), s[k], s[n - 1 - k]


def part_steps(a: argparse.Namespace) -> None:
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="replicas-steps-", dir="/dev/shm"))
    runs = tempfile.mkdtemp(prefix="replicas-runs-")
    roots = [str(tmp / f"node{r}") for r in range(2)]
    for root in roots:
        os.makedirs(os.path.join(root, MEMORY))
    try:
        every = None if a.every == "auto" else int(a.every)
        job = functools.partial(steps_job, roots, runs, cases, a.rounds, a.steps, every)
        out = ddpkit.spawn(job, 2, threads_per_process=1)[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(runs, ignore_errors=True)
    print(f"\n## steps: {a.rounds} rounds x {a.steps} steps, 2 ranks (2 nodes of 1), rank 0, a "
          f"copy every {a.every} step(s)\n")  # fmt: skip
    print(
        "| model | strategy | every, off / on | step, off (ms) | step, on (ms) | on / off (95%) "
        "| sent per copy | transfer (ms) | its CPU (ms) | its cost to a step, as chosen (ms) "
        "| stall, off / on (ms) | held in /dev/shm, off / on |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    names = {"cnn": "the DDP tutorials' CNN", "transformer": "transformer, 196 tensors"}
    for model, strategy in cases:
        off, on = out[f"{model}|{strategy}|1"], out[f"{model}|{strategy}|2"]
        ratios = [b["step"] / x["step"] for x, b in zip(off, on)]
        med, lo, hi = _median_ci(ratios)
        ms = lambda rs, k: 1e3 * statistics.median(r[k] for r in rs)  # noqa: E731
        every = lambda rs: "/".join(str(n) for n in sorted({r["every"] for r in rs}))  # noqa: E731
        print(
            f"| {names[model]} | {strategy} | {every(off)} / {every(on)} | {ms(off, 'step'):.2f} | "
            f"{ms(on, 'step'):.2f} | {med:.3f} ({lo:.3f}-{hi:.3f}) | {on[-1]['sent'] / 1e3:.1f} kB "
            f"| {ms(on, 'transfer'):.2f} | {ms(on, 'cpu'):.2f} | {ms(on, 'cost'):.2f} "
            f"| {ms(off, 'stall'):.2f} / "
            f"{ms(on, 'stall'):.2f} | "
            f"{off[-1]['held'] / 1e6:.2f} / {on[-1]['held'] / 1e6:.2f} MB |"
        )


# -- recovery: a lost node healed from its copies, or from the disk --------------------------------

HOLD_STEP, DISK_EVERY, STEPS = 25, 10, 40
SPARE_WARM = 4.0
"""Seconds a spare is given after it says it waits, for its fork server's imports (2.7 s here)."""


def _process_start() -> float:
    """This process's start, as wall-clock time (the kernel's tick, 10 ms; /proc/stat's boot time
    is in whole seconds, so the age is taken against the boot clock instead)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


class StepTimes:
    """``attempt step time`` after each step, in ``stamps/rank<r>.txt``."""

    def __init__(self, folder: Path, rank: int, attempt: int) -> None:
        self.file = open(folder / f"rank{rank}.txt", "a", buffering=1)  # noqa: SIM115
        self.attempt, self.folder, self.rank = attempt, folder, rank

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        self.file.write(f"{self.attempt} {trainer.step} {time.time()}\n")
        # held at the loss's step until the driver says go (``hold``: its spare is started first)
        held = (self.folder / "hold").exists() and self.rank == 0 and self.attempt == 0
        while held and trainer.step == HOLD_STEP and not (self.folder / "go").exists():
            time.sleep(0.01)


def recovery_job(
    run_dir: str, stamps: str, replicas: int, strategy: str = "fsdp", global_batch: int = 0
) -> None:
    """A node's worker: the transformer under ``strategy``, a copy in memory every step;
    ``global_batch``: the same at every world size (the smaller part's), else the model's batch on
    each rank."""
    from ddpkit.training._config import LoggingConfig, SnapshotConfig
    from ddpkit.training._trainer import Trainer, TrainerConfig

    started = _process_start()
    rt = ddpkit.init()
    folder = Path(stamps)
    (folder / f"start-rank{rt.rank}-attempt{rt.restart_count}").write_text(str(started))
    loader_overhead = _sibling("loader_overhead")
    torch.manual_seed(0)
    net, data, loss_fn, batch, _ = loader_overhead.model_case("transformer", STEPS * 64)
    # the smaller part's job goes from 3 ranks to 2 with the same global batch
    sizes = {"global_batch_size": global_batch} if global_batch else {"batch_size": batch}
    config = TrainerConfig(
        run_dir=run_dir, **sizes, epochs=1, max_steps=STEPS, num_workers=0, strategy=strategy,
        snapshot=SnapshotConfig(every_steps=DISK_EVERY, every_epochs=0, memory=True,
                                memory_every_steps=1, replicas=replicas),
        logging=LoggingConfig(progress=False, every_steps=10_000),
    )  # fmt: skip
    times = StepTimes(folder, rt.rank, rt.restart_count)
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=1e-3), data, config,
                      loss_fn=loss_fn, callbacks=[times])  # fmt: skip
    trainer.fit()
    ddpkit.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _stamps(folder: Path, rank: int) -> list[tuple[int, int, float]]:
    path = folder / f"rank{rank}.txt"
    if not path.exists():
        return []
    return [(int(a), int(s), float(t)) for a, s, t in map(str.split, path.read_text().splitlines())]


def _job_env(shm: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK"))}
    return env | {"DDPKIT_RDZV_SECRET": "b2" * 32, "DDPKIT_MEMORY_ROOT": str(shm),
                  "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
                  "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip


def _lose_node_once(root: Path, replicas: int, i: int, spare: bool = False) -> dict:
    """One loss of node b; with ``spare``, its replacement is started before the loss and waits
    for a place (a spare node), else right after the loss."""
    name = f"{replicas}{'-spare' if spare else ''}-{i}"
    run_dir, stamps = root / f"run-{name}", root / f"stamps-{name}"
    shm = root / "shm"
    for folder in (stamps, shm):
        folder.mkdir(exist_ok=True)
    env = _job_env(shm)
    port = _free_port()
    cmd = [sys.executable, "-m", "ddpkit.cli", "run", "--nnodes", "2", "--nproc", "1",
           "--max-restarts", "3", "--recover", "in-place", "--rdzv-endpoint",
           f"127.0.0.1:{port}", str(Path(__file__).resolve()), "--job", str(run_dir),
           str(stamps), str(replicas)]  # fmt: skip

    def node(label: str) -> subprocess.Popen:
        log = open(root / f"{name}-{label}.log", "w")  # noqa: SIM115
        return subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip

    # node b once node a serves the rendezvous: both on this machine, either could serve it, and b
    # is the node taken away
    a = node("a")
    while not _serving(port):
        if a.poll() is not None:
            raise RuntimeError(f"node a ended: see {root}/{name}-a.log")
        time.sleep(0.05)
    b = node("b")

    def reach(step: int) -> None:
        deadline = time.monotonic() + 600
        while not any(s == step for _, s, _ in _stamps(stamps, 0)):
            if time.monotonic() > deadline or a.poll() is not None:
                raise RuntimeError(f"no step {step}: see {root}/{name}-a.log")
            time.sleep(0.01)

    if spare:  # started after the first step, waiting for a place before the loss
        (stamps / "hold").touch()
        reach(1)
        new_start, b2 = time.time(), node("b2")
        while "waiting for one's place" not in (root / f"{name}-b2.log").read_text():
            if b2.poll() is not None or time.time() - new_start > 120:
                raise RuntimeError(f"the spare is not waiting: see {root}/{name}-b2.log")
            time.sleep(0.05)
        time.sleep(SPARE_WARM)
    reach(HOLD_STEP)
    killed = time.time()
    os.killpg(b.pid, signal.SIGKILL)
    b.wait()
    (stamps / "go").touch()
    if spare:
        b = b2
    else:
        new_start, b = time.time(), node("b2")
    for p in (a, b):
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"a node failed: see {root}/{name}-*.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (event,) = [r for r in records if r.get("event") == "recover"]
    after = [(s, t) for att, s, t in _stamps(stamps, 0) if att == 1]
    done_before = max(s for att, s, _ in _stamps(stamps, 0) if att == 0)
    first_step = after[0][1]
    back = next(t for s, t in after if s >= done_before)
    worker_start = float((stamps / "start-rank1-attempt1").read_text())
    return {
        "source": event["source"], "resumed": event["step"], "lost": done_before - event["step"],
        "phases": event["seconds"], "from_new_node": first_step - new_start,
        "from_new_worker": first_step - worker_start, "kill_to_first": first_step - killed,
        "kill_to_back": back - killed,
    }  # fmt: skip


def part_recovery(a: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="replicas-recovery-"))
    cases = {"copies": (2, False), "spare": (2, True), "disk": (1, False)}
    results: dict[str, list[dict]] = {case: [] for case in cases}
    try:
        for i in range(a.repeats):
            for case in list(cases) if i % 2 == 0 else list(cases)[::-1]:
                replicas, spare = cases[case]
                results[case].append(_lose_node_once(root, replicas, i, spare))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n## recovery: fsdp, the transformer, 2 nodes of 1 rank; node b SIGKILLed after "
          f"step {HOLD_STEP}, a disk snapshot every {DISK_EVERY} steps; {a.repeats} runs each, "
          "medians\n")  # fmt: skip
    print("| from | new node | resumed at | steps lost | leave | decide | regroup | restore | new "
          "node's start to first step | its worker's start to first step | kill to first step | "
          f"kill to step {HOLD_STEP} again |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    labels = {"copies": ("copies in memory", "started after the loss"),
              "spare": ("copies in memory", "a spare, waiting before the loss"),
              "disk": ("disk (replicas=1)", "started after the loss")}  # fmt: skip
    for case, (label, new) in labels.items():
        rs = results[case]

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r["phases"][key] if key in r["phases"] else r[key] for r in rs)

        cells = [f"{med(k):.0f}" for k in ("resumed", "lost")]
        cells += [f"{med(k):.2f}" for k in ("leave", "decide", "regroup", "restore")]
        keys = ("from_new_worker", "kill_to_first", "kill_to_back")
        cells += ["(before the loss)" if case == "spare" else f"{med('from_new_node'):.2f} s"]
        cells += [f"{med(k):.2f} s" for k in keys]
        print(f"| {label}: `{rs[0]['source']}` | {new} | " + " | ".join(cells) + " |")


# -- smaller: a lost node and none to replace it ---------------------------------------------------

JOIN_TIMEOUT = 20


def _lose_node_for_good(root: Path, strategy: str, replicas: int, i: int) -> dict:
    """Three nodes of one rank under ``strategy``, ``--nnodes 2:3``; node b lost after step
    :data:`HOLD_STEP` and none started: the job goes on at two ranks."""
    name = f"smaller-{strategy}-{replicas}-{i}"
    run_dir, stamps, shm = root / f"run-{name}", root / f"stamps-{name}", root / "shm"
    for folder in (stamps, shm):
        folder.mkdir(exist_ok=True)
    port = _free_port()
    cmd = [sys.executable, "-m", "ddpkit.cli", "run", "--nnodes", "2:3", "--nproc", "1",
           "--max-restarts", "3", "--recover", "in-place", "--join-timeout", str(JOIN_TIMEOUT),
           "--rdzv-conf", "last_call_timeout=2", "--rdzv-endpoint", f"127.0.0.1:{port}",
           str(Path(__file__).resolve()), "--job", str(run_dir), str(stamps), str(replicas),
           strategy, "24"]  # fmt: skip

    def node(label: str) -> subprocess.Popen:
        log = open(root / f"{name}-{label}.log", "w")  # noqa: SIM115
        return subprocess.Popen(cmd, env=_job_env(shm), cwd=root, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    a = node("a")
    while not _serving(port):
        if a.poll() is not None:
            raise RuntimeError(f"node a ended: see {root}/{name}-a.log")
        time.sleep(0.05)
    b, c = node("b"), node("c")
    deadline = time.monotonic() + 600
    while not any(s == HOLD_STEP for r in range(3) for _, s, _ in _stamps(stamps, r)):
        if time.monotonic() > deadline or a.poll() is not None:
            raise RuntimeError(f"no step {HOLD_STEP}: see {root}/{name}-a.log")
        time.sleep(0.01)
    killed = time.time()
    os.killpg(b.pid, signal.SIGKILL)
    b.wait()
    for p in (a, c):
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"a node failed: see {root}/{name}-*.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (event,) = [r for r in records if r.get("event") == "resume" and r["world_size"] == 2]
    stamped = [x for r in range(3) for x in _stamps(stamps, r)]
    done_before = max(s for att, s, _ in stamped if att == 0)
    first_step = min(t for att, _, t in stamped if att > 0)
    starts = [float(f.read_text()) for f in stamps.glob("start-rank*-attempt[1-9]*")]
    return {
        "source": event["file"], "resumed": event["step"], "lost": done_before - event["step"],
        "kill_to_first": first_step - killed, "from_new_worker": first_step - max(starts),
    }  # fmt: skip


def part_smaller(a: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="replicas-smaller-"))
    cases = [(strategy, copies) for strategy in a.smaller.split(",") for copies in (2, 1)]
    results: dict[tuple[str, int], list[dict]] = {case: [] for case in cases}
    try:
        for i in range(a.repeats):
            for case in cases if i % 2 == 0 else cases[::-1]:
                results[case].append(_lose_node_for_good(root, *case, i))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n## a lost node and none to replace it: the transformer, 3 nodes of 1 rank, "
          f"--nnodes 2:3, --join-timeout {JOIN_TIMEOUT}; node b SIGKILLed after step {HOLD_STEP}, "
          f"a disk snapshot every {DISK_EVERY} steps; {a.repeats} runs each, medians\n"
          )  # fmt: skip
    print("| strategy | replicas | resumed from | at | steps lost | kill to first step at 2 ranks "
          "| new workers' start to first step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (strategy, copies), rs in results.items():

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        print(f"| {strategy} | {copies} | `{rs[0]['source']}` | {med('resumed'):.0f} | "
              f"{med('lost'):.0f} | {med('kill_to_first'):.2f} s | {med('from_new_worker'):.2f} s "
              "|")  # fmt: skip


# -- scale: a round's cost and the restore's agreement as the world grows --------------------------


def scale_job(root: str, mib: float, rounds: int) -> dict:
    from ddpkit.snapshot import _replicas as rl
    from ddpkit.snapshot import _slots as sl
    from ddpkit.snapshot._choice import choose

    rt = ddpkit.init()
    import torch.distributed as dist

    placement, _ = rl.place(list(range(rt.world_size)), 2)
    assert placement is not None
    folder = Path(root, str(rt.rank))
    folder.mkdir()
    files = rl.ReplicaFiles(folder, job="id:x", run="run", world_size=rt.world_size,
                            sources=placement.sources(rt.rank))  # fmt: skip
    courier = rl.Courier(placement, rt.rank, rt.world_size, dist.new_group(backend="gloo"), files)
    n = int(mib * 2**20 / 4)
    cpu, offers = [], []
    for step in range(1, rounds + 1):
        values = {"job": "id:y", "run": "run", "rank": rt.rank, "world_size": rt.world_size,
                  "step": step, "position": [0, step, step]}  # fmt: skip
        payload = torch.frombuffer(bytearray(sl.pack(values, [torch.full((n,), float(step))])),
                                   dtype=torch.uint8)  # fmt: skip
        ddpkit.barrier()
        c0 = time.process_time()
        courier.submit(step, payload)
        result = courier.settle()
        cpu.append(time.process_time() - c0)
        assert result is not None and result.error is None and not result.damaged, result
        # the restore's agreement: every rank's offer, gathered; the plan, chosen on every rank
        c0 = time.process_time()
        held = files.found()
        offer = {"own": [[0, step, step]] if rt.rank else [],
                 "replicas": {str(p): [list(x) for x in ps] for p, ps in held.items()}}  # fmt: skip
        choice = choose(ddpkit.all_gather_object(offer))
        offers.append(time.process_time() - c0)
        assert choice is not None and choice.sources == ((0, placement.partners[0][0]),)
    courier.close()
    return {"round": statistics.median(cpu[1:]), "restore": statistics.median(offers[1:])}


def part_scale(a: argparse.Namespace) -> None:
    scale = _sibling("scale")
    sizes = [int(s) for s in a.sizes.split(",")]
    rows: dict[str, list[tuple[int, float]]] = {"round": [], "restore": []}
    medians: dict[str, list[float]] = {"round": [], "restore": []}
    for w in sizes:
        tmp = tempfile.mkdtemp(prefix="replicas-scale-", dir="/dev/shm")
        try:
            out = ddpkit.spawn(functools.partial(scale_job, tmp, a.mib, a.scale_rounds), w)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for key in rows:
            rows[key].append((w, max(o[key] for o in out)))
            medians[key].append(statistics.median(o[key] for o in out))
    print(f"\n## scale: a copy of {a.mib:g} MiB to the next rank, {a.scale_rounds} rounds; the "
          "largest rank's CPU (ms) in a median round, the median rank's in brackets\n")  # fmt: skip
    print("| cost | " + " | ".join(f"{w} ranks" for w in sizes) + " | b (95%) | 1,024 ranks |")
    print("|---|" + "---|" * (len(sizes) + 2))
    labels = {"round": "a transfer round (send, receive, check, commit)",
              "restore": "the restore's agreement (offers gathered, plan chosen)"}  # fmt: skip
    for key, points in rows.items():
        fitted = scale.fit(points)
        cells = " | ".join(
            f"{1e3 * y:.2f} ({1e3 * m:.2f})" for (_, y), m in zip(points, medians[key])
        )
        if fitted is None:
            print(f"| {labels[key]} | {cells} | - | - |")
            continue
        coef, b, half = fitted
        print(f"| {labels[key]} | {cells} | {b:.2f} ± {half:.2f} | {1e3 * coef * 1024**b:.1f} ms |")
    took = statistics.median(_plan_at(1024, 8) for _ in range(5))
    print(f"\nThe plan alone (choose(), every rank computes it) at 1,024 ranks, nodes of 8, the "
          f"last node lost: {1e3 * took:.1f} ms (measured, one process)")  # fmt: skip
    took, gathered = (statistics.median(x) for x in zip(*(_reshard_at(1024, 8) for _ in range(3))))
    print(f"The reshard's plan at 1,024 ranks under fsdp (the last node of 8 lost, the job "
          f"restarted on 1,016; 600 tensors cut along dim 0, as the transformer's parameters and "
          f"Adam's two states): {took:.2f} s on one rank (its pieces, taken and given), "
          f"{gathered / 2**20:.0f} MiB of places gathered on every rank (measured, one process)"
          )  # fmt: skip


# -- device: the copy from a GPU, pinned and on a side stream, against a plain one -----------------


def part_device(a: argparse.Namespace) -> None:
    """On one GPU: a state of ``--device-mib`` MiB copied into a slot the plain way (``Slots.save``:
    the host waits for the copies into pageable pages) and from the device (``save_from_device``:
    pinned pages, a side stream; the host returns at once, the commit waits in a thread); the host's
    stall, the time to whole, and the device's time the next step waits, medians of 5 after one."""
    if not torch.cuda.is_available():
        print("\n## device: skipped, no CUDA device")
        return
    from ddpkit.snapshot import _codec as codec
    from ddpkit.snapshot import _slots as sl

    folder = Path(tempfile.mkdtemp(prefix="replicas-device-", dir="/dev/shm"))
    print(f"\n## device: {torch.cuda.get_device_name()}, the copy of a state into a slot\n")
    print(
        "| state | plain: stall (= whole) | from the device: stall | to whole | the device waits |"
    )
    print("|---|---|---|---|---|")
    try:
        for mib in [int(m) for m in a.device_mib.split(",")]:
            tensors = [torch.randn(mib * 2**18 // 8, device="cuda") for _ in range(8)]
            specs, size = codec.layout(tensors)
            manifest = {"specs": [[x.dtype, list(x.shape), x.offset] for x in specs],
                        "data_size": size}  # fmt: skip
            st = sl.Slots(folder, job="id:d", run=f"run{mib}", rank=0, world_size=1)
            side, plain, stall, whole, waits = torch.cuda.Stream(), [], [], [], []
            for i in range(6):
                values = {"step": i, "position": [0, i, i]}
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                st.save(values, tensors, manifest, "x")
                plain.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                before = torch.cuda.Event(enable_timing=True)
                after = torch.cuda.Event(enable_timing=True)
                before.record()  # the step's end, on the current stream
                t0 = time.perf_counter()
                commit = st.save_from_device(values, tensors, manifest, "x", side)
                stall.append(time.perf_counter() - t0)
                after.record()  # the next step's first work waits for the copies
                commit()
                whole.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                waits.append(before.elapsed_time(after) / 1e3)
            st.close()
            med = lambda xs: 1e3 * statistics.median(xs[1:])  # noqa: E731
            print(f"| {mib} MiB | {med(plain):.1f} ms | {med(stall):.2f} ms | "
                  f"{med(whole):.1f} ms | {med(waits):.1f} ms |")  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _plan_at(world: int, per_node: int) -> float:
    """Seconds :func:`~ddpkit.snapshot._choice.choose` takes to plan a restore of ``world`` ranks
    (nodes of ``per_node``, two copies each, the last node lost), measured here in one process."""
    from ddpkit.snapshot import _replicas as rl
    from ddpkit.snapshot._choice import choose

    placement, _ = rl.place([r // per_node for r in range(world)], 2)
    assert placement is not None
    lost = set(range(world - per_node, world))
    positions = [[0, 9, 9], [0, 10, 10]]
    offers = [
        {
            "own": [] if r in lost else positions,
            "replicas": {} if r in lost else {str(p): positions for p in placement.sources(r)},
        }
        for r in range(world)
    ]
    t0 = time.perf_counter()
    choice = choose(offers)
    took = time.perf_counter() - t0
    assert choice is not None and len(choice.sources) == per_node
    return took


def _reshard_at(world: int, per_node: int, tensors: int = 600) -> tuple[float, int]:
    """Seconds :func:`~ddpkit.snapshot._resized.plan` takes one rank (rank 5, which also reads an
    old rank's copy) to find the pieces it takes and gives when ``world`` ranks under ``fsdp``
    restart on ``world - per_node``, and the bytes of places every rank gathers (its own and the
    old ranks'), measured here in one process."""
    import pickle

    from ddpkit.snapshot._resized import plan

    def boxes(ranks: int, rows: int) -> list[tuple]:
        chunk = -(-rows // ranks)  # torch.chunk's cut, as fully_shard's Shard(0)
        return [((min(r * chunk, rows), 0), (max(0, min(chunk, rows - r * chunk)), 64), (rows, 64))
                for r in range(ranks)]  # fmt: skip

    new_world = world - per_node
    old: dict[int, dict] = {r: {} for r in range(world)}
    new: list[dict] = [{} for _ in range(new_world)]
    for t in range(tensors):
        path, rows = ("optim", f"layers.{t}.weight", "exp_avg"), 4096 + t
        for r, box in enumerate(boxes(world, rows)):
            old[r][path] = (box, "torch.float32")
        for r, box in enumerate(boxes(new_world, rows)):
            new[r][path] = (box, "torch.float32")
    givers = tuple(r % new_world for r in range(world))
    t0 = time.perf_counter()
    pieces, missing = plan(old, new, givers, 5)
    took = time.perf_counter() - t0
    assert pieces and not missing
    gathered = sum(len(pickle.dumps(x)) for x in [*old.values(), *new])
    return took, gathered


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        recovery_job(sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6],
                     *map(int, sys.argv[6:7]))  # fmt: skip
        return
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--part", choices=("steps", "recovery", "smaller", "scale", "device", "all"),
                   default="all")  # fmt: skip
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--every", default="1", help="the steps part's copy interval: N, or auto (the "
                   "Trainer's choice)")  # fmt: skip
    p.add_argument("--cases", default="cnn:fsdp,transformer:fsdp,cnn:ddp,transformer:ddp",
                   help="model:strategy pairs of the steps part")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smaller", default="ddp,fsdp,zero", help="the smaller part's strategies")
    p.add_argument("--sizes", default="2,4,8,16")
    p.add_argument("--mib", type=float, default=4.0)
    p.add_argument("--scale-rounds", type=int, default=6)
    p.add_argument("--device-mib", default="64,512,2048", help="the device part's state sizes")
    p.add_argument("--keep", action="store_true", help="keep the recovery's folder (its logs)")
    a = p.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"# copies on other nodes: {platform.node()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, gloo, 1 thread a rank; {now}")  # fmt: skip
    parts = (("steps", part_steps), ("recovery", part_recovery), ("smaller", part_smaller),
             ("scale", part_scale), ("device", part_device))  # fmt: skip
    for part, run in parts:
        if a.part in (part, "all"):
            run(a)


if __name__ == "__main__":
    main()
