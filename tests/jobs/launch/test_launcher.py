"""``ddpkit run``: real jobs end to end."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.testing import run_job, start_job, wait_until

pytestmark = pytest.mark.heavy

HELLO = str(Path(__file__).parents[1] / "scripts" / "hello.py")


PROBE = str(Path(__file__).parents[1] / "scripts" / "launch_probe.py")


DDPKIT = [sys.executable, "-m", "ddpkit.cli"]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    # ddpkit run writes ./ddpkit-logs: keep it out of the checkout.
    monkeypatch.chdir(tmp_path)


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The ``ddpkit`` command as given: for what starts no job (``ddpkit env``, a bad option)."""
    return subprocess.run(DDPKIT + args, env=env, capture_output=True, text=True, timeout=90)


def test_rank_zero_output_by_default(user_env):
    out = run_job(HELLO, "a", "b", env=user_env, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("hello")]
    assert lines == ["hello rank=0 world=2 attempt=0 sum=3 threads=1 words=['a', 'b']"]


# In every process of the job: an exit handler and an object that tells when the interpreter's
# teardown deletes it, each leaving a file named by the process's pid.
_EXIT_PROBE = """
import atexit, os
from pathlib import Path

_FOLDER = Path(os.environ["EXIT_PROBE"])
atexit.register(lambda: (_FOLDER / f"{os.getpid()}.atexit").touch())


class _TornDown:
    def __del__(self):
        (_FOLDER / f"{os.getpid()}.teardown").touch()


_torn_down = _TornDown()
"""


def _exit_probe_env(user_env: dict[str, str], folder: Path) -> dict[str, str]:
    (folder / "site").mkdir(parents=True)
    (folder / "site" / "sitecustomize.py").write_text(_EXIT_PROBE)
    path = os.pathsep.join(filter(None, [str(folder / "site"), user_env.get("PYTHONPATH")]))
    return user_env | {"PYTHONPATH": path, "EXIT_PROBE": str(folder)}


