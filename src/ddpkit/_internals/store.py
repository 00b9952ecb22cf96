"""The TCPStore a launcher serves on a socket it bound itself, and torchrun's agent-store contract.

ddpkit binds the store's listening socket itself (to one address, port chosen by the kernel or by
the agent) and hands it to torch as ``master_listen_fd``. torch's libuv store backend, the default
since 2.4, accepts such a socket only from torch 2.8 (before, it raises ``NotImplementedError``);
the older, threaded backend has always accepted it, so below 2.8 that one serves the store. Both
speak the same protocol: clients of either backend connect to it.

``TORCHELASTIC_USE_AGENT_STORE=True`` in a worker's environment tells torch's ``env://`` rendezvous
(which ``init_process_group`` uses) to connect to the store as a client on every rank, rank 0 too,
rather than have rank 0 start one: read in ``torch.distributed.rendezvous``; not a documented
variable.
"""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from typing import Any

from ddpkit._internals.contract import Internal
from ddpkit._internals.versions import torch_at_least

AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"

LIBUV_LISTEN_FD = (2, 8)
"""The first torch whose libuv store backend serves on a socket handed to it."""


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


def use_agent_store(environ: Any = os.environ) -> None:
    """Have ``init_process_group``'s ``env://`` rendezvous connect to the store on every rank."""
    environ[AGENT_STORE_VARIABLE] = "True"


def agent_store_in_use(environ: Any = os.environ) -> bool:
    return environ.get(AGENT_STORE_VARIABLE) == "True"


def _check_agent_store() -> str | None:
    import importlib

    source = inspect.getsource(importlib.import_module("torch.distributed.rendezvous"))
    return (
        None
        if AGENT_STORE_VARIABLE in source
        else f"torch.distributed.rendezvous no longer reads {AGENT_STORE_VARIABLE}"
    )


def _check_listen_fd() -> str | None:
    import torch.distributed as dist

    # a pybind constructor: its signature is in its docstring
    doc = dist.TCPStore.__init__.__doc__ or ""
    return None if "master_listen_fd" in doc else "TCPStore takes no master_listen_fd"


INTERNALS = [
    Internal(
        f"torch.distributed.rendezvous: {AGENT_STORE_VARIABLE}",
        "torch",
        "every rank connects to the store that rank 0's worker (or the agent) serves on one "
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
