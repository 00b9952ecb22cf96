"""torchrun's elastic agent as ``ddpkit run`` runs it.

Changes to the agent torchrun has no option for (a subclass, installed by :func:`install`):

- a worker that exits with :data:`~ddpkit._errors.PREEMPTED_EXIT_CODE` saved its snapshot because it
  was told to stop, so the agent does not restart it, and ``ddpkit run`` exits with that code;
- SIGTERM and SIGUSR1 reach the workers instead of ending the agent, and SIGUSR2 asks every worker
  for its stack; when a worker fails with an exception, the agent asks the workers still running for
  their stacks before it stops them, so that a hang's summary says where every rank was. A stack
  request signals no worker (:func:`ddpkit._launch.worker.serve_stacks`), and none of the three
  signals ends the launcher once its workers are gone;
- once the workers are stopped, so is every process they started (:mod:`ddpkit._launch.proctree`);
- the job gets a folder in shared memory for the workers' snapshots in memory
  (:mod:`ddpkit.snapshot._slots`), made once per job and removed when the job ends, however
  it ends;
- workers are forked from a server that imported torch once for the job
  (:mod:`ddpkit._launch.forkserver.workers`), so a restart does not start an interpreter and import
  torch again;
- a rank that stops making progress while the others wait for it is named in seconds, and the job
  ended (:mod:`ddpkit._launch.watch`), across nodes through the rendezvous store
  (:mod:`ddpkit._launch.watch_nodes`); before each restart the failure is summarised as at a job's
  end (:mod:`ddpkit._launch.failure`).
"""

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
from ddpkit._launch import watch, worker
from ddpkit._launch import watch_nodes as nodes
from ddpkit._launch.failure import Left, preempted, summarize_failure
from ddpkit._launch.forkserver import workers as forked
from ddpkit._launch.proctree import kill_descendants
from ddpkit.distributed._progress import Phase
from ddpkit.snapshot import _slots as memory_folder