def test_ddpkit_run_ends_after_its_exit_handlers_without_the_interpreters_teardown(
    user_env, tmp_path
):
    env = _exit_probe_env(user_env, tmp_path / "probe")
    proc = start_job(HELLO, "a", env=env)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-3000:]
    # rank 0's line reached the pipe: the launcher's standard output was flushed before it ended
    assert "hello rank=0 world=2" in out, out
    probe = tmp_path / "probe"
    assert (probe / f"{proc.pid}.atexit").exists()  # the exit handlers ran (logging's flush too)
    assert not (probe / f"{proc.pid}.teardown").exists()  # torch's modules were not torn down
    # the workers, which run the user's script, end as interpreters do (and any helper process a
    # torch starts beside them)
    workers = {p.stem for p in probe.glob("*.teardown")}
    assert len(workers) >= 2, sorted(p.name for p in probe.iterdir())
    # Control: the same probe sees the teardown of a process that exits normally, here `main`
    # called without the console script's end (a usage error, before any worker starts).
    control = subprocess.Popen(
        [sys.executable, "-c", "import sys; from ddpkit.cli import main; sys.exit(main())",
         "run", "--nproc", "gpu", HELLO],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, control_err = control.communicate(timeout=90)
    assert control.returncode == 2, control_err[-3000:]
    assert (probe / f"{control.pid}.atexit").exists()
    assert (probe / f"{control.pid}.teardown").exists()


@pytest.mark.slow
def test_more_than_ten_processes_keep_rank_zero_alone_on_the_terminal(user_env, tmp_path):
    # torchrun's --redirects pattern takes one-digit local ranks: "1:3,...,11:3" was a ValueError
    # before any worker started. The map now goes to torchrun's logs spec.
    out = run_job(HELLO, nproc=12, launcher_args=["--oversubscribe"], env=user_env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("hello")]
    assert lines == ["hello rank=0 world=12 attempt=0 sum=78 threads=1 words=[]"]
    (run_dir,) = (tmp_path / "ddpkit-logs").iterdir()
    assert "hello rank=11 world=12" in next(run_dir.rglob("11/stdout.log")).read_text()


def test_all_ranks_output_is_prefixed(user_env):
    out = run_job(HELLO, nproc=3, launcher_args=["--all-ranks"], env=user_env, timeout=90)
    assert out.returncode == 0, out.stderr
    for r in range(3):
        assert f"[rank {r}] hello rank={r} world=3" in out.stdout


PIECES = str(Path(__file__).parents[1] / "scripts" / "pieces.py")


@pytest.mark.slow
def test_all_ranks_tags_whole_lines_not_pieces(user_env):
    # Two ranks print lines in pieces at the same time: each tagged line must be a whole line of one
    # rank.
    out = run_job(PIECES, launcher_args=["--all-ranks"], env=user_env, timeout=90)
    assert out.returncode == 0, out.stderr
    tagged = [line for line in out.stdout.splitlines() if line.startswith("[rank ")]
    for r in range(2):
        mine = [
            line.removeprefix(f"[rank {r}] ") for line in tagged if line.startswith(f"[rank {r}] ")
        ]
        pieces = ["".join(f"r{r}l{i}p{p};" for p in range(4)) for i in range(3)]
        bars = [line for line in mine if line.startswith(f"bar{r} ")]
        # Redraws of the bar may show (at most every few seconds); its final state ends its line.
        assert (
            bars
            and bars[-1] == f"bar{r} 100%"
            and all(b in (f"bar{r} 0%", f"bar{r} 50%") for b in bars[:-1])
        )
        assert [line for line in mine if not line.startswith("bar")] == [*pieces, f"last{r}"], (
            out.stdout
        )
    assert all(
        line.startswith("[rank ")
        for line in out.stdout.splitlines()
        if "p0;" in line or "bar" in line
    )


def test_failure_summary_names_rank_exception_and_line(user_env, tmp_path):
    out = run_job(HELLO, "--fail-rank", "1", env=user_env, timeout=90)
    assert out.returncode == 1
    summary = out.stderr[out.stderr.index("ddpkit run:") :]
    assert "first: rank 1 (local rank 1" in summary
    assert "ValueError: planned failure on rank 1" in summary
    assert 'hello.py", line' in summary  # the user's frame, not only the launcher's
    # Where rank 1's own output is: under ./ddpkit-logs, printed (it was a temporary folder, never
    # named).
    line = next(line for line in summary.splitlines() if "output of every rank:" in line)
    folder = Path(line.split("output of every rank:")[1].strip())
    assert folder.is_relative_to(tmp_path / "ddpkit-logs")
    rank1 = list(folder.rglob("1/stderr.log"))
    assert rank1 and "planned failure on rank 1" in rank1[0].read_text()


_RECORDED = """
import os, sys
from torch.distributed.elastic.multiprocessing import errors

print("record's handler:", type(errors.get_error_handler()).__name__)

@errors.record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("recorded failure on rank 1")

try:
    main()
except ValueError:
    sys.exit(3)  # an exit code of the script's own: only its @record recorded the exception
"""


def test_a_scripts_own_record_writes_through_the_workers_handler(user_env, tmp_path):
    """A script with torch's ``@record`` on its ``main`` gets the worker's handler (which writes the
    agent's file whole), and the summary names the exception it recorded, though the script then
    exits with a code of its own."""
    script = tmp_path / "recorded.py"
    script.write_text(_RECORDED)
    out = run_job(script, env=user_env, timeout=90)
    assert out.returncode == 3, out.stderr
    assert "record's handler: WholeErrorFile" in out.stdout
    summary = out.stderr[out.stderr.index("ddpkit run:") :]
    assert "first: rank 1 (local rank 1" in summary
    assert "ValueError: recorded failure on rank 1" in summary


@pytest.mark.slow  # a whole job with a restart or several launches: seconds each
def test_restart_after_failure_resumes_the_job(user_env):
    out = run_job(
        HELLO, "--fail-first-attempt", launcher_args=["--max-restarts", "1"], env=user_env,
        timeout=90,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "hello rank=0 world=2 attempt=0" in out.stdout
    assert "hello rank=0 world=2 attempt=1" in out.stdout
    # control: without restarts the same job fails
    out = run_job(HELLO, "--fail-first-attempt", env=user_env, timeout=90)
    assert out.returncode != 0 and "planned failure on the first attempt" in out.stderr


@pytest.mark.slow  # a whole job with a restart or several launches: seconds each
def test_two_jobs_at_once_on_one_machine(user_env):
    jobs = [start_job(HELLO, f"job{i}", env=user_env) for i in range(2)]
    for i, job in enumerate(jobs):
        stdout, stderr = job.communicate(timeout=90)
        assert job.returncode == 0, stderr
        assert f"words=['job{i}']" in stdout


def test_bad_flag_is_a_clear_error_not_a_stack(user_env):
    out = cli(["run", "--nproc", "gpu", HELLO], user_env)
    assert out.returncode == 2
    assert "--nproc gpu but no GPU is visible" in out.stderr and "Traceback" not in out.stderr


def test_env_command_reports_and_checks(user_env):
    out = cli(["env"], user_env)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "gloo available" in out.stdout
    assert "live check (2 processes, gloo all-reduce)  ok" in out.stdout


def test_script_arguments_that_look_like_launcher_options_reach_the_script(user_env):
    # Prefixes of ddpkit's and torchrun's options (--log-dir, --max-restarts, --node-rank,
    # --master-addr) and --nproc itself, after the script: all of them belong to the script.
    args = ["--log", "5", "--max", "1", "--node", "x", "--master", "y", "--nproc", "3"]
    out = run_job(PROBE, "args", *args, env=user_env, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"rank=0 argv={args}" in out.stdout


def test_missing_script_is_an_error_before_any_worker_starts(user_env, tmp_path):
    out = run_job("nothere.py", env=user_env, timeout=90)
    assert out.returncode == 2
    assert "script 'nothere.py' not found" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "ddpkit-logs").exists()  # no worker, no log folder
    out = run_job("no_such_module_here", launcher_args=["-m"], env=user_env, timeout=90)
    assert out.returncode == 2 and "no module named 'no_such_module_here'" in out.stderr


@pytest.mark.slow  # a whole job with a restart or several launches: seconds each
def test_a_script_that_forgot_init_fails_instead_of_training_copies(user_env):
    # Without ddpkit.init(), each of the two ranks used to build a loader over the whole data set,
    # train its own copy and exit 0 ("trained on 12 samples" twice).
    out = run_job(PROBE, "no-init", env=user_env, timeout=90)
    assert out.returncode == 1, out.stdout
    assert "trained on" not in out.stdout
    assert (
        "NotInitializedError" in out.stderr
        and "call ddpkit.init() at the start of the script" in out.stderr
    )
    # Control: the same script as plain python is a world of one and runs.
    plain = subprocess.run(
        [sys.executable, PROBE, "no-init"], env=user_env, capture_output=True, text=True
    )
    assert plain.returncode == 0 and "trained on 12 samples" in plain.stdout, plain.stderr


@pytest.mark.slow
@pytest.mark.parametrize("code", [None, 143])
def test_preempted_exit_code_passes_through_without_a_restart(user_env, code):
    """75, or the code asked for (``--preempted-exit-code 143``: a PyTorchJob's ExitCode policy
    retries it)."""
    flags = [] if code is None else ["--preempted-exit-code", str(code)]
    options = ["--max-restarts", "2", *flags]
    out = run_job(PROBE, "preempted", launcher_args=options, env=user_env, timeout=90)
    assert out.returncode == (code or 75), out.stderr[-3000:]
    assert "rank=0 attempt=0" in out.stdout and "attempt=1" not in out.stdout, out.stderr
    assert f"stopped by a signal after saving a snapshot (exit code {code or 75})" in out.stderr


@pytest.mark.slow
def test_no_temporary_folders_left_behind(user_env, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    user_env["TMPDIR"] = str(tmp)
    out = run_job(HELLO, env=user_env, timeout=90)
    assert out.returncode == 0, out.stderr
    # torchrun's default was a torchelastic_* folder in TMPDIR per run, never removed. Rank 1's
    # output is in the run's own folder instead. torchinductor_<user> is torch's compile cache, kept
    # across runs on purpose: importing torch._dynamo makes it (constructing any optimizer does; the
    # fork server preloads it).
    assert sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")) == []
    runs = list((tmp_path / "ddpkit-logs").iterdir())
    assert len(runs) == 1
    assert "hello rank=1" in next(runs[0].rglob("1/stdout.log")).read_text()


def _wait_for_files(paths: list[Path], proc: subprocess.Popen, timeout: float = 60) -> list[int]:
    def written() -> bool:
        assert proc.poll() is None, Path(proc.args[-1]).with_suffix(".log").read_text()[-3000:]
        return all(p.exists() and p.read_text() for p in paths)

    wait_until(written, timeout, what="the workers to start")
    return [int(p.read_text()) for p in paths]


def _let_end(pids: list[int], timeout: float = 10) -> None:
    """Give ``pids`` up to ``timeout`` seconds to end; those still alive then are the finding, not
    an error."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(map(_gone, pids)), timeout, what="the job's processes to end")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has ended; only its parent has not collected it yet


def _start(
    job: list[str], env: dict[str, str], *launcher_args: str, torchrun: list[str] | None = None
) -> subprocess.Popen:
    """Start ``job`` (a script and its arguments, the last a folder) under ``ddpkit run --nproc 2
    LAUNCHER_ARGS``, or under ``torchrun LAUNCHER_ARGS`` where that command is given, with its
    output in FOLDER.log (not a pipe: workers that outlive the launcher would hold a pipe open)."""
    with open(Path(job[-1]).with_suffix(".log"), "w") as log:
        if torchrun is None:
            return start_job(
                job[0], *job[1:], launcher_args=launcher_args, env=env, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        return subprocess.Popen(
            [*torchrun, *launcher_args, *job], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _output(proc: subprocess.Popen, timeout: float = 60) -> str:
    proc.wait(timeout=timeout)
    return Path(proc.args[-1]).with_suffix(".log").read_text()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is a Linux feature"
)
@pytest.mark.slow
def test_workers_die_with_a_sigkilled_launcher(user_env, tmp_path):
    def survivors(
        tag: str, *launcher_args: str, torchrun: list[str] | None = None
    ) -> tuple[list[int], int]:
        """The processes of the job alive after its launcher was SIGKILLed (killed now), and its
        fork servers."""
        folder = tmp_path / tag
        folder.mkdir()
        proc = _start([PROBE, "pids", str(folder)], user_env, *launcher_args, torchrun=torchrun)
        pids = _wait_for_files([folder / "rank0.pid", folder / "rank1.pid"], proc)
        servers = _fork_servers(proc.pid)
        pids += servers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _let_end(pids)
        alive = [pid for pid in pids if not _gone(pid)]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        return alive, len(servers)

    # Both workers and the fork server (on: a job without restarts starts none by default).
    assert survivors("ddpkit", "--fork-server", "on") == ([], 1)
    assert survivors("ddpkit-no-server") == ([], 0)
    # Control: under torchrun's agent alone the workers outlive it (they would train on, orphaned).
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    assert len(survivors("torchrun", torchrun=torchrun)[0]) == 2


def _fork_servers(parent: int) -> list[int]:
    """The fork servers among ``parent``'s children (ddpkit run's agent starts one per job)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    found = []
    for pid in map(int, children):
        with contextlib.suppress(OSError):
            if b"ddpkit._launch.agent.forkserver\x00" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def _family(folder: Path) -> list[int]:
    """The pids of what the workers of ``launch_probe.py family`` started, in every attempt."""
    return [
        int(pid)
        for path in sorted(folder.glob("attempt*-rank*.pids"))
        for pid in path.read_text().split()
    ]


def _probe_process(pid: int) -> bool:
    """``pid`` runs launch_probe.py or one of the sleeps it starts (not another program that reused
    the pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"launch_probe.py" in cmdline or cmdline.startswith(b"sleep\x00100")


def _alive_then_killed(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running; killed now, so that no test leaves them behind."""
    alive = [pid for pid in pids if not _gone(pid) and _probe_process(pid)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return alive


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process trees are read from Linux's /proc"
)
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["end", "fail", "restart"])
def test_what_the_workers_start_ends_with_them(how, user_env, tmp_path):
    """A ``sleep`` in the worker's process group, a forked child that ignores SIGTERM and a
    ``sleep`` in a session of its own, started by each of two workers: gone when the job ends,
    fails, or restarts the workers."""
    probe = [PROBE, "family", "fail-first" if how == "restart" else how]
    restarts = ["--max-restarts", "1"] if how == "restart" else []

    def job(
        tag: str, env: dict[str, str], torchrun: list[str] | None = None
    ) -> tuple[str, list[int]]:
        folder = tmp_path / tag
        folder.mkdir()
        proc = _start([*probe, str(folder)], env, *restarts, torchrun=torchrun)
        try:
            out = _output(proc, timeout=120)
        finally:  # a job that hung: leave nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            alive = _alive_then_killed(_family(folder))
            _alive_then_killed([int(p.read_text()) for p in folder.glob("*.worker")])
        assert proc.returncode == (1 if how == "fail" else 0), out[-3000:]
        assert len(_family(folder)) == 3 * 2 * (2 if how == "restart" else 1), out[-3000:]
        return out, alive

    out, alive = job("ddpkit", user_env)
    assert alive == []
    if how == "restart":  # gone before the second attempt started, not only at the end
        assert "rank=0 attempt=1 alive from the attempt before: [] of 6" in out, out[-3000:]
    # Control: under torchrun's agent they outlive the job. (Its restarted workers hang on the
    # shared store unless it is switched off, as ddpkit run does.)
    out, alive = job(
        "torchrun", user_env | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, torchrun=TORCHRUN
    )
    assert len(alive) >= 4, alive  # at least the forked and the detached children of both workers
    if how == "restart":
        assert "rank=0 attempt=1 alive from the attempt before: []" not in out, out[-3000:]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is a Linux feature"
)
@pytest.mark.slow
def test_what_the_workers_start_dies_with_a_sigkilled_launcher(user_env, tmp_path):
    def survivors(tag: str, torchrun: list[str] | None = None) -> list[int]:
        folder = tmp_path / tag
        folder.mkdir()
        proc = _start([PROBE, "family", "hold", str(folder)], user_env, torchrun=torchrun)
        try:

            def both_ranks_started() -> bool:
                assert proc.poll() is None, _output(proc)[-3000:]
                return len(list(folder.glob("attempt0-rank*.pids"))) >= 2

            wait_until(both_ranks_started, 60, what="both ranks' families")
            pids = _family(folder)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            _let_end(pids)
            return _alive_then_killed(pids)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _alive_then_killed(
                _family(folder) + [int(p.read_text()) for p in folder.glob("*.worker")]
            )

    assert survivors("ddpkit") == []
    # Control: under torchrun's agent all six outlive it (as do the workers themselves).
    assert len(survivors("torchrun", torchrun=TORCHRUN)) == 6


