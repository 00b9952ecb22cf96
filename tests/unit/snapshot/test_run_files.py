"""What a run writes stays inside its run directory: no write or deletion follows a symbolic link
out of it, a run directory of another user is refused, and ``resume=False`` keeps the previous run's
records apart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpkit import _fs as run_files
from ddpkit._errors import ConfigError
from ddpkit.snapshot import _folders as folders
from ddpkit.snapshot._disk import MARKER
from ddpkit.snapshot._run_dir import claim, run_dir_lock
from ddpkit.tracking._metrics import MetricsWriter

VICTIM_TEXT = "a file of someone else's, outside the run directory\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the run directory that a link inside it points to; it must never change."""
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def link(run_dir: Path, name: str, target: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / name).symlink_to(target)
    return run_dir / name


def test_the_lock_is_not_taken_through_a_link(tmp_path, victim):
    link(tmp_path / "run", ".lock", victim)
    with pytest.raises(
        ConfigError, match=r"\.lock' is a symbolic link \(to .*victim.txt'\).*Remove the link"
    ):
        run_dir_lock(tmp_path / "run").acquire()
    assert victim.read_text() == VICTIM_TEXT
    # Control: the same lock in a run directory without the link is taken, and names its holder.
    with run_dir_lock(tmp_path / "other") as lock:
        assert json.loads((tmp_path / "other" / ".lock").read_text())["pid"] == os.getpid()
        assert lock.path.is_file() and not lock.path.is_symlink()


@pytest.mark.parametrize("name", ["metrics.jsonl", "epochs.csv"])
def test_records_are_not_appended_through_a_link(tmp_path, victim, name):
    run_dir = tmp_path / "run"
    link(run_dir, name, victim)
    writer = MetricsWriter(run_dir, enabled=True)
    with pytest.raises(ConfigError, match=f"{name}' is a symbolic link"):
        writer.log("train", 1, {"train/loss": 0.5})
        writer.epoch_row({"epoch": 1, "train/epoch_loss": 0.5})
    writer.close()
    assert victim.read_text() == VICTIM_TEXT and (run_dir / name).is_symlink()


def test_records_are_appended_in_a_plain_run_directory(tmp_path):
    # Control for the test above: the same calls write both files, and a second writer continues
    # them.
    for step in (1, 2):
        writer = MetricsWriter(tmp_path, enabled=True)
        writer.log("train", step, {"train/loss": 0.5})
        writer.epoch_row({"epoch": step, "train/epoch_loss": 0.5})
        writer.close()
    assert [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [1, 2]
    assert (tmp_path / "epochs.csv").read_text().splitlines() == [
        "epoch,train/epoch_loss",
        "1,0.5",
        "2,0.5",
    ]


def test_a_file_replaced_whole_replaces_a_link_and_leaves_its_target(tmp_path, victim):
    path = link(tmp_path / "run", "config.json", victim)
    run_files.write_atomic(path, b'{"lr": 0.1}\n')
    assert victim.read_text() == VICTIM_TEXT
    assert not path.is_symlink() and path.read_text() == '{"lr": 0.1}\n'
    # no temporary file left
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.json"]


def test_claim_refuses_a_link_where_the_run_writes_before_anything_is_written(tmp_path, victim):
    for name in ("config.json", "best.pt", "snapshots", "tensorboard", "loggers.json"):
        run_dir = tmp_path / name
        link(run_dir, name, victim.parent if name in ("snapshots", "tensorboard") else victim)
        with pytest.raises(ConfigError, match=f"/{name}' is a symbolic link"):
            claim(run_dir, is_main=True, fresh=True)
        assert (run_dir / name).is_symlink()
        assert victim.read_text() == VICTIM_TEXT and os.listdir(victim.parent) == ["victim.txt"]
    # Control: the same run directory once the link is gone is claimed.
    (tmp_path / "best.pt" / "best.pt").unlink()
    claim(tmp_path / "best.pt", is_main=True, fresh=True).release()


def _snapshot_folder(path: Path, step: int) -> None:
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"weights")
    (path / MARKER).write_text(json.dumps({"step": step, "files": {}}))


