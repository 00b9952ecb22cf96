"""torchrun's elastic agent as ``ddpkit run`` runs it (:class:`Agent`, installed by
:func:`install`): pre-emption, signals, the stall watch, stacks and failure summaries, the fork
server, and the job's folder in shared memory (docs/launcher.md)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerState

from ddpkit import _fs as fs
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit._internals.elastic import HookedAgent, use_agent
from ddpkit._launch import say
from ddpkit._launch.agent import forkserver as forked
from ddpkit._launch.agent import worker
from ddpkit._launch.agent.failure import Left, preempted, summarize_failure
from ddpkit._launch.proctree import kill_descendants, send
from ddpkit._launch.recover import inplace as recover
from ddpkit._launch.watch import stall as watch
from ddpkit.distributed._progress import Phase
from ddpkit.snapshot import _slots as memory_folder


class Agent(HookedAgent):
    """torchrun's agent with the changes torchrun has no option for: a worker that exits with
    :data:`~ddpkit._errors.PREEMPTED_EXIT_CODE` stops the job instead of being restarted; the stall
    watch polled with the workers; stacks asked of the running workers before torchrun stops them;
    and, once they are stopped, every process still below the agent (a child subreaper) ended."""

    current: Agent | None = None
    policy = watch.StallPolicy(floor=0)  # set by install()
    in_place: recover.InPlace | None = None  # set by install() where --recover in-place applies

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stacks_asked: int | None = None
        self._watched: int | None = None
        self._published_to: Any = None
        folder = os.environ.get(watch.DIR_ENV)
        self.watch = watch.Watch(Path(folder), self.policy, _stack_dir()) if folder else None
        # what the last failed attempt showed (for its summary)
        self.where = ""
        self.left: list[Left] = []
        self._polls = 0
        self._exits_of: int | None = None
        self._exit_seen: dict[int, int] = {}  # local rank -> the poll that first saw it exited
        self._whole_restart: int | None = None  # the attempt in-place recovery gave up on
        self._running = False  # in place: this poll's own look found every worker running
        Agent.current = self

    def intercept(self, worker_group: Any) -> bool:
        self._running = False
        attempt = id(self.process_context())
        if self.in_place is None or self._whole_restart == attempt:
            return False
        if self.in_place.poll(self, worker_group):
            return True
        if self.in_place.ended:  # torchrun takes this attempt over
            self.in_place.ended = False
            self._whole_restart = attempt
            return False
        # a worker that exits from here on is the next poll's failure, recovered in place
        self._running = self.in_place.running
        return False

    def seen_running(self) -> bool:
        return self._running

    def stop_late(self, ranks: list[int], worker_group: Any, waited: float) -> None:
        """SIGKILL the workers of ``ranks``, which did not leave their step within ``waited``
        seconds of a failure recovered in place, saying where each was (its stack)."""
        say(
            f"rank(s) {', '.join(map(str, ranks))} did not leave their step within {waited:g} s "
            "of the failure: killed, to be replaced"
        )
        pids = {w.global_rank: w.id for w in worker_group.workers}
        folder = _stack_dir()
        where = worker.ask_stacks(folder, {r: pids[r] for r in ranks}) if folder else {}
        for rank, frames in where.items():
            say(f"rank {rank} was at (innermost first):")
            for frame in frames:
                say(f"  {frame}")
        send([pids[r] for r in ranks], signal.SIGKILL)

    def stop_workers(self) -> None:
        """SIGKILL every worker of the attempt (this node was replaced)."""
        send(self.worker_pids(), signal.SIGKILL)

    def recovered(self) -> None:
        """The workers went on after a recovery in place: the stall watch starts anew."""
        self._watched = self._exits_of = self._stacks_asked = None

    def start_env(self, worker_group: Any) -> dict[str, str]:
        # a node taking a lost node's place: its workers start in the recovery, at its count
        handler = worker_group.spec.rdzv_handler
        joined = getattr(handler, "joined", None)
        if joined is None or self.in_place is None:
            return {}
        handler.joined = None
        self.restarts_from(joined.go["restart_count"])
        return {recover.GO_ENV: str(self.in_place.joined(joined, worker_group.store))}

    def before_monitor(self, worker_group: Any) -> None:
        self._stacks_before_teardown(worker_group)
        if self.watch is None:
            return
        processes = self.worker_processes()
        attempt = id(self.process_context())
        if self._watched != attempt and processes:
            self._watched = attempt
            self.watch.start_attempt(
                {
                    w.global_rank: (w.local_rank, processes[w.local_rank].pid)
                    for w in worker_group.workers
                }
            )
        store = getattr(worker_group, "store", None)
        if store is not None and self._published_to is not store and processes:
            self._published_to = store
            addr = getattr(worker_group.spec, "local_addr", None)  # not in every torch version
            self.watch.connect(
                store, worker_group.group_rank or 0, worker_group.group_world_size or 1, addr
            )
        running = {
            w.global_rank for w in worker_group.workers if processes[w.local_rank].poll() is None
        }
        if (stall := self.watch.poll(running)) is not None and stall.disagreement:
            say(stall.disagreement)  # named, and they wait in different ops

    def after_monitor(self, worker_group: Any, result: Any) -> None:
        failed = result.state == WorkerState.FAILED
        self.left = self._left_early(worker_group) if failed else []
        if self.watch is not None and (failed or result.state == WorkerState.SUCCEEDED):
            if failed and self.watch.stall is None and not preempted(result.failures):
                self.watch.read()  # a stall's headline says where they were
                for r in self.watch.ranks.values():
                    # a failed collective hands the rank back to its phase before
                    if _left_collective(r.collective, r.record):
                        r.record = r.collective
                self.where = self.watch.where()
            self.watch.disconnect()  # the other nodes no longer count this node's ranks
            self._published_to = None
        if result.state == WorkerState.SUCCEEDED and self.in_place is not None:
            self.in_place.finished()
        if not failed:
            return
        if preempted(result.failures):
            self.stop_restarting()
            return
        if self.in_place is not None:
            self.in_place.finished(succeeded=False)  # torchrun restarts the job, or it ends
        if self.restarts_left() > 0:  # torchrun restarts next: say what failed, as at a job's end
            print(self.summary(result), file=sys.stderr, flush=True)
            left = self.restarts_left() - 1
            say(f"restarting the workers ({left} restart(s) left after this one)")

    @property
    def stall(self) -> watch.Stall | None:
        """What the stall watch named in this attempt."""
        return self.watch.stall if self.watch is not None else None

    def summary(self, failed: Any) -> str:
        """The summary of a failed attempt (torchrun's result or error), with what it saw."""
        text = summarize_failure(failed, stall=self.stall, where=self.where, left=self.left)
        if self.in_place is not None and self.in_place.fallback:
            text += f"\n  not recovered in place: {self.in_place.fallback}"
        return text

    def _stacks_before_teardown(self, worker_group: Any) -> None:
        # torchrun stops the other workers in the poll that finds a failed one: ask their stacks
        # first, only after an exception (a delay would stamp a killed worker later than it died)
        codes = {local: proc.poll() for local, proc in self.worker_processes().items()}
        self._polls += 1
        self._note_exits(codes)
        failed = {
            local
            for local, code in codes.items()
            if code is not None and code > 0 and code != PREEMPTED_EXIT_CODE
        }
        attempt = id(self.process_context())
        folder = _stack_dir()
        if failed and self._stacks_asked != attempt and folder is not None:
            self._stacks_asked = attempt
            for w in worker_group.workers:  # this node's earlier answers go first
                with contextlib.suppress(OSError, ConfigError):
                    fs.remove(folder / f"rank{w.global_rank}.txt")
            running = {
                w.global_rank: w.id for w in worker_group.workers if codes.get(w.local_rank) is None
            }
            worker.ask_stacks(folder, running)  # their answers awaited 3 s at most
        if any(code is not None and code != 0 for code in codes.values()):
            # torchrun's SIGTERM, then 30 s: a stopped process would hold the job's end that long
            stopped = [
                proc.pid
                for local, proc in self.worker_processes().items()
                if codes.get(local) is None and watch.process_state(proc.pid).startswith("stopped")
            ]
            send(stopped, signal.SIGKILL)

    def _note_exits(self, codes: dict[int, int | None]) -> None:
        """Note the poll that first saw each worker of this attempt exited."""
        attempt = id(self.process_context())
        if self._exits_of != attempt:
            self._exits_of, self._exit_seen = attempt, {}
        for local, code in codes.items():
            if code is not None:
                self._exit_seen.setdefault(local, self._polls)

    def _left_early(self, worker_group: Any) -> list[Left]:
        """This node's workers that exited with code 0, no later than the first failure, while the
        others went on: another rank's last mark is past its own, or, where no rank marked, its exit
        was seen while another still ran, before any failed."""
        processes = self.worker_processes()
        codes = {local: proc.poll() for local, proc in processes.items()}
        self._note_exits(codes)  # torchrun's poll, after our own, may have seen some exit
        failed_at = min(
            (self._exit_seen.get(local, self._polls) for local, code in codes.items() if code),
            default=self._polls,
        )
        marks: dict[int, watch.Record] = {}
        if self.watch is not None:
            self.watch.read()  # this attempt's records: its workers' pids
            marks = {
                g: r.record for g, r in self.watch.ranks.items() if r.record and r.record.step >= 0
            }
        left = []
        for w in worker_group.workers:
            seen = self._exit_seen.get(w.local_rank)
            if codes.get(w.local_rank) != 0 or seen is None or seen > failed_at:
                continue
            mine = marks.get(w.global_rank)
            others = [r for g, r in marks.items() if g != w.global_rank]
            if mine is not None and others:
                went_on = any((r.step, r.coll) > (mine.step, mine.coll) for r in others)
            else:
                still_ran = any(self._exit_seen.get(local, seen + 1) > seen for local in codes)
                went_on = seen < failed_at and still_ran
            if went_on:
                step = mine.step if mine is not None else None
                left.append(Left(w.global_rank, w.local_rank, processes[w.local_rank].pid, step))
        return left

    def after_shutdown(self) -> None:
        if self.watch is not None:
            self.watch.disconnect()
        # one torchrun gave up on (stuck in the kernel) is its Popen's alone to collect
        unreaped = [
            proc.pid for proc in self.worker_processes().values() if proc.returncode is None
        ]
        server = forked.current()  # serves the next attempt's workers too
        kill_descendants(keep=unreaped + ([server.pid] if server is not None else []))
        folder = _stack_dir()  # the ended workers' FIFOs and answers by pid go
        with contextlib.suppress(OSError):
            for path in folder.glob("stack-*") if folder is not None else []:
                with contextlib.suppress(OSError, ConfigError):
                    fs.remove(path)

    def worker_pids(self) -> list[int]:
        pcontext = self.process_context()
        return list(pcontext.pids().values()) if pcontext is not None else []


def _left_collective(before: watch.Record | None, after: watch.Record | None) -> bool:
    """Whether a rank seen in a collective (``before``) left it and entered none (``after``)."""
    return (
        before is not None
        and after is not None
        and before.phase == Phase.COLLECTIVE
        and after.phase != Phase.COLLECTIVE
        and (after.coll, after.steps) == (before.coll, before.steps)
    )


def _stack_dir() -> Path | None:
    folder = os.environ.get(worker.STACK_DIR_ENV)
    return Path(folder) if folder else None


def stacks(folder: Path, ranks: Sequence[int], lines: int = 14) -> list[str]:
    """Each rank's main-thread stack as its worker last answered, innermost first."""
    out = []
    for rank in ranks:
        try:
            text = fs.read_bytes(folder / f"rank{rank}.txt").decode(errors="replace")
        except (OSError, ConfigError):
            continue
        frames = worker.main_frames(text)
        if frames:
            out.append(
                f"  rank {rank} was still running when the first rank failed, at (innermost first):"
            )
            out += [f"    {frame}" for frame in frames[:lines]]
    return out


HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
REQUESTS = (signal.SIGUSR1, signal.SIGUSR2)  # a warning and a stack request: never the end
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
TERM_GRACE = 60.0  # seconds the workers get to save and exit after a SIGTERM to the agent


def _forward_signals() -> None:
    """Pass SIGTERM and SIGUSR1 on to the workers, whose Trainer saves and exits with the pre-empted
    code; after a SIGTERM restart nothing, and kill workers still running :data:`TERM_GRACE`
    seconds later. SIGUSR2 asks every worker for its stack (signalling none). SIGINT, SIGHUP and
    SIGQUIT stay torchrun's."""

    def terminate(signum: int, frame: Any) -> None:
        agent = Agent.current
        pids = agent.worker_pids() if agent is not None else []
        if agent is None or not pids:  # no workers yet (rendezvous) or any more: stop now
            raise SystemExit(128 + signum)
        agent.stop_restarting()
        timer = threading.Timer(TERM_GRACE, send, (pids, signal.SIGKILL))
        timer.daemon = True
        timer.start()
        send(pids, signum)

    # torchrun's process context installs its handlers at each start: keep it off SIGTERM
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = TORCHRUN_SIGNALS
    signal.signal(signal.SIGTERM, terminate)
    # SIGUSR1 (to the workers) and SIGUSR2 (a stack request) acted on from a thread of its own
    global _answering
    if _answering is None:
        _answering = threading.Thread(target=_answer, name="ddpkit-signals", daemon=True)
        _answering.start()
    for sig in REQUESTS:
        signal.signal(sig, _note_request)


_requests: queue.SimpleQueue[int] = queue.SimpleQueue()
_answering: threading.Thread | None = None


def _note_request(signum: int, frame: Any) -> None:
    # only noted: a handler that used the agent, wherever the main thread was, could use it freed
    _requests.put_nowait(signum)


def _answer() -> None:
    while True:
        signum = _requests.get()
        try:
            if signum == signal.SIGUSR2:
                folder = _stack_dir()
                if folder is not None:
                    worker.request_every_stack(folder)
            else:
                agent = Agent.current
                send(agent.worker_pids() if agent is not None else [], signum)
        except Exception:  # noqa: BLE001  (an attempt ending as it is read: none left to reach)
            continue


def install(
    launcher_api: Any,
    fork_server: bool = True,
    preload: Sequence[str] = (),
    display: Sequence[str] = (),
    stall: watch.StallPolicy | None = None,
    run_dir: Path | None = None,
    in_place: recover.InPlace | None = None,
) -> None:
    """Make torchrun's ``launch_agent`` (of ``launcher_api``) build :class:`Agent` with the stall
    watch's policy ``stall``, and forward signals to its workers; with ``fork_server``, start the
    job's fork server (importing ``preload``; ``display``: the workers' command). The ranks'
    progress records go to shared memory, else to ``run_dir/progress``."""
    use_agent(launcher_api, Agent)
    Agent.policy = stall if stall is not None else watch.StallPolicy(floor=0)
    # made by the agent, which outlives every attempt: a restarted worker finds its state there
    job = memory_folder.open_job_folder(memory=os.environ.get(memory_folder.OFF_ENV) != "0")
    watch.open_folder(job, (run_dir or Path.cwd()) / "progress")
    _forward_signals()
    if fork_server:
        forked.install(preload, display)
    Agent.in_place = in_place


def ignore_requests() -> None:
    """Ignore SIGUSR1 and SIGUSR2 until :func:`install` handles them (no worker to reach)."""
    for sig in REQUESTS:
        signal.signal(sig, signal.SIG_IGN)


def uninstall() -> None:
    """Undo :func:`install` once the workers have ended. SIGTERM, SIGUSR1 and SIGUSR2 are ignored
    from here on (a handler would get its default action back as the interpreter exits): one that
    comes as the job ends must not end the launcher after its workers succeeded."""
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    forked.uninstall()
    Agent.current = None
    if Agent.in_place is not None:
        Agent.in_place.finished(succeeded=False)  # stops its beat
    Agent.in_place = None
    memory_folder.close_job_folder()
    os.environ.pop(watch.DIR_ENV, None)
