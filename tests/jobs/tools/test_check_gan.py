"""``ddpkit check`` on a step_fn Trainer's script as it is (a small GAN, no ``ddpkit_workload()``):
the Trainer itself run in one process and on 2 ranks, in run directories of its own that are
removed after."""

import tempfile
from pathlib import Path

import pytest

from ddpkit.tools._check import CheckConfig, run_check

pytestmark = pytest.mark.heavy

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "check_gan.py")


def _check(*args: str) -> tuple[int, str]:
    code, lines = run_check(CheckConfig(script=SCRIPT, script_args=args, steps=3))
    return code, "\n".join(lines)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """The script's folder and the temporary one, both watched."""
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir(), temp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TMPDIR", str(temp))  # ranks started as new interpreters
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return work, temp


def test_a_gan_step_fn_script_passes_and_its_batchnorm_is_named(dirs):
    work, temp = dirs
    code, report = _check()
    assert code == 0 and "OK: 2 ranks train the same model as one process" in report, report
    assert "not switched for a Trainer: data order" in report
    # never the script's own run_dir, and the check's own are removed
    assert not (work / "runs").exists() and not list(temp.glob("ddpkit-check-*"))
    # Control: BatchNorm in the discriminator, sync_batchnorm off, fails and is named.
    code, report = _check("--batchnorm")
    assert code == 1 and "MISMATCH: 2 ranks vs 1 process: first differ at step 0" in report, report
    assert "(most in model " in report
    assert "cause: BatchNorm without global statistics" in report and "cause: dropout" not in report


def test_per_rank_dropout_in_a_step_fn_fails_and_global_batch_dropout_passes(dirs):
    code, report = _check("--dropout")
    assert code == 1 and "cause: dropout drawing per rank" in report, report
    assert "cause: BatchNorm" not in report
    # Control: the script's own global_batch_dropout=True passes.
    code, report = _check("--dropout", "--global-dropout")
    assert code == 0 and "OK: 2 ranks train the same model as one process" in report, report
