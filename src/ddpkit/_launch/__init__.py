"""Starting a job: ``ddpkit run``, ``ddpkit sbatch``, ``ddpkit k8s`` and :func:`ddpkit.spawn`.
``import ddpkit`` imports :mod:`~ddpkit.distributed._spawn` alone."""

import sys


def say(line: str) -> None:
    """A line of ``ddpkit run``'s own, on stderr."""
    print(f"ddpkit run: {line}", file=sys.stderr, flush=True)
