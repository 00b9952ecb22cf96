"""One job at a time on a run directory, whichever front door writes it: a hand loop's
``ddpkit.Snapshots`` takes the lock the Trainer's ``fit()`` takes, so a second job on the folder
(a hand loop or a Trainer) is refused, naming the first, rather than resuming from and pruning its
snapshots."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ddpkit.testing import wait_until

pytestmark = pytest.mark.heavy

HAND = textwrap.dedent("""
    import sys, time, torch, ddpkit
    from pathlib import Path
    run_dir, hold = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddpkit.Snapshots(run_dir, model=model, optimizer=opt, every_steps=1) as snaps:
        snaps.resume()
        if hold == "hold":
            Path(run_dir, "held").write_text("1")
            while not Path(run_dir, "go").exists():
                time.sleep(0.05)
        print("ran", flush=True)
""")
TRAINER = textwrap.dedent("""
    import sys, torch, ddpkit
    model = torch.nn.Linear(2, 2)
    data = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randint(0, 2, (16,)))
    config = ddpkit.TrainerConfig(run_dir=sys.argv[1], batch_size=4,
                                  logging=ddpkit.LoggingConfig(progress=False))
    ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config).fit()
    print("ran", flush=True)
""")


@pytest.mark.parametrize("second", ["hand", "trainer"])
def test_a_second_job_on_a_hand_loops_run_directory_is_refused(tmp_path, clean_env, second):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-c", HAND, str(run_dir), "hold"], env=clean_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: (run_dir / "held").exists() or first.poll() is not None, 120)
        assert first.poll() is None, first.communicate()
        code = HAND if second == "hand" else TRAINER
        args = [str(run_dir), "go"] if second == "hand" else [str(run_dir)]
        refused = subprocess.run(
            [sys.executable, "-c", code, *args], env=clean_env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert refused.returncode != 0 and "ran" not in refused.stdout
        assert "is in use by another job" in refused.stderr and f"pid {first.pid}" in (
            refused.stderr
        ), refused.stderr[-2000:]
    finally:
        (run_dir / "go").write_text("1")
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and "ran" in out, err[-2000:]
    # control: the first gone, the same second job runs
    again = subprocess.run(
        [sys.executable, "-c", HAND, str(run_dir), "go"], env=clean_env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and "ran" in again.stdout, again.stderr[-2000:]
