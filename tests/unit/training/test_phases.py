"""Several trainings of one script in one run directory, each a ``phase`` (one process, no
launcher): the phase's folder, the Trainers refused in one folder, and ``fit()`` of a finished
phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.snapshot._run_dir import run_dir_lock
from ddpkit.training._config import LoggingConfig, TrainerConfig

X = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
DATA = torch.utils.data.TensorDataset(X, (X.sum(1) > 0).long())


def trainer(run_dir: Path, phase: str | None, seed: int = 0) -> ddpkit.Trainer:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    config = TrainerConfig(
        run_dir=str(run_dir), phase=phase, epochs=2, batch_size=8, num_workers=0,
        weights_format=None, logging=LoggingConfig(progress=False),
    )  # fmt: skip
    return ddpkit.Trainer(model, torch.optim.Adam(model.parameters(), lr=0.1), DATA, config)


@pytest.mark.parametrize("phase", ["a/b", "..", ".hidden", "", "snapshots", "two words"])
def test_a_phase_that_is_not_a_plain_folder_name_is_refused_naming_it(phase):
    with pytest.raises(ConfigError, match=r"phase=.*: give a plain folder name"):
        TrainerConfig(batch_size=8, phase=phase)
    with pytest.raises(ConfigError, match=r"phase takes a str or None"):
        TrainerConfig(batch_size=8, phase=1)  # type: ignore[arg-type]
    # Control: a plain name is the folder under run_dir.
    assert TrainerConfig(batch_size=8, run_dir="r", phase="teacher-1.b").phase_dir == Path(
        "r/teacher-1.b"
    )


def test_two_trainers_of_a_process_in_one_folder_are_refused_naming_phase(tmp_path):
    teacher = trainer(tmp_path, "teacher")
    with pytest.raises(ConfigError, match=r"phase='teacher'.*TrainerConfig\(phase=\.\.\.\)"):
        trainer(tmp_path, "teacher")
    with pytest.raises(ConfigError, match=r"phase='teacher'.*TrainerConfig\(phase=\.\.\.\)"):
        trainer(tmp_path, None)
    # Control: another phase of the same run directory is built, and writes in its own folder.
    student = trainer(tmp_path, "student")
    assert (teacher.run_dir, student.run_dir) == (tmp_path / "teacher", tmp_path / "student")
    plain = trainer(tmp_path / "plain", None)
    with pytest.raises(ConfigError, match=r"\(no phase\).*phase="):
        trainer(tmp_path / "plain", "teacher")
    # Control: without phases, a second Trainer is built (it resumes the first's run, or the run
    # record's check refuses it); a Trainer let go of leaves its phase to the next.
    assert trainer(tmp_path / "plain", None).run_dir == plain.run_dir
    del teacher
    trainer(tmp_path, "teacher")


def test_fit_of_a_finished_phase_restores_its_final_state_and_returns_its_metrics(tmp_path):
    first = trainer(tmp_path, "teacher")
    last = first.fit()
    final = {k: v.clone() for k, v in first.model.state_dict().items()}
    optim = first.optimizer.state_dict()["state"]
    del first
    again = trainer(tmp_path, "teacher", seed=1)  # other initial weights
    assert not torch.equal(again.model.weight, final["weight"])  # control: not yet restored
    assert again.fit() == last
    assert all(torch.equal(v, final[k]) for k, v in again.model.state_dict().items())
    assert torch.equal(again.optimizer.state_dict()["state"][0]["exp_avg"], optim[0]["exp_avg"])
    records = [json.loads(line) for line in (tmp_path / "teacher" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [4, 8]  # trained once
    stops = [r.get("resumed_finished", False) for r in records if r.get("event") == "stop"]
    assert stops == [False, True]


def test_the_phases_of_a_process_share_the_run_directorys_lock_until_it_ends(tmp_path):
    trainer(tmp_path, "teacher").fit()
    # still held once fit() returned: no other job takes the folder between two phases
    with pytest.raises(ConfigError, match="in use by another job"):
        run_dir_lock(tmp_path).acquire()
    trainer(tmp_path, "student").fit()  # the next phase of the process goes on under it
    assert not (tmp_path / "teacher" / ".lock").exists()
    # Control: a run without phases lets go of its folder when fit() returns.
    trainer(tmp_path / "plain", None).fit()
    with run_dir_lock(tmp_path / "plain"):
        pass
