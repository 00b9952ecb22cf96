"""Grid Engine (SGE): ddpkit reads from it only that the job runs there and the slots it granted
(``NSLOTS``). It names no ranks (an SGE job runs ``ddpkit run`` or ``mpiexec``, read as those), so
it is no :class:`~ddpkit.platforms._base.Platform`."""

from __future__ import annotations

from collections.abc import Mapping


def in_job(env: Mapping[str, str]) -> bool:
    return "SGE_TASK_ID" in env or "NSLOTS" in env or "JOB_ID" in env and "SGE_ROOT" in env


def cpus_granted(env: Mapping[str, str]) -> str | None:
    """The slots granted to the job on this host (``NSLOTS``) as set, or None."""
    return env.get("NSLOTS")
