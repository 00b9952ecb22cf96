"""Nothing a job writes leaves its folder: for every path a job of each kind writes (found by
running it once), a symbolic link to a file outside is planted there; a hard link to a file outside
holding what the job wrote there (a folder copied with ``cp -al``); and, as root, a file or folder
of another user. The job is run again, and the file outside (and the other user's) must be
byte-identical, and any refusal one line that names the path and why.

Kinds: a Trainer run (snapshots, weights, best.pt, records, curves), a search (its lock, journal,
trials.csv and plots), a JSON Lines stream (which writes nothing: an index planted beside its data
is never read), a batch script, and the bench's outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ddpkit._errors import ConfigError
from ddpkit.snapshot._disk import SnapshotWriteError

pytestmark = pytest.mark.heavy

VICTIM = b"a file of someone else's, outside the folder\n"
THEIRS = b"another user's file\n"
NOBODY = 65534
KINDS = [
    "link",
    "hard link",
    pytest.param(
        "other user", marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
    ),
]


class Outside:
    """A file and a folder outside the job's folder that planted links point to, and what they
    held."""

    def __init__(self, tmp_path: Path) -> None:
        self.folder = tmp_path / "elsewhere"
        self.folder.mkdir()
        self.file = self.folder / "victim.txt"
        self.file.write_bytes(VICTIM)
        # hard links to the other user's planted files: their bytes, whatever
        self.kept = tmp_path / "kept"
        self.kept.mkdir()  # the job does with their names
        # the other names of planted hard links, and their bytes
        self.originals = tmp_path / "originals"
        self.originals.mkdir()
        self.held: dict[Path, bytes] = {}

    def plant(self, path: Path, kind: str, is_dir: bool, written: Path | None = None) -> bool:
        """Plant ``kind`` at ``path``; False where it cannot be (a hard link to a folder). A hard
        link's other name holds the bytes ``written`` (what the clean run wrote there), as in a copy
        made with ``cp -al``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "link":
            path.symlink_to(self.folder if is_dir else self.file, target_is_directory=is_dir)
            return True
        if kind == "hard link":
            if is_dir:
                return False
            original = self.originals / str(len(self.held))
            original.write_bytes(written.read_bytes() if written is not None else VICTIM)
            self.held[original] = original.read_bytes()
            os.link(original, path)
            return True
        theirs = path / "theirs" if is_dir else path
        if is_dir:
            path.mkdir()
        theirs.write_bytes(THEIRS)
        os.link(theirs, self.kept / f"{len(os.listdir(self.kept))}")
        os.chown(theirs, NOBODY, NOBODY)
        os.chown(path, NOBODY, NOBODY)
        return True

    def check(self, name: str, error: BaseException | None) -> None:
        assert self.file.read_bytes() == VICTIM, f"{name}: the file outside was written"
        assert os.listdir(self.folder) == ["victim.txt"], f"{name}: written into the folder outside"
        for kept in self.kept.iterdir():
            assert kept.read_bytes() == THEIRS, f"{name}: the other user's file was written"
        for original, held in self.held.items():
            assert original.read_bytes() == held, f"{name}: written through a hard link"
        if error is not None:
            message = str(error)
            assert isinstance(error, (ConfigError, SnapshotWriteError)), f"{name}: {error!r}"
            assert "\n" not in message.strip(), f"{name}: {message}"
            assert Path(name).name in message or Path(name).parts[0] in message, (
                f"{name}: {message}"
            )
            why = ("symbolic link", "other hard link", f"belongs to nobody (uid {NOBODY})")
            assert any(w in message for w in why), message


