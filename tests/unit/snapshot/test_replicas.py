"""Copies of each rank's state on other nodes, in one process: where they go (any K-1 nodes lost
leave a whole copy of every rank's state), where every rank resumes from and who sends it, and the
files that hold them (a copy counts only once it arrived whole and checked)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _replicas as rl
from ddpkit.snapshot import _slots as sl
from ddpkit.snapshot._choice import Choice, choose, choose_resharded, choose_resized
from ddpkit.snapshot._interval import interval_of
from ddpkit.snapshot._resized import Piece, checked_boxes, plan
from ddpkit.strategies._base import PER_RANK
from ddpkit.training._config import SnapshotConfig
from tests.tmpfs import small_tmpfs

# -- where the copies go ---------------------------------------------------------------------------


def _survives(partners: list[tuple[int, ...]], node_of: list[int], lost: set[int]) -> bool:
    """Every rank's state is whole somewhere once the nodes ``lost`` are gone."""
    return all(
        node_of[r] not in lost or any(node_of[h] not in lost for h in held)
        for r, held in enumerate(partners)
    )


@pytest.mark.parametrize(
    "nodes, per_node, k", [(2, 1, 2), (2, 4, 2), (3, 1, 2), (3, 2, 3), (4, 2, 2), (5, 3, 3)]
)
def test_losing_any_k_minus_1_nodes_leaves_a_whole_copy_of_every_ranks_state(nodes, per_node, k):
    node_of = [n for n in range(nodes) for _ in range(per_node)]  # torchrun's contiguous ranks
    placement, note = rl.place(node_of, k)
    assert placement is not None and note == "" and placement.copies == k
    for rank, held in enumerate(placement.partners):
        assert len(held) == k - 1 and len({node_of[h] for h in held} | {node_of[rank]}) == k
        assert [r for r in held] == [rank + j * per_node - (rank + j * per_node >= len(node_of)) *
                                     len(node_of) for j in range(1, k)]  # fmt: skip
    for lost in itertools.combinations(range(nodes), k - 1):
        assert _survives(list(placement.partners), node_of, set(lost)), lost
    # every rank holds as many copies as it sends: the memory and the traffic are even
    assert all(len(placement.sources(r)) == k - 1 for r in range(len(node_of)))
    # Control: the next rank's memory (a neighbour on the same node) is no copy across nodes.
    naive = [((r + 1) % len(node_of),) for r in range(len(node_of))]
    if per_node > 1:
        assert not _survives(naive, node_of, {0})


def test_nodes_whose_ranks_are_not_numbered_by_node_are_placed_by_their_key():
    # ranks 0 and 2 on node "a", 1 and 3 on node "b"
    placement, _ = rl.place(["a", "b", "a", "b"], 2)
    assert placement is not None and placement.partners == ((1,), (0,), (3,), (2,))


def test_where_no_copy_can_leave_a_node_it_is_said_or_silent_where_none_was_asked():
    assert rl.place([0, 0], None) == (None, "")  # one node, the default: nothing to say
    assert rl.place([0, 1], 1) == (None, "")  # off
    placement, note = rl.place([0, 0], 2)
    assert placement is None and "runs on one node" in note
    placement, note = rl.place([0, 0, 1], 2)
    assert placement is None and "give every node the same --nproc" in note and "2, 1 ranks" in note
    placement, note = rl.place([0, 1], 3)  # fewer nodes than copies: one a node
    assert placement is not None and placement.copies == 2 and "replicas=3 on 2 nodes" in note
    default, _ = rl.place([0, 1, 2], None)
    assert default is not None and default.copies == 2


def test_the_copies_setting_is_checked_where_it_is_given():
    assert SnapshotConfig(memory=True, replicas=3).replicas == 3
    with pytest.raises(Exception, match="replicas=0 is not valid"):
        SnapshotConfig(memory=True, replicas=0)


# -- where every rank resumes ----------------------------------------------------------------------


def _offer(own=(), **held):
    return {
        "own": [list(p) for p in own],
        "replicas": {k.removeprefix("r"): [list(p) for p in v] for k, v in held.items()},
    }


A, B, C = (1, 10, 0), (1, 11, 8), (1, 12, 16)


