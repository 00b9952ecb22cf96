"""``ddpkit run`` without a job: the torchrun command it builds, its options and their errors, its
log folders, the texts it prints, and how the cause of a failure is told."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ddpkit._errors import ConfigError
from ddpkit._launch.cli.options import LaunchConfig, resolve_nproc
from ddpkit._launch.cli.run import torchrun_argv, worker_env

HELLO = str(Path(__file__).parents[2] / "jobs" / "scripts" / "hello.py")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    # ddpkit run writes ./ddpkit-logs: keep it out of the checkout.
    monkeypatch.chdir(tmp_path)


def test_script_arguments_are_the_scripts_even_when_they_look_like_ours():
    from ddpkit._launch.cli.options import build_parser, split_argv

    build_parser()
    ours, theirs = split_argv(
        ["--nproc", "2", "--log-dir", "L", "train.py", "--log", "5", "--nproc", "3", "--max"]
    )
    assert ours == ["--nproc", "2", "--log-dir", "L", "train.py"]
    assert theirs == ["--log", "5", "--nproc", "3", "--max"]
    assert split_argv(["--all-ranks", "-m", "pkg.train", "-x"]) == (
        ["--all-ranks", "-m", "pkg.train"],
        ["-x"],
    )
    assert split_argv(["--nproc=2", "--", "-weird.py", "a"]) == (["--nproc=2", "-weird.py"], ["a"])


def test_single_node_uses_a_free_loopback_port_and_shows_rank_zero_only():
    cfg = LaunchConfig(script="train.py", script_args=["--lr", "1"])
    argv = torchrun_argv(cfg, nproc=3)
    # ddpkit's rendezvous, its store on a free port of 127.0.0.1; MASTER_ADDR (the node's address)
    # loopback too.
    for flag, value in [
        ("--rdzv-backend", "ddpkit"),
        ("--rdzv-endpoint", "127.0.0.1:0"),
        ("--nnodes", "1"),
        ("--local-addr", "127.0.0.1"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    assert worker_env(cfg, 3)["GLOO_SOCKET_IFNAME"] == os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    # Local ranks 1.. go to files through the logs spec (torchrun's --redirects takes one-digit
    # ranks only).
    assert "--redirects" not in argv and "--tee" not in argv
    assert argv[-5:] == ["-m", "ddpkit._launch.agent.worker", "train.py", "--lr", "1"]


def test_all_ranks_tees_with_a_rank_prefix():
    cfg = LaunchConfig(script="t.py", all_ranks=True)
    argv = torchrun_argv(cfg, nproc=2)
    assert argv[argv.index("--tee") + 1] == "3" and "--redirects" not in argv
    assert worker_env(cfg, 2)["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank ${rank}] "


def test_multi_node_flags_pass_through():
    cfg = LaunchConfig(
        script="t.py",
        nnodes="2",
        rdzv_endpoint="node1:29400",
        rdzv_id="job7",
        node_rank=1,
        local_addr="10.0.0.2",
    )
    argv = torchrun_argv(cfg, nproc=4)
    assert "--standalone" not in argv
    for flag, value in [
        ("--nnodes", "2"),
        ("--rdzv-endpoint", "node1:29400"),
        ("--rdzv-id", "job7"),
        ("--rdzv-backend", "ddpkit"),
        ("--node-rank", "1"),
        ("--local-addr", "10.0.0.2"),
    ]:
        assert argv[argv.index(flag) + 1] == value


def test_module_mode_and_restarts():
    cfg = LaunchConfig(script="pkg.train", module=True, max_restarts=3)
    argv = torchrun_argv(cfg, nproc=1)
    assert argv[argv.index("--max-restarts") + 1] == "3"
    assert argv[-4:] == ["-m", "ddpkit._launch.agent.worker", "-m", "pkg.train"]
    # Always: the workers' store is rank 0's, bound to MASTER_ADDR (ddpkit._launch.agent.worker),
    # fresh at each attempt.
    assert worker_env(cfg, 1)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert worker_env(LaunchConfig(script="t.py"), 1)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nproc": "zero"}, "--nproc"),
        ({"nproc": "0"}, "--nproc"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"nnodes": "2"}, "--rdzv-endpoint"),
        ({"nnodes": "x", "rdzv_endpoint": "h:1"}, "--nnodes"),
    ],
)
def test_bad_options_name_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(script="t.py", **kwargs)


@pytest.mark.parametrize(
    "flags, valid",
    [
        (["--nnodes", "0"], "use a number of nodes >= 1, or MIN:MAX with 1 <= MIN <= MAX"),
        (["--nnodes", "-2"], "use a number of nodes >= 1, or MIN:MAX with 1 <= MIN <= MAX"),
        (["--nnodes", "4:2"], "use a number of nodes >= 1, or MIN:MAX with 1 <= MIN <= MAX"),
        (["--nproc", "\u00b2"], "use auto, gpu, or a whole number of processes from 1 to 1024"),
        (["--preload", "numpy,os.path;rm"], "use module names separated by commas"),
        (["--fork-server", "yes"], "use auto, on or off"),
        *[
            ([option, value], "use a number of seconds from 1 to 2592000 (30 days)")
            for option in ("--collective-timeout", "--join-timeout")
            for value in ("inf", "nan", "1e30", "1e-300", "0.5", "-1")
        ],
    ],
)
def test_bad_values_are_one_line_naming_the_option_and_what_is_valid(flags, valid, capsys):
    from ddpkit.cli import main

    assert main(["run", *flags, HELLO]) == 2  # argparse's code for a usage error
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and err.startswith(f"ddpkit run: error: {flags[0]} ") and valid in err
    ), err
    assert "Traceback" not in err


def test_a_multi_node_job_without_a_secret_stops_before_anything_listens(
    monkeypatch, capsys, tmp_path
):
    from ddpkit.cli import main

    monkeypatch.delenv("DDPKIT_RDZV_SECRET", raising=False)
    assert main(["run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29499", HELLO]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "needs a secret that only its nodes know: export DDPKIT_RDZV_SECRET=" in err
    )
    assert not (tmp_path / "ddpkit-logs").exists()


@pytest.mark.parametrize("nproc", ["99999999999999999999", "1" * 5000, "5000", "1025"])
def test_nproc_is_bounded_before_anything_is_built(nproc, capsys, monkeypatch):
    import ddpkit._launch.cli.run as launcher
    from ddpkit.cli import main

    def built(*args, **kwargs):
        raise AssertionError("torchrun's arguments were built")

    monkeypatch.setattr(launcher, "torchrun_argv", built)
    assert main(["run", "--nproc", nproc, HELLO]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "--nproc" in err and "from 1 to 1024" in err and len(err) < 300
    ), err


def test_nproc_above_four_per_core_needs_oversubscribe(monkeypatch, capsys):
    import torch

    import ddpkit._launch.cli.run as launcher
    from ddpkit.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NSLOTS", "2")
    assert resolve_nproc("8") == 8
    with pytest.raises(
        ConfigError, match="--nproc 9: more than 4 processes per core .* pass --oversubscribe"
    ):
        resolve_nproc("9")
    assert resolve_nproc("9", oversubscribe=True) == 9
    monkeypatch.setattr(
        launcher, "torchrun_argv", lambda *a, **k: pytest.fail("torchrun's arguments were built")
    )
    assert main(["run", "--nproc", "100", HELLO]) == 2
    assert "pass --oversubscribe" in capsys.readouterr().err


def test_nproc_resolution_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NSLOTS", "32")
    assert resolve_nproc("auto") == 8
    monkeypatch.setenv("NSLOTS", "3")
    assert resolve_nproc("auto") == 3
    assert resolve_nproc("5") == 5
    with pytest.raises(ConfigError, match="no GPU"):
        resolve_nproc("gpu")


def test_threads_per_worker_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("NSLOTS", "16")
    assert worker_env(LaunchConfig(script="t.py"), 4)["OMP_NUM_THREADS"] == "4"
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert worker_env(LaunchConfig(script="t.py"), 4)["MKL_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins, for MKL's pool too
    assert worker_env(LaunchConfig(script="t.py"), 4)["OMP_NUM_THREADS"] == "2"
    assert worker_env(LaunchConfig(script="t.py"), 4)["MKL_NUM_THREADS"] == "2"
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    assert worker_env(LaunchConfig(script="t.py"), 4)["MKL_NUM_THREADS"] == "1"


def test_log_folders_of_quiet_runs_are_removed_and_old_ones_pruned(tmp_path):
    from ddpkit._launch.cli.run import new_run_log_dir, tidy_log_dirs

    root = tmp_path / "logs"
    old = [root / f"20250101-0000{i:02d}-1" for i in range(25)]
    for folder in old:
        (folder / "attempt_0" / "1").mkdir(parents=True)
        (folder / "attempt_0" / "1" / "stdout.log").write_text("words")
    (root / "notes").mkdir()  # not a run folder: not ours to remove
    quiet = new_run_log_dir(str(root))
    (quiet / "attempt_0" / "1").mkdir(parents=True)
    (quiet / "attempt_0" / "1" / "stdout.log").write_text("")
    tidy_log_dirs(str(root), quiet)
    assert not quiet.exists()
    assert sorted(p.name for p in root.iterdir()) == sorted([p.name for p in old[-20:]] + ["notes"])


@pytest.mark.heavy
def test_env_reports_versions_os_memory_and_the_distributed_variables(monkeypatch, capsys):
    from ddpkit import __version__
    from ddpkit.tools._env import main as env_main

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("DDPKIT_RDZV_SECRET", "the-job-secret-that-must-not-be-printed")
    assert env_main(["--no-live"]) == 0
    out = capsys.readouterr().out
    for key in ("ddpkit", "numpy", "os", "memory"):
        assert any(line.startswith(key + " ") for line in out.splitlines()), (key, out)
    assert __version__ in out and "  NCCL_DEBUG=INFO" in out and "  SLURM_JOB_ID=42" in out
    assert "  DDPKIT_RDZV_SECRET=(set, not shown)" in out and "must-not-be-printed" not in out
    for name in list(os.environ):
        if name.startswith(
            (
                "SLURM_",
                "NCCL_",
                "GLOO_",
                "TORCHELASTIC_",
                "PMI_",
                "OMPI_",
                "PET_",
                "TORCH_",
                "DDPKIT_",
            )
        ) or name in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "NSLOTS",
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES",
            "MPI_LOCALRANKID",
            "MPI_LOCALNRANKS",
        ):
            monkeypatch.delenv(name)
    env_main(["--no-live"])
    assert "distributed variables set  none" in capsys.readouterr().out


def test_version_and_help_texts(capsys):
    from ddpkit import __version__
    from ddpkit.cli import main as cli_main

    assert (
        cli_main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"ddpkit {__version__}"
    )
    for args in (["--help"], ["run", "--help"], ["sbatch", "--help"], ["env", "--help"]):
        try:
            code = cli_main(args)
        except SystemExit as done:  # argparse's --help
            code = done.code
        out = capsys.readouterr().out
        assert code == 0, args
        assert "examples:" in out, args
        assert "``" not in out and ":func:" not in out and ":data:" not in out, args


def _failure(exitcode: int, timestamp: int, message: str | None = None):
    from types import SimpleNamespace

    data = {"message": {"message": message, "extraInfo": {"py_callstack": ""}}} if message else {}
    return SimpleNamespace(
        exitcode=exitcode,
        timestamp=timestamp,
        error_file_data=data,
        local_rank=0,
        pid=1,
        signal_name=lambda: f"signal {-exitcode}",
    )


def test_the_cause_of_a_failure_is_told_from_its_consequences():
    # Pure logic over torchrun's failure records (timestamps in whole seconds, often equal).
    from types import SimpleNamespace

    from ddpkit._launch.agent.failure import cause, exit_code

    lost = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"
    cases = [
        # (failures by rank, the rank that caused it, exit code)
        ({0: _failure(1, 10, lost), 1: _failure(1, 10, "ValueError: boom")}, 1, 1),
        # a SIGKILLed rank, a peer's consequence
        ({0: _failure(1, 9, lost), 1: _failure(-9, 10)}, 1, 137),
        (
            {
                0: _failure(-15, 10, "NotInitializedError: x"),
                1: _failure(1, 10, "NotInitializedError: x"),
            },
            1,
            1,
        ),
        ({0: _failure(-15, 10), 1: _failure(-12, 10), 2: _failure(3, 11)}, 2, 3),
        # pre-empted: saved, then stopped by the agent
        ({0: _failure(75, 10), 1: _failure(-15, 10)}, 0, 75),
    ]
    for failures, rank, code in cases:
        assert cause(failures)[0] == rank, failures
        assert exit_code(SimpleNamespace(failures=failures)) == code, failures


def test_a_worker_killed_otherwise_is_a_failure_even_when_the_others_saved_and_exited_75():
    # The survivors of a SIGKILL get the agent's SIGTERM as it tears the group down; a Trainer then
    # saves and exits 75. That is not a pre-emption: the job must be restarted (the search's kill
    # test caught this).
    from types import SimpleNamespace

    from ddpkit._launch.agent.failure import preempted

    def failures(*codes):
        return {rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(codes)}

    assert preempted(failures(75, 75)) and preempted(failures(75, -15))
    assert (
        not preempted(failures(75, -9))
        and not preempted(failures(1, 75))
        and not preempted(failures(-15, -15))
    )


def test_line_tagger_writes_whole_lines_and_throttles_redraws():
    import io

    from ddpkit._launch.cli.tail import PROGRESS_EVERY, LineTagger

    now = [100.0]
    dst = io.StringIO()
    tagger = LineTagger("[rank 1] ", dst, clock=lambda: now[0])
    for piece in (b"ab", b"c\nde", b"f\r\n", b"\r 1%", b"\r 2%", b"\r 3%"):
        tagger.feed(piece)
    now[0] += PROGRESS_EVERY / 2
    tagger.feed(b"\r 4%\r 5%")  # too soon after " 1%" was shown
    now[0] += PROGRESS_EVERY
    tagger.feed(b"\r 6%")
    tagger.feed(b"\r100%\n\xc3")
    tagger.feed(b"\xa9 end")
    tagger.close()
    assert dst.getvalue().splitlines() == [
        "[rank 1] abc",
        "[rank 1] def",
        "[rank 1]  1%",
        "[rank 1]  5%",
        "[rank 1] 100%",
        "[rank 1] \u00e9 end",
    ]


def _stopped_half_way(data: Any, fp: Any) -> None:
    """torch's handler writing its error file (``json.dump``), stopped after a few bytes."""
    import json

    fp.write(json.dumps(data)[:12])
    fp.flush()
    raise KeyboardInterrupt  # as a worker stopped there


