"""torchrun's elastic agent and its worker processes, where ddpkit reaches past their public API.
Where one is gone, its feature is off with one warning, and the job runs as torchrun runs it."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ddpkit import _fs as fs
from ddpkit._internals.contract import Internal, warn_lost


def warn_once(internal: str, lost: str) -> None:
    """:func:`~ddpkit._internals.contract.warn_lost` for one of torch's internals."""
    warn_lost(internal, "torch", lost)


_AGENT_ADDS = (
    "what ddpkit adds to torchrun's agent (stack dumps after a failure, no restart after a "
    "pre-emption, the cleanup of what workers left)"
)


def _agent_hooks_problem() -> str | None:
    """Both hooks on torchrun's local agent; ``_monitor_workers`` taking the worker group."""
    for name in ("_monitor_workers", "_shutdown", "_start_workers"):
        if not callable(getattr(LocalElasticAgent, name, None)):
            return f"LocalElasticAgent has no {name}"
    found = list(inspect.signature(LocalElasticAgent._monitor_workers).parameters)
    if found != ["self", "worker_group"]:
        return f"LocalElasticAgent._monitor_workers takes {found}"
    return None


class HookedAgent(LocalElasticAgent):
    """torchrun's local agent, calling the hooks below around its private steps (where those
    differ, never, with one warning)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hooked = _agent_hooks_problem() is None
        if not self.hooked:
            warn_once("torch's LocalElasticAgent._monitor_workers/_shutdown", _AGENT_ADDS)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self._monitored = False
        result = super().run(*args, **kwargs)
        # torchrun's loop returns only from a poll: one not through _monitor_workers went elsewhere
        # (None: its rendezvous closed before this node joined, no worker to poll)
        if self.hooked and not self._monitored and result is not None:
            warn_once(
                "torch's LocalElasticAgent._monitor_workers (never called)",
                "what ddpkit adds to torchrun's agent (stack dumps after a failure, no restart "
                "after a pre-emption)",
            )
        return result

    def before_monitor(self, worker_group: Any) -> None:
        """Called before each poll of the workers."""

    def after_monitor(self, worker_group: Any, result: Any) -> None:
        """Called with each poll's result."""

    def after_shutdown(self) -> None:
        """Called after the agent stopped the workers."""

    def intercept(self, worker_group: Any) -> bool:
        """Called before each poll: True to answer it "healthy" without torchrun's look."""
        return False

    def start_env(self, worker_group: Any) -> dict[str, str]:
        """Called before the workers of an attempt start: variables they start with besides."""
        return {}

    def after_start(self, worker_group: Any) -> None:
        """Called once the workers of an attempt started (not a worker replaced in place)."""

    def _start_workers(self, worker_group: Any) -> Any:
        extra = self.start_env(worker_group)
        os.environ.update(extra)
        try:
            started = super()._start_workers(worker_group)
        finally:
            for name in extra:  # the next attempt's workers start without them
                os.environ.pop(name, None)
        self.after_start(worker_group)
        return started

    def seen_running(self) -> bool:
        """Called after :meth:`before_monitor`: True where :meth:`intercept`'s own look found every
        worker running, to answer "healthy" without torchrun's look (which, seeing a worker that
        exited in between first, would stop all the others)."""
        return False

    def _monitor_workers(self, worker_group: Any) -> Any:
        self._monitored = True
        if not self.hooked:
            return super()._monitor_workers(worker_group)
        if self.intercept(worker_group):
            from torch.distributed.elastic.agent.server.api import RunResult

            return RunResult(state=WorkerState.HEALTHY)
        self.before_monitor(worker_group)
        if self.seen_running():
            from torch.distributed.elastic.agent.server.api import RunResult

            return RunResult(state=WorkerState.HEALTHY)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            self._add_stopped(worker_group, result)
        self.after_monitor(worker_group, result)
        return result

    def _add_stopped(self, worker_group: Any, result: Any) -> None:
        """Add to a failed poll's ``result.failures`` the workers torchrun stopped after it (torch
        < 2.7 records only those that had exited when it polled)."""
        context = self.process_context()
        error_files = getattr(context, "error_files", None) or {}
        processes = self.worker_processes()
        for w in worker_group.workers:
            proc = processes.get(w.local_rank)
            if proc is None or w.global_rank in result.failures or w.local_rank not in error_files:
                continue
            code = proc.poll()
            if not code:  # running, or exited with 0
                continue
            result.failures[w.global_rank] = ProcessFailure(
                local_rank=w.local_rank, pid=proc.pid, exitcode=code,
                error_file=error_files[w.local_rank],
            )  # fmt: skip

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        super()._shutdown(*args, **kwargs)
        if self.hooked:
            self.after_shutdown()

    def process_context(self) -> Any:
        """The current attempt's process context (None before the first workers start)."""
        return getattr(self, "_pcontext", None)

    def worker_processes(self) -> dict[int, Any]:
        """Local rank -> the ``Popen`` (or forked stand-in) of each worker of the attempt."""
        handlers = getattr(self.process_context(), "subprocess_handlers", None) or {}
        return {local: handler.proc for local, handler in handlers.items()}

    def restarts_left(self) -> int:
        """How many more times torchrun restarts the workers after a failure."""
        return int(getattr(self, "_remaining_restarts", 0))

    def use_restart(self) -> None:
        """Count one restart (a recovery in place) against ``--max-restarts``."""
        self._remaining_restarts = self.restarts_left() - 1

    def restarts_from(self, used: int) -> None:
        """Count ``used`` restarts as made (a node that joined after them)."""
        self._remaining_restarts = int(self._worker_group.spec.max_restarts) - used

    def restarts_used(self) -> int:
        """Restarts so far: the workers' ``TORCHELASTIC_RESTART_COUNT``, as torchrun computes it."""
        return int(self._worker_group.spec.max_restarts) - self.restarts_left()

    def replace_worker(self, rank: int, env: dict[str, str]) -> None:
        """Start a new process for the worker of global rank ``rank``, whose process exited, with
        its variables and ``env``, in the attempt's process context; the exited one's logs are kept
        beside (``.N``)."""
        from torch.distributed.elastic.multiprocessing import api

        worker = next(w for w in self._worker_group.workers if w.global_rank == rank)
        context, local = self.process_context(), worker.local_rank
        for log in log_files(context.subprocess_handlers[local]) or ():
            if log is not None:
                log.close()
        for path in (context.stdouts.get(local), context.stderrs.get(local)):
            if path and os.path.exists(path):
                fs.rename(Path(path), Path(f"{path}.{self.restarts_used()}"))
        numa = {"numa_options": context._numa_options} if hasattr(context, "_numa_options") else {}
        context.subprocess_handlers[local] = api.get_subprocess_handler(
            entrypoint=context.entrypoint, args=context.args[local],
            env={**context.envs[local], **env}, stdout=context.stdouts[local],
            stderr=context.stderrs[local], local_rank_id=local, **numa,
        )  # fmt: skip
        worker.id = context.subprocess_handlers[local].proc.pid  # torchrun compares the pids
        context._running_local_ranks.add(local)
        context._failures.pop(local, None)

    def stop_restarting(self) -> None:
        """Restart no worker after this: the job ends with the current attempt."""
        self._remaining_restarts = 0