def test_a_rank_of_a_lost_node_takes_its_state_from_the_rank_that_holds_its_copy():
    # 4 ranks on 2 nodes (0,1 | 2,3), copies on rank r+2: node b (ranks 2, 3) is new, it holds
    # nothing; ranks 0 and 1 hold the copies of ranks 2 and 3 at steps 10 and 11.
    offers = [_offer([A, B], r2=[A, B]), _offer([A, B], r3=[A, B]), _offer(), _offer()]
    assert choose(offers) == Choice(B, ((2, 0), (3, 1)))
    # Control: without the copies, no position holds every rank's state: the disk.
    assert choose([_offer([A, B]), _offer([A, B]), _offer(), _offer()]) is None


def test_the_newest_position_every_shard_has_a_whole_copy_of_is_taken():
    # node b lost during the transfer of step 12: rank 0 holds its own 11 and 12, and rank 1's
    # copy of 11 only (that of 12 was not whole)
    offers = [_offer([B, C], r1=[A, B]), _offer()]
    assert choose(offers) == Choice(B, ((1, 0),))
    # where every rank holds its own, no copy is sent, however new the copies
    assert choose([_offer([B, C], r1=[B, C]), _offer([B, C], r0=[B, C])]) == Choice(C)
    # a disk snapshot as new wins
    assert choose(offers, disk_step=11) is None


def test_under_ddp_a_copy_of_an_own_part_is_read_over_its_holders_own_slot():
    # rank 2's node is lost; rank 0 holds rank 2's own part at 11 and 12, but its own slot at 11
    # only (killed in its copy of 12; rank 1 holds rank 0's copy of 12)
    offers = [_offer([B], r2=[B, C]), _offer([B, C], r0=[B, C]), _offer()]
    assert choose(offers, over_own=True) == Choice(B, ((2, 0),))
    # Control: a whole copy (zero, fsdp) needs no slot of its holder's: 12, rank 0's from rank 1.
    assert choose(offers) == Choice(C, ((0, 1), (2, 0)))


def test_every_rank_agrees_on_one_holder_per_needy_rank_whatever_the_order_of_the_offers():
    # three copies: ranks 1 and 2 both hold rank 0's state; the first of them serves it
    offers = [_offer(), _offer([A], r0=[A]), _offer([A], r0=[A])]
    assert choose(offers) == Choice(A, ((0, 1),))
    assert choose([dict(o) for o in offers]) == choose(offers)


def _sized(own=(), size=3, slots=None, parts=None, copies=None):
    """A rank's offer at a new world size: its own slots of it, and the slots, own parts and whole
    copies of the old world of ``size`` ranks its node holds (``{old rank: positions}``)."""
    held = {"slots": slots or {}, "parts": parts or {}, "copies": copies or {}}
    found = slots or parts or copies
    return {"own": [list(p) for p in own], "sizes": {str(size): held} if found else {}}


def test_at_a_smaller_world_size_every_old_ranks_own_part_and_a_slot_on_each_node_are_needed():
    # 3 ranks of one node each, copies on the next node; node 1 lost, the job on nodes 0 and 2:
    # rank 0 (node 0) holds old rank 0's slots, rank 1 (node 2) old rank 2's and rank 1's own part
    # of step 11 only (the transfer of 12 cut)
    offers = [_sized(slots={0: [B, C]}), _sized(slots={2: [B, C]}, parts={1: [A, B]})]
    assert choose_resized(offers, 2) == Choice(B, world_size=3, givers=(0, 1, 1))
    # Control: without old rank 1's own part (copies off), no position: the disk.
    assert choose_resized([_sized(slots={0: [B, C]}), _sized(slots={2: [B, C]})], 2) is None
    # Control: a rank of this world whose node holds no slot would read the model from another
    # node's memory: the disk (node 2 held rank 1's own part only).
    assert choose_resized([_sized(slots={0: [B, C]}), _sized(parts={1: [B], 2: [B]})], 2) is None