class Agent(HookedAgent):
    """torchrun's agent, with three changes torchrun has no option for.

    - A worker that exits with :data:`~ddpkit._errors.PREEMPTED_EXIT_CODE` saved its snapshot
      because it was told to stop: restarting it here would train on after the scheduler's warning.
      The agent stops instead, and ``ddpkit run`` exits with that code so that the batch script
      requeues the job.
    - SIGUSR1 (SLURM's ``--signal`` warning) and SIGTERM reach the workers instead of ending the
      agent, and SIGUSR2 asks them for their stacks; see ``_forward_signals``.
    - Stopping the workers (a restart, a failure, a signal) ends every process they started too:
      torchrun signals a worker's process group only while the worker runs, and misses what left the
      group. The launcher makes the agent a child subreaper, so all that is still below it then is
      the job's (:mod:`ddpkit._launch.proctree`).
    """

    current: Agent | None = None
    policy = watch.StallPolicy(floor=0)
    """The stall watch's, set by :func:`install`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stacks_asked: int | None = None
        self._watched: int | None = None
        self._published_to: Any = None
        folder, stacks = os.environ.get(watch.DIR_ENV), os.environ.get("DDPKIT_STACK_DIR")
        self.watch = (
            watch.Watch(Path(folder), self.policy, Path(stacks) if stacks else None)
            if folder
            else None
        )
        self.where = ""
        """Each rank's step and phase at its last mark, when the last attempt failed."""
        self.left: list[Left] = []
        """This node's workers that exited with code 0 while the others went on, when the last
        attempt failed."""
        self.disagreement = ""
        """The stall watch's line on ranks in one collective under different ops, in this
        attempt."""
        self._collectives: dict[int, watch.Record] = {}
        """Global rank -> its record when the stall watch last read it waiting in a collective."""
        self._polls = 0
        self._exits_of: int | None = None
        self._exit_seen: dict[int, int] = {}
        """Local rank -> the poll that first saw its worker exited, in this attempt."""
        Agent.current = self

    def before_monitor(self, worker_group: Any) -> None:
        self._stacks_before_teardown(worker_group)
        if self.watch is None:
            return
        processes = self.worker_processes()
        attempt = id(self.process_context())
        if self._watched != attempt and processes:
            self._watched = attempt
            self.disagreement = ""
            self._collectives.clear()
            self.watch.start_attempt(
                {
                    w.global_rank: (w.local_rank, processes[w.local_rank].pid)
                    for w in worker_group.workers
                }
            )
        # the rendezvous round's: a new one at each restart
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
        if self.watch.poll(running) is not None:
            self._say_disagreement(running)
        for g, r in self.watch.ranks.items():
            if r.record is not None and r.record.phase == Phase.COLLECTIVE:
                self._collectives[g] = r.record

    def _say_disagreement(self, running: set[int]) -> None:
        """Once the stall watch named ranks: say so when the job's ranks wait in one collective
        under different ops (the ranks named are those whose op is not the others')."""
        assert self.watch is not None
        now = self.watch.clock()
        views = [self.watch.view(r, now) for g, r in self.watch.ranks.items() if g in running]
        disagree = nodes.disagreement(views + self.watch.link.remote)
        if disagree:
            self.disagreement = nodes.disagreement_words(disagree, self.watch.link.multi)
            print(f"ddpkit run: {self.disagreement}", file=sys.stderr, flush=True)

    def after_monitor(self, worker_group: Any, result: Any) -> None:
        failed = result.state == WorkerState.FAILED
        self.left = self._left_early(worker_group) if failed else []
        if self.watch is not None and (failed or result.state == WorkerState.SUCCEEDED):
            if failed and self.watch.stall is None and not preempted(result.failures):
                self.watch.read()  # a stall's headline says where they were
                for g, r in self.watch.ranks.items():
                    # A collective that failed (its timeout, a lost peer) hands the rank back to the
                    # phase it was in before, and the line would say "user code": say the
                    # collective it was last seen waiting in, when it has entered none since.
                    if _left_collective(self._collectives.get(g), r.record):
                        r.record = self._collectives[g]
                self.where = self.watch.where()
            self.watch.disconnect()  # the other nodes no longer count this node's ranks
            self._published_to = None
        if not failed:
            return
        if preempted(result.failures):
            self.stop_restarting()
            return
        # torchrun restarts next: say what failed first, as at a job's end
        if self.restarts_left() > 0:
            stall = self.watch.stall if self.watch is not None else None
            print(
                summarize_failure(
                    result,
                    stall=stall,
                    where=self.where,
                    left=self.left,
                    disagreement=self.disagreement,
                ),
                file=sys.stderr,
                flush=True,
            )
            print(
                f"ddpkit run: restarting the workers ({self.restarts_left() - 1} restart(s) left "
                "after this one)",
                file=sys.stderr,
                flush=True,
            )

    def _stacks_before_teardown(self, worker_group: Any) -> None:
        # torchrun stops the other workers in the same poll that finds a failed one; ask them where
        # they are first. The exit codes come from the Popen objects torchrun's process context
        # keeps (poll() caches the code, so its own poll that follows sees the same). Only after a
        # Python exception (a collective that timed out, an error in user code): its time is in its
        # error file. A worker killed by a signal has none, and torchrun stamps it when it polls; a
        # delay here would let a peer's consequent error look earlier than the kill.
        codes = {local: proc.poll() for local, proc in self.worker_processes().items()}
        self._polls += 1
        self._note_exits(codes)
        failed = {
            local
            for local, code in codes.items()
            if code is not None and code > 0 and code != PREEMPTED_EXIT_CODE
        }
        attempt = id(self.process_context())
        if failed and self._stacks_asked != attempt:
            self._stacks_asked = attempt
            running = {
                w.global_rank: w.id for w in worker_group.workers if codes.get(w.local_rank) is None
            }
            _ask_for_stacks(running, [w.global_rank for w in worker_group.workers])
        if any(code is not None and code != 0 for code in codes.values()):
            # torchrun now sends SIGTERM to the rest and waits 30 s before SIGKILL: a stopped
            # process cannot act on the SIGTERM, and would hold the job's end (or restart) for all
            # of that time.
            for local, proc in self.worker_processes().items():
                if codes.get(local) is None and watch.process_state(proc.pid).startswith("stopped"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)

    def _note_exits(self, codes: dict[int, int | None]) -> None:
        """Note the poll at which each worker of this attempt was first seen exited (``codes``:
        local rank -> exit code, None while it runs)."""
        attempt = id(self.process_context())
        if self._exits_of != attempt:
            self._exits_of, self._exit_seen = attempt, {}
        for local, code in codes.items():
            if code is not None:
                self._exit_seen.setdefault(local, self._polls)

    def _left_early(self, worker_group: Any) -> list[Left]:
        """This node's workers that exited with code 0, no later than the first failure, while the
        others went on.

        torchrun counts an exit with code 0 as a success and waits for the rest: the others then
        fail in their next collective ("Connection closed by peer"), and the first failure is a
        survivor's. Went on: another rank's last mark is past its own (a later step, or more
        collectives entered). A worker that finished with the others marked as far as they did, and
        one that left after the failure (a script that catches its collective's error and returns)
        is not behind the rank that failed. Where the ranks never marked (a loop ddpkit does not
        see), its exit must have been seen while another worker still ran, before any failed.
        """
        processes = self.worker_processes()
        codes = {local: proc.poll() for local, proc in processes.items()}
        self._note_exits(codes)  # torchrun's poll, after this poll's own, may have seen some exit
        failed_at = min(
            (self._exit_seen.get(local, self._polls) for local, code in codes.items() if code),
            default=self._polls,
        )
        marks: dict[int, watch.Record] = {}
        for w in worker_group.workers:
            proc = processes.get(w.local_rank)
            if self.watch is None or proc is None:
                continue
            record = watch.read_record(self.watch.folder / f"rank{w.global_rank}.progress")
            if record is not None and record.pid == proc.pid and record.step >= 0:
                marks[w.global_rank] = record
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
        # A worker torchrun gave up on (stuck in the kernel) keeps its Popen, which alone may
        # collect it.
        unreaped = [
            proc.pid for proc in self.worker_processes().values() if proc.returncode is None
        ]
        server = forked.current()  # serves the next attempt's workers too
        kill_descendants(keep=unreaped + ([server.pid] if server is not None else []))
        _sweep_stack_requests()

    def worker_pids(self) -> list[int]:
        pcontext = self.process_context()
        return list(pcontext.pids().values()) if pcontext is not None else []