def _check_agent_state() -> str | None:
    """``_pcontext`` set by ``_start_workers``; restarts counted down in ``_remaining_restarts``."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    if "self._pcontext = " not in inspect.getsource(LocalElasticAgent._start_workers):
        return "LocalElasticAgent._start_workers no longer sets self._pcontext"
    loop = inspect.getsource(SimpleElasticAgent._invoke_run)
    if "self._remaining_restarts > 0" not in loop or "self._remaining_restarts -= 1" not in loop:
        return (
            "SimpleElasticAgent._invoke_run no longer counts restarts down in "
            "self._remaining_restarts"
        )
    return None


def use_agent(launcher_api: Any, agent: type) -> None:
    """Have torchrun's ``launch_agent`` (of ``launcher_api``) build ``agent``, by swapping the
    module-level name it builds its agent by; where it no longer does, said once."""
    if _check_launch_agent() is not None:
        warn_once("torch's launcher.api.LocalElasticAgent", _AGENT_ADDS)
    launcher_api.LocalElasticAgent = agent


def _check_launch_agent() -> str | None:
    from torch.distributed.launcher import api

    if not isinstance(vars(api).get("LocalElasticAgent"), type):
        return "torch.distributed.launcher.api has no LocalElasticAgent"
    if "LocalElasticAgent(" not in inspect.getsource(api.launch_agent):
        return "launch_agent no longer builds its agent as LocalElasticAgent(...)"
    return None


def record_with(handler: type) -> None:
    """Have torch's ``@record``, applied from now on in this process, build ``handler()`` (by its
    module's name ``get_error_handler``); where that changed, said once."""
    from torch.distributed.elastic.multiprocessing import errors

    if _check_record_handler() is not None:
        warn_once(
            "torch's errors.get_error_handler in @record",
            "a script's own @record writing its error file whole (the worker's record does)",
        )
        return
    errors.get_error_handler = handler


def _check_record_handler() -> str | None:
    from torch.distributed.elastic.multiprocessing import errors

    if not callable(vars(errors).get("get_error_handler")):
        return "torch.distributed.elastic.multiprocessing.errors has no get_error_handler"
    if "get_error_handler()" not in inspect.getsource(errors.record):
        return "record no longer builds its handler as get_error_handler()"
    return None


