"""The search on groups of ranks: budgets, pruning, failures, kills, restarts, a second job, a
damaged journal and a full disk, with real processes."""

from __future__ import annotations

import errno
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.search import SearchConfig, choice, search, uniform
from ddpkit.testing import read_records, run_job, run_on_ranks
from ddpkit.training._config import LoggingConfig
from ddpkit.training._trainer import Trainer, TrainerConfig
from tests.jobs.scripts.search_job import Data

JOB = str(Path(__file__).parents[1] / "scripts" / "search_job.py")


def _study(search_dir: Path) -> optuna.Study:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(search_dir / "study.journal")))
    return optuna.load_study(study_name="ddpkit", storage=storage)


def _job(
    search_dir: Path,
    *args: str,
    env: dict,
    nproc: int | None = None,
    restarts: int = 0,
    timeout: float = 150,
) -> subprocess.CompletedProcess:
    """The test search job, as plain python (one rank) or under ``ddpkit run`` with ``nproc``
    ranks."""
    if nproc:
        restart = ("--max-restarts", str(restarts))
        return run_job(
            JOB,
            str(search_dir),
            *args,
            nproc=nproc,
            launcher_args=restart,
            env=env,
            timeout=timeout,
        )
    cmd = [sys.executable, JOB, str(search_dir), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _params(study: optuna.Study) -> dict[int, tuple[float, float]]:
    return {t.number: (t.params["lr"], t.params["momentum"]) for t in study.trials}


def _tiny_trainer(
    candidate,
    lr: float,
    epochs: int = 3,
    callbacks=(),
    val_every_steps: int | None = None,
    max_steps: int | None = None,
) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    config = TrainerConfig(
        run_dir=str(candidate.run_dir),
        epochs=epochs,
        global_batch_size=12,
        val_every_steps=val_every_steps,
        max_steps=max_steps,
        logging=LoggingConfig(progress=False),
    )
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        Data(96, 1),
        config,
        val_data=Data(40, 2),
        group=candidate.group,
        callbacks=[candidate, *callbacks],
    )


def _pruning(search_dir: str) -> dict:
    ddpkit.init()
    stopped = {}

    def objective(candidate):
        # Trials 0 and 1 learn; trial 2 does not (lr 0), so the median pruner stops it after its
        # first epoch.
        trainer = _tiny_trainer(candidate, lr=0.3 if candidate.number < 2 else 0.0)
        try:
            return trainer.fit()
        finally:
            stopped[candidate.number] = trainer.epoch

    cfg = SearchConfig(
        n_trials=3,
        group_size=2,
        sampler="random",
        pruner="median",
        search_dir=search_dir,
        plots=False,
    )
    search(objective, {"unused": uniform(0.0, 1.0)}, cfg)
    return stopped


def test_a_pruned_candidate_stops_at_the_same_epoch_on_every_rank_of_its_group(tmp_path):
    per_rank = run_on_ranks(functools.partial(_pruning, str(tmp_path)), 2)
    states = {t.number: t.state for t in _study(tmp_path).trials}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.COMPLETE, 2: TrialState.PRUNED}
    assert per_rank[0] == per_rank[1]
    # judged from epoch 2 on: pruned there; the others ran all 3
    assert per_rank[0][2] == 2 and per_rank[0][0] == 3


def _reported(search_dir: str, val_every_steps: int | None, max_steps: int | None) -> None:
    ddpkit.init()
    cfg = SearchConfig(n_trials=1, group_size=2, pruner="none", search_dir=search_dir, plots=False)

    def objective(candidate):
        return _tiny_trainer(
            candidate, lr=0.3, val_every_steps=val_every_steps, max_steps=max_steps
        ).fit()

    search(objective, {"x": uniform(0, 1)}, cfg)


def test_the_candidate_reports_each_validation_at_epoch_ends_or_every_n_steps(tmp_path):
    # 96 samples in global batches of 12: 8 steps an epoch, 3 epochs. Validating every 4 steps, the
    # candidate reports val/loss at steps 4, 8, ..., 24 (where the epochs' metrics hold no val/loss,
    # which once was taken for a Trainer without val_data); validating at epoch ends, at epochs 1,
    # 2, 3; stopped by max_steps inside the second epoch, at epoch 1 and at the epoch begun, 2 (not
    # at 1 again, which Optuna would ignore).
    for every, max_steps, steps in (
        (4, None, [4, 8, 12, 16, 20, 24]),
        (None, None, [1, 2, 3]),
        (None, 12, [1, 2]),
    ):
        search_dir = tmp_path / f"{every}-{max_steps}"
        run_on_ranks(functools.partial(_reported, str(search_dir), every, max_steps), 2)
        (trial,) = _study(search_dir).trials
        assert trial.state == TrialState.COMPLETE and sorted(trial.intermediate_values) == steps