def test_copies_of_another_world_size_older_than_a_slot_of_this_one_are_passed_over():
    # the job went on at 2 ranks and copied step 12 (rank 0 only: the other is lost again): the
    # 3-rank copies of step 11 are of an abandoned course
    offers = [_sized([C], slots={0: [B]}), _sized(slots={2: [B]}, parts={1: [B]})]
    assert choose_resized(offers, 2) is None
    # Control: the same copies with no slot of this world newer than them
    offers = [_sized([A], slots={0: [B]}), _sized(slots={2: [B]}, parts={1: [B]})]
    assert choose_resized(offers, 2) == Choice(B, world_size=3, givers=(0, 1, 1))
    # the copies of this world's own size are choose()'s; a larger world's new ranks hold none
    assert choose_resized([_sized(size=2, slots={0: [B], 1: [B]})] * 2, 2) is None
    assert choose_resized([_sized(size=2, slots={0: [B], 1: [B]})] * 3, 3) is None


def test_each_old_ranks_own_part_is_read_from_a_copy_first_and_spread_over_a_nodes_ranks():
    # 2 nodes of 2 ranks to 1 node: its ranks 0 and 1 both see old ranks 0 and 1's slots and the
    # copies of old ranks 2 and 3's own parts
    offer = _sized(size=4, slots={0: [B], 1: [B]}, parts={2: [B], 3: [B]})
    assert choose_resized([offer, offer], 2) == Choice(B, world_size=4, givers=(0, 1, 0, 1))
    # a copy of old rank 1's own part on the node too: read instead of its slot
    offer = _sized(size=4, slots={0: [B], 1: [B]}, parts={1: [B], 2: [B], 3: [B]})
    assert choose_resized([offer, _sized(size=4, slots={0: [B]})], 2).givers == (0, 0, 0, 0)


def test_sharded_every_old_ranks_state_is_read_from_a_slot_or_a_whole_copy_on_a_node_left():
    # fsdp, 3 nodes of one rank, copies on the next node; node 1 lost: rank 0 (node 0) holds old
    # rank 0's slots and old rank 2's copy, rank 1 (node 2) old rank 2's slots and old rank 1's
    # copy of step 11 only (the transfer of 12 cut)
    offers = [_sized(slots={0: [B, C]}, copies={2: [B, C]}), _sized(slots={2: [B, C]},
              copies={1: [A, B]})]  # fmt: skip
    # a slot's holder reads it before a copy's: old rank 2 from its slot on node 2
    assert choose_resharded(offers, 2) == Choice(B, world_size=3, givers=(0, 1, 1))
    # no slot of this world is needed on each node: every piece is sent; a larger world too
    assert choose_resharded(offers + [_sized()], 4) == Choice(B, world_size=3, givers=(0, 1, 1))
    # Controls: old rank 1's copies lost with node 1 (replicas=1): the disk; a slot of this world
    # newer than the copies (an abandoned course): the disk; this world's own size: choose()'s
    assert choose_resharded([_sized(slots={0: [B, C]}), _sized(slots={2: [B, C]})], 2) is None
    newer = [_sized([C], slots={0: [B]}, copies={1: [B]}), _sized(slots={2: [B]})]
    assert choose_resharded(newer, 2) is None
    assert choose_resharded([_sized(size=2, slots={0: [B], 1: [B]})] * 2, 2) is None


def _rows(offset: int, rows: int, total: int = 10) -> tuple:
    return (offset, 0), (rows, 3), (total, 3)