def _stopped_before_the_rename(fd: int) -> None:
    """ddpkit's atomic write stopped with the record in the new file, not yet renamed."""
    raise KeyboardInterrupt


def test_a_workers_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A worker stopped while its error file is written leaves no file, where torch's own handler
    stopped half-way leaves a truncated one that the agent's poll fails to parse
    (torch's ProcessFailure raises, and the launcher ended on it). A write that completes gives the
    file torch reads, message and traceback."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

    from ddpkit._launch.agent.worker import WholeErrorFile

    def record(handler: ErrorHandler, name: str) -> Path:
        path = tmp_path / name
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        try:
            raise ValueError("bad input on rank 1")
        except ValueError as e:
            handler.record_exception(e)
        return path

    whole = record(WholeErrorFile(), "whole.json")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(whole))
    assert failure.message["message"] == "ValueError: bad input on rank 1"
    assert "bad input on rank 1" in failure.message["extraInfo"]["py_callstack"]

    # each stopped in the middle of its write
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _stopped_before_the_rename)
        with pytest.raises(KeyboardInterrupt):
            record(WholeErrorFile(), "ddpkit.json")
    with monkeypatch.context() as m:
        m.setattr(json, "dump", _stopped_half_way)
        with pytest.raises(KeyboardInterrupt):
            record(ErrorHandler(), "torch.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torch.json", "whole.json"]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file=str(tmp_path / "x"))
    assert failure.exitcode == -9  # no file: the exit status speaks
    # Control: torch's handler left a truncated file, on which torch's poll raises.
    with pytest.raises(json.JSONDecodeError):
        ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "torch.json"))


