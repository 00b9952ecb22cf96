"""A module that starts a thread when it is imported (for the fork server's tests: a server that
preloads it must not fork)."""

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, daemon=True, name="started-at-import").start()
