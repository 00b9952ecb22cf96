"""The search on groups of ranks: budgets, pruning, failures and a SIGKILL, with real processes."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.search import SearchConfig, choice, search, uniform
from ddpkit.trainer import Trainer, TrainerConfig

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from search_job import Data  # noqa: E402

JOB = str(Path(__file__).parent / "scripts" / "search_job.py")


def _study(search_dir: Path) -> optuna.Study:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return optuna.load_study(study_name="ddpkit", storage=JournalStorage(JournalFileBackend(str(search_dir / "study.journal"))))


def _tiny_trainer(candidate, lr: float, epochs: int = 3, callbacks=()) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    config = TrainerConfig(run_dir=str(candidate.run_dir), epochs=epochs, global_batch_size=12, progress=False)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), Data(96, 1), config, val_data=Data(40, 2),
                   group=candidate.group, callbacks=callbacks)


def _pruning(search_dir: str) -> dict:
    ddpkit.init()
    stopped = {}

    def objective(candidate):
        # Trials 0 and 1 learn; trial 2 does not (lr 0), so the median pruner stops it after its first epoch.
        trainer = _tiny_trainer(candidate, lr=0.3 if candidate.number < 2 else 0.0)
        try:
            return trainer.fit()
        finally:
            stopped[candidate.number] = trainer.epoch

    cfg = SearchConfig(n_trials=3, group_size=2, sampler="random", pruner="median", search_dir=search_dir, plots=False)
    search(objective, {"unused": uniform(0.0, 1.0)}, cfg)
    return stopped


def test_a_pruned_candidate_stops_at_the_same_epoch_on_every_rank_of_its_group(tmp_path):
    per_rank = ddpkit.spawn(functools.partial(_pruning, str(tmp_path)), 2)
    states = {t.number: t.state for t in _study(tmp_path).trials}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.COMPLETE, 2: TrialState.PRUNED}
    assert per_rank[0] == per_rank[1]
    assert per_rank[0][2] == 2 and per_rank[0][0] == 3  # judged from epoch 2 on: pruned there; the others ran all 3


def _failing(search_dir: str) -> None:
    ddpkit.init()

    def objective(candidate):
        if candidate.number == 1:
            raise ValueError("a bug in user code")
        # Trial 2 diverges: the Trainer stops every rank at the same step with FloatingPointError.
        return _tiny_trainer(candidate, lr=1e6 if candidate.number == 2 else 0.1, epochs=2).fit()

    cfg = SearchConfig(n_trials=4, group_size=1, pruner="none", search_dir=search_dir, plots=False)
    search(objective, {"x": choice([1, 2, 3])}, cfg)


def test_a_failing_candidate_fails_its_trial_only(tmp_path):
    ddpkit.spawn(functools.partial(_failing, str(tmp_path)), 2)
    trials = {t.number: t for t in _study(tmp_path).trials}
    assert len(trials) == 4
    assert [trials[n].state for n in range(4)] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE]
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

    cfg = SearchConfig(n_trials=5, group_size=group_size, pruner="none", search_dir=search_dir, plots=False)
    search(objective, {"lr": uniform(0.01, 0.5, log=True)}, cfg)
    return numbers


def test_groups_run_candidates_concurrently_and_the_budget_is_exact(tmp_path):
    numbers = ddpkit.spawn(functools.partial(_budget, str(tmp_path), 1), 2)
    study = _study(tmp_path)
    assert len(study.trials) == 5 and all(t.state == TrialState.COMPLETE for t in study.trials)
    assert sorted(numbers[0] + numbers[1]) == [0, 1, 2, 3, 4]  # every trial run once, by one group
    assert numbers[0] and numbers[1]  # both groups worked
    assert len({t.params["lr"] for t in study.trials}) == 5  # the groups' samplers do not draw alike
    # Each trial trained in its own run directory, written once by its group's main rank.
    for n in range(5):
        log = (tmp_path / f"trial-{n:04d}" / "metrics.jsonl").read_text()
        assert log.count('"event": "start"') == 1


def _bad(what: str, tmp: str) -> str:
    ddpkit.init()
    try:
        if what == "group_size":
            search(lambda c: 0.0, {"x": choice([1])}, SearchConfig(n_trials=1, group_size=2, search_dir=tmp))
        elif what == "sqlite":
            search(lambda c: 0.0, {"x": choice([1])},
                   SearchConfig(n_trials=1, storage=f"sqlite:///{tmp}/no/such/dir/study.db", search_dir=tmp))
        elif what == "postgres":
            search(lambda c: 0.0, {"x": choice([1])},
                   SearchConfig(n_trials=1, storage="postgresql://ddpkit@127.0.0.1:1/study", search_dir=tmp))
    except ConfigError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize("what, expected", [
    ("group_size", "group_size=2 does not divide the job's 3 ranks"),
    ("sqlite", "cannot open the study 'ddpkit' in storage sqlite:///"),
    ("postgres", "cannot open the study 'ddpkit' in storage postgresql://ddpkit@127.0.0.1:1/study"),
])
def test_bad_input_is_a_clear_error_on_every_rank(tmp_path, what, expected):
    messages = ddpkit.spawn(functools.partial(_bad, what, str(tmp_path)), 3 if what == "group_size" else 2)
    assert all(expected in m for m in messages), messages


def test_a_search_space_optuna_rejects_is_a_clear_error():
    with pytest.raises(ConfigError, match="uniform"):
        uniform(1.0, 0.1)
    with pytest.raises(ConfigError, match="log"):
        uniform(0.0, 1.0, log=True)
    with pytest.raises(ConfigError, match="parameter 'lr'"):
        ddpkit.search.space.to_distributions({"lr": 0.1})
    with pytest.raises(ConfigError, match="sampler='grid' needs choices"):
        ddpkit.search.engine._sampler(SearchConfig(n_trials=1, sampler="grid"), {"lr": uniform(0.1, 1.0)})


@pytest.mark.slow
def test_a_sigkill_during_a_search_is_survived(tmp_path, clean_env):
    # 2 groups of 1 rank; rank 1 kills itself after epoch 2 of its first trial on the first attempt. The agent
    # restarts the job; that trial resumes from its snapshot, and the study ends with exactly 4 finished trials.
    cmd = [sys.executable, "-m", "ddpkit.cli", "run", "--nproc", "2", "--max-restarts", "1", JOB, str(tmp_path),
           "--trials", "4", "--kill", "2"]
    proc = subprocess.run(cmd, env=clean_env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr or "SIGKILL" in proc.stderr, "no worker was killed"
    study = _study(tmp_path)
    assert len(study.trials) == 4
    assert all(t.state == TrialState.COMPLETE for t in study.trials), [t.state for t in study.trials]
    killed = int((tmp_path / "killed_trial").read_text())
    events = [json.loads(line) for line in (tmp_path / f"trial-{killed:04d}" / "metrics.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e.get("event") == "resume"]
    # From its own snapshot: the epoch-2 one, or the one before it if the kill came while the epoch-2 snapshot
    # was still being written in the background.
    assert resumes and resumes[0]["restart_count"] == 1 and resumes[0]["step"] > 0, resumes
    # The other group's candidate was stopped by the agent too: both were left running, both are resumed.
    line = next(x for x in proc.stdout.splitlines() if "a stopped job left running" in x)
    assert killed in json.loads(line.split("running: ")[1])
