"""Copies of each rank's state in the memory of ranks on other nodes, with real processes and gloo:
the transfer beside training (whole or absent, a rank that stops stops every rank without a hang),
and the Trainer under ``ddp``, ``zero`` and ``fsdp`` resuming a lost node's ranks from the copies on
the other node, bitwise (each rank its own node here: its own job folder, local rank 0). The same
across network-namespace nodes under ``ddpkit run --recover in-place``: :mod:`tests.jobs.snapshot.
test_replicas_nodes`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.distributed._channels import JOB_DIR_ENV, MEMORY
from ddpkit.snapshot import _replicas as rl
from ddpkit.snapshot import _slots as sl
from ddpkit.testing import run_on_ranks
from tests.tmpfs import small_tmpfs
from tests.trainer_checks import rank_differences

# -- the transfer ----------------------------------------------------------------------------------


def _slot(rank: int, step: int) -> torch.Tensor:
    values = {"job": "id:node", "run": "run", "rank": rank, "world_size": 3, "step": step,
              "position": [0, step, step]}  # fmt: skip
    data = sl.pack(values, [torch.full((70_000,), 10.0 * rank + step)])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _courier_job(root: str, rounds: list[list[bool]], timeout: float) -> list[dict]:
    """Rank r (its own node, its folder ``root/r``) submits a round per entry of ``rounds`` (its
    copy of that step, or None where ``rounds[i][r]`` is False), settling each before the next;
    what each round said, and the copies it then holds."""
    from datetime import timedelta

    import torch.distributed as dist

    rt = ddpkit.init()
    placement, _ = rl.place(list(range(rt.world_size)), 2)
    assert placement is not None
    folder = Path(root, str(rt.rank))
    folder.mkdir()
    files = rl.ReplicaFiles(folder, job="id:mine", run="run", world_size=rt.world_size,
                            sources=placement.sources(rt.rank))  # fmt: skip
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    courier = rl.Courier(placement, rt.rank, rt.world_size, group, files)
    seen = []
    for step, sends in enumerate(rounds, 1):
        courier.submit(step, _slot(rt.rank, step) if sends[rt.rank] else None)
        result = courier.settle()
        assert result is not None
        error = f"{type(result.error).__name__}" if result.error else None
        held = {p: sorted(s[1] for s in ps) for p, ps in files.found().items()}
        seen.append(
            {"stopped": result.stopped, "damaged": result.damaged, "error": error, "held": held}
        )
        if result.stopped or result.error:
            break
    for p in placement.sources(rt.rank):
        for position in files.found().get(p, []):
            got = sl.parse_slot(files.bytes_at(p, position))
            assert got is not None
            tensor = sl.tensors_of(got[3], got[0], got[1])[0]
            assert torch.equal(tensor, torch.full((70_000,), 10.0 * p + position[1]))
    courier.close()
    return seen


def test_each_ranks_copy_reaches_the_next_node_whole_and_a_rank_that_stops_stops_every_rank(
    tmp_path,
):
    # three nodes of one rank: rank r's copies go to rank r+1; four rounds, rank 1 stops at the 4th
    rounds = [[True] * 3] * 3 + [[True, False, True]] + [[True] * 3]
    seen = run_on_ranks(_courier_job, 3, (str(tmp_path), rounds, 60.0))
    for rank, mine in enumerate(seen):
        source = (rank - 1) % 3
        assert [s["held"] for s in mine[:3]] == [
            {source: [1]}, {source: [1, 2]}, {source: [2, 3]}
        ], mine  # fmt: skip
        assert all(s["stopped"] == [] and not s["damaged"] and not s["error"] for s in mine[:3])
        # the 4th round: every rank hears that rank 1 stopped, and none sends (step 3 stays)
        assert mine[3]["stopped"] == [1] and mine[3]["held"] == {source: [2, 3]}
        assert len(mine) == 4  # nobody waits for a 5th round


@pytest.mark.timeout(300)
def test_a_rank_that_stops_without_saying_so_leaves_the_others_waiting_until_the_timeout(tmp_path):
    # Control of the word in each round: rank 1 submits no round at all after the first.
    def job(root: str) -> list:
        if int(os.environ["RANK"]) == 1:
            rounds = [[True] * 2]
        else:
            rounds = [[True] * 2] * 2
        return _courier_job(root, rounds, 5.0)

    start = time.monotonic()
    seen = run_on_ranks(job, 2, (str(tmp_path),))
    assert seen[0][1]["error"] is not None and seen[1][0]["error"] is None
    assert time.monotonic() - start >= 5


# -- the Trainer: a lost node's ranks resume from the copies on the other node ---------------------

STEPS, KILL = 14, 8
SLOW = pytest.mark.slow


def _trainer_job(
    roots: list[str],
    run_dir: str,
    strategy: str,
    replicas: int,
    stop: bool,
    steps: int = STEPS,
    every: int | None = 1,
    options: dict | None = None,
) -> dict:
    """The resume tests' job (tests/jobs/scripts/train_job.py) with a copy in memory every step,
    rank r on a node of its own (:func:`_as_nodes`: its job folder ``roots[r]``); ``stop``: rank 1
    raises in the step after step ``KILL`` (whose state is whole on both ranks, its copies maybe in
    flight)."""
    import tests.jobs.scripts.train_job as train_job
    from ddpkit.training._config import SnapshotConfig

    train_job.SnapshotConfig = functools.partial(SnapshotConfig, replicas=replicas)  # type: ignore[misc]
    held: list = []
    final = train_job.train(
        run_dir, max_steps=steps, snapshot_every_steps=None, snapshot_every_epochs=0, memory=True,
        memory_every_steps=every, strategy=strategy, sync_batchnorm=False, out=f"{run_dir}.pt",
        event=("raise", 1, KILL) if stop else None, trainer_hook=held.append,
        strategy_options=options,
    )  # fmt: skip
    memory = held[0].memory
    final["copies"] = memory.replicas if memory is not None else 0
    final["copying"] = memory is not None and memory.enabled
    return final


def _roots(tmp: Path, name: str, nodes: int = 2) -> list[str]:
    roots = [tmp / name / f"node{r}" for r in range(nodes)]
    for root in roots:
        (root / MEMORY).mkdir(parents=True)
    return [str(r) for r in roots]


def _lose_node(root: str) -> None:
    """Node b is gone with its memory: its new node starts with an empty job folder."""
    shutil.rmtree(root)
    (Path(root) / MEMORY).mkdir(parents=True)


def _records(run_dir: Path, event: str) -> list[dict]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r.get("event") == event]


def _resumes(run_dir: Path) -> list[dict]:
    return _records(run_dir, "resume")


def _same(final: dict, reference: dict, strategy: str) -> bool:
    part = "full" if strategy != "ddp" else None
    a, b = (final[part], reference[part]) if part else (final, reference)
    return (
        all(
            torch.equal(a[k][n], b[k][n]) if torch.is_tensor(a[k][n]) else a[k][n] == b[k][n]
            for k in ("model",) + (("optim",) if part else ())
            for n in a[k]
        )
        and a["model"].keys() == b["model"].keys()
    )


def _as_nodes(roots: list[str]):
    """Each rank a node of its own, its job folder ``roots[rank]`` (``run_on_ranks``'s ``env``)."""
    return lambda rank: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", JOB_DIR_ENV: roots[rank]}


def _train(tmp: Path, name: str, roots: list[str], strategy: str, replicas: int, stop: bool):
    job = functools.partial(_trainer_job, roots, str(tmp / name), strategy, replicas, stop)
    if stop:
        with pytest.raises(Exception, match="planned failure"):
            run_on_ranks(job, 2, env=_as_nodes(roots))
        return None
    return run_on_ranks(job, 2, env=_as_nodes(roots))[0]


def _budget_job(roots: list[str], run_dir: str, replicas: int) -> dict:
    """The Trainer's job with the interval chosen, the copy's own stall never spacing copies out
    and the transfers' budget a ten-thousandth of a step."""
    from ddpkit.snapshot import _interval

    _interval.STALL_BUDGET, _interval.TRANSFER_BUDGET = 1.0, 1e-4
    return _trainer_job(roots, run_dir, "ddp", replicas, False, steps=20, every=None)


@pytest.mark.timeout(300)
def test_the_chosen_interval_spaces_out_copies_whose_transfers_exceed_their_budget(tmp_path):
    chosen = {}
    for replicas in (2, 1):  # 1: the control, nothing leaves the node, nothing to space out
        name, roots = f"copies-{replicas}", _roots(tmp_path, f"copies-{replicas}")
        run_on_ranks(_budget_job, 2, (roots, str(tmp_path / name), replicas), env=_as_nodes(roots))
        (chosen[replicas],) = _records(tmp_path / name, "memory_snapshots")
    on, off = chosen[2], chosen[1]
    print(f"\nchosen with copies on the other node: {on}\nwithout: {off}")
    # the thread's CPU of a transfer, over a ten-thousandth of a step, is many steps
    assert on["replicas"] == 2 and on["transfer_cpu_ms"] > 0 and on["every_steps"] > 1
    assert off["replicas"] == 1 and off["transfer_cpu_ms"] == 0 and off["every_steps"] == 1


def _spin(seconds: float) -> None:
    """``seconds`` of this thread's CPU in Python: turns of the GIL taken from the training
    thread."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _hidden_cost_job(roots: list[str], run_dir: str) -> dict:
    """The Trainer's job with the interval chosen, each step with a transfer beside it taking 20 ms
    more of the training thread's CPU before its optimizer step waits for the transfer: a cost the
    wait and the transfer's thread's CPU do not show (as gloo's threads and the turns of a shared
    core are not)."""
    from ddpkit.snapshot import _interval, _memory

    before = _memory.MemoryStore._before_update

    def slowed(self, optimizer, args, kwargs):  # type: ignore[no-untyped-def]
        if not self._tuned and self._sent and self._sent[-1]:  # a transfer beside this step
            _spin(0.02)
        before(self, optimizer, args, kwargs)

    _memory.MemoryStore._before_update = slowed  # type: ignore[method-assign]
    _interval.STALL_BUDGET = 1.0
    return _trainer_job(roots, run_dir, "ddp", 2, False, steps=20, every=None)


@pytest.mark.timeout(300)
def test_the_chosen_interval_counts_what_a_transfer_costs_a_step_beyond_its_own_thread(tmp_path):
    roots = _roots(tmp_path, "run")
    run_on_ranks(_hidden_cost_job, 2, (roots, str(tmp_path / "run")), env=_as_nodes(roots))
    (chosen,) = _records(tmp_path / "run", "memory_snapshots")
    print(f"\na transfer costing its step 20 ms more: {chosen}")
    # the saves with a transfer beside the next step against those without count the work; the
    # transfer's thread's CPU does not see it (the control, and tests/unit/snapshot/
    # test_replicas.py's: the unpaired figures)
    assert chosen["transfer_cost_ms"] > 10 and chosen["transfer_cpu_ms"] < 10
    # and the interval is chosen on it: within 2% of a step (rank 0's step, the largest cost over
    # the ranks: a factor 2 for the difference between ranks)
    budget = chosen["every_steps"] * 0.02 * chosen["step_ms"]
    assert budget >= chosen["transfer_cost_ms"] / 2, chosen


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "strategy", ["fsdp", pytest.param("zero", marks=SLOW), pytest.param("ddp", marks=SLOW)]
)
def test_a_lost_nodes_ranks_resume_from_the_copies_on_the_other_node_bitwise(tmp_path, strategy):
    reference = _train(tmp_path, "reference", _roots(tmp_path, "reference"), strategy, 2, False)
    assert reference["copies"] == 2 and reference["step"] == STEPS
    # the transfers' cost in the records: the bytes a rank sends a copy, the time it takes
    (interval,) = _records(tmp_path / "reference", "memory_snapshots")
    assert interval["replicas"] == 2 and interval["every_steps"] == 1
    assert interval["copy_bytes"] > 0 and interval["transfer_ms"] > 0, interval
    roots = _roots(tmp_path, "lost")
    _train(tmp_path, "lost", roots, strategy, 2, True)
    _lose_node(roots[1])
    final = _train(tmp_path, "lost", roots, strategy, 2, False)
    (event,) = _resumes(tmp_path / "lost")
    print(f"\n{strategy}: rank 1's node lost after step {KILL}: {event['file']} at {event['step']}")
    # the state of step KILL was whole on both ranks; its copy's transfer may not have been
    assert event["file"] == "memory (ranks [1] from rank 0)" and event["step"] in (KILL - 1, KILL)
    assert _same(final, reference, strategy)
    differs = rank_differences(tmp_path / "lost.pt", tmp_path / "reference.pt")
    assert differs == {0: [], 1: []}, differs  # each rank's own state: streams, buffers
    # Control: without copies on other nodes, the same loss goes back to disk (none: the start).
    roots = _roots(tmp_path, "none")
    _train(tmp_path, "none", roots, strategy, 1, True)
    _lose_node(roots[1])
    control = _train(tmp_path, "none", roots, strategy, 1, False)
    assert control["copies"] == 1 and _resumes(tmp_path / "none") == []
    assert control["resumed_from"] is None and _same(control, reference, strategy)


def _on(roots: list[str], job: functools.partial, ranks: int) -> dict:
    return run_on_ranks(job, ranks, env=_as_nodes(roots))[0]


def _from_disk(
    tmp: Path, strategy: str, step: int, before: int, after: list[int], **options: dict
) -> tuple[dict, dict]:
    """The reference of a resume at another world size: a disk snapshot of ``step`` taken on
    ``before`` ranks (each a node of three), resumed on the nodes ``after``; its final state and
    its resume event."""
    disk = _roots(tmp, "disk", 3)
    job = functools.partial(_trainer_job, disk, str(tmp / "disk"), strategy, 1, False, **options)
    _on(disk, functools.partial(job, steps=step), before)
    reference = _on([disk[r] for r in after], job, len(after))
    (resumed,) = _resumes(tmp / "disk")
    return reference, resumed


def _damage_newest_copy(root: str, rank: int) -> int:
    """Flip a bit in the data of the newest copy of ``rank``'s state held on the node ``root``;
    its step."""
    copies = {}
    for path in Path(root, MEMORY).glob(f"*-replica{rank}-*.slot"):
        if (got := sl.read_slot(path)) is not None:
            copies[got[2]["step"]] = (path, got[0])
    newest = max(copies)
    path, record = copies[newest]
    raw = bytearray(path.read_bytes())
    raw[record.data[0] + 100] ^= 0x10
    path.write_bytes(raw)
    return newest


@pytest.mark.timeout(600)
@pytest.mark.parametrize("gone", [1, pytest.param(0, marks=SLOW)])
def test_a_lost_nodes_ranks_resume_from_memory_at_the_smaller_world_size_as_from_disk(
    tmp_path, gone
):
    """Three nodes of one rank under ``ddp``, node ``gone`` lost with its memory, the job resumed
    on the other two: from the copies in memory (the lost rank's own part from its copy on the next
    node), as a disk snapshot of the same step resumes at two ranks, bitwise. Buffers not
    broadcast: each rank's BatchNorm statistics are its own, and the disk gives every rank old
    rank 0's (from its copy where node 0 is the one lost)."""
    own = {"options": {"broadcast_buffers": False}}
    roots = _roots(tmp_path, "lost", 3)
    lost = functools.partial(_trainer_job, roots, str(tmp_path / "lost"), "ddp", 2, **own)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(lost, True), 3, env=_as_nodes(roots))
    _lose_node(roots[gone])
    left = [r for r in range(3) if r != gone]
    final = _on([roots[r] for r in left], functools.partial(lost, False), 2)
    (event,) = _resumes(tmp_path / "lost")
    print(f"\nnode {gone} of 3 lost after step {KILL}, resumed on 2: {event}")
    # the state of step KILL was whole on every rank; its copy's transfer may not have been
    assert event["file"] == "memory (taken on 3 ranks)" and event["step"] in (KILL - 1, KILL)
    assert event["world_size"] == 2 and final["step"] == STEPS
    # the old world's slots and copies went once the new one had its first copy (and the new
    # world's own at its end): nothing is left in the nodes' memory
    assert [p.name for r in left for p in Path(roots[r], MEMORY).glob("*.slot")] == []
    # The reference: a disk snapshot of the same step, taken on three ranks, resumed on two.
    step = event["step"]
    reference, resumed = _from_disk(tmp_path, "ddp", step, 3, left, **own)
    assert resumed["step"] == step and resumed["world_size"] == 2
    assert resumed["file"].startswith("step-")
    assert _same(final, reference, "ddp")
    differs = rank_differences(tmp_path / "lost.pt", tmp_path / "disk.pt")
    assert differs == {0: [], 1: []}, differs  # each rank's own state: streams, buffers
    # Control: without copies on other nodes, the lost rank's own part (its streams, its buffers)
    # went with its node: back to the disk (none: the start).
    roots = _roots(tmp_path, "none", 3)
    none = functools.partial(_trainer_job, roots, str(tmp_path / "none"), "ddp", 1, **own)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(none, True), 3, env=_as_nodes(roots))
    _lose_node(roots[gone])
    control = _on([roots[r] for r in left], functools.partial(none, False), 2)
    assert _resumes(tmp_path / "none") == [] and control["resumed_from"] is None