def _left_collective(before: watch.Record | None, after: watch.Record | None) -> bool:
    """Whether a rank seen waiting in a collective (``before``) has left it and entered no other
    collective nor step since (``after``)."""
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


def _ask_for_stacks(running: dict[int, int], ranks: Sequence[int], wait: float = 3.0) -> None:
    """Ask the workers still running (global rank -> pid) for their stacks, and wait for their
    answers (``wait`` seconds at most): each in ``rank<N>.txt``, where an earlier answer of any of
    this node's ``ranks`` is removed first (it says where the rank was then, not at the failure)."""
    folder = _stack_dir()
    if folder is None:
        return
    for rank in ranks:
        with contextlib.suppress(OSError, ConfigError):
            fs.remove(folder / f"rank{rank}.txt")
    worker.ask_stacks(folder, running, wait)


def _sweep_stack_requests() -> None:
    """Once the workers and all they started have ended: their FIFOs and answers by pid (a killed
    process leaves its own)."""
    folder = _stack_dir()
    if folder is None:
        return
    with contextlib.suppress(OSError):
        for path in folder.glob("stack-*"):
            with contextlib.suppress(OSError, ConfigError):
                fs.remove(path)


def stacks(folder: Path, ranks: Sequence[int], lines: int = 14) -> list[str]:
    """Each rank's main-thread stack as its worker last answered (``rank<N>.txt``), innermost
    frames first."""
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
REQUESTS = (signal.SIGUSR1, signal.SIGUSR2)
"""A warning and a stack request: neither ends the launcher, at any time."""
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
TERM_GRACE = 60.0
"""Seconds the workers get to save and exit after a SIGTERM to the agent, before they are killed."""


