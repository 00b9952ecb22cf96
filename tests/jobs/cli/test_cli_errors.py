"""Bad input to the commands as a user runs them: one line naming the option, no traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HELLO = str(Path(__file__).parents[1] / "scripts" / "hello.py")


def _run_dir(path: Path, metrics: bytes | str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if metrics is None:
        records = [
            {"kind": "train", "step": s, "time": 0.0, "train/loss": 1.0 / s, "lr": 0.1}
            for s in (1, 2, 3)
        ]
        metrics = "".join(json.dumps(r) + "\n" for r in records)
    if isinstance(metrics, str):
        metrics = metrics.encode()
    (path / "metrics.jsonl").write_bytes(metrics)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["plot", "{tmp}", "-o", "{tmp}/curves.xyz"],
        ["bench", "--warmup", "-5"],
        ["sbatch", "--dry-run", "--job-name", "../../x", HELLO],
        ["run", "--rdzv-conf", "=", HELLO],
        ["run", "--rdzv-id", "i" * 300, HELLO],
        ["run", "s" * 300 + ".py"],
        ["run", "--nproc", "9" * 20, HELLO],
        ["run", "--collective-timeout", "1e-300", HELLO],
        ["sbatch", "--dry-run", "--output-dir", "/proc/x", HELLO],
        ["sbatch", "--dry-run", "--output-dir", "d" * 300, HELLO],
        ["plot", "{tmp}", "-o", "{tmp}/" + "c" * 300 + ".png"],
    ],
)
def test_the_command_prints_one_line_and_no_traceback(tmp_path, clean_env, argv):
    _run_dir(tmp_path)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", *(a.format(tmp=tmp_path) for a in argv)],
        env=clean_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert re.fullmatch(rf"ddpkit {argv[0]}: error: [^\n]+\n", done.stderr), done.stderr
    assert time.monotonic() - started < 60  # the interpreter and torch's import, not a wait