@pytest.mark.timeout(900)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("zero", marks=SLOW)])
def test_a_lost_nodes_shards_are_resharded_from_memory_at_the_smaller_world_size_as_from_disk(
    tmp_path, capfd, strategy
):
    """Three nodes of one rank under a sharded strategy, node 1 lost with its memory, the job
    resumed on the other two: each rank's new shards put together from the old ranks' slots and
    node 2's copy of rank 1's, as a disk snapshot of the same step (DCP's reshard) resumes at two
    ranks, bitwise."""
    roots = _roots(tmp_path, "lost", 3)
    lost = functools.partial(_trainer_job, roots, str(tmp_path / "lost"), strategy, 2)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(lost, True), 3, env=_as_nodes(roots))
    _lose_node(roots[1])
    final = _on([roots[0], roots[2]], functools.partial(lost, False), 2)
    (event,) = _resumes(tmp_path / "lost")
    print(f"\n{strategy}: node 1 of 3 lost after step {KILL}, resumed on 2: {event}")
    assert event["file"] == "memory (taken on 3 ranks)" and event["step"] in (KILL - 1, KILL)
    assert event["world_size"] == 2 and final["step"] == STEPS
    # The reference: a disk snapshot of the same step, taken on three ranks, resumed on two.
    step = event["step"]
    reference, resumed = _from_disk(tmp_path, strategy, step, 3, [0, 2])
    assert resumed["step"] == step and resumed["world_size"] == 2
    assert resumed["file"].startswith("step-")
    assert _same(final, reference, strategy)
    differs = rank_differences(tmp_path / "lost.pt", tmp_path / "disk.pt")
    assert differs == {0: [], 1: []}, differs  # each rank's own state: streams
    # Control: without copies on other nodes, rank 1's shards went with its node: the disk (none:
    # the start), named.
    roots = _roots(tmp_path, "none", 3)
    none = functools.partial(_trainer_job, roots, str(tmp_path / "none"), strategy, 1)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(none, True), 3, env=_as_nodes(roots))
    _lose_node(roots[1])
    capfd.readouterr()
    control = _on([roots[0], roots[2]], functools.partial(none, False), 2)
    said = capfd.readouterr()
    line = f"the copies in memory were taken on 3 ranks, this run has 2: under {strategy!r} no step"
    assert line in said.out + said.err
    assert _resumes(tmp_path / "none") == [] and control["resumed_from"] is None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
