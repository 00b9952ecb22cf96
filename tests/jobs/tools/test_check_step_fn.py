"""``ddpkit check`` on a step function's script that defines ``ddpkit_workload()``: the hook is
checked, not the Trainer (a student distilled from a frozen teacher, the teacher inside the
student's loss), with real ranks. Without a hook the Trainer itself is run
(``test_check_gan.py``)."""

from pathlib import Path

from ddpkit.tools._check import CheckConfig, run_check

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "check_step_fn.py")


def test_a_step_fn_script_is_checked_through_the_workload_it_defines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, lines = run_check(CheckConfig(script=SCRIPT, steps=2))
    report = "\n".join(lines)
    assert code == 0 and "OK: 2 ranks train the same model as one process" in report, report
    assert not (tmp_path / "runs").exists()  # the Trainer was neither built nor run
    # Control: the student with BatchNorm over each rank's slice differs, and the cause is named.
    code, lines = run_check(CheckConfig(script=SCRIPT, script_args=("--batchnorm",), steps=2))
    assert code == 1 and "cause: BatchNorm without global statistics" in "\n".join(lines)
