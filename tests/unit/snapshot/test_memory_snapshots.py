"""Snapshots in shared memory, in one process: values without pickle, the double-buffered store and
its keys, memory full, the job's folder, and where ranks agree to resume."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ddpkit._errors import ConfigError
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _slots as mf
from ddpkit.snapshot import _slots as ms
from ddpkit.snapshot import _slots as mslot
from ddpkit.snapshot._choice import Choice, choose
from ddpkit.training._config import SnapshotConfig
from tests.tmpfs import small_tmpfs
from tests.unit.snapshot.slots import load, save, store

# -- values without pickle -------------------------------------------------------------------------


def test_values_round_trip_with_their_types_and_python_numpy_torch_rng_states():
    random.seed(3)
    np.random.seed(4)
    state = {
        "python": random.getstate(),  # (3, tuple of 625 ints, None): random.setstate refuses a list
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "int_keys": {0: "a", 7: (1.5, None, True)},
        "scalar": np.float64(0.1),
        "dtype": torch.bfloat16,
        "nested": [{"lr": 0.1, "betas": (0.9, 0.999)}],
        "nan": float("nan"),
    }
    tensors: list[torch.Tensor] = []
    text = json.dumps(codec.encode(state, tensors))  # JSON only: nothing to unpickle
    back = codec.decode(json.loads(text), [t.clone() for t in tensors])
    assert (
        type(back["python"]) is tuple
        and type(back["python"][1]) is tuple
        and back["python"] == state["python"]
    )
    assert back["int_keys"] == state["int_keys"] and type(back["int_keys"][7]) is tuple
    assert type(back["scalar"]) is np.float64 and back["dtype"] is torch.bfloat16
    assert back["nested"] == state["nested"] and np.isnan(back["nan"])
    assert torch.equal(back["torch"], state["torch"])
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    torch.set_rng_state(back["torch"])
    drawn = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(3)
    np.random.seed(4)
    torch.set_rng_state(state["torch"])
    assert drawn == (random.random(), np.random.rand(), torch.rand(1))
    with pytest.raises(
        ConfigError, match="a snapshot cannot hold bad, a type: convert it in state_dict"
    ):
        codec.encode({"bad": object}, [])


# -- the store -------------------------------------------------------------------------------------


def test_a_save_overwrites_the_older_slot_and_the_newest_two_are_whole(tmp_path):
    st = store(tmp_path)
    for step in (1, 2, 3):
        save(st, step, [torch.full((1000,), float(step)), torch.arange(step + 5)], {"step": step})
    found = sorted(st.found(), key=lambda f: f.step)
    assert [f.step for f in found] == [2, 3]
    values, tensors = load(found[-1])
    assert values["values"] == {"step": 3} and torch.equal(tensors[0], torch.full((1000,), 3.0))
    assert torch.equal(tensors[1], torch.arange(8))
    # A new store for the same rank (a restarted worker) finds both, and continues the generations.
    again = store(tmp_path)
    save(again, 4, [torch.full((1000,), 4.0), torch.arange(9)])
    assert sorted(f.step for f in again.found()) == [3, 4]


def test_slots_of_another_job_run_dir_or_world_size_are_never_found(tmp_path):
    save(store(tmp_path, job="job-a", run="run-a"), 5, [torch.ones(3)])
    # control: same keys
    assert [f.step for f in store(tmp_path, job="job-a", run="run-a").found()] == [5]
    # an earlier job's slot in a reused folder
    assert store(tmp_path, job="job-b", run="run-a").found() == []
    assert store(tmp_path, job="job-a", run="run-b").found() == []  # another Trainer of the job
    assert store(tmp_path, job="job-a", run="run-a", world=3).found() == []  # another world size


def test_a_slot_whose_commit_record_or_values_do_not_check_is_not_found(tmp_path):
    st = store(tmp_path)
    save(st, 1, [torch.ones(8)])
    (found,) = st.found()
    raw = bytearray(found.path.read_bytes())
    record = mslot.Record.unpack(bytes(raw[: mslot.HEADER]))
    assert record is not None and record.whole
    raw[record.values[0]] ^= 0xFF  # one byte of the values flipped: its CRC-32 no longer matches
    found.path.write_bytes(bytes(raw))
    assert st.found() == []


def test_a_full_memory_raises_before_any_page_is_touched_and_keeps_the_other_slot(tmp_path):
    with small_tmpfs(tmp_path / "shm", "256k") as folder:
        st = store(folder)
        save(st, 1, [torch.ones(1000)])
        # 1 MiB does not fit: posix_fallocate says ENOSPC; without it the copy would die of SIGBUS.
        with pytest.raises(
            ms.MemoryUnavailable, match="no room for .* MiB in .*No space left on device"
        ):
            save(st, 2, [torch.ones(1 << 18)])
        assert [f.step for f in st.found()] == [1]
        assert len(list(folder.glob("*.slot"))) == 1  # the failed slot's file is gone


def test_a_save_that_found_memory_full_and_is_tried_again_keeps_the_newest_slot(tmp_path):
    """Memory full at a new layout (the older slot's file made again, and refused): once room is
    made, the save tried again goes to that slot, and the newest whole one stays whole. Control:
    the slot refused is not whole any more (its file is gone), though it was before."""
    with small_tmpfs(tmp_path / "shm", "2m") as folder:
        st = store(folder)
        save(st, 1, [torch.ones(8)])
        save(st, 2, [torch.ones(8)])
        assert sorted(f.step for f in st.found()) == [1, 2]
        filler = folder / "filler"
        filler.write_bytes(bytes(1536 << 10))
        with pytest.raises(ms.MemoryUnavailable):
            save(st, 3, [torch.ones(1 << 18)])  # 1 MiB: the older slot (step 1) made again
        assert [f.step for f in st.found()] == [2]
        filler.unlink()  # room made
        save(st, 3, [torch.ones(1 << 18)])
        assert sorted(f.step for f in st.found()) == [2, 3]


def test_a_memory_too_small_for_two_copies_of_the_model_is_said_with_the_volume_to_mount(tmp_path):
    """A container's 64 MiB /dev/shm, played by a 1 MiB tmpfs: 2 MiB needed is warned of, naming
    Kubernetes' emptyDir of medium Memory and Docker's --shm-size; 512 KiB needed (the control) is
    not."""
    with small_tmpfs(tmp_path / "shm", "1m") as folder:
        warning = mf.room_warning(folder, 2 << 20)
        assert warning is not None and "1 MiB free" in warning and "2 MiB" in warning
        assert (
            "emptyDir volume with medium: Memory mounted at /dev/shm" in warning
            and "--shm-size" in warning
        )
        assert mf.room_warning(folder, 512 << 10) is None
        with pytest.raises(ms.MemoryUnavailable, match="emptyDir volume with medium: Memory"):
            # 2 MiB: the store says the same when it runs out
            save(store(folder), 1, [torch.ones(1 << 19)])


def test_the_run_key_is_the_run_directorys_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ms.run_key("runs/a") == ms.run_key(tmp_path / "runs" / "a") != ms.run_key("runs/b")


def test_the_memory_interval_is_checked_where_it_is_given():
    assert SnapshotConfig(memory=True, memory_every_steps=4).memory_every_steps == 4
    with pytest.raises(Exception, match="memory_every_steps=0 is not valid"):
        SnapshotConfig(memory=True, memory_every_steps=0)


@pytest.mark.parametrize("kept", [3, 4096])  # 4096: the control, a short run keeps every time
def test_a_long_runs_copy_times_are_bounded(tmp_path, monkeypatch, kept):
    import ddpkit
    from ddpkit.distributed._channels import JOB_DIR_ENV, MEMORY
    from ddpkit.snapshot import _memory
    from ddpkit.training._config import LoggingConfig, TrainerConfig

    monkeypatch.setattr(_memory, "KEPT_TIMES", kept)
    (tmp_path / "job" / MEMORY).mkdir(parents=True)
    monkeypatch.setenv(JOB_DIR_ENV, str(tmp_path / "job"))
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(160, 4), torch.randint(0, 2, (160,)))
    config = TrainerConfig(
        run_dir=str(tmp_path / "run"), batch_size=8, epochs=1, num_workers=0,
        logging=LoggingConfig(progress=False),
        snapshot=SnapshotConfig(memory=True, memory_every_steps=1, every_epochs=0),
    )  # fmt: skip
    trainer = ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config)
    memory = trainer.snapshots.memory
    assert memory is not None, "the snapshots in memory are off: the test shows nothing"
    trainer.fit()
    assert trainer.step == 20 and len(memory.waits) == len(memory.stalls)
    assert len(memory.stalls) == (20 if kept == 4096 else 20 % kept + kept), memory.stalls


# -- where every rank resumes ----------------------------------------------------------------------


def _offer(own=()):
    return {"own": [list(p) for p in own], "replicas": {}}


def test_ranks_resume_from_the_newest_step_all_of_them_hold():
    a, b, c = (0, 6, 48), (0, 7, 56), (0, 8, 64)  # (epoch, step, cursor)
    # Rank 1 was killed while copying step 8: it holds 7 and 6; the others hold 8 and 7.
    offers = [_offer([b, c]), _offer([a, b]), _offer([b, c])]
    assert choose(offers, disk_step=-1) == Choice(b)
    assert choose(offers, disk_step=7) is None  # the disk's newest is as new: resume from disk
    assert choose(offers, disk_step=6) == Choice(b)
