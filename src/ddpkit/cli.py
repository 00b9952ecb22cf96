"""The ``ddpkit`` command: one subcommand per module, each with its own ``-h``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from ddpkit._errors import ConfigError

__all__ = ["main"]

# name -> (module whose main(argv) runs it, one line of help). Imported only when used.
COMMANDS = {
    "run": (
        "ddpkit._launch.cli.run",
        "launch a training script on every GPU (or CPU share) of this node, or of several",
    ),
    "sbatch": (
        "ddpkit._launch.cli.sbatch",
        "write and submit a SLURM batch script that requeues itself when pre-empted",
    ),
    "k8s": (
        "ddpkit._launch.cli.k8s",
        "write a Kubernetes manifest (TrainJob, PyTorchJob or JobSet) that resumes after failures",
    ),
    "env": (
        "ddpkit.tools._env",
        "versions, devices, the choices `run` would make, and a live all-reduce check",
    ),
    "bench": (
        "ddpkit.tools._bench",
        "step time at 1..N ranks, the all-reduce alone, and a prediction at larger sizes",
    ),
    "check": (
        "ddpkit.tools._check",
        "one process against N ranks, step by step; names the cause of a difference",
    ),
    "plot": (
        "ddpkit.tracking._curves",
        "a Trainer run's training and validation curves to RUN_DIR/curves.png",
    ),
}

EXAMPLES = """examples:
  ddpkit run --nproc 2 train.py --lr 0.1
  ddpkit sbatch --nodes 2 --gpus-per-node 4 --time 4:00:00 train.py
  ddpkit k8s --image registry/train:1 --nodes 4 --gpus-per-node 8 --pvc runs train.py
  ddpkit env
  ddpkit bench --nproc 2
  ddpkit check my_script.py
  ddpkit plot runs/digits"""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: ddpkit {{{','.join(COMMANDS)}}} ... | --version", ""]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(
        lines + ["", "`ddpkit COMMAND -h` lists each command's options.", "", EXAMPLES]
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from ddpkit import __version__

        print(f"ddpkit {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"ddpkit: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(COMMANDS[command][0]).main(rest)
    except ConfigError as err:
        # a name given on the command line may hold bytes that are not text: escaped
        text = str(err).encode("utf-8", "backslashreplace").decode("utf-8")
        print(f"ddpkit {command}: error: {text}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``ddpkit`` console script (and ``python -m ddpkit.cli``): :func:`main`, then the exit;
    ``ddpkit run`` ends as an interpreter ends, without the teardown of torch's modules."""
    code = main()
    if sys.argv[1:2] == ["run"]:
        from ddpkit._internals.interpreter import finalize_as_interpreter, finalize_problem

        if finalize_problem() is None:  # else a normal exit
            finalize_as_interpreter()
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
