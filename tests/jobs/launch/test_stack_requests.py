"""Looking never kills: a stack request to ``ddpkit run`` (SIGUSR2), or to a worker's pid, is safe
while the worker's other threads run, at any instant of a job, its start and end included; SIGUSR1
and SIGUSR2 never end the launcher as its job ends; a stuck loader worker's stack can be asked for.

Real jobs under ``ddpkit run``. Each test has its control, which fails on the old mechanism: a
request was a SIGUSR2 to each worker, answered by ``faulthandler`` walking every thread's frames
from the signal handler, and the launcher gave SIGUSR1/SIGUSR2 their default action back once its
workers were gone. The pauses between requests are the load under test (the rates of the reports:
a burst, then one every 0.02 to 0.25 s), never a wait for something to happen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpkit._launch.agent import jobdir
from ddpkit.distributed import _channels as channels
from ddpkit.testing import start_job, wait_until
from tests.jobs.conftest import memory_environ

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs and /proc"),
]

# A Trainer that snapshots every step in its background thread (a thread started and ended at each
# step) until the test creates FOLDER/stop. OLD_HANDLER=1: the old request's answer, faulthandler on
# SIGUSR2 with all_threads=True, as ddpkit's worker registered it.
SNAPSHOT_JOB = """
import faulthandler, os, signal, sys
from pathlib import Path
import torch
import ddpkit
from ddpkit import SnapshotConfig
from ddpkit.training._trainer import Callback
from ddpkit.training._config import LoggingConfig, TrainerConfig
from ddpkit.training._step import StopReason
from ddpkit.training._trainer import Trainer

folder = Path(sys.argv[1])
rt = ddpkit.init()
if os.environ.get("OLD_HANDLER"):
    dump = open(folder / f"old-rank{rt.rank}.txt", "w")
    faulthandler.register(signal.SIGUSR2, file=dump, all_threads=True)


class UntilStop(Callback):
    def on_step_end(self, trainer, taken, output):
        if trainer.step == 2:
            (folder / f"rank{rt.rank}.training").write_text(str(os.getpid()))
        if ddpkit.all_reduce(int((folder / "stop").exists())):  # every rank stops at one step
            trainer.stopped_by = StopReason.MAX_STEPS


g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(
    torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
)
model = torch.nn.Linear(4, 2)
config = TrainerConfig(
    run_dir=str(folder / "run"),
    epochs=1_000_000,
    global_batch_size=8,
    num_workers=0,
    snapshot=SnapshotConfig(every_steps=1, async_write=True, keep=1),
    logging=LoggingConfig(progress=False, every_steps=1000, step_timings=False),
)
trainer = Trainer(
    model,
    torch.optim.SGD(model.parameters(), lr=0.1),
    data,
    config,
    loss_fn=torch.nn.functional.cross_entropy,
    callbacks=[UntilStop()],
)
trainer.fit()
print(f"rank {rt.rank} stopped at step {trainer.step}", flush=True)
"""

# Every rank says it runs, waits for FOLDER/go, and ends (no Trainer: a held SIGUSR1 stops nothing).
SHORT_JOB = """
import os, sys
from pathlib import Path
import ddpkit
from ddpkit.testing import wait_until

folder = Path(sys.argv[1])
rt = ddpkit.init()
(folder / f"rank{rt.rank}.pid").write_text(str(os.getpid()))
wait_until(lambda: (folder / "go").exists(), 120, what="the test's go")
ddpkit.barrier()
ddpkit.shutdown()
"""

# One rank whose single loader worker (num_workers=1) hangs in __getitem__ until FOLDER/release.
# LOADER=plain: torch's own DataLoader, not build_loader's.
LOADER_JOB = """
import os, sys, time
from pathlib import Path
import torch
import ddpkit
import ddpkit.data

folder = Path(sys.argv[1])


class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        (folder / "loader.pid").write_text(str(os.getpid()))
        while not (folder / "release").exists():
            time.sleep(0.02)  # the hang under test
        return torch.zeros(2)