@pytest.mark.slow
def test_sigusr1_to_the_launcher_reaches_the_workers(user_env, tmp_path):
    # SLURM's --signal=USR1@T warning, sent to `ddpkit run` (the srun task): the workers get it,
    # stop as a pre-empted Trainer does, and the launcher exits 75 for the batch script to requeue
    # the job.
    folder = tmp_path / "ddpkit"
    folder.mkdir()
    proc = _start([PROBE, "hold-usr1", str(folder)], user_env)
    _wait_for_files([folder / "rank0.pid", folder / "rank1.pid"], proc)
    os.kill(proc.pid, signal.SIGUSR1)
    out = _output(proc)
    assert proc.returncode == 75, out[-3000:]
    assert "rank=0 stopping on SIGUSR1" in out
    # Control: torchrun's own agent dies of the signal (exit 138 in a shell), leaving the workers'
    # save to chance.
    folder = tmp_path / "torchrun"
    folder.mkdir()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    proc = _start(
        ["-m", "ddpkit._launch.agent.worker", PROBE, "hold-usr1", str(folder)], user_env,
        torchrun=torchrun,
    )  # fmt: skip
    pids = _wait_for_files([folder / "rank0.pid", folder / "rank1.pid"], proc)
    os.kill(proc.pid, signal.SIGUSR1)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGUSR1
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigusr1_before_the_trainer_listens_does_not_kill_a_worker(user_env, tmp_path):
    # The warning can come while the data loads: each worker holds it for a later fit() instead of
    # dying.
    folder = tmp_path / "ddpkit"
    folder.mkdir()
    proc = _start([PROBE, "hold-usr1", str(folder)], user_env)
    pids = _wait_for_files([folder / "rank0.pid", folder / "rank1.pid"], proc)
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    out = _output(proc)
    assert proc.returncode == 75, out[-3000:]
    assert "rank=1 stopping on SIGUSR1" in out or "rank=0 stopping on SIGUSR1" in out