def test_each_new_shard_is_put_together_from_the_old_shards_that_overlap_it():
    w = ("model", "w")
    # fsdp's rows of 10 over 3 ranks (4, 4, 2) to 2 (5, 5); a replicated scalar held by all
    old = {r: {w: (_rows(4 * r, [4, 4, 2][r]), "torch.float32"),
               ("optim", "step"): (((), (), ()), "torch.float32")} for r in range(3)}  # fmt: skip
    new = [{w: (_rows(5 * n, 5), "torch.float32"), ("optim", "step"): (((), (), ()),
            "torch.float32")} for n in range(2)]  # fmt: skip
    givers = (0, 1, 1)
    pieces, missing = plan(old, new, givers)
    assert missing == []
    assert [p for p in pieces if p.path == w] == [
        Piece(0, w, 0, (0, 0), (4, 3)), Piece(0, w, 1, (4, 0), (1, 3)),
        Piece(1, w, 1, (5, 0), (3, 3)), Piece(1, w, 2, (8, 0), (2, 3)),
    ]  # fmt: skip
    # a replicated tensor from an old rank its taker reads itself: nothing sent for it
    steps = [p for p in pieces if p.path == ("optim", "step")]
    assert [(p.needy, p.old) for p in steps] == [(0, 0), (1, 1)]
    # each rank's own plan: the pieces it takes or gives, in the same order as the whole plan's
    for rank in range(2):
        mine, _ = plan(old, new, givers, rank)
        assert mine == [p for p in pieces if rank in (p.needy, givers[p.old])]
    # a replicated tensor a new rank reads from none of its own: spread over the old ranks
    third = {("optim", "step"): (((), (), ()), "torch.float32")}
    more, _ = plan(old, [*new, third], givers)
    assert (more[-1].needy, more[-1].old) == (2, 2)  # rank 2 of a third new rank: old rank 2
    # Control: old rank 1's shard gone: rows 4-7 named, for both new ranks
    del old[1]
    _, missing = plan(old, new, givers)
    assert missing == ["model.w of rank 0", "model.w of rank 1"]


def test_a_ranks_own_tensors_come_from_old_rank_0_and_another_dtype_is_no_piece():
    own = (PER_RANK, "model", "bn.running_mean")
    old = {r: {own: (((0,), (4,), (4,)), "torch.float32")} for r in range(3)}
    pieces, missing = plan(old, [{own: (((0,), (4,), (4,)), "torch.float32")}] * 2, (0, 1, 1))
    assert missing == [] and [(p.needy, p.old) for p in pieces] == [(0, 0), (1, 0)]
    # Control: the same tensor in another dtype is none of it
    _, missing = plan(old, [{own: (((0,), (4,), (4,)), "torch.float64")}], (0, 1, 1))
    assert missing == [f"{PER_RANK}.model.bn.running_mean of rank 0"]


def test_a_copys_places_of_its_tensors_are_checked_against_them():
    assert checked_boxes([[[4, 0], [4, 3], [10, 3]]], [(4, 3)]) == [((4, 0), (4, 3), (10, 3))]
    # Controls: past the global tensor; sizes that are not the tensor's; one place for two
    with pytest.raises(ValueError, match="overruns"):
        checked_boxes([[[8, 0], [4, 3], [10, 3]]], [(4, 3)])
    with pytest.raises(ValueError, match="says it is"):
        checked_boxes([[[0, 0], [4, 3], [10, 3]]], [(5, 3)])
    with pytest.raises(ValueError, match="no place"):
        checked_boxes([[[0, 0], [4, 3], [10, 3]]], [(4, 3), (4, 3)])
    with pytest.raises(ValueError, match="whole numbers"):
        checked_boxes([[[0, 0.5], [4, 3], [10, 3]]], [(4, 3)])
    with pytest.raises(ValueError, match="whole numbers"):
        checked_boxes([[[0, 0], [4, 3], "10"]], [(4, 3)])


def test_old_places_that_overlap_are_refused_where_they_would_hide_a_gap():
    w = ("model", "w")
    # old rank 1 says it holds rows 2-5 of 8 where it holds 4-7: rows 6-7 would stay unwritten
    old = {0: {w: (((0,), (4,), (8,)), "torch.float32")},
           1: {w: (((2,), (4,), (8,)), "torch.float32")}}  # fmt: skip
    wanted = [{w: (((0,), (8,), (8,)), "torch.float32")}]
    assert plan(old, wanted, (0, 0))[1] == ["model.w of rank 0"]
    # Control: the places it holds
    old[1] = {w: (((4,), (4,), (8,)), "torch.float32")}
    assert plan(old, wanted, (0, 0))[1] == []


def _timings(hidden: float, n: int = 16) -> tuple[list[float], list[bool], list[float]]:
    """The first ``n`` saves, every other one sent (the first too): a save of 0.1 ms and a step of
    9.9 ms, and ``hidden`` seconds more in the cycles with a transfer beside the step."""
    sent = [i % 2 == 0 for i in range(n)]
    starts = [0.0]
    for was in sent[:-1]:
        starts.append(starts[-1] + 0.010 + (hidden if was else 0.0))
    return starts, sent, [1e-4] * n


