"""``ddpkit run --recover in-place`` at the edges of a recovery, with real processes (4 ranks, a
hand loop written as docs/snapshots.md shows, copies in memory after every step): a failure before
``init()``, while the ranks make their group, during the regroup, of a replacement as it starts;
two, three and all-but-one ranks at once, rank 0 among them; a survivor stopped before, during and
after the regroup. Each ends bitwise where an uninterrupted run ends, in place. Control: with
torch's group count not reset, a failure before ``init()`` is not recovered in place.

A rerun starts from a clean process: no optimizer or module of the failed run alive at its top, the
resident memory flat over five recoveries, for the hand loop and the Trainer; the control keeps
the failed run's optimizer in a module's global, and the rerun names what holds it. A recovery
before the first copy in memory keeps its ``recover`` record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ddpkit.testing import read_records, run_job
from tests.jobs.conftest import clean_environ, memory_environ

JOB = Path(__file__).resolve().parents[1] / "scripts" / "recover_job.py"
IN_PLACE = ("--max-restarts", "6", "--recover", "in-place")


def run(tmp: Path, name: str, *fails: str, env: dict, args=(), nproc: int = 4, launcher=IN_PLACE):
    """The job, ``fails`` planned (``KIND:RANK:ATTEMPT[:ARG]``): its exit, stderr, log folder."""
    log = tmp / f"{name}-log"
    log.mkdir()
    plan = [x for fail in fails for x in ("--fail", fail)]
    proc = run_job(
        JOB, str(tmp / f"{name}-run"), "--log", str(log), *plan, *args, nproc=nproc,
        launcher_args=(*launcher, "--log-dir", str(tmp / f"{name}-logs")), env=env, cwd=tmp,
        timeout=600,
    )  # fmt: skip
    return proc.returncode, proc.stderr, log


def final(log: Path, nproc: int = 4) -> list[torch.Tensor]:
    return [torch.load(log / f"final-rank{r}.pt") for r in range(nproc)]


def tops(log: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (log / f"rank{rank}.jsonl").read_text().splitlines()]


def in_place(stderr: str) -> list[str]:
    """The agent's lines for each recovery in place."""
    return re.findall(r"recovering in place \(recovery \d+[^\n]*", stderr)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The memory environment (a job folder root of the module's), collectives of 60 s, and 60 s
    for a rank to leave its step after a failure: on a machine loaded by other work a survivor can
    take longer than the 10 s default, and would be killed and replaced where these tests count
    its process as kept."""
    base = memory_environ(clean_environ(), tmp_path_factory.mktemp("memory"))
    return base | {"DDPKIT_COLLECTIVE_TIMEOUT": "60", "DDPKIT_RECOVER_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env) -> list[torch.Tensor]:
    tmp = tmp_path_factory.mktemp("reference")
    code, err, log = run(tmp, "reference", env=env)
    assert code == 0, err[-3000:]
    return final(log)


EDGES = {
    # name: the failures planned, the recoveries in place they take
    # a rank that raised before init(): its peers were in init_process_group, half-way
    "raise-before-init": (["raise-before-init:2:0"], 1),
    # a rank killed before its group; rank 0 enters init() once its agent has opened the recovery
    "killed-as-peers-make-the-group": (["told-before-init:0:0", "kill-before-init:1:0"], 1),
    # a rank killed while the others make the group (likely inside it after its 1 s), one of them
    # to come once the recovery is open
    "killed-while-the-group-is-made": (
        ["told-before-init:3:0", "sleep-before-init:1:0:1", "kill-before-init:1:0"], 1,
    ),
    # a survivor killed at the top of its rerun, as the ranks regroup
    "killed-during-the-regroup": (["kill-after-step:1:0:20", "kill-before-init:2:1"], 2),
    # the replacement dies as it starts
    "replacement-dies-as-it-starts": (["kill-after-step:1:0:20", "kill-before-init:1:1"], 2),
    "two-at-once": (["kill-after-step:1:0:20", "kill-after-step:2:0:20"], 1),
    "three-at-once": ([f"kill-after-step:{r}:0:20" for r in (1, 2, 3)], 1),
    "all-but-one-rank-0-among-them": ([f"kill-after-step:{r}:0:20" for r in (0, 2, 3)], 1),
    "survivor-stopped-before-the-regroup": (
        ["kill-after-step:1:0:20", "stop-after-step:2:0:20"], 1,
    ),
    "survivor-stopped-during-the-regroup": (
        ["kill-after-step:1:0:20", "stop-before-init:2:1"], 2,
    ),
    "survivor-stopped-after-the-regroup": (["stop-after-step:2:0:30"], 1),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("edge", list(EDGES))
def test_a_failure_at_each_edge_is_recovered_in_place_bitwise(tmp_path, env, reference, edge):
    plan, recoveries = EDGES[edge]
    code, err, log = run(tmp_path, edge, *plan, env=env)
    assert code == 0, err[-3000:]
    assert len(in_place(err)) == recoveries, err[-3000:]
    assert "not recovered in place" not in err, err[-3000:]
    assert "Timed out" not in err and "timed out" not in err, err[-3000:]  # none waited it out
    got = final(log)
    assert all(torch.equal(g, reference[0]) for g in got), edge
    if "stopped" in edge:
        assert "stopped (SIGSTOP)" in err or "stopped (SIGSTOP), at step" in err, err[-3000:]
    # a survivor kept its process through every recovery
    kept = [
        r for r in range(4) if len({t["pid"] for t in tops(log, r)}) == 1 and len(tops(log, r)) > 1
    ]
    assert kept, [tops(log, r) for r in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_control_without_the_reset_of_torchs_group_count_a_failure_before_init_is_not_recovered(
    tmp_path, env
):
    code, err, _ = run(
        tmp_path, "no-reset", *EDGES["raise-before-init"][0],
        env=env | {"DDPKIT_COLLECTIVE_TIMEOUT": "10"}, args=("--control", "no-reset"),
        launcher=("--max-restarts", "1", "--recover", "in-place"),
    )  # fmt: skip
    # the rerun's groups are named otherwise on the ranks that counted a group made half-way: they
    # never meet, and wait until the collective timeout; with no restart left, the job fails
    assert code != 0 and "no restart left" in err, err[-3000:]
    assert "could not reach the other ranks" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("trainer", [False, True], ids=["hand-loop", "trainer"])
def test_a_rerun_starts_clean_and_memory_stays_flat_over_five_recoveries(tmp_path, env, trainer):
    # rank 3 killed after steps 8, 16, 24, 32 and 40: rank 0 runs the script six times in one
    # process, its model of 8.4 M parameters with Adam (about 130 MB a run, with its copy)
    plan = [f"kill-after-step:3:{k}:{8 * (k + 1)}" for k in range(5)]
    args = ("--hidden", "2048", *(["--trainer"] if trainer else []))
    code, err, log = run(tmp_path, "clean", *plan, env=env, args=args)
    assert code == 0, err[-3000:]
    assert len(in_place(err)) == 5, err[-3000:]
    runs = tops(log, 0)
    assert [r["attempt"] for r in runs] == list(range(6)) and len({r["pid"] for r in runs}) == 1
    assert all(r["optimizers"] == r["modules"] == 0 for r in runs), runs
    rss = [r["rss"] for r in runs[1:]]
    assert max(rss) - min(rss) < 32 << 20, [f"{x >> 20} MB" for x in rss]
    fds = [r["fds"] for r in runs[1:]]  # every connection of a failed run's groups closed
    assert max(fds) - min(fds) <= 2, fds
    # Control: the failed run's optimizer kept in a module's global: alive at each rerun's top,
    # named, and the memory grows by a run's worth at every recovery.
    (tmp_path / "keep").mkdir()
    code, err, log = run(
        tmp_path / "keep", "keep", *plan[:3], env=env, args=(*args, "--control", "keep-global")
    )
    assert code == 0, err[-3000:]
    runs = tops(log, 0)
    assert [r["optimizers"] for r in runs] == [0, 1, 2, 3], runs
    assert "stay alive (held by a global of module leaky_cache" in err, err[-3000:]
    assert runs[3]["rss"] - runs[1]["rss"] > 100 << 20, [r["rss"] >> 20 for r in runs]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_recovery_before_the_first_copy_keeps_its_record(tmp_path, env):
    # rank 1 dies before its first step: nothing in memory yet, every rank starts again at step 0
    code, err, log = run(tmp_path, "first", "kill-before-init:1:0", env=env, args=("--trainer",))
    assert code == 0, err[-3000:]
    (recover,) = [r for r in read_records(tmp_path / "first-run") if r.get("event") == "recover"]
    assert recover["replaced"] == [1] and recover["step"] == 0 and recover["source"] == "none"
