"""MLflow (local SQLite store) and Weights & Biases (offline) get the records metrics.jsonl gets,
across a resume."""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import pytest

from ddpkit.testing import read_records, run_on_ranks
from tests.jobs.scripts.train_job import train

mlflow = pytest.importorskip("mlflow")
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def jsonl_curves(run_dir: Path) -> dict[str, dict[int, float]]:
    curves: dict[str, dict[int, float]] = {}
    for rec in read_records(run_dir):
        if rec["kind"] in ("train", "epoch", "val"):  # "val": a validation between epoch ends
            for k, v in rec.items():
                if k not in ("kind", "step", "time", "epoch"):
                    curves.setdefault(k, {})[rec["step"]] = v
    return curves


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """The history records of the offline W&B run in ``run_dir/wandb``, over all its processes (one
    folder each).

    A ``.wandb`` file is a LevelDB-style log (W&B's own format, read here because the package no
    longer ships a reader): a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type: 1
    whole, 2 first, 3 middle, 4 last), each whole record a protobuf ``Record``.
    """
    history = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, block = path.read_bytes(), 32768
        assert data[:4] == b":W&B"
        pos, pending = 7, b""
        while pos + 7 <= len(data):
            left = block - pos % block
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if left < 7 or (kind == 0 and length == 0):  # block trailer or padding
                pos += left
                continue
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_pb.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    history.append(
                        {
                            i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.history.item
                        }
                    )
    return history


@pytest.mark.slow
def test_mlflow_and_wandb_get_the_same_records_and_continue_after_a_resume(tmp_path, monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    job = functools.partial(
        train,
        str(run_dir),
        loggers=("mlflow", "wandb"),
        early_stopping_patience=5,
        log_every_steps=5,
        epochs=2,
    )
    run_on_ranks(functools.partial(job, max_steps=13), 2)
    first_ids = json.loads((run_dir / "loggers.json").read_text())
    run_on_ranks(job, 2)  # resumes at step 13: the same tracker runs continue
    # one folder per process, one run id
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2
    assert json.loads((run_dir / "loggers.json").read_text()) == first_ids
    expected = jsonl_curves(run_dir)
    # The first job, stopped by max_steps inside its second epoch, validates where it stops (step
    # 13).
    assert sorted(expected["train/loss"]) == [5, 10, 13, 15, 20] and sorted(
        expected["val/loss"]
    ) == [10, 13, 20]

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(first_ids["mlflow"])
    assert run.data.params["seed"] == "0" and run.data.params["logging.every_steps"] == "5"
    for name, points in expected.items():
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert logged == pytest.approx(points), name

    logged: dict[str, dict[int, float]] = {}
    for row in wandb_history(run_dir):
        for k, v in row.items():
            if not k.startswith("_"):
                logged.setdefault(k, {})[row["_step"]] = v
    assert logged.keys() == expected.keys()
    for name, points in expected.items():
        assert logged[name] == pytest.approx(points), name
