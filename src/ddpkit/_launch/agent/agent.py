"""torchrun's elastic agent as ``ddpkit run`` runs it (:class:`Agent`, installed by
:func:`install`): pre-emption, signals, the stall watch, stacks and failure summaries, the fork
server, in-place recovery, and the job's folder (docs/launcher.md)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerState

from ddpkit import _fs as fs
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit._internals.elastic import HookedAgent, use_agent
from ddpkit._launch import say
from ddpkit._launch.agent import forkserver as forked
from ddpkit._launch.agent import jobdir
from ddpkit._launch.agent.failure import Left, preempted, summarize_failure
from ddpkit._launch.proctree import kill_descendants, send, state_code
from ddpkit._launch.recover.inplace import InPlace, Round
from ddpkit._launch.rendezvous.link import NodeLink
from ddpkit._launch.watch import stall as watch
from ddpkit._launch.watch.verdict import STOPPED
from ddpkit.distributed import _channels as channels
from ddpkit.distributed._progress import Phase


@dataclass
class Attempt:
    """One start of the workers (the first, or torchrun's restart): what the agent knows of it.
    A recovery in place goes on in the same attempt, with new pids for the ranks it replaced."""

    ranks: dict[int, int]  # global rank -> local rank
    watched: bool = False  # the stall watch knows its workers' pids
    stacks_asked: bool = False  # the running workers' stacks were asked after a failure
    polls: int = 0
    exit_seen: dict[int, int] = field(default_factory=dict)  # local rank -> first poll it exited
    whole_restart: bool = False  # in-place recovery gave it back to torchrun
    running: bool = False  # this poll's own look found every worker running (in place)


class Agent(HookedAgent):
    """torchrun's agent with the changes torchrun has no option for: a worker that exits with
    :data:`~ddpkit._errors.PREEMPTED_EXIT_CODE` stops the job instead of being restarted; the stall
    watch polled with the workers; stacks asked of the running workers before torchrun stops them;
    in-place recovery polled first; and, once the workers are stopped, every process still below
    the agent (a child subreaper) ended. Its in-place recovery sees it as
    :class:`~ddpkit._launch.recover.inplace.Workers`."""

    current: Agent | None = None
    policy = watch.StallPolicy(floor=0)  # set by install()
    in_place: InPlace | None = None  # set by install() where --recover in-place applies
    node_timeout = 30.0  # set by install()
    run_dir: Path | None = None  # the run's log folder, set by install()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        progress = channels.channel(channels.PROGRESS)
        self.watch = watch.Watch(progress, self.policy, True) if progress is not None else None
        self.attempt: Attempt | None = None
        self.link: NodeLink | None = None  # across nodes, this round's
        self._round: str | None = None
        # what the last failed attempt showed (for its summary)
        self.where = ""
        self.left: list[Left] = []
        Agent.current = self

    def run(self, *args: Any, **kwargs: Any) -> Any:
        result = super().run(*args, **kwargs)
        if result is None:
            # torch's agent returns None where the job's rendezvous closed before this node joined
            # it (RendezvousGracefulExitError), and torch's launch_agent then fails on None
            raise ConfigError(
                "the job ended before this node joined it (its rendezvous is closed): nothing ran "
                "on this node"
            )
        return result

    # -- an attempt's start ------------------------------------------------------------------------

    def start_env(self, worker_group: Any) -> dict[str, str]:
        # a node taking a lost node's place: its workers start in the recovery, at its count
        in_place = self.in_place
        if in_place is not None and in_place.joined is not None:
            in_place.joined_start(in_place.joined, self)
        return {}

    def after_start(self, worker_group: Any) -> None:
        workers = worker_group.workers
        self.attempt = Attempt({w.global_rank: w.local_rank for w in workers})
        handler = worker_group.spec.rdzv_handler
        nodes = worker_group.group_world_size or 1
        round_name = getattr(handler, "round_name", "") or ""
        if self.link is not None and round_name != self._round:
            self.link.close()
            self.link = None
        in_place = self.in_place
        if nodes > 1 and self.link is None and getattr(handler, "base", None) is not None:
            if in_place is not None and in_place.joined is not None:  # beating since its claim
                self.link, in_place.joined = in_place.joined.link, None
            else:
                self.link = NodeLink(
                    handler.base, round_name, worker_group.group_rank, nodes, handler.addr,
                    self.node_timeout,
                )  # fmt: skip
        self._round = round_name
        if self.watch is not None:
            addr = getattr(worker_group.spec, "local_addr", None)  # not in every torch version
            self.watch.connect(self.link, worker_group.group_rank or 0, nodes, addr)
        if self.in_place is not None:
            addr = getattr(handler, "addr", None) or "127.0.0.1"
            ranks = sorted(self.attempt.ranks)
            waiting = getattr(handler, "nodes_waiting", lambda: 0)
            self.in_place.start(Round(addr, ranks, self.link, waiting))

    # -- in-place recovery's view of the agent (recover.inplace.Workers) ---------------------------

    def exit_codes(self) -> dict[int, int | None]:
        processes = self.worker_processes()
        ranks = self.attempt.ranks if self.attempt is not None else {}
        return {g: processes[local].poll() for g, local in ranks.items() if local in processes}

    def pids(self) -> dict[int, int]:
        processes = self.worker_processes()
        ranks = self.attempt.ranks if self.attempt is not None else {}
        return {g: processes[local].pid for g, local in ranks.items() if local in processes}

    def kill(self, ranks: list[int], why: str) -> None:
        """SIGKILL the workers of ``ranks``, saying why, and where each was (its stack)."""
        say(f"rank(s) {', '.join(map(str, ranks))} {why}")
        pids = self.pids()
        # a stopped process cannot answer: its stack is not asked
        asked = {r: pids[r] for r in ranks if r in pids and state_code(pids[r]) not in STOPPED}
        where = channels.ask_stacks(asked)
        for rank, frames in where.items():
            say(f"rank {rank} was at (innermost first):")
            for frame in frames:
                say(f"  {frame}")
        send([pids[r] for r in ranks if r in pids], signal.SIGKILL)

    def stall_ended(self) -> bool:
        stall = self.stall
        return stall is not None and not stall.stopped

    def went_on(self) -> None:
        """The workers went on after a recovery in place: the stall watch starts anew."""
        if self.attempt is not None:
            self.attempt.watched = self.attempt.stacks_asked = False
            self.attempt.exit_seen = {}

    # -- each poll ---------------------------------------------------------------------------------

    def intercept(self, worker_group: Any) -> bool:
        attempt = self.attempt
        if attempt is None:
            return False
        attempt.running = False
        if self.in_place is None or attempt.whole_restart:
            return False
        if self.in_place.poll(self):
            return True
        if self.in_place.ended:  # torchrun takes this attempt over
            self.in_place.ended = False
            attempt.whole_restart = True
            return False
        # a worker that exits from here on is the next poll's failure, recovered in place
        attempt.running = self.in_place.running
        return False

    def seen_running(self) -> bool:
        return self.attempt is not None and self.attempt.running

    def before_monitor(self, worker_group: Any) -> None:
        self._stacks_before_teardown(worker_group)
        attempt = self.attempt
        if self.watch is None or attempt is None:
            return
        pids = self.pids()
        if not attempt.watched and pids:
            attempt.watched = True
            self.watch.start_attempt({g: (attempt.ranks[g], pid) for g, pid in pids.items()})
        running = {g for g, code in self.exit_codes().items() if code is None}
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
        if result.state == WorkerState.SUCCEEDED:
            self.end_round(succeeded=True)
        if not failed:
            return
        if preempted(result.failures):
            self.stop_restarting()
            return
        self.end_round(succeeded=False)  # torchrun restarts the job, or it ends
        if self.restarts_left() > 0:  # torchrun restarts next: say what failed, as at a job's end
            print(self.summary(result), file=sys.stderr, flush=True)
            left = self.restarts_left() - 1
            say(f"restarting the workers ({left} restart(s) left after this one)")

    def end_round(self, succeeded: bool) -> None:
        """This node's part in the round ends: its link stops beating (``succeeded``: its silence
        from now on is no loss)."""
        if self.in_place is not None:
            self.in_place.finished()
        if self.link is not None:
            self.link.close(finished=succeeded)
            self.link, self._round = None, None

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
        attempt = self.attempt
        if attempt is None:
            return
        codes = {local: proc.poll() for local, proc in self.worker_processes().items()}
        attempt.polls += 1
        self._note_exits(codes)
        failed = {
            local
            for local, code in codes.items()
            if code is not None and code > 0 and code != PREEMPTED_EXIT_CODE
        }
        folder = channels.channel(channels.STACKS)
        if failed and not attempt.stacks_asked and folder is not None:
            attempt.stacks_asked = True
            for w in worker_group.workers:  # this node's earlier answers go first
                with contextlib.suppress(OSError, ConfigError):
                    fs.remove(folder / f"rank{w.global_rank}.txt")
            running = {
                w.global_rank: w.id for w in worker_group.workers if codes.get(w.local_rank) is None
            }
            channels.ask_stacks(running)  # their answers awaited 3 s at most
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
        attempt = self.attempt
        assert attempt is not None
        for local, code in codes.items():
            if code is not None:
                attempt.exit_seen.setdefault(local, attempt.polls)

    def _left_early(self, worker_group: Any) -> list[Left]:
        """This node's workers that exited with code 0, no later than the first failure, while the
        others went on: another rank's last mark is past its own, or, where no rank marked, its exit
        was seen while another still ran, before any failed."""
        attempt = self.attempt
        if attempt is None:
            return []
        processes = self.worker_processes()
        codes = {local: proc.poll() for local, proc in processes.items()}
        self._note_exits(codes)  # torchrun's poll, after our own, may have seen some exit
        seen_at = attempt.exit_seen
        failed_at = min(
            (seen_at.get(local, attempt.polls) for local, code in codes.items() if code),
            default=attempt.polls,
        )
        marks: dict[int, watch.Record] = {}
        if self.watch is not None:
            self.watch.read()  # this attempt's records: its workers' pids
            marks = {
                g: r.record for g, r in self.watch.ranks.items() if r.record and r.record.step >= 0
            }
        left = []
        for w in worker_group.workers:
            seen = seen_at.get(w.local_rank)
            if codes.get(w.local_rank) != 0 or seen is None or seen > failed_at:
                continue
            mine = marks.get(w.global_rank)
            others = [r for g, r in marks.items() if g != w.global_rank]
            if mine is not None and others:
                went_on = any((r.step, r.coll) > (mine.step, mine.coll) for r in others)
            else:
                still_ran = any(seen_at.get(local, seen + 1) > seen for local in codes)
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
        folder = channels.channel(channels.STACKS)  # the ended workers' answers by pid go
        with contextlib.suppress(OSError):
            for path in folder.iterdir() if folder is not None else []:
                if path.stem.isdigit():
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


def stacks(ranks: Sequence[int], lines: int = 14) -> list[str]:
    """Each rank's main-thread stack as its worker last answered, innermost first."""
    folder = channels.channel(channels.STACKS)
    out: list[str] = []
    if folder is None:
        return out
    for rank in ranks:
        try:
            text = fs.read_bytes(folder / f"rank{rank}.txt").decode(errors="replace")
        except (OSError, ConfigError):
            continue
        frames = channels.main_frames(text)
        if frames:
            out.append(
                f"  rank {rank} was still running when the first rank failed, at (innermost first):"
            )
            out += [f"    {frame}" for frame in frames[:lines]]
    return out


