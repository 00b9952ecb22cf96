"""The Ray internal ddpkit relies on (its key-value store, for the restart count), and its control.
Run by the Python of ``.venv-ray`` (or this one, where Ray is installed): Ray lives in a venv of its
own (.ci/run). The check reads Ray's source, never importing it: ``ddpkit env`` and every process
that runs the checks stay free of Ray's threads and its start-up time."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RAY_PYTHON = (
    sys.executable
    if importlib.util.find_spec("ray")
    else str(ROOT / ".venv-ray" / "bin" / "python")
)
# Slow-marked: CI makes .venv-ray before its slow step (where the Ray cluster tests run too).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(RAY_PYTHON).exists(),
        reason="no Ray: VENV=.venv-ray bash scripts/setup.sh ray,examples",
    ),
]

CHECK = """
import sys
from importlib import metadata
from pathlib import Path
from ddpkit._internals import ray_train
from ddpkit._internals.contract import problem

(internal,) = ray_train.INTERNALS
assert problem(internal) is None, problem(internal)
assert "ray" not in sys.modules  # the check reads Ray's source
source = ray_train.kv_source()
text = source.read_text()
changed = Path(sys.argv[1]) / "internal_kv.py"
ray_train.kv_source = lambda: changed
changed.write_text(text.replace("def _internal_kv_put(", "def _internal_kv_store("))
found = problem(internal) or ""
assert f"Ray {metadata.version('ray')}" in found and "has no _internal_kv_put" in found, found
changed.write_text(text.replace("overwrite", "replace"))
assert "_internal_kv_put takes no overwrite" in (problem(internal) or ""), problem(internal)
print("ok")
"""


def test_the_key_value_store_is_as_relied_on_and_a_changed_one_is_named(tmp_path):
    """The check passes on the installed Ray; controls: Ray's module without ``_internal_kv_put``,
    and with its ``overwrite`` keyword renamed, are each reported with Ray's version."""
    out = subprocess.run(
        [RAY_PYTHON, "-c", CHECK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
