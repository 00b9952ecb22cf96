"""What ``ddpkit run`` starts in each worker: the user's script, with its exception recorded for the launcher.

torchrun reports a failed worker's traceback only when the script's entry point is decorated with ``@record``;
running the script through this module gives every script that, unchanged. Usage (by the launcher):
``python -m ddpkit.worker [-m] TARGET ARGS...``.
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def _run(target: str, as_module: bool) -> None:
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    argv = sys.argv[1:]
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m ddpkit.worker [-m] TARGET [ARGS...]")
    target = argv[0]
    sys.argv = argv
    # As `python script.py` does: the script's folder first on the import path, not ours.
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    _run(target, as_module)


if __name__ == "__main__":
    main()
