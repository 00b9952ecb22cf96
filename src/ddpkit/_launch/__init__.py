"""Starting a job: ``ddpkit run``, ``ddpkit sbatch``, ``ddpkit k8s`` and :func:`ddpkit.spawn`.
``import ddpkit`` imports :mod:`~ddpkit._launch.spawn` alone."""

import sys


def say(line: str) -> None:
    """A line of ``ddpkit run``'s own, on stderr."""
    print(f"ddpkit run: {line}", file=sys.stderr, flush=True)
