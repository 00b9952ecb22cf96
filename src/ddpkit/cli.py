"""The ``ddpkit`` command: ``ddpkit run`` launches a job, ``ddpkit env`` describes the machine."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ddpkit.errors import ConfigError

USAGE = """usage: ddpkit {run,env,bench,check,plot} ...

  ddpkit run [--nproc N] [--max-restarts N] [--all-ranks] script.py [args...]
                 launch one process per GPU (or CPU share) with torchrun's agent
  ddpkit env     versions, devices, the choices `run` would make, and a live all-reduce check
  ddpkit plot RUN_DIR
                 a Trainer run's training and validation curves to RUN_DIR/curves.png
  ddpkit bench [script.py]   step time at 1..N ranks, all-reduce sweep, prediction at larger world sizes
  ddpkit check [script.py]   one process against N ranks, step by step; names the cause of a difference

`ddpkit run -h` lists every option."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "run":
            from ddpkit.launcher import main as run_main

            return run_main(rest)
        if command == "env":
            from ddpkit.envinfo import main as env_main

            return env_main(rest)
        if command == "plot":
            from ddpkit.plot import main as plot_main

            return plot_main(rest)
        if command == "bench":
            from ddpkit.tools.bench import main as bench_main

            return bench_main(rest)
        if command == "check":
            from ddpkit.tools.check import main as check_main

            return check_main(rest)
    except ConfigError as err:
        print(f"ddpkit {command}: error: {err}", file=sys.stderr)
        return 2
    print(f"ddpkit: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