ddpkit.init()
if os.environ.get("LOADER") == "plain":
    loader = torch.utils.data.DataLoader(Stuck(), batch_size=2, num_workers=1)
else:
    loader = ddpkit.data.build_loader(Stuck(), batch_size=2, num_workers=1, shuffle=False)
for batch in loader:
    pass
ddpkit.shutdown()
"""

# `ddpkit run` with its agent as it was: a control's launcher. OLD_FORWARD: SIGUSR2 is sent on to
# the workers as a signal. OLD_DEFAULTS: SIGUSR1 and SIGUSR2 get their default action back once the
# workers are gone.
OLD_LAUNCHER = """
import os, signal
from ddpkit._launch.agent import agent
from ddpkit.distributed import _channels as channels
if os.environ.get("OLD_FORWARD"):
    def forward():
        for pid in agent.Agent.current.worker_pids() if agent.Agent.current else []:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
    channels.request_every_stack = forward

if os.environ.get("OLD_DEFAULTS"):
    uninstall = agent.uninstall
    def old_uninstall():
        uninstall()
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
    agent.uninstall = old_uninstall

from ddpkit.cli import entry
entry()
"""


@pytest.fixture
def env(user_env, tmp_path) -> dict[str, str]:
    """A user's environment, the job folders under ``tmp_path/shm``."""
    return memory_environ(user_env, tmp_path)