def test_a_damaged_copy_of_an_old_ranks_shards_is_named_and_the_step_before_is_resharded(
    tmp_path, capfd
):
    """Node 1 of 3 lost under ``fsdp``, and node 2's newest copy of rank 1's shards damaged (a bit
    flipped in its data): every rank passes over that step, named, and reshards the one before,
    as a disk snapshot of it resumes at two ranks, bitwise."""
    roots = _roots(tmp_path, "lost", 3)
    lost = functools.partial(_trainer_job, roots, str(tmp_path / "lost"), "fsdp", 2)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(lost, True), 3, env=_as_nodes(roots))
    _lose_node(roots[1])
    newest = _damage_newest_copy(roots[2], 1)
    capfd.readouterr()
    final = _on([roots[0], roots[2]], functools.partial(lost, False), 2)
    said = capfd.readouterr()
    assert "fail their checksum" in said.out + said.err
    (event,) = _resumes(tmp_path / "lost")
    assert event["file"] == "memory (taken on 3 ranks)" and event["step"] == newest - 1, event
    reference, _ = _from_disk(tmp_path, "fsdp", newest - 1, 3, [0, 2])
    assert _same(final, reference, "fsdp")


def _killed_in_the_exchange_job(victim: int, marker: str, job: functools.partial) -> dict:
    """``job``, with rank ``victim`` SIGKILLed in the reshard's exchange of pieces, once it has
    posted its first send or receive (``marker`` written first)."""
    import signal

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    if rank == victim:
        for name in ("isend", "irecv"):
            real = getattr(dist, name)

            def posted(*args, _real=real, **kwargs):
                work = _real(*args, **kwargs)
                Path(marker).write_text("posted")
                os.kill(os.getpid(), signal.SIGKILL)
                return work

            setattr(dist, name, posted)
    return job()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
