"""examples/gan.py under ``ddpkit run --nproc 2 --max-restarts 1``: a rank SIGKILLed at a step, the
job restarted, and both models and both optimizers end bit for bit where an uninterrupted run's
do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpkit.testing import run_job
from tests.trainer_checks import same_bits

JOB = str(Path(__file__).parents[1] / "scripts" / "gan_job.py")


def launch(
    tmp: Path, name: str, kill_rank: int, kill_step: int, forget: bool = False
) -> tuple[list, str]:
    job = [str(tmp / name), str(kill_rank), str(kill_step), str(int(forget)), "--"]
    job += ["--run-dir", str(tmp / f"{name}-run"), "--epochs", "3"]
    proc = run_job(JOB, *job, launcher_args=("--max-restarts", "1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"{name}.rank{r}", weights_only=False) for r in (0, 1)], proc.stdout


def same_state(a: dict, b: dict) -> bool:
    """Both models and both optimizers the same bits, at the same step."""
    return same_bits(a["strategy"], b["strategy"], "model", "optim") and a["step"] == b["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_one_rank_resumes_both_models_and_optimizers_bitwise(tmp_path):
    reference, _ = launch(tmp_path, "reference", 0, -1)
    assert reference[0]["attempt"] == 0 and reference[0]["step"] == 96  # 3 epochs of 32 steps
    # Snapshots every 20 steps and at epoch ends: a kill after step 47 resumes from step 40's (or
    # 32's, where step 40's was still being written in the background).
    killed, out = launch(tmp_path, "killed", 1, 47)
    assert killed[0]["attempt"] == 1 and killed[0]["resumed_from"] in (32, 40), out[-2000:]
    assert any(k.startswith("g.") for k in killed[0]["strategy"]["model"])
    assert any(k.startswith("state.d.") for k in killed[0]["strategy"]["optim"])
    for rank in (0, 1):
        assert same_state(killed[rank], reference[rank]), (
            f"rank {rank}: the resumed run's state differs"
        )
    # Control: a resume that leaves the discriminator's optimizer state out ends elsewhere.
    forgot, _ = launch(tmp_path, "forgot", 1, 47, forget=True)
    assert forgot[0]["attempt"] == 1 and not same_state(forgot[0], reference[0])
