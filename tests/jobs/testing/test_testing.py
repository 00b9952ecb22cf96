"""ddpkit.testing, as a user's test suite calls it: real processes over gloo, results per rank, a
failing rank's error, a hang bounded, and the same-on-every-rank check with its control; a script
under the launcher, started clean of an enclosing job's variables, and killed whole past its
timeout; the same started without waiting, in a session of its own that the test can signal; each
rank's output, read from the job's own log folder."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.testing import (
    assert_same_on_ranks,
    run_job,
    run_on_ranks,
    start_job,
    wait_job,
    wait_until,
)

pytestmark = pytest.mark.heavy


def _whoami() -> tuple[int, int, float]:
    rt = ddpkit.get_runtime()
    return rt.rank, rt.world_size, ddpkit.all_reduce(float(rt.rank))


def test_a_function_runs_on_every_rank_with_the_process_group_up():
    assert run_on_ranks(_whoami, world_size=3) == [(0, 3, 3.0), (1, 3, 3.0), (2, 3, 3.0)]


def _one_ddp_step(diverge: bool) -> int:
    torch.manual_seed(0)
    model = ddpkit.prepare_model(torch.nn.Linear(4, 1))
    rank = ddpkit.get_runtime().rank
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
    model(x).pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    state = ddpkit.unwrap(model).state_dict()
    if diverge and rank == 1:
        state["bias"] = state["bias"] + 1e-6
    assert_same_on_ranks(state)
    return rank


def test_ranks_that_train_one_ddp_step_hold_the_same_weights():
    assert run_on_ranks(_one_ddp_step, 2, (False,)) == [0, 1]


def test_control_weights_that_differ_on_one_rank_fail_naming_it():
    with pytest.raises(Exception, match=r"rank 1 differs from rank 0 in value\['bias'\]"):
        run_on_ranks(_one_ddp_step, 2, (True,))


def _fails_on_rank_1() -> None:
    if ddpkit.get_runtime().rank == 1:
        raise ValueError("bad input on rank 1")
    ddpkit.barrier()


def test_a_rank_that_raises_fails_the_call_with_its_error():
    with pytest.raises(Exception, match="bad input on rank 1"):
        run_on_ranks(_fails_on_rank_1, 2, timeout=60)


def _rank_1_hangs() -> None:
    if ddpkit.get_runtime().rank == 1:
        time.sleep(600)  # the hang under test: user code that never returns


def test_a_hang_fails_after_the_timeout_naming_the_ranks_still_running():
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] of 2 still running after 3 s"):
        run_on_ranks(_rank_1_hangs, 2, timeout=3)


def test_values_compare_by_structure_and_bits():
    from ddpkit.testing import _differences

    same = {"w": torch.tensor([1.0, 2.0]), "n": [1, (2, "x")]}
    assert _differences(same, {"w": torch.tensor([1.0, 2.0]), "n": [1, (2, "x")]}) == []
    assert _differences(same, {"w": torch.tensor([1.0, 2.001]), "n": [1, (2, "x")]}) == [
        "value['w']"
    ]
    assert _differences(
        same, {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "n": [1, (2, "x")]}
    )
    assert _differences(same, {"w": torch.tensor([1.0, 2.0]), "n": [1, (2, "y")]}) == [
        "value['n'][1][1]"
    ]
    assert _differences(same, {"w": torch.tensor([1.0, 2.0])}) == ["value (keys)"]
    # Bits, not values: the same NaN is equal (torch.equal says not), -0.0 is not 0.0 (torch.equal
    # says it is).
    nan = torch.tensor([float("nan"), 1.0])
    assert _differences(nan, nan.clone()) == [] and not torch.equal(nan, nan.clone())
    assert _differences(torch.tensor([-0.0]), torch.tensor([0.0])) == ["value"]
    assert _differences(float("nan"), float("nan")) == [] and _differences(1.0, 2.0) == ["value"]
    # Values whose == gives an array are compared by their bytes.
    import numpy as np

    assert _differences(np.arange(3), np.arange(3)) == [] and _differences(
        np.arange(3), np.zeros(3)
    ) == ["value"]


def test_named_tuples_keep_their_type_on_the_way_to_the_cpu():
    from collections import namedtuple

    from ddpkit.testing import _on_cpu

    Pair = namedtuple("Pair", "a b")
    moved = _on_cpu(Pair(torch.ones(2), [torch.zeros(1)]))
    assert type(moved) is Pair and torch.equal(moved.a, torch.ones(2))


# A job that says where it sits and what it inherited from the environment it was started from.
WHERE = """
import os, sys
import ddpkit
rt = ddpkit.init()
total = ddpkit.all_reduce(rt.rank + 1)
inherited = sorted(k for k in ("SLURM_JOB_ID", "NSLOTS", "OUTER_NOTE") if k in os.environ)
line = f"rank={rt.rank} world={rt.world_size} sum={total} args={sys.argv[2:]} inherited={inherited}"
with open(os.path.join(sys.argv[1], f"rank{rt.rank}.txt"), "w") as f:
    f.write(line)