@pytest.mark.parametrize("again", ["on-both", "node-2-lost-too"])
def test_a_rank_killed_in_the_reshards_exchange_leaves_the_old_copies_for_the_next_attempt(
    tmp_path, again
):
    """Node 1 of 3 lost under ``fsdp`` (``replicas=3``: every node holds every rank's state), and
    the rank of node 2 SIGKILLed in the middle of the exchange that reshards the copies onto two
    ranks. The old world's copies are left whole by the failed attempt: the next one (on the same
    two nodes, or on node 0 alone with node 2 lost too) reshards the same step, as a disk snapshot
    of it resumes there, bitwise."""
    roots = _roots(tmp_path, "lost", 3)
    lost = functools.partial(_trainer_job, roots, str(tmp_path / "lost"), "fsdp", 3)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(lost, True), 3, env=_as_nodes(roots))
    _lose_node(roots[1])
    marker = tmp_path / "in-exchange"
    killed = functools.partial(
        _killed_in_the_exchange_job, 1, str(marker), functools.partial(lost, False)
    )
    with pytest.raises(Exception, match="SIGKILL|signal 9|Connection"):
        run_on_ranks(killed, 2, env=_as_nodes([roots[0], roots[2]]))
    assert marker.exists(), "rank 1 was not killed in the exchange"
    assert _resumes(tmp_path / "lost") == []  # the killed attempt resumed nothing
    after = [0, 2]
    if again == "node-2-lost-too":
        _lose_node(roots[2])
        after = [0]
    final = _on([roots[r] for r in after], functools.partial(lost, False), len(after))
    (event,) = _resumes(tmp_path / "lost")
    print(f"\nkilled in the exchange, then {again}: {event}")
    assert event["file"] == "memory (taken on 3 ranks)" and event["step"] in (KILL - 1, KILL)
    assert event["world_size"] == len(after) and final["step"] == STEPS
    reference, _ = _from_disk(tmp_path, "fsdp", event["step"], 3, after)
    assert _same(final, reference, "fsdp")


