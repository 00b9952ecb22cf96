"""What the job tests share: the environments a job starts from, and the uninterrupted runs that
tests in several files compare their runs to (each made once a session, on first use)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpkit._launch.agent import jobdir
from ddpkit.testing import Job, without_launch_env

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def clean_environ(threads: int | None = None) -> dict[str, str]:
    """A copy of ``os.environ`` for a job, or a fresh interpreter, that a test starts.

    No launcher or scheduler variable, whatever the shell running pytest exported; nor the tier
    check of the suite running it (CI sets it: a pytest run inside a test is a tier of its own,
    which its test configures). ``src`` for ddpkit and the checkout for the job scripts
    (``tests.jobs.scripts``, which import each other as a package) on ``PYTHONPATH``. No GPU, even
    on a machine that has one. ``threads``: ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` for every
    process (bitwise equality holds at equal intra-op thread counts); None leaves them as they are.
    """
    env = without_launch_env()
    env.pop("DDPKIT_REQUIRE_RUN", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["CUDA_VISIBLE_DEVICES"] = ""
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


@pytest.fixture
def clean_env() -> dict[str, str]:
    """:func:`clean_environ`, the test's own copy."""
    return clean_environ()


def user_environ() -> dict[str, str]:
    """:func:`clean_environ` without ``OMP_NUM_THREADS``, as a user's shell has it (the launcher
    splits the cores between its processes), output unbuffered."""
    env = clean_environ()
    env.pop("OMP_NUM_THREADS", None)
    return env | {"PYTHONUNBUFFERED": "1"}


@pytest.fixture
def user_env() -> dict[str, str]:
    """:func:`user_environ`, the test's own copy."""
    return user_environ()


def memory_environ(base: dict[str, str], folder: Path) -> dict[str, str]:
    """``base`` with the launcher's job folders (the snapshots in memory) under ``folder/shm``,
    made now."""
    (folder / "shm").mkdir(exist_ok=True)
    return base | {jobdir.ROOT_ENV: str(folder / "shm")}


@pytest.fixture
def memory_env(clean_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """``clean_env`` with the job folders of the test's jobs under ``tmp_path/shm``."""
    return memory_environ(clean_env, tmp_path)


# -- uninterrupted runs, made once a session on first use ------------------------------------------


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The train job (``tests/jobs/scripts/train_job.py``) on 2 ranks of this process: 30 Adam
    steps under ddp, global-batch dropout (so world sizes and strategies compare); rank 0's final
    state."""
    from tests.jobs.scripts.train_job import train_on_ranks

    return train_on_ranks(2, tmp_path_factory.mktemp("ddp-reference") / "run", global_dropout=True)


@pytest.fixture(scope="session")
def zero_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """:func:`ddp_reference` under the ``zero`` strategy; rank 0's final state."""
    from tests.jobs.scripts.train_job import train_on_ranks

    run_dir = tmp_path_factory.mktemp("zero-reference") / "run"
    return train_on_ranks(2, run_dir, global_dropout=True, strategy="zero")


@pytest.fixture(scope="session")
def train_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The train job under ``ddpkit run`` (``train_job.under_launcher``, from a user's
    environment), uninterrupted: the folder of its ``reference.pt`` and each rank's
    ``reference.pt.rank<r>``."""
    from tests.jobs.scripts.train_job import under_launcher

    tmp = tmp_path_factory.mktemp("train-reference")
    under_launcher(tmp, "reference", env=user_environ(), timeout=120)
    return tmp


@pytest.fixture(scope="session")
def memory_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of the memory job (``tests/jobs/snapshot/memory_jobs.py``): the folder
    of its run directory ``reference``, its ``reference.pt`` and each rank's
    ``reference.pt.rank<r>``."""
    from tests.jobs.snapshot import memory_jobs

    tmp = tmp_path_factory.mktemp("memory-reference")
    memory_jobs.run(tmp, "reference", env=memory_environ(clean_environ(), tmp))
    return tmp


@pytest.fixture(scope="session")
def strategy_references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``strategy_references(strategy)``: an uninterrupted run of the memory job under ``zero`` or
    ``fsdp`` without sync BatchNorm (each rank's own running statistics), as
    :func:`memory_reference` gives its own; made on first use."""
    from tests.jobs.snapshot import memory_jobs

    made: dict[str, Path] = {}

    def reference(strategy: str) -> Path:
        if strategy not in made:
            tmp = tmp_path_factory.mktemp(f"{strategy}-reference")
            job = ("--strategy", strategy, "--no-sync-bn")
            memory_jobs.run(tmp, "reference", *job, env=memory_environ(clean_environ(), tmp))
            made[strategy] = tmp
        return made[strategy]

    return reference


@pytest.fixture(scope="session")
def hand_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's result of an uninterrupted run of the hand loop job
    (``tests/jobs/snapshot/memory_jobs.py``)."""
    from tests.jobs.snapshot import memory_jobs

    tmp = tmp_path_factory.mktemp("hand-reference")
    return memory_jobs.hand_run(tmp, "reference", env=clean_environ())


@pytest.fixture(scope="session")
def epoch_end_references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Job]:
    """``epoch_end_references(variant)``: the :class:`~ddpkit.testing.Job` of an uninterrupted run
    of the epoch's-end job's ``variant`` (``tests/jobs/scripts/epoch_end_job.py``), made on first
    use."""
    from tests.jobs.scripts.epoch_end_job import under_launcher

    made: dict[str, Job] = {}

    def reference(variant: str) -> Job:
        if variant not in made:
            tmp = tmp_path_factory.mktemp(f"epoch-end-{variant}")
            env = memory_environ(clean_environ(), tmp)
            made[variant] = under_launcher(tmp, env, "reference", variant)
        return made[variant]

    return reference