def subprocess_handler_base() -> type | None:
    """torchrun's ``SubprocessHandler``, where workers can start through a subclass of it."""
    from torch.distributed.elastic.multiprocessing import api

    base = getattr(api, "SubprocessHandler", None)
    if (
        base is None
        or not callable(getattr(api, "get_subprocess_handler", None))
        or not callable(getattr(base, "_popen", None))
        or list(inspect.signature(base._popen).parameters) != ["self", "args", "env"]
    ):
        return None
    return base


def set_handler_factory(factory: Callable[..., Any] | None) -> None:
    """Have torchrun make each worker's handler with ``factory`` (None: torch's own)."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

    api.get_subprocess_handler = factory if factory is not None else get_subprocess_handler


def log_files(handler: Any) -> tuple[Any, Any] | None:
    """The files a ``SubprocessHandler`` opened for its worker's output and errors (each None where
    not redirected); None where it keeps them under other names."""
    if not (hasattr(handler, "_stdout") and hasattr(handler, "_stderr")):
        return None
    return handler._stdout, handler._stderr


def popen_override(
    base: type, popen: Callable[[Any, Any, Any], Any], bypassed: Callable[[], None] = lambda: None
) -> type:
    """A subclass of ``base`` whose ``_popen(args, env)`` is ``popen(handler, args, env)`` (None: as
    torch does); one whose ``__init__`` bypassed ``_popen`` warns once and calls ``bypassed``."""

    class Handler(base):  # torchrun's class, given at run time
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._popen_called = False
            super().__init__(*args, **kwargs)
            if not self._popen_called:
                warn_once("SubprocessHandler._popen", "forking workers from the job's server")
                bypassed()

        def _popen(self, args: Any, env: Any) -> Any:
            self._popen_called = True
            started = popen(self, args, env)
            return started if started is not None else super()._popen(args, env)

    return Handler


def _check_handler() -> str | None:
    base = subprocess_handler_base()
    if base is None:
        return (
            "no api.SubprocessHandler with _popen(self, args, env), or no "
            "api.get_subprocess_handler"
        )
    init = inspect.getsource(vars(base).get("__init__", object.__init__))
    if "self._popen(" not in init:
        return "SubprocessHandler.__init__ no longer starts its process through self._popen"
    if "self._stdout" not in init or "self._stderr" not in init:
        return "SubprocessHandler.__init__ no longer keeps its log files as _stdout/_stderr"
    from torch.distributed.elastic.multiprocessing import api

    if "get_subprocess_handler(" not in inspect.getsource(api):
        return "the process context no longer makes its handlers through api.get_subprocess_handler"
    return None


def _check_replace_worker() -> str | None:
    """``SubprocessContext`` polls ``_running_local_ranks``; the agent keeps its worker group."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    poll = "".join(  # _poll itself until torch 2.8 or so, then a method it calls
        inspect.getsource(getattr(SubprocessContext, name))
        for name in ("_poll", "_capture_process_failures")
        if hasattr(SubprocessContext, name)
    )
    for name in ("self._running_local_ranks", "self._failures", "self.subprocess_handlers"):
        if name not in poll:
            return f"SubprocessContext no longer polls {name}"
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    if "self._worker_group" not in inspect.getsource(SimpleElasticAgent.__init__):
        return "SimpleElasticAgent no longer keeps self._worker_group"
    return None


INTERNALS = [
    Internal(
        "torch.distributed.elastic SubprocessContext._running_local_ranks / _failures, "
        "LocalElasticAgent._worker_group",
        "torch",
        "--recover in-place (a replacement for a failed worker, the others kept)",
        _check_replace_worker,
    ),
    Internal(
        "torch.distributed.elastic LocalElasticAgent._monitor_workers / _shutdown",
        "torch",
        "stack dumps of the ranks still running when one fails, no restart after a pre-emption, "
        "and the cleanup of processes workers left",
        _agent_hooks_problem,
    ),
    Internal(
        "torch.distributed.elastic LocalElasticAgent._pcontext / _remaining_restarts",
        "torch",
        "each worker's process for stack dumps and SIGTERM forwarding; no restart after a "
        "pre-emption",
        _check_agent_state,
    ),
    Internal(
        "torch.distributed.launcher.api.LocalElasticAgent (the name launch_agent builds its agent "
        "by)",
        "torch",
        "ddpkit's agent (stack dumps, no restart after a pre-emption, cleanup) runs instead of "
        "torchrun's",
        _check_launch_agent,
    ),
    Internal(
        "torch.distributed.elastic SubprocessHandler._popen / _stdout / _stderr, "
        "api.get_subprocess_handler",
        "torch",
        "workers forked from the job's server (restarts in half a second), their output in "
        "torchrun's log files",
        _check_handler,
    ),
    Internal(
        "torch.distributed.elastic.multiprocessing.errors.get_error_handler (the name record "
        "builds its handler by)",
        "torch",
        "a script's own @record writes its error file whole, so that the agent never reads a "
        "truncated one",
        _check_record_handler,
    ),
]
