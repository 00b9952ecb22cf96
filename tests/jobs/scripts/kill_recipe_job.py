"""A job for the documented kill recipe: each rank writes its pid to ``DIR/attempt<N>-rank<R>.pid``;
on the first attempt it then waits to be killed (at most 30 s, then it ends as if nothing happened),
on a restart it prints the attempt and finishes."""

import os
import sys
import time
from pathlib import Path

import ddpkit

rt = ddpkit.init()
folder = Path(sys.argv[1])
(folder / f"attempt{rt.restart_count}-rank{rt.rank}.pid").write_text(str(os.getpid()))
if rt.restart_count == 0:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"rank={rt.rank} attempt=0 was never killed", flush=True)
else:
    print(f"rank={rt.rank} attempt={rt.restart_count} restarted", flush=True)
ddpkit.barrier()
ddpkit.shutdown()
