"""Every option of every ``ddpkit`` command, and every ``DDPKIT_*`` variable ddpkit reads, fed
hostile values.

The options are found from the parsers themselves (argparse's ``_actions``), so a new option is
fuzzed without a change here. Each value must be refused with a usage error naming the option (exit
code 2, the error on one line, no traceback) within seconds, or accepted: a stand-in for the work
each command would start (torchrun, the measurement, the comparison) stops the command once its
options are checked. A traceback or a hang fails.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import cli

HELLO = str(Path(__file__).parents[2] / "jobs" / "scripts" / "hello.py")
SRC = Path(__file__).parents[3] / "src" / "ddpkit"
SECONDS = 10  # the most one value may take, refused or accepted


class Accepted(Exception):
    """The command checked its options and was about to start its work."""


class Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(command: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``ddpkit COMMAND`` builds, taken as it parses."""

    def caught(self, *args, **kwargs):
        raise Parser(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", caught)
        try:
            cli.main([command, HELLO])
        except Parser as found:
            return found.parser
    raise AssertionError(f"ddpkit {command} parsed no arguments")


def _value_options(parser: argparse.ArgumentParser) -> list[str]:
    return [
        action.option_strings[-1]
        for action in parser._actions
        if action.option_strings
        and action.nargs != 0
        and not isinstance(action, argparse._HelpAction)
    ]


# What each command needs besides the fuzzed option, so that only that option is wrong.
POSITIONALS = {
    "run": [HELLO],
    "sbatch": ["--dry-run", HELLO],
    "plot": ["{run_dir}"],
    "bench": [],
    "check": [],
}


# Options whose value is a name, which a run of 30 digits may well be; every other option is a
# number or a choice, and must refuse 10^30 - 1.
NAMES = {
    ("run", "--log-dir"),
    ("run", "--rdzv-id"),
    ("run", "--rdzv-secret-file"),  # read only for a job on several nodes
    ("sbatch", "--job-name"),
    ("sbatch", "--partition"),
    ("sbatch", "--account"),
    ("sbatch", "--output-dir"),
    ("sbatch", "--sbatch-option"),
    ("bench", "--out"),
}


def hostile_values(tmp_path: Path) -> dict[str, str]:
    fifo = tmp_path / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo, 0o600)
    (tmp_path / "folder").mkdir(exist_ok=True)
    return {
        "huge": "9" * 30,
        "negative": "-1",
        "zero": "0",
        "tiny": "1e-300",
        "nan": "nan",
        "inf": "inf",
        "empty": "",
        "not UTF-8": os.fsdecode(b"\xff\xfe"),
        "300 chars": "a" * 300,
        "a FIFO": str(fifo),
        "a folder": str(tmp_path / "folder"),
        "/proc/x": "/proc/x",
    }


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """Stop each command where its work would start; restore what ``ddpkit run`` sets in this
    process."""
    import ddpkit._launch.cli.run as launcher
    import ddpkit.tools._bench as bench
    import ddpkit.tools._check as check

    def accepted(*args, **kwargs):
        raise Accepted

    monkeypatch.setattr(launcher, "torchrun_argv", accepted)
    monkeypatch.setattr(launcher.proctree, "become_subreaper", lambda: False)
    monkeypatch.setattr(bench, "run_bench", accepted)
    monkeypatch.setattr(check, "run_check", accepted)
    # so that an endpoint is looked at
    monkeypatch.setenv("DDPKIT_RDZV_SECRET", "0123456789abcdef" * 4)
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _alarm(signum, frame):
    raise TimeoutError(f"no answer within {SECONDS} s")


