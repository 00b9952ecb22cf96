"""Preloaded by a fork server in a test: the server and the workers it forks have no
``os.pidfd_open``, as on a kernel before 5.3 or under a seccomp profile that refuses the call."""

import errno
import os


def _refused(pid: int, flags: int = 0) -> int:
    raise OSError(errno.ENOSYS, "pidfd_open refused (test)")


os.pidfd_open = _refused