@pytest.mark.slow
def test_a_hang_ends_within_the_bound_with_every_ranks_stack(user_env):
    # Rank 1 sleeps in user code while rank 0 waits for it in an all-reduce.
    out = run_job(
        PROBE, "hang", launcher_args=["--collective-timeout", "5"], env=user_env, timeout=120
    )
    assert out.returncode == 1, out.stderr[-3000:]
    summary = out.stderr[out.stderr.index("ddpkit run:") :]
    # Rank 0: the collective it waited in, from its own exception.
    assert (
        "first: rank 0" in summary
        and "Timed out waiting 5000ms" in summary
        and "all_reduce" in summary
    )
    # Rank 1: where it was when rank 0 gave up, from its stack.
    stack = summary[summary.index("rank 1 was still running") :]
    assert "in stuck_in_user_code" in stack and "launch_probe.py" in stack
    # Control: under torchrun's agent alone the job also ends (the bound is the process group's),
    # but nothing says where rank 1 was.
    env = user_env | {"DDPKIT_COLLECTIVE_TIMEOUT": "5"}
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    out = subprocess.run(
        torchrun + [PROBE, "hang"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "stuck_in_user_code" not in out.stderr + out.stdout


@pytest.mark.slow
def test_mismatched_collectives_are_named_by_the_stall_watch_or_debug_collectives(user_env):
    """Rank 0 all-reduces 3 numbers through ``torch.distributed``, rank 1 two: the stall watch
    names them (op, number and size) within its floor. ``--debug-collectives`` diagnoses the same
    with torch's DETAIL mode where that mode works, and is refused with the reason where it
    crashes DDP (torch 2.13's CPU wheel)."""
    from ddpkit._errors import ConfigError
    from ddpkit._launch.cli.run import check_debug_collectives

    watch = ["--stall-timeout", "3", "--collective-timeout", "20"]
    out = run_job(PROBE, "mismatch", launcher_args=watch, env=user_env, timeout=120)
    assert out.returncode != 0
    assert "ranks disagree on their collectives: rank 0 in all_reduce #1 of 3 elements" in (
        out.stderr
    ), out.stderr[-3000:]
    # Control: the watch off, gloo gives no such diagnosis (it fails on sizes, or waits out the
    # bound).
    off = ["--stall-timeout", "0", "--collective-timeout", "5"]
    out = run_job(PROBE, "mismatch", launcher_args=off, env=user_env, timeout=120)
    assert out.returncode != 0 and "disagree" not in out.stderr
    try:
        check_debug_collectives()
    except ConfigError as refused:
        out = run_job(
            PROBE, "mismatch", launcher_args=["--debug-collectives"], env=user_env, timeout=90
        )
        assert out.returncode != 0 and str(refused) in out.stderr, out.stderr[-3000:]
        return
    debug = ["--debug-collectives", "--collective-timeout", "10"]
    out = run_job(PROBE, "mismatch", launcher_args=debug, env=user_env, timeout=120)
    assert out.returncode == 1
    assert (
        "Detected mismatch between collectives" in out.stderr
        and "Tensor shapes: 3vs 2" in out.stderr
    )


@pytest.mark.slow
def test_sigterm_to_the_launcher_lets_the_workers_save_and_exit_75(user_env, tmp_path):
    # A pre-emption's SIGTERM to `ddpkit run`: the workers get it, save (here: agree and stop) and
    # exit 75, which the launcher passes on. torchrun's own agent stopped them itself and exited 143
    # whatever they did.
    folder = tmp_path / "ddpkit"
    folder.mkdir()
    proc = _start([PROBE, "hold-term", str(folder)], user_env, "--max-restarts", "2")
    _wait_for_files([folder / "rank0.pid", folder / "rank1.pid"], proc)
    os.kill(proc.pid, signal.SIGTERM)
    out = _output(proc)
    assert proc.returncode == 75, out[-3000:]
    assert "rank=0 stopping on SIGTERM" in out
    # Control: torchrun's agent passes SIGTERM on too, but ends with its own code, not the
    # workers' 75.
    folder = tmp_path / "torchrun"
    folder.mkdir()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    proc = _start(
        ["-m", "ddpkit._launch.agent.worker", PROBE, "hold-term", str(folder)], user_env,
        torchrun=torchrun,
    )  # fmt: skip
    _wait_for_files([folder / "rank0.pid", folder / "rank1.pid"], proc)
    os.kill(proc.pid, signal.SIGTERM)
    out = _output(proc)
    assert proc.returncode != 75


KILL_JOB = str(Path(__file__).parents[1] / "scripts" / "kill_recipe_job.py")
SNAPSHOTS_DOC = Path(__file__).parents[3] / "docs" / "snapshots.md"


def _documented_kill_recipe() -> list[str]:
    """The ``pkill`` line of docs/snapshots.md, aimed at :data:`KILL_JOB` instead of the example's
    script."""
    import shlex

    lines = [line for line in SNAPSHOTS_DOC.read_text().splitlines() if line.startswith("pkill ")]
    assert len(lines) == 1, lines
    command = shlex.split(lines[0], comments=True)
    assert any("digits_trainer" in word for word in command), command
    return [word.replace("digits_trainer", "kill_recipe_job") for word in command]


@pytest.mark.slow  # a whole job with a restart or several launches: seconds each
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker's guard is Linux only")
def test_the_documented_kill_recipe_kills_a_worker_and_the_job_restarts(user_env, tmp_path):
    folder = tmp_path / "pids"
    folder.mkdir()
    proc = _start([KILL_JOB, str(folder)], user_env, "--max-restarts", "1")
    try:
        workers = _wait_for_files([folder / f"attempt0-rank{r}.pid" for r in (0, 1)], proc)
        killed = subprocess.run(
            [*_documented_kill_recipe(), "--echo"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        victim = int(re.findall(r"\(pid (\d+)\)", killed.stdout)[0])
        assert victim in workers, (victim, workers, killed.stdout)
        out = _output(proc, timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "attempt=1 restarted" in out and "never killed" not in out, out


@pytest.mark.slow  # a whole job with a restart or several launches: seconds each
def test_a_worker_sees_the_users_omp_threads_for_mkl_too(user_env, tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(
        'import os, ddpkit\nrt = ddpkit.init()\nprint(f"rank={rt.rank} '
        "omp={os.environ.get('OMP_NUM_THREADS')} "
        "mkl={os.environ.get('MKL_NUM_THREADS')}\")\nddpkit.shutdown()\n"
    )
    user_env.pop("MKL_NUM_THREADS", None)
    out = run_job(script, env={**user_env, "OMP_NUM_THREADS": "3"}, timeout=90)
    assert out.returncode == 0, out.stderr
    # (the user's own MKL_NUM_THREADS: test_launcher unit)
    assert "rank=0 omp=3 mkl=3" in out.stdout, out.stdout