@contextlib.contextmanager
def _memory_of(roots: list[str], kib: list[int]):
    """Each node ``roots[i]``'s memory folder a tmpfs of ``kib[i]`` KiB, holding what it held."""
    with contextlib.ExitStack() as stack:
        for root, size in zip(roots, kib):
            memory = Path(root) / MEMORY
            kept = Path(shutil.copytree(memory, f"{root}-kept"))
            stack.enter_context(small_tmpfs(memory, f"{size}k"))
            for f in kept.iterdir():
                shutil.copy2(f, memory / f.name)
        yield


def _used_kib(root: str) -> int:
    return sum(f.stat().st_size for f in (Path(root) / MEMORY).iterdir()) // 1024


def _no_room_made_job(job: functools.partial) -> dict:
    """``job`` with the old world's files kept whatever the room (``_make_room`` makes none)."""
    from ddpkit.snapshot._memory import MemoryStore

    MemoryStore._make_room = lambda self, needed: False  # type: ignore[method-assign]
    return job()


def _shrunk_in_little_room(tmp: Path, name: str, capfd, wrap=None) -> tuple[dict, str, dict, list]:
    """Three nodes of one rank under ``fsdp``, node 1 lost, resumed on the other two in room for
    the old world's files and 100 KiB more (``wrap``: around the resumed job); its final state,
    what it said, its resume and the room (KiB) of each node."""
    roots = _roots(tmp, name, 3)
    lost = functools.partial(_trainer_job, roots, str(tmp / name), "fsdp", 2)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(lost, True), 3, env=_as_nodes(roots))
    _lose_node(roots[1])
    left = [roots[0], roots[2]]
    kib = [_used_kib(root) + 100 for root in left]
    resumed = functools.partial(lost, False)
    capfd.readouterr()
    with _memory_of(left, kib):
        final = _on(left, functools.partial(wrap, resumed) if wrap else resumed, 2)
    said = capfd.readouterr()
    (event,) = _resumes(tmp / name)
    return final, said.out + said.err, event, kib


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
def test_the_old_worlds_copies_make_room_for_the_new_worlds_when_memory_is_full(tmp_path, capfd):
    """Node 1 of 3 lost under ``fsdp``, and each node left with room for the old world's files and
    100 KiB more: less than the world of two's copies need beside them, though enough for them
    alone. Resumed on two from the old world's copies, the first write that finds memory full
    removes them on its node, saying so, and the copies go on, to the bits of a disk snapshot of
    the same step resumed on two. Controls: with the old files kept the copies stop; a world of
    two alone keeps its copies in the same room."""
    final, said, event, kib = _shrunk_in_little_room(tmp_path, "lost", capfd)
    assert said.count("removed from this node") == 2, said
    assert "snapshots in memory stop" not in said
    assert event["file"] == "memory (taken on 3 ranks)" and event["world_size"] == 2
    assert final["copying"] and final["step"] == STEPS
    reference, _ = _from_disk(tmp_path, "fsdp", event["step"], 3, [0, 2])
    assert _same(final, reference, "fsdp")
    kept, said, _, _ = _shrunk_in_little_room(tmp_path, "kept", capfd, _no_room_made_job)
    assert not kept["copying"] and "snapshots in memory stop" in said, said
    fresh = _roots(tmp_path, "fresh", 2)
    job = functools.partial(_trainer_job, fresh, str(tmp_path / "fresh"), "fsdp", 2, False)
    with _memory_of(fresh, kib):
        alone = _on(fresh, job, 2)
    said = capfd.readouterr()
    assert alone["copying"] and "snapshots in memory stop" not in said.out + said.err


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
@pytest.mark.parametrize("strategy", ["fsdp", "zero"])
def test_a_node_that_joins_takes_its_shards_from_the_copies_in_memory(tmp_path, strategy):
    """Two nodes of one rank under a sharded strategy, the job restarted on three (a node joined,
    with an empty memory): its rank holds nothing on its node and takes every piece of its shards
    (under ``zero`` the model too, and the optimizer state of the parameters it now owns) from the
    others, as a disk snapshot of the same step resumes at three ranks, bitwise."""
    roots = _roots(tmp_path, "grown", 3)
    grown = functools.partial(_trainer_job, roots, str(tmp_path / "grown"), strategy, 2)
    with pytest.raises(Exception, match="planned failure"):
        run_on_ranks(functools.partial(grown, True), 2, env=_as_nodes(roots))
    final = _on(roots, functools.partial(grown, False), 3)
    (event,) = _resumes(tmp_path / "grown")
    print(f"\n{strategy}: 2 ranks stopped after step {KILL}, resumed on 3: {event}")
    assert event["file"] == "memory (taken on 2 ranks)" and event["step"] in (KILL - 1, KILL)
    step = event["step"]
    reference, resumed = _from_disk(tmp_path, strategy, step, 2, [0, 1, 2])
    assert resumed["step"] == step and resumed["world_size"] == 3
    assert resumed["file"].startswith("step-")
    assert _same(final, reference, strategy)
    differs = rank_differences(tmp_path / "grown.pt", tmp_path / "disk.pt", world=3)
    assert differs == {0: [], 1: [], 2: []}, differs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
