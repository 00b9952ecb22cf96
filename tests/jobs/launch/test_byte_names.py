"""Names are bytes: a script path, its arguments and a run directory whose names are not UTF-8 run
under ``ddpkit run`` (the fork server on) with snapshots in memory as ASCII ones do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

SCRIPT = """
import os, sys, torch, ddpkit
ddpkit.init()
run_dir = sys.argv[1]
model = torch.nn.Linear(2, 2)
data = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randint(0, 2, (16,)))
config = ddpkit.TrainerConfig(
    run_dir=run_dir, batch_size=4, epochs=2, snapshot=ddpkit.SnapshotConfig(memory=True),
    logging=ddpkit.LoggingConfig(progress=False),
)
ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config).fit()
print("args", os.fsencode(sys.argv[2]).hex(), flush=True)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="byte names of a Linux file system")
@pytest.mark.parametrize("fork_server", ["off", "on"])
def test_a_script_its_arguments_and_its_run_directory_not_utf8_run(
    tmp_path, clean_env, fork_server
):
    folder = os.fsencode(tmp_path)
    script = os.path.join(folder, b"sc\xe9.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    run_dir = os.path.join(folder, b"runs", b"r\xff")
    # control: the names are not text (the slots' run key once encoded the path as UTF-8 and
    # every rank failed with this error)
    with pytest.raises(UnicodeEncodeError):
        os.fsdecode(run_dir).encode()
    argv = [sys.executable.encode(), b"-m", b"ddpkit.cli", b"run", b"--nproc", b"2"]
    # the fork server hands the arguments to each worker it forks, which shows them as its own
    argv += [b"--fork-server", fork_server.encode(), script]
    done = subprocess.run(
        [*argv, run_dir, b"caf\xe9"], env=clean_env, cwd=tmp_path, capture_output=True,
        timeout=300,
    )  # fmt: skip
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    assert done.returncode == 0, err[-3000:]
    assert "args " + b"caf\xe9".hex() in out
    assert os.path.isdir(os.path.join(run_dir, b"snapshots"))
