"""What an outsider does to a rendezvous endpoint, for tests/jobs/launch/test_multinode.py; the
first argument picks it.

- ``forge HOST PORT KEY MARKER``: connect as a plain TCPStore client and write, under KEY, a pickle
  that creates the file MARKER when unpickled (as torch's rendezvous unpickles its state). Prints
  ``written`` or ``refused: <error>``.
- ``reach HOST PORT...``: print ``PORT open`` or ``PORT closed`` for a TCP connection to each.
- ``wait-open HOST PORT``: wait (at most 60 s) until something accepts TCP connections there; exit 1
  if not.
"""

import base64
import pickle
import socket
import sys
import time
from datetime import timedelta


class FileMaker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


mode, args = sys.argv[1], sys.argv[2:]
if mode == "forge":
    import torch.distributed as dist

    host, port, key, marker = args
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        store.set(key, base64.b64encode(pickle.dumps(FileMaker(marker))))
        print("written", flush=True)
    except Exception as err:  # noqa: BLE001 - any failure to write is the outcome under test
        print(f"refused: {type(err).__name__}", flush=True)
elif mode == "reach":
    host = args[0]
    for port in args[1:]:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            print(f"{port} open", flush=True)
        except OSError:
            print(f"{port} closed", flush=True)
elif mode == "wait-open":
    host, port = args
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            sys.exit(0)
        except OSError:
            time.sleep(0.1)
    sys.exit(1)