def test_pruning_removes_a_link_named_like_an_old_snapshot_never_what_it_points_to(tmp_path):
    # Another run's whole snapshot, and a link to it among this run's snapshots, older than the ones
    # kept.
    other = tmp_path / "other-run" / "snapshots" / "step-00000001"
    _snapshot_folder(other, 1)
    own = tmp_path / "run" / "snapshots"
    _snapshot_folder(own / "step-00000002", 2)
    _snapshot_folder(own / "step-00000005", 5)
    (own / "step-00000001").symlink_to(other, target_is_directory=True)
    folders.prune(own, 1, newest=5)
    # the other run's snapshot is whole
    assert sorted(os.listdir(other)) == ["__0_0.distcp", MARKER]
    # the link and this run's old snapshot are pruned
    assert sorted(os.listdir(own)) == ["step-00000005"]


def test_pruning_removes_an_old_snapshot_whole_and_nothing_its_links_point_to(tmp_path, victim):
    own = tmp_path / "run" / "snapshots"
    _snapshot_folder(own / "step-00000002", 2)
    _snapshot_folder(own / "step-00000005", 5)
    link(own / "step-00000002", "file-link", victim)
    link(own / "step-00000002" / "sub", "folder-link", victim.parent)
    folders.prune(own, 1, newest=5)
    assert sorted(os.listdir(own)) == ["step-00000005"]  # the old snapshot is gone, links and all
    assert sorted(os.listdir(own / "step-00000005")) == ["__0_0.distcp", MARKER]
    assert sorted(os.listdir(victim.parent)) == ["victim.txt"] and victim.read_text() == VICTIM_TEXT


def test_pruning_refuses_a_snapshots_folder_that_is_a_link(tmp_path):
    other = tmp_path / "other-run" / "snapshots"
    _snapshot_folder(other / "step-00000001", 1)
    _snapshot_folder(other / "step-00000002", 2)
    link(tmp_path / "run", "snapshots", other)
    with pytest.raises(OSError):
        folders.prune(tmp_path / "run" / "snapshots", 1, newest=2)
    assert sorted(os.listdir(other)) == ["step-00000001", "step-00000002"]
    assert sorted(os.listdir(other / "step-00000001")) == ["__0_0.distcp", MARKER]


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize("what", ["run_dir", "snapshots", "metrics.jsonl"])
def test_a_run_dir_of_another_user_is_refused_naming_the_owner_and_the_ways_out(tmp_path, what):
    run_dir = tmp_path / "run"
    (run_dir / "snapshots").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    owned = run_dir if what == "run_dir" else run_dir / what
    os.chown(owned, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as refused:
        claim(run_dir, is_main=True, fresh=False)
    message = str(refused.value)
    assert f"(uid {NOBODY}), not to you (root, uid 0)" in message and "\n" not in message
    assert "run_dir of your own" in message and f"chown -R root '{owned}'" in message
    if what == "run_dir":
        assert not (run_dir / ".lock").exists()  # nothing was created in the other user's folder
    # Control: handed back, the same run directory is claimed.
    os.chown(owned, 0, 0)
    claim(run_dir, is_main=True, fresh=False).release()


def test_claim_for_a_fresh_run_moves_the_previous_runs_state_and_records_into_one_folder(
    tmp_path, capsys
):
    run_dir = tmp_path / "run"
    _snapshot_folder(run_dir / "snapshots" / "step-00000002", 2)
    names = (
        "metrics.jsonl",
        "epochs.csv",
        "best.pt",
        "best.safetensors",
        "final.safetensors",
        "loggers.json",
    )
    for name in (*names, "config.json", "mlflow.db"):
        (run_dir / name).write_text(name)
    (run_dir / "tensorboard").mkdir()
    claim(run_dir, is_main=True, fresh=False).release()  # control: a resuming run moves nothing
    assert not [p for p in run_dir.iterdir() if p.name.startswith("replaced-")]
    claim(run_dir, is_main=True, fresh=True).release()
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("replaced-")]
    assert sorted(os.listdir(aside)) == sorted(["snapshots", *names, "tensorboard", "config.json"])
    assert (aside / "metrics.jsonl").read_text() == "metrics.jsonl"
    # a store of many runs stays
    assert sorted(os.listdir(run_dir)) == sorted([".lock", "mlflow.db", aside.name])
    assert (
        "the previous run's snapshots, best.pt, best.safetensors, final.safetensors, metrics.jsonl"
        in (capsys.readouterr().out)
    )