def written(root: Path) -> dict[str, bool]:
    """Every path under ``root`` (relative), and whether it is a folder."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            found[str(path.relative_to(root))] = path.is_dir()
    return found


def each_path_planted(
    tmp_path: Path,
    kind: str,
    job: Callable[[Path], None],
    expected: set[str],
    inputs: tuple[str, ...] = (),
) -> list[str]:
    """Run ``job`` in a clean folder, then once per path it wrote (but its ``inputs``) with that
    path planted; the outcomes."""
    outside = Outside(tmp_path)
    clean = tmp_path / "clean"
    job(clean)
    paths = written(clean)
    assert expected <= set(paths), f"the job no longer writes {sorted(expected - set(paths))}"
    outcomes = []
    for i, (name, is_dir) in enumerate(sorted(paths.items())):
        if name in inputs:
            continue
        root = tmp_path / f"planted-{i}"
        if not outside.plant(root / name, kind, is_dir, clean / name):
            continue
        error: BaseException | None = None
        try:
            job(root)
        except Exception as err:  # a refusal, checked below
            error = err
        outside.check(name, error)
        outcomes.append(f"{name}: {'refused' if error else 'written beside it'}")
    return outcomes


# -- a Trainer run ---------------------------------------------------------------------------------


def _trainer_run(run_dir: Path) -> None:
    from ddpkit.tracking._curves import plot
    from tests.jobs.scripts.train_job import train

    # One epoch of two steps with validation: snapshots, best.pt, weights files, records; then its
    # curves, in the clean run (which lists what they write) and where their file is planted: ~0.7
    # s of matplotlib a run, and they write no other path.
    curves = run_dir.name == "clean" or os.path.lexists(run_dir / "curves.png")
    train(str(run_dir), n_samples=48, epochs=1, early_stopping_patience=5, log_every_steps=1)
    if curves:
        plot(run_dir)


@pytest.mark.parametrize("kind", KINDS)
def test_a_trainer_run_writes_nothing_outside_its_run_dir(tmp_path, kind):
    outcomes = each_path_planted(
        tmp_path,
        kind,
        _trainer_run,
        {
            ".lock",
            "metrics.jsonl",
            "epochs.csv",
            "config.json",
            "best.pt",
            "best.safetensors",
            "final.safetensors",
            "curves.png",
            "snapshots/step-00000002/complete.json",
            "snapshots/step-00000002/__0_0.distcp",
        },
    )
    # a copied run goes on: each file a copy of its own first, the other name whole
    if kind == "hard link":
        beside = {f"{name}: written beside it" for name in (".lock", "metrics.jsonl", "epochs.csv")}
        assert beside <= set(outcomes), outcomes
    else:
        assert "metrics.jsonl: refused" in outcomes and ".lock: refused" in outcomes, outcomes


# -- a search --------------------------------------------------------------------------------------


def _search(search_dir: Path) -> None:
    import ddpkit
    from ddpkit.search import SearchConfig, search, uniform

    # Optuna's plots (~3 s) as the Trainer's curves above: where they list or meet their paths
    plots = search_dir.name == "clean" or any(
        os.path.lexists(search_dir / f"{name}.png")
        for name in ("history", "importances", "intermediate")
    )
    ddpkit.init()
    search(
        lambda c: c.params["x"],
        {"x": uniform(0.0, 1.0)},
        SearchConfig(n_trials=2, search_dir=str(search_dir), plots=plots),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_search_writes_nothing_outside_its_search_dir(tmp_path, kind):
    # The paths of the reproduction among them: .lock (was truncated and overwritten with the
    # holder), trials.csv (its fixed temporary .trials.csv.tmp) and history.png (matplotlib followed
    # the link).
    expected = {".lock", ".ask.lock", "study.journal", "search_id", "trials.csv", "history.png"}
    outcomes = each_path_planted(tmp_path, kind, _search, expected)
    outcome = "written beside it" if kind == "hard link" else "refused"
    assert f".lock: {outcome}" in outcomes and f"study.journal: {outcome}" in outcomes, outcomes


@pytest.mark.parametrize("name", [".lock", ".trials.csv.tmp", "history.png", "trial-0000"])
def test_the_links_of_the_reproduction_leave_the_victim_whole(tmp_path, name):
    outside = Outside(tmp_path)
    search_dir = tmp_path / "search"
    outside.plant(search_dir / name, "link", name.startswith("trial-"))
    error = None
    try:
        _search(search_dir)
    except ConfigError as err:
        error = err
    outside.check(name, error)
    assert (error is None) == (name in (".trials.csv.tmp", "history.png")), error
    if error is None:  # written beside the link: the files are the search's own
        assert (
            not (search_dir / "history.png").is_symlink() and (search_dir / "trials.csv").is_file()
        )


# -- a JSON Lines stream and its line index --------------------------------------------------------


def _records(folder: Path, n: int = 64) -> Path:
    path = folder / "data.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(n)))
    return path


def _stream(folder: Path) -> None:
    from ddpkit.data._stream_sources import JsonlStream

    path = folder / "data.jsonl" if (folder / "data.jsonl").exists() else _records(folder)
    stream = JsonlStream(path)
    assert [r["id"] for r in stream.read(0, np.arange(len(stream)))] == list(range(64))


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_writes_nothing_outside_its_data_folder(tmp_path, kind):
    def job(folder: Path) -> None:
        if not (folder / "data.jsonl").exists():
            _records(folder)
        _stream(folder)

    # Nothing but its input: the line index is built in memory, so no path is there to plant.
    assert each_path_planted(tmp_path, kind, job, set(), inputs=("data.jsonl",)) == []
    assert written(tmp_path / "clean") == {"data.jsonl": False}


def _poisoned_index(path: Path, lines: np.ndarray) -> Path:
    """A line index beside ``path`` as the previous cache kept it (version 3): its header names the
    file's size and content digest, and holds the offsets' checksum."""
    from ddpkit.data._fingerprint import digest
    from ddpkit.data._stream_sources import indexed_lines

    content = int.from_bytes(bytes.fromhex(indexed_lines(path)[1]), "little", signed=True)
    checksum = np.frombuffer(bytes.fromhex(digest(lines.view(np.uint8).data)), np.int64)[0]
    cached = path.with_name(f".{path.name}.lines")
    header = np.array([[3, path.stat().st_size], [content, checksum]], np.int64)
    np.concatenate([header, lines]).tofile(cached)
    return cached


@pytest.mark.parametrize("owner", ["this user", pytest.param("other user", marks=KINDS[-1].marks)])
def test_a_planted_line_index_is_not_used_and_the_records_are_right(tmp_path, capfd, owner):
    from ddpkit.data._stream_sources import JsonlStream, indexed_lines

    path = _records(tmp_path / "data")
    # every line pointing at record 0
    lines = np.tile(np.array([[0, len(json.dumps({"id": 0}))]], np.int64), (64, 1))
    cached = _poisoned_index(path, lines)
    if owner == "other user":
        os.chown(cached, NOBODY, NOBODY)
    # Control: the index as planted is what the previous cache used (its header matches): every
    # record is record 0.
    table = np.fromfile(cached, np.int64).reshape(-1, 2)
    assert table[0, 1] == path.stat().st_size and not np.array_equal(
        table[2:], indexed_lines(path)[0]
    )
    planted = cached.read_bytes()
    stream = JsonlStream(path)
    assert [r["id"] for r in stream.read(0, np.arange(64))] == list(range(64))
    assert capfd.readouterr().err == ""
    assert cached.read_bytes() == planted  # never read, never written


@pytest.mark.parametrize(
    "table",
    [
        [[0, 9], [5, 18]],  # overlapping
        [[10, 19], [0, 9]],  # out of order
        [[0, 9], [10, 10_000]],  # past the end of the file
        [[0, 0], [10, 19]],  # an empty line
        [],  # cut to its header: no records
    ],
)
def test_a_line_index_that_cannot_be_the_files_is_not_read(tmp_path, table):
    from ddpkit.data._stream_sources import JsonlStream

    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 0}\n{"id": 1}\n')
    _poisoned_index(path, np.array(table, np.int64).reshape(-1, 2))
    assert JsonlStream(path).lines[0].tolist() == [[0, 9], [10, 19]]


def test_a_planted_temporary_of_the_old_fixed_name_is_never_written(tmp_path):
    from ddpkit.data._stream_sources import JsonlStream

    outside = Outside(tmp_path)
    path = _records(tmp_path / "data")
    (path.parent / f".data.jsonl.lines.{os.getpid()}.tmp").symlink_to(outside.file)
    assert len(JsonlStream(path)) == 64
    outside.check("the temporary", None)


# -- a batch script, the bench's outputs -----------------------------------------------------------


def _batch_script(folder: Path) -> None:
    from ddpkit._launch.cli.sbatch import BatchConfig, submit

    script = folder.parent / "train.py"
    script.write_text("print('hi')\n")
    submit(BatchConfig(script=str(script), output_dir=str(folder)), dry_run=True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_script_is_written_only_inside_its_output_dir(tmp_path, kind):
    each_path_planted(tmp_path, kind, _batch_script, {"train.sbatch"})


def _bench_outputs(folder: Path) -> None:
    from ddpkit.tools._bench import BenchConfig, write_outputs

    row = {"world_size": 2, "samples_per_s": 50.0}
    result = {
        "workload": "tiny",
        "conditions": {"device": "cpu", "backend": "gloo"},
        "scaling": {
            1: {"batch_size": 32, "parts": {"step": 0.5}},
            2: {"batch_size": 32, "parts": {"step": 0.6}},
        },
        "predictions": {
            "larger": {"ib": {"rows": [row, {"world_size": 4, "samples_per_s": 90.0}]}},
            "chosen": "ib",
            "intra_link": {"name": "shared memory"},
            "this_machine": [row],
        },
    }
    write_outputs(BenchConfig(out=str(folder)), result)


@pytest.mark.parametrize("kind", KINDS)
def test_the_bench_writes_its_json_and_plot_only_inside_its_out_folder(tmp_path, kind):
    each_path_planted(tmp_path, kind, _bench_outputs, {"bench.json", "bench.png"})


# -- a run directory copied with cp -al ------------------------------------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("check", ["on", "off"])
def test_training_in_a_copy_made_with_cp_al_leaves_the_original_run_byte_identical(
    tmp_path, check, monkeypatch
):
    from ddpkit import _fs as fs
    from tests.jobs.scripts.train_job import train

    original, copy = tmp_path / "original", tmp_path / "copy"
    train(str(original), n_samples=48, epochs=1)
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    before = _tree(original)
    assert os.stat(copy / "metrics.jsonl").st_nlink == 2  # every file of the copy is a second name
    # control: the check switched off, the copy's records are written into the original's
    if check == "off":
        monkeypatch.setattr(fs, "other_names", lambda st: False)
    result = train(str(copy), n_samples=48, epochs=2)
    assert result["resumed_from"] is not None  # the copy went on from the original's snapshot
    after = _tree(original)
    changed = sorted(name for name in before if after.get(name) != before[name])
    if check == "off":
        assert {"metrics.jsonl", "epochs.csv"} <= set(changed), changed
        return
    assert changed == [] and after.keys() == before.keys(), changed
    # The copy's records go on from the original's: the same bytes first, then epoch 2's.
    for name in ("metrics.jsonl", "epochs.csv"):
        assert (copy / name).read_bytes().startswith(before[name]) and len(
            (copy / name).read_bytes()
        ) > len(before[name])
        assert os.stat(copy / name).st_nlink == 1 and os.stat(original / name).st_nlink == 1
    assert len((copy / "epochs.csv").read_text().splitlines()) == 3  # the header and two epochs
    # each its own
    assert os.stat(copy / ".lock").st_nlink == 1 and os.stat(original / ".lock").st_nlink == 1


@pytest.mark.parametrize("check", ["on", "off"])
def test_mlflow_in_a_copy_made_with_cp_al_leaves_the_originals_store_byte_identical(
    tmp_path, check, monkeypatch
):
    # SQLite opens mlflow.db in place by its name: the copy's logger gets a store of its own first.
    pytest.importorskip("mlflow")
    from ddpkit import _fs as fs
    from ddpkit.tracking._trackers import MLflowLogger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    MLflowLogger(original, {"lr": 0.1}).close()
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    before = _tree(original)
    if check == "off":  # control: SQLite writes the copy's run into the original's store
        monkeypatch.setattr(fs, "other_names", lambda st: False)
    # resumes the run named in loggers.json, in the copy's store
    logger = MLflowLogger(copy, {"lr": 0.1})
    logger.log(1, {"loss": 0.5})
    logger.close()
    changed = (_tree(original)["mlflow.db"] != before["mlflow.db"]) or os.stat(
        original / "mlflow.db"
    ).st_nlink > 1
    assert changed == (check == "off")
