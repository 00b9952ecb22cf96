"""A tiny job for launcher tests: greets, optionally fails on one rank or on the first attempt
only."""

import argparse
import os

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--fail-first-attempt", action="store_true")
parser.add_argument("words", nargs="*")
args = parser.parse_args()

rt = ddpkit.init()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
total = ddpkit.all_reduce(rt.rank + 1)
print(
    f"hello rank={rt.rank} world={rt.world_size} attempt={attempt} sum={total} "
    f"threads={os.environ.get('OMP_NUM_THREADS')} words={args.words}"
)
if args.fail_rank == rt.rank:
    raise ValueError(f"planned failure on rank {rt.rank}")
if args.fail_first_attempt and attempt == 0 and rt.rank == rt.world_size - 1:
    raise RuntimeError("planned failure on the first attempt")
ddpkit.barrier()
ddpkit.shutdown()