@pytest.mark.parametrize("whole", [True, False])
def test_a_scripts_own_record_stopped_half_way_never_leaves_the_agent_a_truncated_file(
    tmp_path, monkeypatch, whole
):
    """torchrun's documentation asks for torch's ``@record`` on a script's ``main``; its handler
    runs before the worker's. In a worker, ``record`` builds ddpkit's handler
    (``record_with(WholeErrorFile)``): stopped in the middle of its write, it leaves no file (the
    failure reads as its exit status); a write that completes gives the file torch reads. Control
    (``whole=False``): torch's handler stopped half-way leaves the agent a truncated file, on which
    its poll raises."""
    import json

    from torch.distributed.elastic.multiprocessing import errors
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddpkit._internals.elastic import record_with
    from ddpkit._launch.agent.worker import WholeErrorFile

    agent = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(agent))
    monkeypatch.setattr(errors, "get_error_handler", errors.get_error_handler)  # put back after
    if whole:
        record_with(WholeErrorFile)

    @errors.record  # as a script decorates its main, once the worker has started
    def main() -> None:
        raise ValueError("bad input on rank 1")

    with monkeypatch.context() as m:
        m.setattr(json, "dump", _stopped_half_way)
        m.setattr(os, "fsync", _stopped_before_the_rename)
        with pytest.raises(KeyboardInterrupt):
            main()
    if not whole:
        with pytest.raises(json.JSONDecodeError):
            ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(agent))
        return
    assert not agent.exists()
    assert ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(agent)).exitcode == -15
    with pytest.raises(ValueError):
        main()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(agent))
    assert failure.message["message"] == "ValueError: bad input on rank 1"
    assert "bad input on rank 1" in failure.message["extraInfo"]["py_callstack"]