def answered_ranks() -> list[int]:
    """The ranks whose stacks were answered (after a failure, for the summary)."""
    folder = channels.channel(channels.STACKS)
    if folder is None:
        return []
    with contextlib.suppress(OSError):
        return sorted(
            int(p.stem[4:])
            for p in folder.glob("rank*.txt")
            if p.stem[4:].isdigit() and p.stat().st_size
        )
    return []


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
                _stacks_to_log_folder()
            else:
                agent = Agent.current
                send(agent.worker_pids() if agent is not None else [], signum)
        except Exception:  # noqa: BLE001  (an attempt ending as it is read: none left to reach)
            continue


def _stacks_to_log_folder() -> None:
    """SIGUSR2: every process of the job on this node asked for its stacks; their answers, by
    name (``rank<N>.txt``, ``rank<N>-loader<W>.txt``), copied to the run's log folder
    (``stacks/``), where a user looks for them."""
    asked = channels.request_every_stack()
    folder, run_dir = channels.channel(channels.STACKS), Agent.run_dir
    channels.answered(asked)
    if folder is None or run_dir is None:
        return
    fs.make_dirs(run_dir / "stacks", root=run_dir)
    for path in folder.glob("*.txt"):
        if not path.stem.isdigit():
            with contextlib.suppress(OSError, ConfigError):
                fs.write_atomic(run_dir / "stacks" / path.name, fs.read_bytes(path))