def test_the_interval_counts_a_transfers_whole_cost_where_saves_are_paired():
    # 1 ms a transfer costs the step, none of it in its wait, 0.1 ms in its thread's CPU
    starts, sent, stalls = _timings(0.001)
    figures = interval_of(starts, sent, stalls, [0.0] * 16, [1e-4] * 8, copies=True, paired=True)
    wanted, _, step, cpu, cost = figures
    assert step == pytest.approx(0.0099) and cost == pytest.approx(0.001) and cpu == 1e-4
    assert wanted == 6  # 1 ms within 2% of 9.9 ms: one copy in 5.05 steps
    # Control: unpaired, only the wait and the thread's CPU are seen: every step.
    wanted, *_, cost = interval_of(starts, sent, stalls, [0.0] * 16, [1e-4] * 8, copies=True,
                                   paired=False)  # fmt: skip
    assert cost == pytest.approx(1e-4) and wanted == 1
    # a wait counted in the stall is a cost too, paired or not; no copy to other nodes, no cost
    waits = [0.002 if was else 0.0 for was in sent]
    assert interval_of(starts, sent, stalls, waits, [0.0], copies=True, paired=False)[4] == 0.002
    assert interval_of(starts, sent, stalls, waits, [0.0], copies=False, paired=False)[4] == 0.0


# -- the files that hold the copies ----------------------------------------------------------------


def _slot(rank: int, step: int, tensors: list[torch.Tensor], job: str = "run-id:node-b") -> bytes:
    """A slot of ``rank`` at ``step``, as it leaves a rank (:func:`sl.pack`)."""
    values = {"job": job, "run": "run-a", "rank": rank, "world_size": 2, "step": step,
              "position": [0, step, step]}  # fmt: skip
    return sl.pack(values, tensors)


def _files(folder, sources=(1,)) -> rl.ReplicaFiles:
    return rl.ReplicaFiles(folder, job="run-id:node-a", run="run-a", world_size=2, sources=sources)


def _arrive(files: rl.ReplicaFiles, source: int, data: bytes, cut: int | None = None) -> str | None:
    """``data`` arriving as the transfer delivers it: header apart, the rest into the file; ``cut``:
    the sender lost after that many bytes of the rest (nothing committed)."""
    arrival = files.arriving(source, len(data))
    arrival.head.copy_(torch.frombuffer(bytearray(data[: sl.HEADER]), dtype=torch.uint8))
    rest = torch.frombuffer(bytearray(data), dtype=torch.uint8)[sl.HEADER :]
    end = len(data) if cut is None else sl.HEADER + cut
    arrival.body[sl.HEADER : end].copy_(rest[: end - sl.HEADER])
    return None if cut is not None else files.commit(arrival)


def test_a_copy_counts_once_it_arrived_whole_and_the_older_one_is_overwritten(tmp_path):
    files = _files(tmp_path)
    for step in (1, 2, 3):
        assert _arrive(files, 1, _slot(1, step, [torch.full((5000,), float(step))])) is None
    assert sorted(p[1] for p in files.found()[1]) == [2, 3]
    got = sl.parse_slot(files.bytes_at(1, (0, 3, 3)))
    assert got is not None and torch.equal(
        sl.tensors_of(got[3], got[0], got[1])[0], torch.full((5000,), 3.0)
    )
    # a transfer cut half-way (the sender's node lost): the older whole copy went first, the
    # newer stays
    _arrive(files, 1, _slot(1, 4, [torch.full((5000,), 4.0)]), cut=9000)
    assert sorted(p[1] for p in files.found()[1]) == [3]
    # a new process of the same rank finds what is whole
    assert sorted(p[1] for p in _files(tmp_path).found()[1]) == [3]