def _failing(search_dir: str) -> None:
    ddpkit.init()

    def objective(candidate):
        if candidate.number == 1:
            raise ValueError("a bug in user code")
        # Trial 2 diverges: the Trainer stops every rank at the same step with FloatingPointError.
        return _tiny_trainer(candidate, lr=1e6 if candidate.number == 2 else 0.1, epochs=2).fit()

    cfg = SearchConfig(n_trials=4, group_size=1, pruner="none", search_dir=search_dir, plots=False)
    search(objective, {"x": choice([1, 2, 3])}, cfg)


@pytest.mark.torch_at_least(2, 7, "snapshots of a group of ranks without the job's rank 0")
def test_a_failing_candidate_fails_its_trial_only(tmp_path):
    run_on_ranks(functools.partial(_failing, str(tmp_path)), 2)
    trials = {t.number: t for t in _study(tmp_path).trials}
    assert len(trials) == 4
    assert [trials[n].state for n in range(4)] == [
        TrialState.COMPLETE,
        TrialState.FAIL,
        TrialState.FAIL,
        TrialState.COMPLETE,
    ]
    assert "a bug in user code" in trials[1].user_attrs["error"]
    assert "non-finite" in trials[2].user_attrs["error"]
    rows = (tmp_path / "trials.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[2].split(",")[1] == "FAIL"


def _budget(search_dir: str, group_size: int) -> list[int]:
    ddpkit.init()
    numbers = []

    def objective(candidate):
        numbers.append(candidate.number)
        return _tiny_trainer(candidate, lr=candidate.params["lr"], epochs=1).fit()

    cfg = SearchConfig(
        n_trials=5, group_size=group_size, pruner="none", search_dir=search_dir, plots=False
    )
    search(objective, {"lr": uniform(0.01, 0.5, log=True)}, cfg)
    return numbers


@pytest.mark.torch_at_least(2, 7, "snapshots of a group of ranks without the job's rank 0")
def test_groups_run_candidates_concurrently_and_the_budget_is_exact(tmp_path):
    numbers = run_on_ranks(functools.partial(_budget, str(tmp_path), 1), 2)
    study = _study(tmp_path)
    assert len(study.trials) == 5 and all(t.state == TrialState.COMPLETE for t in study.trials)
    assert sorted(numbers[0] + numbers[1]) == [0, 1, 2, 3, 4]  # every trial run once, by one group
    assert numbers[0] and numbers[1]  # both groups worked
    # the groups' samplers do not draw alike
    assert len({t.params["lr"] for t in study.trials}) == 5
    # Each trial trained in its own run directory, written once by its group's main rank.
    for n in range(5):
        log = (tmp_path / f"trial-{n:04d}" / "metrics.jsonl").read_text()
        assert log.count('"event": "start"') == 1


def _bad(what: str, tmp: str) -> str:
    ddpkit.init()
    try:
        if what == "group_size":
            search(
                lambda c: 0.0,
                {"x": choice([1])},
                SearchConfig(n_trials=1, group_size=2, search_dir=tmp),
            )
        elif what == "sqlite":
            search(
                lambda c: 0.0,
                {"x": choice([1])},
                SearchConfig(
                    n_trials=1, storage=f"sqlite:///{tmp}/no/such/dir/study.db", search_dir=tmp
                ),
            )
        elif what == "postgres":
            search(
                lambda c: 0.0,
                {"x": choice([1])},
                SearchConfig(
                    n_trials=1, storage="postgresql://ddpkit@127.0.0.1:1/study", search_dir=tmp
                ),
            )
    except ConfigError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize(
    "what, expected",
    [
        ("group_size", "group_size=2 does not divide the job's 3 ranks"),
        ("sqlite", "cannot open the study 'ddpkit' in storage sqlite:///"),
        (
            "postgres",
            "cannot open the study 'ddpkit' in storage postgresql://ddpkit@127.0.0.1:1/study",
        ),
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(tmp_path, what, expected):
    messages = run_on_ranks(
        functools.partial(_bad, what, str(tmp_path)), 3 if what == "group_size" else 2
    )
    assert all(expected in m for m in messages), messages


def _search_once(search_dir: str) -> str:
    ddpkit.init()
    try:
        search(
            lambda c: 0.0,
            {"x": uniform(0.0, 1.0)},
            SearchConfig(n_trials=1, search_dir=search_dir, plots=False),
        )
    except ConfigError as err:
        return str(err)
    return "accepted"


def test_trial_folders_no_trial_of_the_study_owns_are_refused(tmp_path):
    search_dir = tmp_path / "search"
    old = search_dir / "trial-0000"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"event": "start"}\n')
    (search_dir / "trial-0007").mkdir()  # empty: nothing to resume from, not named
    [message] = run_on_ranks(functools.partial(_search_once, str(search_dir)), 1)
    assert "trial-0000" in message and "trial-0007" not in message, message
    assert "another search_dir" in message and "move those folders" in message
    assert [p.name for p in old.iterdir()] == ["metrics.jsonl"]
    old.rename(tmp_path / "aside")
    assert run_on_ranks(functools.partial(_search_once, str(search_dir)), 1) == ["accepted"]


@pytest.mark.slow
@pytest.mark.parametrize("seeding", ["per start", "same every start"])
def test_a_sigkill_during_a_search_is_survived(tmp_path, clean_env, seeding):
    # 2 groups of 1 rank; rank 1 kills itself after epoch 2 of its first trial on the first attempt.
    # The agent restarts the job; that trial resumes from its snapshot, and the study ends with
    # exactly 4 finished trials.
    control = seeding == "same every start"
    proc = _job(
        tmp_path,
        "--trials",
        "6",  # with 4, the other group could draw every candidate before the kill (seen under load)
        "--kill",
        "2",
        *(["--same-seed-every-start"] if control else []),
        env=clean_env,
        nproc=2,
        restarts=1,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # written by rank 1 just before it SIGKILLed itself
    killed = int((tmp_path / "killed_trial").read_text())
    study = _study(tmp_path)
    assert len(study.trials) == 6
    assert all(t.state == TrialState.COMPLETE for t in study.trials), [
        t.state for t in study.trials
    ]
    log = (tmp_path / f"trial-{killed:04d}" / "metrics.jsonl").read_text()
    events = [json.loads(line) for line in log.splitlines()]
    resumes = [e for e in events if e.get("event") == "resume"]
    # From its own snapshot: the epoch-2 one, or the one before it if the kill came while the
    # epoch-2 snapshot was still being written in the background.
    assert resumes and resumes[0]["restart_count"] == 1 and resumes[0]["step"] > 0, resumes
    # The other group's candidate was stopped by the agent too: both were left running, both are
    # resumed.
    line = next(x for x in proc.stdout.splitlines() if "a stopped job left running" in x)
    assert killed in json.loads(line.split("running: ")[1])
    # The restarted job draws new candidates (a continuous space: a repeat by chance has probability
    # 0). Control: seeded as the first start was, a group's first draw after the restart repeats its
    # first draw of the first start.
    params = _params(study)
    after = {n for n in params if _first_start(tmp_path / f"trial-{n:04d}")["restart_count"] == 1}
    assert after, (
        "every candidate was drawn before the kill: the test shows nothing "
        f"({params})\n{proc.stderr[-4000:]}"
    )
    repeats = [n for n in after if params[n] in {params[m] for m in params if m not in after}]
    assert repeats if control else not repeats, (after, params)


def _first_start(run_dir: Path) -> dict:
    return next(e for e in read_records(run_dir) if e.get("event") == "start")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_search_run_again_with_a_larger_budget_draws_new_candidates_and_replays_alike(
    tmp_path, clean_env
):
    runs = {}
    for name, extra in [("a", []), ("b", []), ("control", ["--same-seed-every-start"])]:
        for trials in ("2", "4"):
            plots = ["--plots"] if (name, trials) == ("a", "4") else []
            proc = _job(tmp_path / name, "--trials", trials, *extra, *plots, env=clean_env)
            assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = _params(_study(tmp_path / name))
    # the report of the second start plots all four trials (the others' jobs draw no plots)
    plots = ("history.png", "importances.png", "intermediate.png")
    assert all((tmp_path / "a" / p).stat().st_size > 0 for p in plots)
    assert not list((tmp_path / "b").glob("*.png"))
    assert sorted(runs["a"]) == [0, 1, 2, 3]
    assert len(set(runs["a"].values())) == 4  # the second start drew candidates of its own
    assert runs["a"] == runs["b"]  # the same starts replayed: the same candidates
    assert runs["control"][2] == runs["control"][0] and runs["control"][3] == runs["control"][1]


@pytest.mark.slow
def test_a_kill_inside_ask_leaves_a_trial_the_restart_resumes(tmp_path, clean_env):
    # The process drawing trial 2's parameters SIGKILLs itself after drawing the first of two,
    # inside the sampler: the trial exists in the study, half drawn. The agent restarts the job.
    proc = _job(tmp_path, "--trials", "4", "--kill-in-ask", "2", env=clean_env, nproc=2, restarts=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the mark the process wrote before its SIGKILL
    assert (tmp_path / "killed_in_ask").read_text() == "2"
    study = _study(tmp_path)
    assert len(study.trials) == 4, [(t.number, t.state) for t in study.trials]
    assert all(t.state == TrialState.COMPLETE for t in study.trials), [
        t.state for t in study.trials
    ]
    assert set(study.trials[2].params) == {"lr", "momentum"}
    line = next(x for x in proc.stdout.splitlines() if "a stopped job left running" in x)
    assert 2 in json.loads(line.split("running: ")[1])
    events = (tmp_path / "trial-0002" / "metrics.jsonl").read_text()
    # trained once, whole
    assert events.count('"event": "start"') == 1 and '"event": "resume"' not in events


@pytest.mark.slow
def test_a_second_job_on_a_search_dir_is_refused_and_the_first_goes_on(tmp_path, clean_env):
    first = subprocess.Popen(
        [sys.executable, JOB, str(tmp_path), "--trials", "2", "--gate"],
        env=clean_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The first job holds the search and trial 0 is running in it while it waits at the gate.
        for line in first.stdout:
            if line.startswith("gate: trial 0 is running"):
                break
        else:
            pytest.fail(
                f"the first job ended before trial 0 started: {first.stderr.read()[-3000:]}"
            )
        second = _job(tmp_path, "--trials", "2", env=clean_env)
        out, err = first.communicate(input="go\n", timeout=120)
    finally:
        first.kill()
    assert second.returncode != 0, second.stdout[-2000:]
    assert f"search_dir {str(tmp_path)!r} is in use by another search job (host" in second.stderr
    assert f"pid {first.pid}" in second.stderr and "another search_dir" in second.stderr
    assert first.returncode == 0, err[-3000:]
    study = _study(tmp_path)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert "trial 0 val/loss" in out  # the first job finished its trial itself


@pytest.mark.slow
def test_a_search_goes_on_from_a_journal_cut_by_a_kill(tmp_path, clean_env):
    assert _job(tmp_path, "--trials", "2", env=clean_env).returncode == 0
    journal = tmp_path / "study.journal"
    before = {t.number: t.value for t in _study(tmp_path).trials}
    journal.write_bytes(journal.read_bytes()[:-20])  # the last record (trial 1's result) cut short
    proc = _job(tmp_path, "--trials", "3", env=clean_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ended in a record cut short" in proc.stdout and list(
        tmp_path.glob("study.journal.cut-*")
    )
    trials = _study(tmp_path).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert trials[0].value == before[0]
    assert "resuming 1 trial(s) a stopped job left running: [1]" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("fault, nproc", [(errno.ENOSPC, None), (errno.EROFS, 2)])
def test_an_error_of_the_machine_stops_the_search_and_spends_no_budget(
    tmp_path, clean_env, fault, nproc
):
    # Trial 1 meets the error at the end of its first epoch: on the only rank, or on one rank of a
    # group of 2 while the other goes on into the next epoch's collectives.
    group = ["--group-size", "2"] if nproc else []
    proc = _job(
        tmp_path, "--trials", "3", "--fault", f"{fault}:1", *group, env=clean_env, nproc=nproc
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "trial 1 was stopped by the machine, not by the candidate" in proc.stderr
    assert os.strerror(fault) in proc.stderr
    states = {t.number: t.state for t in _study(tmp_path).trials}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.RUNNING}
    proc = _job(tmp_path, "--trials", "3", *group, env=clean_env, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [t.state for t in _study(tmp_path).trials] == [TrialState.COMPLETE] * 3
    assert '"event": "resume"' in (tmp_path / "trial-0001" / "metrics.jsonl").read_text()


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs mounted for the test (needs root; skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_a_full_disk_stops_the_search_and_it_goes_on_once_there_is_room(small_disk, clean_env):
    search_dir = small_disk / "search"
    proc = _job(search_dir, "--trials", "3", "--fill-disk", "1", env=clean_env)
    assert "filled the disk" in proc.stdout
    assert proc.returncode != 0, proc.stdout[-2000:]
    # Met by the Trainer's snapshot, written in the background by torch.distributed.checkpoint, or
    # by the study.
    assert (
        "trial 1 was stopped by the machine, not by the candidate: [Errno 28] No space left"
        in proc.stderr
    )
    assert {t.number: t.state for t in _study(search_dir).trials} == {
        0: TrialState.COMPLETE,
        1: TrialState.RUNNING,
    }
    (search_dir / "filler").unlink()
    proc = _job(search_dir, "--trials", "3", env=clean_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = _study(search_dir).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3, [t.state for t in trials]
    assert "resuming 1 trial(s) a stopped job left running: [1]" in proc.stdout


@pytest.mark.slow
def test_a_full_disk_met_between_trials_stops_the_search_and_fails_no_trial(small_disk, clean_env):
    # The disk fills after trial 0 has trained: the next write is the study's (the result, the next
    # trial) or the next trial's run directory, whichever the file system's slack lets through
    # first. Either way the search stops with the error named in one line, and no trial is failed
    # for it (the run directory's claim used to turn the OSError into a ConfigError, which failed
    # trial 1 and spent the budget).
    search_dir = small_disk / "search"
    proc = _job(search_dir, "--trials", "3", "--fill-disk-after", "0", env=clean_env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "filled the disk" in proc.stdout
    named = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("ddpkit search: ") and "[Errno 28]" in line
    ]
    assert named and ("the study's storage" in named[0] or "stopped by the machine" in named[0]), (
        proc.stderr[-3000:]
    )
    assert all(t.state != TrialState.FAIL for t in _study(search_dir).trials)


@pytest.mark.slow
def test_trial_folders_left_by_another_search_are_refused(tmp_path, clean_env):
    assert _job(tmp_path, "--trials", "2", env=clean_env).returncode == 0
    log = (tmp_path / "trial-0000" / "metrics.jsonl").read_text()
    # the study emptied; its trials' folders left behind
    (tmp_path / "study.journal").write_bytes(b"")
    proc = _job(tmp_path, "--trials", "2", env=clean_env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "trial-0000, trial-0001" in proc.stderr and "another search_dir" in proc.stderr
    # nothing trained, nothing written
    assert (tmp_path / "trial-0000" / "metrics.jsonl").read_text() == log


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_searches_sharing_a_study_draw_candidates_of_their_own_however_they_start(
    tmp_path, clean_env
):
    """Two searches on one database study (their own search dirs), each reading the study's count
    of starts as 0, as two started together do: their samplers' seeds differ by the search's own
    id, so they draw other candidates. Control: seeded without the id, they draw the same."""
    found = {}
    for name, extra in [("own", []), ("control", ["--seed-without-search-id"])]:
        url = f"sqlite:///{tmp_path / name}.db"
        for one in ("a", "b"):
            args = ["--trials", "2", "--epochs", "1", "--storage", url, "--first-start", *extra]
            proc = _job(tmp_path / name / one, *args, env=clean_env)
            assert proc.returncode == 0, proc.stderr[-3000:]
        study = optuna.load_study(study_name="ddpkit", storage=url)
        by_search: dict[str, list] = {}
        for t in sorted(study.trials, key=lambda t: t.number):
            by_search.setdefault(t.user_attrs["ddpkit_search"], []).append(t.params)
        found[name] = list(by_search.values())
    own_a, own_b = found["own"]
    assert own_a != own_b, found
    control_a, control_b = found["control"]
    assert control_a == control_b, found