def install(
    launcher_api: Any,
    fork_server: bool = True,
    preload: Sequence[str] = (),
    display: Sequence[str] = (),
    stall: watch.StallPolicy | None = None,
    in_place: InPlace | None = None,
    node_timeout: float = 30.0,
    run_dir: Path | None = None,
) -> None:
    """Make torchrun's ``launch_agent`` (of ``launcher_api``) build :class:`Agent` with the stall
    watch's policy ``stall``, and forward signals to its workers; with ``fork_server``, start the
    job's fork server (importing ``preload``; ``display``: the workers' command). The job folder
    is made first (:func:`open_job_folder`); the stacks SIGUSR2 asks for go to ``run_dir``."""
    use_agent(launcher_api, Agent)
    Agent.policy = stall if stall is not None else watch.StallPolicy(floor=0)
    Agent.node_timeout, Agent.run_dir = node_timeout, run_dir
    _forward_signals()
    if fork_server:
        forked.install(preload, display)
    Agent.in_place = in_place


def open_job_folder(run_dir: Path) -> Path:
    """The job's folder on this node (its channels; in shared memory where it has room, else in
    ``run_dir``), made by the agent, which outlives every attempt: a restarted worker finds its
    state there."""
    return jobdir.open_job_folder(run_dir / "job")


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
    agent, Agent.current = Agent.current, None
    if agent is not None:
        agent.end_round(succeeded=False)  # stops its beat
    Agent.in_place = None
    jobdir.close_job_folder()