def test_a_copy_damaged_on_the_way_is_named_and_not_kept(tmp_path):
    files = _files(tmp_path)
    assert _arrive(files, 1, _slot(1, 1, [torch.zeros(5000)])) is None
    data = bytearray(_slot(1, 2, [torch.zeros(5000)]))
    record = sl.Record.unpack(bytes(data[: sl.HEADER]))
    assert record is not None
    data[record.data[0] + 17] ^= 0x04  # one bit of a tensor, after the sender's checksums
    why = _arrive(files, 1, bytes(data))
    assert why is not None and "fail their checksum" in why and "rank 1's state" in why
    assert [p[1] for p in files.found()[1]] == [1]
    # Control: the damaged bytes did land in the file: only the check keeps them out.
    on_disk = (tmp_path / "run-a-replica1-1.slot").read_bytes()
    assert on_disk[record.data[0] + 17] == data[record.data[0] + 17]


def test_a_copy_of_another_run_world_or_rank_is_not_kept(tmp_path):
    files = _files(tmp_path)
    assert "not rank 1's of this run" in _arrive(files, 1, _slot(0, 1, [torch.zeros(3)]))
    assert "not rank 1's of this run" in _arrive(
        files, 1, _slot(1, 1, [torch.zeros(3)], job="another-run:node-b")
    )
    assert files.found() == {}
    # the same run from another node's folder is this job's
    assert _arrive(files, 1, _slot(1, 1, [torch.zeros(3)], job="run-id:node-c")) is None


def test_only_the_copies_of_the_position_resumed_from_stay(tmp_path):
    files = _files(tmp_path, sources=(0, 1))
    for step in (1, 2):
        for source in (0, 1):
            _arrive(files, source, _slot(source, step, [torch.zeros(3)]))
    files.found()
    files.discard_except((0, 1, 1))
    assert files.found() == {0: [(0, 1, 1)], 1: [(0, 1, 1)]}
    files.discard_except(None)
    assert files.found() == {}


def test_memory_full_while_a_copy_arrives_drops_it_and_says_why(tmp_path):
    from tests.tmpfs import small_tmpfs

    with small_tmpfs(tmp_path / "tiny", "64k"):
        files = _files(tmp_path / "tiny")
        big = _slot(1, 1, [torch.zeros(200_000)])
        arrival = files.arriving(1, len(big))
        assert arrival.copy is None and arrival.body.numel() == len(big)
        assert files.full is not None and "no room" in files.full
        assert files.commit(arrival) is None and files.found() == {}


def test_a_packed_slot_reads_back_with_its_values_and_tensors():
    tensors = [torch.arange(10, dtype=torch.int64), torch.randn(3, 4), torch.zeros(0)]
    data = sl.pack({"rank": 3, "step": 5, "position": [0, 5, 40]}, tensors)
    got = sl.parse_slot(data, "packed")
    assert got is not None and got[2]["rank"] == 3
    back = sl.tensors_of(got[3], got[0], got[1])
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    # an own part travels as one blob
    blob = codec.encode_blob({"own": {"rng": torch.arange(4)}, "strategy_own": {}})
    again = sl.parse_slot(sl.pack({}, [torch.frombuffer(bytearray(blob), dtype=torch.uint8)]))
    assert again is not None
    part = codec.decode_blob(sl.tensors_of(again[3], again[0], again[1])[0].numpy().tobytes())
    assert torch.equal(part["own"]["rng"], torch.arange(4))


def test_a_copy_not_sent_never_overwrites_the_slot_of_the_last_one_sent(tmp_path):
    # while the interval is chosen, every other copy stays on its node: copies of steps 1 (sent),
    # 2 (not), 3 (sent, its transfer in flight): this node still holds step 1, as the other nodes do
    st = sl.Slots(tmp_path, job="id:a", run="run-a", rank=0, world_size=2)
    tensors = [torch.arange(10.0)]
    specs, size = codec.layout(tensors)
    manifest = {"specs": [[s.dtype, list(s.shape), s.offset] for s in specs], "data_size": size}
    for step, sent in ((1, True), (2, False), (3, True)):
        st.save({"step": step, "position": [0, step, step]}, tensors, manifest, "l", keep=sent)
    assert sorted(f.step for f in st.found()) == [1, 3]
    # Control: every copy kept alike (sent, or not chosen), the older slot goes: steps 2 and 3.
    (tmp_path / "all").mkdir()
    st = sl.Slots(tmp_path / "all", job="id:a", run="run-a", rank=0, world_size=2)
    for step in (1, 2, 3):
        st.save({"step": step, "position": [0, step, step]}, tensors, manifest, "l")
    assert sorted(f.step for f in st.found()) == [2, 3]