ddpkit.shutdown()
"""
# The variables of a job the test itself runs in (a SLURM allocation granting 7 cores), and one of
# the user's.
ENCLOSING = {
    "RANK": "5",
    "WORLD_SIZE": "9",
    "SLURM_JOB_ID": "4242",
    "NSLOTS": "7",
    "OUTER_NOTE": "kept",
}


def test_a_script_runs_under_the_launcher_on_its_own_ranks_with_its_arguments(tmp_path, clean_env):
    (tmp_path / "where.py").write_text(WHERE)
    done = run_job(
        tmp_path / "where.py", str(tmp_path), "--lr", "0.1", env=clean_env | ENCLOSING, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))]
    assert lines == [
        f"rank={r} world=2 sum=3 args=['--lr', '0.1'] inherited=['OUTER_NOTE']" for r in (0, 1)
    ]
    assert done.args[1:6] == ["-m", "ddpkit.cli", "run", "--nproc", "2"]


def test_control_the_launcher_started_from_the_enclosing_environment_passes_its_job_on(
    tmp_path, clean_env
):
    """What the cleaning of run_job and start_job prevents: started as is, the launcher hands the
    enclosing job's variables to the workers (the scheduler's job id and core grant, read by ddpkit
    as this job's)."""
    (tmp_path / "where.py").write_text(WHERE)
    argv = [
        sys.executable,
        "-m",
        "ddpkit.cli",
        "run",
        "--nproc",
        "2",
        str(tmp_path / "where.py"),
        str(tmp_path),
    ]
    done = subprocess.run(
        argv, env=clean_env | ENCLOSING, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "inherited=['NSLOTS', 'OUTER_NOTE', 'SLURM_JOB_ID']" in (tmp_path / "rank1.txt").read_text()
    )


def test_a_failing_job_returns_its_exit_status_and_output(tmp_path, clean_env):
    hello = Path(__file__).parents[1] / "scripts" / "hello.py"
    done = run_job(hello, "--fail-rank", "1", nproc=2, env=clean_env, timeout=240)
    assert done.returncode != 0 and "planned failure on rank 1" in done.stdout + done.stderr


def test_each_ranks_output_is_read_over_its_restarts_from_the_jobs_own_log_folder(
    tmp_path, clean_env
):
    hello = Path(__file__).parents[1] / "scripts" / "hello.py"
    logs = ("--log-dir", str(tmp_path / "logs"))
    # rank 2 fails its first attempt, after its greeting; the restart greets again
    proc = start_job(
        hello, "--fail-first-attempt", nproc=3, launcher_args=("--max-restarts", "1", *logs),
        env=clean_env,
    )  # fmt: skip
    done = wait_job(proc, 240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(3):
        greetings = re.findall(r"hello rank=(\d) world=3 attempt=(\d)", done.output(rank))
        assert greetings == [(str(rank), "0"), (str(rank), "1")], done.output(rank)
    assert "planned failure on the first attempt" in done.output(2, "stderr")
    # Control: another job with the same log folder reads its own ranks' files, not the first's.
    again = run_job(hello, "again", nproc=2, launcher_args=logs, env=clean_env, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.log_dir is not None and done.log_dir is not None
    assert again.log_dir != done.log_dir and again.log_dir.parent == done.log_dir.parent
    assert "words=['again']" in again.output(1) and "again" not in done.output(1)


# A job that says what it inherited, leaves its pid, and runs until it is killed.
HOLD = """
import os, sys, time
from pathlib import Path
import ddpkit
rt = ddpkit.init()
inherited = sorted(k for k in ("SLURM_JOB_ID", "NSLOTS", "OUTER_NOTE") if k in os.environ)
print(f"rank={rt.rank} world={rt.world_size} inherited={inherited}", flush=True)
Path(sys.argv[1], f"{rt.rank}.tmp").write_text(str(os.getpid()))
Path(sys.argv[1], f"{rt.rank}.tmp").rename(Path(sys.argv[1], f"{rt.rank}.pid"))
time.sleep(600)  # until the test kills the job
"""


def test_a_started_job_runs_clean_while_the_test_watches_and_one_killpg_ends_it(
    tmp_path, clean_env
):
    (tmp_path / "hold.py").write_text(HOLD)
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        proc = start_job(
            tmp_path / "hold.py",
            str(tmp_path),
            env=clean_env | ENCLOSING,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def started() -> list[int]:
            assert proc.poll() is None, log.read_text()[-3000:]
            pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
            return pids if len(pids) == 2 and "rank=0 world=2" in log.read_text() else []

        pids = wait_until(started, 240, what=lambda: f"both workers\n{log.read_text()[-3000:]}")
        assert proc.args[1:6] == ["-m", "ddpkit.cli", "run", "--nproc", "2"]
        # the launcher leads a session of its own: one killpg reaches it
        assert os.getsid(proc.pid) == proc.pid
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # its workers end with it (the launcher's parent-death signal)
    wait_until(lambda: all(map(_gone, pids)), 30, what=lambda: f"the workers {pids} to end")
    # rank 0's line, in the file given for the output, without the enclosing job's variables
    assert "rank=0 world=2 inherited=['OUTER_NOTE']" in log.read_text(), log.read_text()[-3000:]


def test_a_started_job_that_fails_gives_its_exit_status_and_output_on_the_pipes(clean_env):
    hello = Path(__file__).parents[1] / "scripts" / "hello.py"
    proc = start_job(hello, "--fail-rank", "1", env=clean_env)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0 and "planned failure on rank 1" in out + err


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has ended; only its parent has not collected it yet


@pytest.mark.slow
def test_a_job_past_its_timeout_is_killed_with_its_workers(tmp_path, clean_env):
    (tmp_path / "hang.py").write_text(
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "Path(sys.argv[1], f\"{os.environ['RANK']}.pid\").write_text(str(os.getpid()))\n"
        "time.sleep(600)  # the hang under test\n"
    )
    with pytest.raises(TimeoutError, match=r"hang.py .* still running after 25 s, killed"):
        run_job(tmp_path / "hang.py", str(tmp_path), nproc=2, env=clean_env, timeout=25)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 2, "the workers did not start within the timeout (a slow machine: raise it)"
    wait_until(lambda: all(map(_gone, pids)), 10, what=lambda: f"the workers {pids} to end")
