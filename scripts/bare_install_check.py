"""A bare install's end to end check: ddpkit and its dependencies (torch, numpy), no extra, run from
outside any checkout.

    python scripts/bare_install_check.py WORKDIR

With the ``ddpkit`` command next to this Python: ``ddpkit --version``, ``ddpkit env``, then a 2-rank
``ddpkit run`` of a Trainer twice: once uninterrupted, once SIGKILLed on rank 1 after step 5 and
restarted by the launcher, resuming from its snapshots (in memory and on disk). The two runs' final
weights must be equal bit for bit; any difference, failed command or import of an extra exits
non-zero, saying which.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

JOB = '''
import os, signal, sys
import torch
import ddpkit
from ddpkit import SnapshotConfig, Trainer, TrainerConfig
from ddpkit.training._trainer import Callback

EXTRAS = (
    "sklearn", "optuna", "matplotlib", "tqdm", "tensorboard", "mlflow", "wandb", "safetensors"
)


class KillOnce(Callback):
    """Rank 1 SIGKILLs itself after step 5 of the first attempt."""

    def on_step_end(self, trainer, taken, output):
        rt = ddpkit.get_runtime()
        if kill and trainer.step == 5 and rt.rank == 1 and rt.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)


run_dir, kill = sys.argv[1], sys.argv[2] == "kill"
ddpkit.init()
ddpkit.seed_everything(0)
g = torch.Generator().manual_seed(0)
inputs, targets = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
data = torch.utils.data.TensorDataset(inputs, targets)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3)
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
config = TrainerConfig(
    run_dir=run_dir, epochs=3, batch_size=8, num_workers=0,
    snapshot=SnapshotConfig(every_steps=2, memory=True, async_write=False),
)
Trainer(model, optimizer, data, config, callbacks=[KillOnce()]).fit()
loaded = sorted(name for name in sys.modules if name.split(".")[0] in EXTRAS)
assert not loaded, f"a bare install imported extras: {loaded}"
if ddpkit.get_runtime().rank == 0:
    torch.save(model.state_dict(), os.path.join(run_dir, "weights.pt"))
    open(os.path.join(run_dir, f"attempt-{ddpkit.get_runtime().restart_count}"), "w").close()
'''


def _run(*args: str, cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"FAILED ({done.returncode}): {' '.join(args)}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main() -> None:
    import torch

    work = Path(sys.argv[1]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ddpkit = str(Path(sys.executable).parent / "ddpkit")
    print(_run(ddpkit, "--version", cwd=work).strip())
    env = _run(ddpkit, "env", cwd=work)
    print(f"ddpkit env: {len(env.splitlines())} lines")
    (work / "job.py").write_text(JOB)
    for name, kill in (("whole", "-"), ("killed", "kill")):
        _run(
            ddpkit,
            "run",
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            "job.py",
            str(work / name),
            kill,
            cwd=work,
        )
    attempts = {
        name: sorted(p.name for p in (work / name).glob("attempt-*"))
        for name in ("whole", "killed")
    }
    if attempts != {"whole": ["attempt-0"], "killed": ["attempt-1"]}:
        sys.exit(
            "FAILED: the runs did not end in the attempts expected (killed once, then resumed): "
            f"{attempts}"
        )
    whole = torch.load(work / "whole" / "weights.pt", weights_only=True)
    killed = torch.load(work / "killed" / "weights.pt", weights_only=True)
    different = [k for k in whole if not torch.equal(whole[k], killed[k])]
    if different:
        sys.exit(
            f"FAILED: the run killed and resumed differs from the uninterrupted one in {different}"
        )
    print(
        "a run SIGKILLed on rank 1 at step 5 and resumed ends with the uninterrupted run's "
        "weights, bit for bit"
    )


if __name__ == "__main__":
    main()