def _start(
    tmp_path: Path,
    job: str,
    env: dict[str, str],
    *launcher: str,
    nproc: int = 2,
    old: bool = False,
) -> tuple[subprocess.Popen, Path]:
    """``ddpkit run --nproc NPROC LAUNCHER job.py FOLDER`` (the old agent where ``old``), in
    ``tmp_path``, with ``FOLDER`` made for the job."""
    folder = tmp_path / "job"
    folder.mkdir(parents=True)
    script = tmp_path / "job.py"
    script.write_text(job)
    if not old:
        proc = start_job(
            script, str(folder), nproc=nproc, launcher_args=launcher, env=env, cwd=tmp_path,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        return proc, folder
    proc = subprocess.Popen(
        [sys.executable, "-c", OLD_LAUNCHER, "run", "--nproc", str(nproc), *launcher, str(script),
         str(folder)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    return proc, folder


def _end(proc: subprocess.Popen, timeout: float = 240) -> str:
    """The launcher's output once it has ended; killed with its whole session past ``timeout``."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the job did not end\n{out[-4000:]}") from None
    return out


def _stack_dir(proc: subprocess.Popen, env: dict[str, str], monkeypatch) -> Path:
    """The job's stack folder, once the launcher has made its job folder (it handles SIGUSR1 and
    SIGUSR2 by then); this process asks through that job folder from now on."""
    base = Path(env[jobdir.ROOT_ENV]) / f"ddpkit-memory-{os.getuid()}"

    def made() -> Path | None:
        if proc.poll() is not None:
            raise AssertionError(f"the launcher ended first:\n{proc.communicate()[0][-4000:]}")
        return next(iter(base.glob("[0-9a-f]*/stacks")), None)

    stacks = wait_until(made, 120, what="the stack folder")
    monkeypatch.setenv(channels.JOB_DIR_ENV, str(stacks.parent))
    return stacks


def _running(
    proc: subprocess.Popen, paths: list[Path], what: str, or_ended: bool = False
) -> list[int]:
    """The pids in ``paths`` once all are written; with ``or_ended``, [] if the launcher ends
    first."""

    def ready() -> tuple[list[int]] | None:
        if proc.poll() is not None:
            if or_ended:
                return ([],)
            raise AssertionError(f"the job ended first:\n{proc.communicate()[0][-4000:]}")
        return ([int(p.read_text()) for p in paths],) if all(p.exists() for p in paths) else None

    (pids,) = wait_until(ready, 180, what=what)
    return pids


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (exited, or a zombie not yet collected)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _stop(proc: subprocess.Popen, folder: Path) -> str:
    (folder / "stop").touch()
    return _end(proc)


@pytest.mark.slow
@pytest.mark.timeout(600)  # two 2-rank jobs on 2 shared cores, one asked 1,300 times
def test_stack_requests_while_the_snapshot_thread_runs_never_kill_a_worker(
    tmp_path, env, monkeypatch
):
    proc, folder = _start(tmp_path / "new", SNAPSHOT_JOB, env)
    pids = _running(proc, [folder / f"rank{r}.training" for r in (0, 1)], "training")
    stacks = _stack_dir(proc, env, monkeypatch)
    try:
        # What the reports sent to `ddpkit run`: a burst of 60, then one every 0.05 s and every
        # 0.25 s. The agent asks every worker each time it handles one.
        for _ in range(60):
            os.kill(proc.pid, signal.SIGUSR2)
        for pause in [0.05] * 40 + [0.25] * 12:
            os.kill(proc.pid, signal.SIGUSR2)
            time.sleep(pause)
        # What the control sends each worker: a request every 0.02 s, 600 of them.
        snapshot_thread_seen = False
        for i in range(600):
            for pid in pids:
                channels.request_stack(pid)
            time.sleep(0.02)
            if i % 10 == 0 and not snapshot_thread_seen:
                answered = stacks / "rank0.txt"  # replaced whole: never missing once there
                answer = answered.read_text() if answered.exists() else ""
                snapshot_thread_seen = "'ddpkit-snapshot-" in answer
        asked = channels.ask_stacks({r: pid for r, pid in enumerate(pids)}, lines=100)
    finally:
        out = _stop(proc, folder)
    assert proc.returncode == 0, out[-4000:]
    assert "killed by" not in out, out[-4000:]
    assert snapshot_thread_seen  # answers taken while a snapshot thread ran
    # Every rank answered, from inside its training loop, and SIGUSR2's answers are where the docs
    # say.
    (logged,) = (tmp_path / "new").glob("ddpkit-logs/*/stacks")  # the job's folder is gone
    for rank in (0, 1):
        assert any("in fit" in frame for frame in asked[rank]), asked
        answer = (logged / f"rank{rank}.txt").read_text()
        assert "Main thread" in answer and "job.py" in answer, answer[:2000]

    # Control: the old answer to the same requests, faulthandler walking the threads from the
    # signal handler (the old agent sent each worker a SIGUSR2 per request): a worker dies of
    # SIGSEGV. 600 at most; on a 2-core machine it took 30 to 172.
    proc, folder = _start(tmp_path / "old", SNAPSHOT_JOB, env | {"OLD_HANDLER": "1"})
    pids = _running(proc, [folder / f"rank{r}.training" for r in (0, 1)], "training (control)")
    try:
        for _ in range(600):
            if proc.poll() is not None:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGUSR2)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
    finally:
        out = _stop(proc, folder)
    assert proc.returncode != 0 and "killed by SIGSEGV" in out, (
        "the control no longer shows the crash",
        proc.returncode,
        out[-4000:],
    )


class _Pelting(threading.Thread):
    """Sends ``signals`` in turn to the launcher ``proc`` every ``pause`` s until it has ended;
    counts those sent after every process in ``ended`` was gone."""

    def __init__(self, proc: subprocess.Popen, signals: tuple[int, ...], pause: float) -> None:
        super().__init__(daemon=True)
        self.proc, self.signals, self.pause = proc, signals, pause
        self.ended: list[int] = []
        self.sent = self.after = 0
        self.extra = lambda: None

    def run(self) -> None:
        while self.proc.poll() is None:
            for sig in self.signals:
                try:
                    os.kill(self.proc.pid, sig)
                except ProcessLookupError:
                    return
                self.sent += 1
                if self.ended and all(_gone(pid) for pid in self.ended):
                    self.after += 1
            self.extra()
            time.sleep(self.pause)


@pytest.mark.slow
def test_sigusr1_and_sigusr2_through_the_jobs_end_never_kill_the_launcher(tmp_path, env):
    def job(where: Path, old: bool) -> tuple[int, str, _Pelting]:
        proc, folder = _start(
            where, SHORT_JOB, env | ({"OLD_DEFAULTS": "1"} if old else {}), old=old
        )
        pids = _running(proc, [folder / f"rank{r}.pid" for r in (0, 1)], "the workers")
        pelting = _Pelting(proc, (signal.SIGUSR1, signal.SIGUSR2), 0.002)
        pelting.ended = pids
        pelting.start()
        (folder / "go").touch()
        out = _end(proc)
        pelting.join()
        return proc.returncode, out, pelting

    code, out, pelting = job(tmp_path / "new", old=False)
    assert code == 0, out[-4000:]
    # requests kept coming while the launcher ended, its workers gone
    assert pelting.after > 0, (pelting.sent, pelting.after)
    # Control: the defaults given back once the workers are gone (the old uninstall): the launcher
    # dies of one of them (138 or 140 in a shell) after every worker exited 0.
    code, out, pelting = job(tmp_path / "old", old=True)
    assert code in (-signal.SIGUSR1, -signal.SIGUSR2), (code, pelting.sent, out[-4000:])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fork_server", ["off", "on"])
def test_stack_requests_at_a_workers_start_and_end_never_kill_it(
    tmp_path, env, fork_server, monkeypatch
):
    def job(where: Path, old: bool) -> tuple[int, str, _Pelting]:
        proc, folder = _start(
            where, SHORT_JOB, env | ({"OLD_FORWARD": "1"} if old else {}), "--fork-server",
            fork_server, old=old,
        )  # fmt: skip
        # From before any worker until the launcher has ended: to the launcher, and straight to
        # every worker that serves requests.
        stacks = _stack_dir(proc, env, monkeypatch)
        pelting = _Pelting(proc, (signal.SIGUSR2,), 0.005)
        pelting.extra = channels.request_every_stack
        assert not list((stacks.parent / channels.INBOX).iterdir()), "a worker started first"
        pelting.start()
        pids = [folder / f"rank{r}.pid" for r in (0, 1)]
        pelting.ended = _running(proc, pids, "the workers", or_ended=old)
        (folder / "go").touch()
        out = _end(proc)
        pelting.join()
        return proc.returncode, out, pelting

    code, out, pelting = job(tmp_path / "new", old=False)
    assert code == 0 and "killed by" not in out, out[-4000:]
    assert pelting.after > 0, (pelting.sent, pelting.after)
    # Control: a request sent as SIGUSR2 to each worker (the old agent's): a worker asked before it
    # has set up its handler (while its interpreter starts and imports) dies of it.
    code, out, pelting = job(tmp_path / "old", old=True)
    assert code != 0 and "killed by SIGUSR2" in out, (code, out[-4000:])


@pytest.mark.parametrize("loader", ["build_loader", "plain"])
def test_a_loader_workers_stack_can_be_asked_for_by_its_pid(tmp_path, env, loader, monkeypatch):
    proc, folder = _start(tmp_path, LOADER_JOB, env | {"LOADER": loader}, nproc=1)
    try:
        (pid,) = _running(proc, [folder / "loader.pid"], "the loader worker's pid")
        stacks = _stack_dir(proc, env, monkeypatch)
        asked = channels.ask_stacks({pid: pid}, lines=100)
        if loader == "plain":
            # Control: a loader built without build_loader's worker_init_fn serves no requests:
            # nothing is asked, nothing answers (as with the old mechanism, for every loader).
            assert asked == {}, asked
        else:
            assert any("in __getitem__" in frame for frame in asked[pid]), asked
            # SIGUSR2 to `ddpkit run` asks it too: its answer beside its rank's
            os.kill(proc.pid, signal.SIGUSR2)
            answer = wait_until(
                lambda: (
                    (stacks / "rank0-loader0.txt").exists()
                    and (stacks / "rank0-loader0.txt").read_text()
                ),
                60,
                what="the loader worker's answer to SIGUSR2",
            )
            assert "in __getitem__" in answer, answer[:2000]
    finally:
        (folder / "release").touch()
        out = _end(proc)
    assert proc.returncode == 0, out[-4000:]