def _outcome(argv: list[str], capsys) -> tuple[str, int | None, str]:
    """('accepted' | 'refused' | 'crashed: ...', exit code, stderr) of ``ddpkit ARGV`` in this
    process."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS)
    code: int | None = None
    try:
        code = cli.main(argv)
        kind = "accepted"  # finished (sbatch --dry-run, plot)
    except Accepted:
        kind = "accepted"
    except SystemExit as stop:  # argparse's usage error
        code = stop.code if isinstance(stop.code, int) else 1
        kind = "refused"
    except BaseException as err:  # noqa: BLE001 - whatever escapes is the defect this test looks for
        kind = f"crashed: {type(err).__name__}: {err}"[:300]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    if kind == "accepted" and code == 2:
        kind = "refused"
    return kind, code, err


def _option_names(option: str, parser: argparse.ArgumentParser) -> set[str]:
    for action in parser._actions:
        if option in action.option_strings:
            return set(action.option_strings) | {action.dest}
    return {option}


@pytest.mark.parametrize("command", ["run", "sbatch", "plot", "bench", "check"])
def test_every_option_refuses_hostile_values_in_one_line_or_accepts_them(
    command, tmp_path, capsys, monkeypatch, stand_ins
):
    parser = _parser_of(command, monkeypatch)
    options = _value_options(parser)
    assert options, command
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 1, "time": 0.0, "train/loss": 1.0}\n'
    )
    rest = [a.replace("{run_dir}", str(run_dir)) for a in POSITIONALS[command]]
    problems = []
    for option in options:
        for name, value in hostile_values(tmp_path).items():
            environ = dict(os.environ)
            kind, code, err = _outcome([command, option, value, *rest], capsys)
            # `ddpkit run` sets its workers' variables here, and drops the secret
            os.environ.clear()
            os.environ.update(environ)
            lines = err.strip().splitlines()
            names = _option_names(option, parser)
            if kind.startswith("crashed") or "Traceback" in err:
                problems.append(f"{option} {name}: {kind} {err[-300:]}")
            elif kind == "refused" and not (
                code == 2 and lines and "error:" in lines[-1] and any(n in lines[-1] for n in names)
            ):
                problems.append(
                    f"{option} {name}: exit {code}, not one line naming the option: {err[-300:]!r}"
                )
            elif kind == "accepted" and name == "huge" and (command, option) not in NAMES:
                problems.append(
                    f"{option} {name}: accepted 10^30 - 1, which no count or duration should be"
                )
    assert not problems, "\n".join(problems)


# The positional argument of each command, and what else it needs.
POSITIONAL = {"run": [], "sbatch": ["--dry-run"], "plot": [], "bench": [], "check": []}


@pytest.mark.parametrize("command", sorted(POSITIONAL))
def test_every_positional_argument_refuses_hostile_values_in_one_line_or_accepts_them(
    command, tmp_path, capsys, monkeypatch, stand_ins
):
    parser = _parser_of(command, monkeypatch)
    positionals = [a for a in parser._actions if not a.option_strings]
    assert len(positionals) == 1, positionals
    problems = []
    for name, value in hostile_values(tmp_path).items():
        environ = dict(os.environ)
        kind, code, err = _outcome([command, *POSITIONAL[command], value], capsys)
        os.environ.clear()
        os.environ.update(environ)
        lines = err.strip().splitlines()
        if kind.startswith("crashed") or "Traceback" in err:
            problems.append(f"{positionals[0].dest} {name}: {kind} {err[-300:]}")
        elif kind == "refused" and not (code == 2 and lines and "error:" in lines[-1]):
            problems.append(
                f"{positionals[0].dest} {name}: exit {code}, not a one-line error: {err[-300:]!r}"
            )
    assert not problems, "\n".join(problems)


def _variables_read() -> set[str]:
    """Every DDPKIT_* variable the package's source names."""
    found = set()
    for path in SRC.rglob("*.py"):
        found |= set(re.findall(r"\bDDPKIT_[A-Z0-9_]+\b", path.read_text()))
    return found


# Variables the launcher sets for its workers and reads back there; a user who sets them sets them
# for a worker, and ddpkit.init() checks them (DDPKIT_COLLECTIVE_TIMEOUT) or uses them as paths it
# owns.
def test_the_environment_variables_are_known(capsys):
    assert {"DDPKIT_RDZV_SECRET", "DDPKIT_COLLECTIVE_TIMEOUT"} <= _variables_read()


@pytest.mark.slow  # a launcher process per value; in-process: test_cli_errors.py
@pytest.mark.parametrize("value", [os.fsencode(os.fsdecode(b"\xff\xfe")) * 20, b"", b"nan", b"-1"])
def test_the_rendezvous_secret_variable_is_checked_in_one_line(value, tmp_path):
    env_b = {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}
    env_b[b"DDPKIT_RDZV_SECRET"] = value
    # An endpoint on this machine where nothing listens: a secret let through would end there, in a
    # wait.
    endpoint = ["--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "1", "--join-timeout", "1"]
    argv = [sys.executable, "-m", "ddpkit.cli", "run", "--nnodes", "2", *endpoint, HELLO]
    out = subprocess.run(
        [os.fsencode(a) for a in argv], env=env_b, capture_output=True, timeout=60, cwd=tmp_path
    )
    err = out.stderr.decode(errors="replace").strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "DDPKIT_RDZV_SECRET" in err[0], err


def test_a_long_secret_of_letters_is_accepted():
    # Control for the refusals above: the check lets a usable secret through.
    from ddpkit._launch.rendezvous.auth import load_secret

    assert load_secret(None, {"DDPKIT_RDZV_SECRET": "x" * 300}) == b"x" * 300


@pytest.mark.parametrize(
    "name", ["huge", "negative", "zero", "tiny", "nan", "inf", "empty", "not UTF-8", "300 chars"]
)
def test_the_collective_timeout_variable_is_checked_before_any_worker(
    name, tmp_path, capsys, stand_ins, monkeypatch
):
    monkeypatch.setenv("DDPKIT_COLLECTIVE_TIMEOUT", hostile_values(tmp_path)[name])
    kind, code, err = _outcome(["run", HELLO], capsys)
    assert kind == "refused" and code == 2 and err.count("\n") == 1, (kind, err)
    assert err.startswith("ddpkit run: error: DDPKIT_COLLECTIVE_TIMEOUT "), err
    monkeypatch.setenv("DDPKIT_COLLECTIVE_TIMEOUT", "30")  # control: a usable value is accepted
    assert _outcome(["run", HELLO], capsys)[0] == "accepted"