def test_a_commit_left_to_another_thread_makes_the_slot_whole_only_then(tmp_path):
    # what a save from a GPU does: the copies queued, the commit run by the courier's thread
    import threading

    st = sl.Slots(tmp_path, job="id:a", run="run-a", rank=0, world_size=2)
    tensors = [torch.full((3000,), 7.0), torch.arange(5)]
    specs, size = codec.layout(tensors)
    manifest = {"specs": [[s.dtype, list(s.shape), s.offset] for s in specs], "data_size": size}
    slot, commit = st._begin({"step": 1, "position": [0, 1, 1]}, manifest, "layout")
    sl.copy_tensors(slot.dests, tensors)
    assert st.found() == [] and st.committed() is None  # copied, not whole
    thread = threading.Thread(target=commit)
    thread.start()
    thread.join()
    (found,) = st.found()
    got = sl.read_slot(found.path, data=True)
    assert got is not None and found.step == 1
    assert all(torch.equal(a, b) for a, b in zip(sl.tensors_of(got[3], got[0], got[1]), tensors))
    committed = st.committed()
    assert (
        committed is not None
        and bytes(committed.numpy()) == found.path.read_bytes()[: committed.numel()]
    )


def test_a_layout_checked_once_per_source_is_not_laid_out_again_but_its_bytes_are_checked(
    tmp_path, monkeypatch
):
    calls = []
    checked = sl.checked_specs
    monkeypatch.setattr(sl, "checked_specs", lambda *a: calls.append(1) or checked(*a))
    files = _files(tmp_path)
    for step in (1, 2):
        assert _arrive(files, 1, _slot(1, step, [torch.zeros(5000), torch.ones(7)])) is None
    assert len(calls) == 1  # the second copy's manifest is the first's, byte for byte
    data = bytearray(_slot(1, 3, [torch.zeros(5000), torch.ones(7)]))
    record = sl.Record.unpack(bytes(data[: sl.HEADER]))
    assert record is not None
    data[record.data[0] + 5] ^= 1
    assert "fail their checksum" in (_arrive(files, 1, bytes(data)) or "")
    # another layout is laid out again
    assert _arrive(files, 1, _slot(1, 4, [torch.zeros(9)])) is None and len(calls) == 2


def _arriving_where_full(folder, make_room) -> tuple[rl.Arrival, rl.ReplicaFiles]:
    """Rank 1's copy of 512 KiB arriving in a memory of 1 MiB that a file of 900 KiB fills."""
    files = rl.ReplicaFiles(folder, job="id:j", run="run", world_size=2, sources=[1])
    (folder / "filler").write_bytes(bytes(900 << 10))
    files.make_room = make_room
    return files.arriving(1, 512 << 10), files


def test_a_copy_that_finds_memory_full_is_tried_once_more_where_room_was_made(tmp_path):
    """Memory full for an arriving copy: where ``make_room`` made room, the copy lands in its
    file; where it made none, the copy goes to a buffer of the heap, the files say why, and the
    copy is tried once more at most."""
    asked: list[int] = []

    def made(needed: int) -> bool:
        asked.append(needed)
        (folder / "filler").unlink()
        return True

    with small_tmpfs(tmp_path / "made", "1m") as folder:
        arrival, files = _arriving_where_full(folder, made)
        assert arrival.copy is not None and files.full is None and asked == [512 << 10]
    with small_tmpfs(tmp_path / "none", "1m") as folder:
        arrival, files = _arriving_where_full(folder, lambda needed: False)
        assert arrival.copy is None and files.full is not None and "no room" in files.full
    tries: list[int] = []
    with small_tmpfs(tmp_path / "still", "1m") as folder:
        # room said to be made, memory still full: one more try, then the heap
        arrival, files = _arriving_where_full(folder, lambda needed: tries.append(needed) or True)
        assert arrival.copy is None and files.full is not None and len(tries) == 1
