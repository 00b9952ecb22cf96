"""A job for ``--all-ranks``: each rank prints lines in pieces, a progress bar redrawn with \\r, and
a last line without a newline."""

import sys
import time

import ddpkit

rt = ddpkit.init()
ddpkit.barrier()  # both ranks print at the same time
for line in range(3):
    for piece in range(4):
        print(f"r{rt.rank}l{line}p{piece};", end="", flush=True)
        # A line written slowly, as a computation between its parts would: longer than the
        # launcher's poll of the output, so that a reader of pieces finds a line half written.
        time.sleep(0.15)
    print(flush=True)
for percent in (0, 50, 100):
    sys.stdout.write(f"\rbar{rt.rank} {percent}%")
    sys.stdout.flush()
    time.sleep(0.15)
print(flush=True)
ddpkit.barrier()
sys.stdout.write(f"last{rt.rank}")  # no newline before the exit
sys.stdout.flush()
ddpkit.shutdown()