def _forward_signals() -> None:
    """Pass SIGTERM and SIGUSR1 on to the workers, and let them finish; on SIGUSR2, ask every worker
    for its stack.

    torchrun's agent leaves SIGUSR1 at its default action, so ``srun ddpkit run`` died with exit
    code 138 on SLURM's warning and the workers' snapshot raced the teardown of the step. On SIGTERM
    it stops the workers itself and exits 143, whatever they did. Forwarded instead, the workers'
    Trainer saves and exits with the pre-empted code, which the agent reports. After a SIGTERM the
    agent restarts nothing, and workers still running after :data:`TERM_GRACE` seconds are killed.
    SIGINT (Ctrl-C), SIGHUP and SIGQUIT stay torchrun's. SIGUSR2 signals no worker: each worker and
    its loader workers answer through a FIFO (:func:`ddpkit._launch.worker.request_every_stack`),
    in ``rank<N>.txt`` and ``rank<N>-loader<W>.txt`` of the stack folder.
    """

    def terminate(signum: int, frame: Any) -> None:
        agent = Agent.current
        pids = agent.worker_pids() if agent is not None else []
        # no workers yet (rendezvous) or any more: nothing to save, stop now
        if agent is None or not pids:
            raise SystemExit(128 + signum)
        agent.stop_restarting()
        timer = threading.Timer(TERM_GRACE, _kill, (pids,))
        timer.daemon = True
        timer.start()
        _send(pids, signum)

    # torchrun's process context installs its handlers each time it starts workers; keep it off
    # SIGTERM (``--signals-to-handle``, and the variable it sets, for versions without the option).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = TORCHRUN_SIGNALS
    signal.signal(signal.SIGTERM, terminate)
    _answer_requests()


_requests: queue.SimpleQueue[int] = queue.SimpleQueue()
_answering: threading.Thread | None = None


def _note_request(signum: int, frame: Any) -> None:
    # Only noted: the thread below acts on it. A handler that used the agent, run by the main
    # thread wherever a loop of `kill -USR1` found it, crashed CPython 3.11 (the agent freed while
    # still in use: SIGSEGV as the launcher ended).
    _requests.put_nowait(signum)


def _answer_requests() -> None:
    """Act on SIGUSR1 and SIGUSR2 from a thread of the agent's own: SIGUSR1 sent on to the workers
    of the current attempt, SIGUSR2 a stack request to every worker."""
    global _answering
    if _answering is None:
        _answering = threading.Thread(target=_answer, name="ddpkit-signals", daemon=True)
        _answering.start()
    for sig in REQUESTS:
        signal.signal(sig, _note_request)


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
                _send(agent.worker_pids() if agent is not None else [], signum)
        except Exception:  # noqa: BLE001
            continue  # the workers of an attempt that ends as they are read: none left to reach


def _send(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def install(
    launcher_api: Any,
    fork_server: bool = True,
    preload: Sequence[str] = (),
    display: Sequence[str] = (),
    stall: watch.StallPolicy | None = None,
    run_dir: Path | None = None,
) -> None:
    """Make torchrun's ``launch_agent`` build :class:`Agent`, and forward SIGTERM/SIGUSR1/SIGUSR2 to
    its workers; with ``fork_server``, start the job's fork server (importing ``preload`` too;
    ``display``: the workers' command, shown on its command line). ``launcher_api``:
    ``torch.distributed.launcher.api``. ``stall``: the stall watch's policy; the ranks' progress
    records go to shared memory, else to ``run_dir/progress``.
    """
    use_agent(launcher_api, Agent)
    Agent.policy = stall if stall is not None else watch.StallPolicy(floor=0)
    watch.open_folder((run_dir or Path.cwd()) / "progress")
    _forward_signals()
    if fork_server:
        forked.install(preload, display)
    # Made by the agent, which outlives every attempt of the workers: a restarted worker finds its
    # state there.
    if os.environ.get(memory_folder.OFF_ENV) != "0":
        memory_folder.open_job_folder()


def ignore_requests() -> None:
    """Ignore SIGUSR1 and SIGUSR2 until :func:`install` handles them: a warning or a stack request
    that comes before any worker has nothing to reach, and must not end the launcher."""
    for sig in REQUESTS:
        signal.signal(sig, signal.SIG_IGN)


def uninstall() -> None:
    """Undo :func:`install` once the workers have ended. SIGTERM, SIGUSR1 and SIGUSR2 are ignored
    from here on, not given their default action back: one that comes as the job ends has nothing
    left to reach, and would end the launcher with 143, 138 or 140 after its workers succeeded.
    Ignored rather than handled: the interpreter gives a signal with a Python handler its default
    action back while it exits."""
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    forked.uninstall()
    Agent.current = None
    memory_folder.close_job_folder()
    watch.close_folder()
