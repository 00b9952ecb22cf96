"""Where ``ddpkit run --debug-collectives`` has nccl's flight recorder write, in a real job on the
CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpkit._launch.cli.run import flight_recorder_vars
from ddpkit.testing import run_job
from tests.device_support import SCRIPTS, device_env

PROBE = str(SCRIPTS / "device_probe.py")


@pytest.mark.slow
def test_the_flight_record_goes_to_the_runs_stacks_folder_and_the_summary_names_it(
    clean_env, tmp_path
):
    env = device_env(clean_env, "cpu")
    logs = tmp_path / "logs"

    def job(mode: str, *flags: str):
        options = ["--log-dir", str(logs), *flags]
        return run_job(
            PROBE, mode, nproc=1, launcher_args=options, env=env, cwd=tmp_path, timeout=120
        )

    from ddpkit._errors import ConfigError
    from ddpkit._launch.cli.run import check_debug_collectives

    try:
        check_debug_collectives()
    except ConfigError as refused:  # this torch's DETAIL mode crashes DDP: refused before a start
        out = job("env", "--debug-collectives")
        assert out.returncode != 0 and str(refused) in out.stderr, out.stderr[-3000:]
        pytest.skip(f"--debug-collectives is refused on this torch: {refused}")
    out = job("env", "--debug-collectives")
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    buffer, dump_file = flight_recorder_vars()
    assert seen[buffer] == "2000" and seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    prefix = Path(seen[dump_file])
    # ddpkit-logs/<run>/stacks/nccl_trace_rank_<N>, as the README says.
    assert (
        prefix.name == "nccl_trace_rank_"
        and prefix.parent.name == "stacks"
        and prefix.parents[1].parent == logs
    )
    # A rank that fails after writing its record (as nccl's watchdog does on a timeout): the summary
    # names it.
    out = job("dump-and-fail", "--debug-collectives")
    assert out.returncode == 3
    (record,) = logs.glob("*/stacks/nccl_trace_rank_0")
    assert f"nccl flight recorder of rank 0: {record}" in out.stderr, out.stderr[-3000:]
    # Control: without the option nothing asks for the recorder.
    out = job("env")
    assert out.returncode == 0 and set(json.loads(out.stdout.splitlines()[-1]).values()) == {None}
