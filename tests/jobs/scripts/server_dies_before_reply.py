"""Preloaded by a fork server in a test: the server dies right after it has forked its first worker,
before it answers the agent (as the OOM killer could end it), so that the agent starts that rank as
a new interpreter."""

import os
import socket

_send_fds = socket.send_fds


def _die_at_the_first_reply(sock, buffers, fds, *args, **kwargs):
    os._exit(9)


socket.send_fds = _die_at_the_first_reply
