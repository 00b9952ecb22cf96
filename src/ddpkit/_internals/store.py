"""The TCPStore a launcher serves on a socket it bound itself, and ``TORCHELASTIC_USE_AGENT_STORE``
(torch's ``env://`` rendezvous connects to the store on every rank, rank 0 too)."""

from __future__ import annotations

import inspect
import os
import socket
from datetime import timedelta
from typing import Any

from ddpkit._internals.contract import Internal
from ddpkit._internals.versions import LIBUV_LISTEN_FD, torch_at_least

AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def serve_store(listener_fd: int, host: str, port: int, timeout: timedelta) -> Any:
    """A master TCPStore serving on the listening socket ``listener_fd`` (which it takes over)."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {} if torch_at_least(LIBUV_LISTEN_FD) else {"use_libuv": False}
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=listener_fd,
        **kwargs,
    )


def serve_new_store(
    host: str, timeout: timedelta, bind: str | None = None, port: int = 0
) -> tuple[Any, int]:
    """A master TCPStore and its port, for clients that reach it at ``host``; it listens on ``bind``
    (default: ``host``'s address) and ``port`` (0: the system picks, the socket bound from then)."""
    address = socket.gethostbyname(host) if bind is None else bind
    listener = socket.create_server((address, port), backlog=1024)
    port = int(listener.getsockname()[1])
    return serve_store(listener.detach(), host, port, timeout), port


def use_agent_store(environ: Any = os.environ) -> None:
    """Have ``init_process_group``'s ``env://`` rendezvous connect to the store on every rank."""
    environ[AGENT_STORE_VARIABLE] = "True"


def _check_agent_store() -> str | None:
    import importlib

    source = inspect.getsource(importlib.import_module("torch.distributed.rendezvous"))
    if AGENT_STORE_VARIABLE not in source:
        return f"torch.distributed.rendezvous no longer reads {AGENT_STORE_VARIABLE}"
    return None


def _check_listen_fd() -> str | None:
    import torch.distributed as dist

    # a pybind constructor: its signature is in its docstring
    doc = dist.TCPStore.__init__.__doc__ or ""
    return None if "master_listen_fd" in doc else "TCPStore takes no master_listen_fd"


INTERNALS = [
    Internal(
        f"torch.distributed.rendezvous: {AGENT_STORE_VARIABLE}",
        "torch",
        "every rank connects to the store that the agent (or rank 0 of ddpkit.spawn) serves on one "
        "address; without it rank 0's init_process_group would start a second store on every "
        "interface",
        _check_agent_store,
    ),
    Internal(
        "torch.distributed.TCPStore(master_listen_fd=...)",
        "torch",
        "the store listens on a socket ddpkit bound (one address, no race for the port)",
        _check_listen_fd,
    ),
]