def test_a_damaged_copy_is_named_and_every_rank_passes_over_it(tmp_path, capfd):
    reference = _train(tmp_path, "reference", _roots(tmp_path, "reference"), "fsdp", 2, False)
    roots = _roots(tmp_path, "damaged")
    _train(tmp_path, "damaged", roots, "fsdp", 2, True)
    _lose_node(roots[1])
    newest = _damage_newest_copy(roots[0], 1)
    final = _train(tmp_path, "damaged", roots, "fsdp", 2, False)
    (event,) = _resumes(tmp_path / "damaged")
    out = capfd.readouterr()
    assert "skipping the snapshot in memory at step" in out.out + out.err
    assert "fail their checksum" in out.out + out.err
    # the copy before it, one step older, on every rank
    assert event["step"] == newest - 1 and event["file"].startswith("memory (ranks [1]")
    assert _same(final, reference, "fsdp")


@pytest.mark.timeout(300)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
def test_a_rank_whose_memory_is_full_stops_every_ranks_copies_without_a_hang(tmp_path, capfd):
    from tests.tmpfs import small_tmpfs

    roomy = tmp_path / "roomy" / "node0"
    (roomy / MEMORY).mkdir(parents=True)
    with small_tmpfs(tmp_path / "tiny", "64k"):
        (tmp_path / "tiny" / MEMORY).mkdir()
        roots = [str(roomy), str(tmp_path / "tiny")]
        job = functools.partial(_trainer_job, roots, str(tmp_path / "run"), "fsdp", 2, False, 6)
        finals = run_on_ranks(job, 2, env=_as_nodes(roots))
    # rank 1 had no room for its slot; it said so in the next transfer, and both went on without
    # copies in memory
    assert [(f["step"], f["copying"]) for f in finals] == [(6, False), (6, False)]
    out = capfd.readouterr()
    assert "snapshots in memory stop on rank 1 (no room for" in out.err
    assert "snapshots in memory stop on every rank: rank(s) [1]" in out.err
