"""``ddpkit check``: real ranks (ddpkit.spawn, gloo) against one process, on scripts with one known
mistake each.

Every mistake script is ``scripts/check_correct.py`` plus that one mistake; the correct script must
pass, each mistake must get exactly its own cause named (a check that named causes at random, or
always the same one, fails here), and a mistake outside the known list must be reported as
unexplained, with a non-zero exit.
"""

import subprocess
from pathlib import Path

import pytest

from ddpkit._errors import ConfigError
from ddpkit.testing import run_job
from ddpkit.tools._check import CAUSES, CheckConfig, run_check
from ddpkit.tools._workload import load_workload
from tests.jobs.conftest import clean_environ

pytestmark = pytest.mark.heavy

SCRIPTS = Path(__file__).parents[1] / "scripts"


ROOT = Path(__file__).resolve().parents[3]


def _check(name: str) -> tuple[int, str]:
    code, lines = run_check(
        CheckConfig(script=str(SCRIPTS / f"check_{name}.py"), steps=3 if name == "uneven" else 2)
    )
    return code, "\n".join(lines)


def test_a_correct_script_passes():
    code, report = _check("correct")
    assert code == 0, report
    assert "OK: 2 ranks train the same model as one process" in report


MISTAKES = {
    "batchnorm": "batchnorm",
    "dropout": "dropout",
    "augmentation": "augmentation",
    "data_order": "data_order",
    "unused": "unused_parameters",
    "initial_state": "initial_state",
    "nondeterminism": "nondeterminism",
    "uneven": "uneven_mean",
}


@pytest.mark.parametrize("script,key", MISTAKES.items())
def test_each_mistake_gets_its_own_cause_named(script, key):
    code, report = _check(script)
    assert code == 1, report
    assert "MISMATCH: " in report and "first differ at step" in report, report
    named = [c.key for c in CAUSES if f"cause: {c.what}" in report]
    assert named == [key], f"expected only {key!r} named, got {named}\n{report}"
    fix = next(c.fix for c in CAUSES if c.key == key)
    assert f"fix: {fix}" in report


def test_a_mistake_outside_the_list_is_unexplained_and_fails():
    code, report = _check("unexplained")
    assert code == 1, report
    assert "UNEXPLAINED" in report and "cause:" not in report, report


