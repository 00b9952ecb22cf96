"""The core without numpy or any extra: ``import ddpkit``, ``ddpkit --version``, ``ddpkit env`` and
a 2-rank ``ddpkit run`` work; a snapshot of several ranks, which torch's checkpoint cannot write
without numpy, is refused at the Trainer's start naming what to install; the memory snapshot's
checksum is the same either way.

numpy and the extras are hidden from every process of a job by a ``sitecustomize`` on ``PYTHONPATH``
that marks them missing (``sys.modules[name] = None``: ``import`` raises ModuleNotFoundError,
``find_spec`` finds nothing), as in an install of torch and ddpkit alone
(``scripts/bare_install_check.py`` runs such an install for real in CI).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.snapshot import _slots as slot
from ddpkit.snapshot._slots import block_crcs

pytestmark = pytest.mark.heavy

HIDDEN = (
    "numpy", "sklearn", "optuna", "matplotlib", "tqdm", "tensorboard", "mlflow", "wandb",
    "safetensors", "mpi4py", "yaml", "ray",
)  # fmt: skip
HELLO = str(Path(__file__).parent / "scripts" / "hello.py")
DDPKIT = [sys.executable, "-m", "ddpkit.cli"]

TRAINER = """
import sys, torch, ddpkit
from ddpkit import Trainer, TrainerConfig
ddpkit.init()
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
model = torch.nn.Linear(4, 2)
config = TrainerConfig(run_dir=sys.argv[1], epochs=1, batch_size=8, num_workers=0)
Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config).fit()
"""


@pytest.fixture
def bare_env(clean_env, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor name in {HIDDEN!r}:\n    sys.modules[name] = None\n"
    )
    clean_env["PYTHONPATH"] = f"{site}:{Path(__file__).parents[2]}"
    return clean_env


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


# jobs in a venv without numpy; the bare-wheel cell of .ci/run runs the same from a wheel
@pytest.mark.slow
def test_import_version_env_and_a_two_rank_run_need_no_numpy(bare_env, tmp_path):
    found = _run([sys.executable, "-c", "import sys, ddpkit; import numpy"], bare_env, tmp_path)
    # the hiding works: numpy is missing
    assert "ModuleNotFoundError" in found.stderr and "numpy" in found.stderr
    assert _run(DDPKIT + ["--version"], bare_env, tmp_path).returncode == 0
    env = _run(DDPKIT + ["env"], bare_env, tmp_path)
    assert env.returncode == 0, env.stderr[-2000:]
    job = _run(DDPKIT + ["run", "--nproc", "2", "--all-ranks", HELLO], bare_env, tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "hello rank=0 world=2" in job.stdout and "hello rank=1 world=2" in job.stdout


# jobs in a venv without numpy; the bare-wheel cell of .ci/run runs the same from a wheel
@pytest.mark.slow
def test_a_trainer_of_several_ranks_without_numpy_is_refused_at_its_start_naming_numpy(
    bare_env, tmp_path
):
    (tmp_path / "train.py").write_text(TRAINER)
    job = _run(
        DDPKIT + ["run", "--nproc", "2", "train.py", str(tmp_path / "run")], bare_env, tmp_path
    )
    assert job.returncode != 0
    assert (
        "whose object collectives need numpy, which is not installed: pip install numpy"
        in job.stderr
    )
    # Control: the same job with numpy trains.
    bare_env["PYTHONPATH"] = str(Path(__file__).parents[2])
    job = _run(
        DDPKIT + ["run", "--nproc", "2", "train.py", str(tmp_path / "run2")], bare_env, tmp_path
    )
    assert job.returncode == 0, job.stderr[-3000:]


SIZES = (0, 8, 4096, (1 << 20) + 40, 3 * (1 << 20))
CHECKSUMS = f"""
import sys, torch
from ddpkit.snapshot._slots import block_crcs
try:
    import numpy
    sys.exit("numpy is not hidden")
except ModuleNotFoundError:
    pass
for size in {SIZES!r}:
    data = bytes((i * 7 + size) % 251 for i in range(size))
    empty = torch.empty(0, dtype=torch.uint8)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else empty
    assert block_crcs(tensor) == block_crcs(data), size
    print(block_crcs(tensor).hex())
"""


def test_the_memory_checksum_without_numpy_is_numpys(bare_env, tmp_path):
    """A slot written by a process with numpy checks in one without, and the other way round:
    without numpy a tensor's bytes are copied before their CRCs are taken, with it they are
    viewed."""
    # this ddpkit, wherever it is imported from
    bare_env["PYTHONPATH"] += f":{Path(slot.__file__).parents[2]}"
    run = _run([sys.executable, "-c", CHECKSUMS], bare_env, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    here = []
    for size in SIZES:
        data = bytes((i * 7 + size) % 251 for i in range(size))
        tensor = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        assert block_crcs(tensor) == block_crcs(data)
        here.append(block_crcs(tensor).hex())
    assert run.stdout.splitlines() == here
    # Control: one byte changed changes its block's CRC.
    changed = bytearray(data)
    changed[len(changed) // 2] ^= 1
    assert block_crcs(bytes(changed)) != block_crcs(data)
