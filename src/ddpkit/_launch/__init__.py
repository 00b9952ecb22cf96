"""Starting a job: ``ddpkit run`` over torchrun's elastic agent, its rendezvous, workers, stall
watch and failure summary; ``ddpkit sbatch`` and ``ddpkit k8s``; and :func:`ddpkit.spawn`. Internal:
``import ddpkit`` imports :mod:`~ddpkit._launch.spawn` alone, each command the rest it uses.
"""

import sys


def say(line: str) -> None:
    """A line of ``ddpkit run``'s own, on stderr."""
    print(f"ddpkit run: {line}", file=sys.stderr, flush=True)