def test_the_command_exits_non_zero_and_names_the_fix():
    proc = _check_cli(SCRIPTS / "check_batchnorm.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fix: sync_batchnorm=True" in proc.stdout, proc.stdout


# --- workloads without a hook ---------------------------------------------------------------------


def _named(report: str) -> list[str]:
    return [c.key for c in CAUSES if f"cause: {c.what}" in report]


@pytest.mark.slow
def test_an_unchanged_trainer_script_is_checked_from_the_trainer_it_builds(tmp_path, monkeypatch):
    # examples/digits_trainer.py defines no ddpkit_workload(): the check runs it up to its Trainer
    # and takes the model, optimizer, data and loss from there. Its CNN has BatchNorm and it leaves
    # sync_batchnorm off.
    monkeypatch.chdir(tmp_path)  # where the script's run_dir (runs/digits) would be written
    code, lines = run_check(
        CheckConfig(script=str(ROOT / "examples" / "digits_trainer.py"), steps=2)
    )
    report = "\n".join(lines)
    assert code == 1 and _named(report) == ["batchnorm"], report
    # stopped where the Trainer would be built: nothing trained
    assert not (tmp_path / "runs").exists()
    # The same script with sync_batchnorm=True passes: the check takes the Trainer's config too.
    for name in ("digits_trainer.py", "digits_cnn.py"):
        text = (ROOT / "examples" / name).read_text()
        (tmp_path / name).write_text(
            text.replace("num_workers=0,", "num_workers=0, sync_batchnorm=True,")
        )
    code, lines = run_check(CheckConfig(script=str(tmp_path / "digits_trainer.py"), steps=2))
    assert code == 0, "\n".join(lines)


@pytest.mark.slow
def test_the_built_in_language_model_passes_with_per_token_weights():
    code, lines = run_check(CheckConfig(script="lm", steps=3))
    assert code == 0 and "OK: 2 ranks train the same model as one process" in lines[-1], "\n".join(
        lines
    )


def test_a_script_that_builds_no_trainer_and_has_no_hook_is_refused(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import sys\nprint('ran', sys.argv)\n")
    with pytest.raises(ConfigError, match="builds no ddpkit.Trainer"):
        load_workload(str(script))


# --- a script's arguments and its own failures ----------------------------------------------------

_WITH_OPTIONS = f"""
import argparse, sys
sys.path.insert(0, {str(SCRIPTS)!r})
import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from ddpkit.tools._workload import Workload

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--fail-at", type=int, default=None)
args = parser.parse_args()
calls = []


def loss(out, y):
    calls.append(1)
    if args.fail_at is not None and len(calls) > args.fail_at:
        raise RuntimeError("a bug in the script's loss")
    return F.cross_entropy(out, y)


def ddpkit_workload():
    return Workload(
        model=mlp(), dataset=toy_data(), loss_fn=loss, optimizer=sgd, batch_size=args.batch
    )
"""


def _check_cli(script: Path, *args: str) -> subprocess.CompletedProcess:
    """``ddpkit check --nproc 2 --steps 2 SCRIPT ARGS`` from the checkout."""
    return run_job(
        script, *args, command="check", launcher_args=("--steps", "2"), env=clean_environ(),
        cwd=ROOT, timeout=120,
    )  # fmt: skip


def test_the_scripts_own_arguments_are_passed_on(tmp_path):
    script = tmp_path / "with_options.py"
    script.write_text(_WITH_OPTIONS)
    proc = _check_cli(script, "--batch", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: 2 ranks train the same model as one process" in proc.stdout
    # Control: the options are read by the script (without them its argparse stops it), and that
    # stop is the script's failure, reported as such.
    proc = _check_cli(script)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (
        "FAILED" in proc.stdout
        and "the following arguments are required: --batch" in proc.stderr + proc.stdout
    )


def test_an_exception_in_the_script_is_reported_with_its_traceback_not_as_a_difference(
    tmp_path, monkeypatch
):
    script = tmp_path / "with_options.py"
    script.write_text(_WITH_OPTIONS)
    cfg = CheckConfig(script=str(script), script_args=("--batch", "8", "--fail-at", "1"), steps=2)
    code, lines = run_check(cfg)
    report = "\n".join(lines)
    assert code == 3, report
    assert "raised in the 1-process run" in report and "Traceback" in report, report
    assert "RuntimeError: a bug in the script's loss" in report and "MISMATCH" not in report
    # Control: with the traceback left out (the check as it was), the same failure reads as a
    # numerical one.
    import ddpkit.tools._check as check

    train = check.train_steps
    monkeypatch.setattr(check, "train_steps", lambda *a, **k: train(*a, **k) | {"traceback": None})
    code, lines = run_check(cfg)
    assert code == 1 and "MISMATCH" in "\n".join(lines)


# --- the check checks what it says ----------------------------------------------------------------

_NAMESPACE = f"""
import sys
from types import SimpleNamespace
sys.path.insert(0, {str(SCRIPTS)!r})
import torch.nn.functional as F
from torch import nn
from check_common import mlp, sgd, toy_data
from ddpkit.tools._workload import Workload


class Wrapped(nn.Module):
    '''A model whose forward returns its logits in a SimpleNamespace, as HF models' outputs are
    objects: DDP cannot search it for tensors. With --batchnorm, each rank normalises its own
    slice.'''

    def __init__(self):
        super().__init__()
        self.inner = mlp(nn.BatchNorm1d(16)) if "--batchnorm" in sys.argv else mlp()

    def forward(self, x):
        return SimpleNamespace(logits=self.inner(x))


def ddpkit_workload():
    return Workload(model=Wrapped(), dataset=toy_data(), optimizer=sgd, batch_size=8,
                    loss_fn=lambda out, y: F.cross_entropy(out.logits, y))
"""


def test_a_correct_model_with_namespace_outputs_passes_and_is_not_failed_by_a_switch(
    tmp_path, monkeypatch
):
    import ddpkit.tools._check as check

    script = tmp_path / "namespace.py"
    script.write_text(_NAMESPACE)
    code, lines = run_check(CheckConfig(script=str(script), steps=2))
    assert code == 0, "\n".join(lines)
    # With a mistake the switches are turned, find_unused_parameters not among them: the mistake
    # is named.
    cfg = CheckConfig(script=str(script), script_args=("--batchnorm",), steps=2)
    code, lines = run_check(cfg)
    assert code == 1 and _named("\n".join(lines)) == ["batchnorm"], "\n".join(lines)
    # Control: find_unused_parameters switched on whatever the model (the set-ups before): DDP
    # cannot honour it for this output, and the check blamed the script for its own switch.
    old = check._setups
    monkeypatch.setattr(check, "_setups", lambda keys: old(check._KEYS))
    code, lines = run_check(cfg)
    assert code == check.SCRIPT_FAILED and "FAILED" in lines[0], "\n".join(lines)


def test_a_hand_loop_without_a_workload_is_refused_before_it_runs(tmp_path):
    run_dir = tmp_path / "runs" / "x"
    script = tmp_path / "hand.py"
    script.write_text(
        f"import pathlib, torch\npathlib.Path({str(run_dir)!r}).mkdir(parents=True)\n"
        "w = torch.zeros(1, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(3):\n    (w * 2).sum().backward()\n    opt.step()\n"
    )
    with pytest.raises(ConfigError, match="read from its source, which was not run"):
        load_workload(str(script))
    assert not run_dir.exists()  # nothing of it ran
    # One whose source builds a Trainer only where it never runs stops at its first optimizer step.
    script.write_text(
        script.read_text() + "\nif False:\n    from ddpkit import Trainer\n    Trainer()\n"
    )
    with pytest.raises(ConfigError, match="takes an optimizer step before building"):
        load_workload(str(script))
    assert run_dir.exists()  # it ran up to the step: the control that the refusal above ran nothing


def test_a_script_of_several_trainings_names_the_one_it_checks(tmp_path):
    # a teacher, then a student: the check takes the first Trainer the script builds, and says so
    for name in ("digits_trainer.py", "digits_cnn.py"):
        (tmp_path / name).write_text((ROOT / "examples" / name).read_text())
    script = tmp_path / "digits_trainer.py"
    first = script.read_text().count("\n", 0, script.read_text().index("Trainer(model")) + 1
    script.write_text(
        script.read_text() + "student = Trainer(model, optimizer, train_set, config)\n"
    )
    last = script.read_text().count("\n")
    w = load_workload(str(script), 2, ["--epochs", "1"])
    note = w.extra["workload"]
    assert f"the first it builds; its source builds Trainers at lines {first}, {last}" in note, note


_PADDED = """
import torch
import torch.nn.functional as F
from torch import nn

import ddpkit


class Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(2 + i % 5, 4, generator=g), i % 3


def pad(samples):
    seqs, targets = zip(*samples)
    return nn.utils.rnn.pad_sequence(list(seqs), batch_first=True), torch.tensor(targets)


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x.sum(1))  # padded zeros add nothing


torch.manual_seed(0)
model = Pooled()
config = ddpkit.TrainerConfig(run_dir="runs/pad", epochs=1, batch_size=8, collate_fn=pad)
ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), Ragged(), config).fit()
"""


def test_a_trainer_scripts_collate_fn_builds_the_checks_batches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "padded.py"
    script.write_text(_PADDED)
    code, lines = run_check(CheckConfig(script=str(script), steps=2))
    assert code == 0, "\n".join(lines)
    # control: the same samples through torch's default collate cannot be stacked
    script.write_text(_PADDED.replace(", collate_fn=pad", ""))
    code, lines = run_check(CheckConfig(script=str(script), steps=2))
    report = "\n".join(lines)
    assert code == 3 and "stack expects each tensor to be equal size" in report, report
