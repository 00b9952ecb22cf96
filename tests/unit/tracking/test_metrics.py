"""The main rank's records: TensorBoard's scalars across a :meth:`MetricsWriter.load_state_dict`."""

from __future__ import annotations

import json

from ddpkit.tracking._metrics import MetricsWriter


def _steps_resumed_partway(tmp_path, reopens: bool = True) -> list[int]:
    """The steps TensorBoard holds of a run resumed at step 1 after it had written step 2."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    writer.log("train", 1, {"train/loss": 1.0})
    state = writer.state_dict()
    writer.log("train", 2, {"train/loss": 0.9})
    writer.load_state_dict(state)  # a resume from step 1's snapshot, partway through the run
    if not reopens:
        writer._tensorboard = False  # as before: the writer closed by the resume stays closed
    writer.log("train", 2, {"train/loss": 0.8})
    writer.log("train", 3, {"train/loss": 0.7})
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # metrics.jsonl reads as uninterrupted
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars("train/loss")]


def test_tensorboard_gets_the_records_written_after_a_resume_partway_through_a_run(tmp_path):
    assert 3 in _steps_resumed_partway(tmp_path)


def test_control_a_tensorboard_writer_left_closed_by_the_resume_misses_them(tmp_path):
    steps = _steps_resumed_partway(tmp_path, reopens=False)
    assert 1 in steps and 3 not in steps  # the same check fails, and the reader reads the file
