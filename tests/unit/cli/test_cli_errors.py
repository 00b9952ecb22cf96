"""Bad input to ``ddpkit plot``, ``bench`` and ``sbatch``: one line naming the option, exit code 2,
no traceback, and nothing written where it should not be. ``sbatch --dry-run`` writes the batch
script without submitting."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import cli
from ddpkit.tools import _bench as bench

pytestmark = pytest.mark.heavy

HELLO = str(Path(__file__).parents[2] / "jobs" / "scripts" / "hello.py")


def ddpkit(argv: list[str], capsys) -> tuple[int, str, str]:
    """``ddpkit ARGV`` in this process: (exit code, stdout, stderr). An exception escaping is a
    traceback."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(argv: list[str], capsys, option: str) -> str:
    code, out, err = ddpkit(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert option in lines[0] and "Traceback" not in err and out == ""
    return lines[0]


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


PLOT_CASES = {
    "binary metrics.jsonl": (
        lambda d: _run_dir(d, b"\x89PNG\r\n\x1a\n\x00\xff\xfe"),
        [],
        "not UTF-8 text",
    ),
    "record without a step": (
        lambda d: _run_dir(d, '{"kind": "train", "train/loss": 0.5}\n'),
        [],
        "line 1: a 'train' record without an integer 'step'",
    ),
    "metrics.jsonl a folder": (
        lambda d: (d / "metrics.jsonl").mkdir(parents=True) or d,
        [],
        "is not a file",
    ),
    "-o into a missing folder": (_run_dir, ["-o", "{tmp}/missing/curves.png"], "-o"),
    "-o unknown extension": (_run_dir, ["-o", "{tmp}/curves.xyz"], "-o"),
    "-o without extension": (_run_dir, ["-o", "{tmp}/curves"], "-o"),
    "-o a folder": (_run_dir, ["-o", "{tmp}/outdir"], "-o"),
}


@pytest.mark.parametrize("case", PLOT_CASES)
def test_plot_refuses_bad_input_in_one_line(tmp_path, capsys, case):
    make, options, expected = PLOT_CASES[case]
    (tmp_path / "outdir").mkdir()
    run_dir = make(tmp_path / "run")
    refused(["plot", str(run_dir), *(o.format(tmp=tmp_path) for o in options)], capsys, expected)
    # Nothing written: not the default image, not matplotlib's "<name>.png" next to a folder or a
    # bare name.
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("*.xyz"))


def test_plot_writes_the_format_of_its_extension_and_replaces_a_link_without_following_it(
    tmp_path, capsys
):
    run_dir = _run_dir(tmp_path / "run")
    for name, magic in (("curves.svg", b"<?xml"), ("curves.pdf", b"%PDF")):
        code, out, err = ddpkit(["plot", str(run_dir), "-o", str(tmp_path / name)], capsys)
        assert code == 0 and out == f"ddpkit plot: wrote {tmp_path / name}\n", err
        assert (tmp_path / name).read_bytes().startswith(magic)
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    (run_dir / "curves.png").symlink_to(victim)
    assert ddpkit(["plot", str(run_dir)], capsys)[0] == 0
    assert victim.read_text() == "untouched"
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG" and not (
        run_dir / "curves.png"
    ).is_symlink()


BENCH_CASES = {
    "--warmup": (["--warmup", "-5"], "--warmup -5"),
    "--latency-us nan": (["--latency-us", "nan"], "--latency-us nan"),
    "--latency-us negative": (["--latency-us", "-1"], "--latency-us -1"),
    "--bandwidth inf": (["--bandwidth", "inf"], "--bandwidth inf"),
    "--out a file": (["--out", "{tmp}/afile"], "--out"),
    "--out earlier results": (["--out", "{tmp}/earlier"], "--overwrite"),
    "--out under a file": (["--out", "{tmp}/afile/sub"], "--out"),
}


@pytest.fixture
def no_measuring(monkeypatch):
    """The refusals must come before any rank starts: measuring fails the test."""

    def measure(*args, **kwargs):
        raise AssertionError("a rank started before the options were checked")

    monkeypatch.setattr(bench, "run_bench", measure)


@pytest.mark.parametrize("case", BENCH_CASES)
def test_bench_refuses_bad_input_before_any_rank_starts(tmp_path, capsys, no_measuring, case):
    options, expected = BENCH_CASES[case]
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "bench.json").write_text('{"earlier": true}')
    refused(["bench", *(o.format(tmp=tmp_path) for o in options)], capsys, expected)
    assert (tmp_path / "afile").read_text() == "not a folder"
    assert (tmp_path / "earlier" / "bench.json").read_text() == '{"earlier": true}'


def test_bench_accepts_a_new_folder_and_earlier_results_with_overwrite(
    tmp_path, capsys, no_measuring
):
    # Control for the refusals above: the same options pass the checks and reach the measuring
    # (refused here).
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "bench.json").write_text("{}")
    for options in (
        ["--out", str(tmp_path / "new" / "folder")],
        ["--out", str(tmp_path / "earlier"), "--overwrite"],
        ["--warmup", "0", "--latency-us", "2.5", "--bandwidth", "25"],
    ):
        with pytest.raises(AssertionError, match="a rank started"):
            cli.main(["bench", *options])


def sbatch(tmp_path: Path, *options: str) -> list[str]:
    return ["sbatch", "--dry-run", "--output-dir", str(tmp_path / "logs"), *options, HELLO]


SBATCH_CASES = {
    "newline in --partition": (["--partition", "cpu\nrm -rf ~"], "--partition"),
    "newline in --account": (["--account", "acct\ntouch /tmp/pwned"], "--account"),
    "newline in --job-name": (["--job-name", "x\ntouch /tmp/pwned"], "--job-name"),
    "newline in --sbatch-option": (
        ["--sbatch-option=--mem=1G\ntouch /tmp/pwned"],
        "--sbatch-option",
    ),
    "carriage return in --time": (["--time", "10\r"], "--time"),
    "--job-name with a path": (["--job-name", "../../x"], "--job-name"),
    "--partition with a space": (["--partition", "cpu gpu"], "--partition"),
    "--signal-lead past --time": (["--time", "1", "--signal-lead", "600"], "--signal-lead 600"),
    "--signal-lead past --time MM:SS": (
        ["--time", "5:00", "--signal-lead", "300"],
        "--signal-lead 300",
    ),
    "--time not SLURM's": (["--time", "1:2:3:4"], "--time"),
    "--output-dir a file": (["--output-dir", "{tmp}/afile"], "--output-dir"),
    "--output-dir not UTF-8": (["--output-dir", os.fsdecode(b"{tmp}/logs-\xff")], "--output-dir"),
}


@pytest.mark.parametrize("case", SBATCH_CASES)
def test_sbatch_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, capsys, case):
    options, expected = SBATCH_CASES[case]
    (tmp_path / "afile").write_text("not a folder")
    refused(sbatch(tmp_path, *(o.format(tmp=tmp_path) for o in options)), capsys, expected)
    written = [p for p in tmp_path.rglob("*") if p.name != "afile"]
    assert (
        written == []
        and not Path("/tmp/pwned").exists()
        and not (tmp_path.parent / "x.sbatch").exists()
    )


def _sbatch_arguments(line: str) -> list[str]:
    """The arguments sbatch reads from an #SBATCH line: split at unquoted spaces, quotes group, a
    backslash escapes the next character, an unquoted # ends the line (SLURM's src/sbatch/opt.c,
    _get_argument)."""
    args, current, quote, escape, started = [], "", "", False, False
    for char in line.removeprefix("#SBATCH"):
        if escape:
            current, escape = current + char, False
        elif char == "\\":
            escape = started = True
        elif quote:
            if char == quote:
                quote = ""
            else:
                current += char
        elif char in "\"'":
            quote, started = char, True
        elif char == "#":
            break
        elif char.isspace():
            if started:
                args.append(current)
            current, started = "", False
        else:
            current, started = current + char, True
    return args + ([current] if started else [])


@pytest.mark.parametrize("folder", ["logs with space", "100% done", 'say "hi" #1', "back\\slash"])
def test_sbatch_quotes_an_output_folder_sbatch_and_bash_read_back(tmp_path, capsys, folder):
    out = tmp_path / folder
    code, stdout, err = ddpkit(
        [
            "sbatch",
            "--dry-run",
            "--output-dir",
            str(out),
            "--time",
            "1-2:30",
            "--signal-lead",
            "600",
            HELLO,
            "an arg; with $(shell)",
        ],
        capsys,
    )
    assert code == 0, err
    script = out / "hello.sbatch"
    text = script.read_text()
    (output,) = [line for line in text.splitlines() if line.startswith("#SBATCH --output")]
    # As SLURM reads it: one argument, the folder with its own % doubled (SLURM's %% is a literal
    # %).
    assert _sbatch_arguments(output) == [f"--output={str(out).replace('%', '%%')}/%x-%j.out"]
    # Every #SBATCH line comes before the first command, and bash parses the script.
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])
    assert "#SBATCH --time=1-2:30" in lines and "#SBATCH --signal=USR1@600" in lines
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "'an arg; with $(shell)'" in text


def test_sbatch_default_job_name_from_an_odd_script_name_is_safe(tmp_path, capsys):
    script = tmp_path / "my train (v2).py"
    script.write_text("print('hi')\n")
    code, stdout, err = ddpkit(
        ["sbatch", "--dry-run", "--output-dir", str(tmp_path / "logs"), str(script)], capsys
    )
    assert code == 0, err
    assert (tmp_path / "logs" / "my_train__v2_.sbatch").read_text().count(
        "#SBATCH --job-name=my_train__v2_\n"
    ) == 1


LONG = "a" * 300


@pytest.mark.parametrize(
    "argv, option",
    [
        (["run", "--rdzv-conf", "=", HELLO], "--rdzv-conf"),
        (["run", "--rdzv-conf", "a=1,=2", HELLO], "--rdzv-conf"),
        (["run", "--rdzv-id", LONG, HELLO], "--rdzv-id"),
        (["run", "--rdzv-id", "", HELLO], "--rdzv-id"),
        (["run", "--rdzv-id", "a/b", HELLO], "--rdzv-id"),
        (["run", LONG + ".py"], "script"),
        (["run", "-m", LONG], "module"),
        (["run", "--collective-timeout", "1e-300", HELLO], "--collective-timeout"),
        (["sbatch", "--dry-run", "--output-dir", "/proc/x", HELLO], "--output-dir"),
        (["sbatch", "--dry-run", "--output-dir", LONG, HELLO], "--output-dir"),
        (["sbatch", "--dry-run", "--nodes", "9" * 30, HELLO], "--nodes"),
        (["sbatch", "--dry-run", LONG + ".py"], "script"),
    ],
)
def test_hostile_values_are_one_line_errors_naming_the_option(
    argv, option, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    refused(argv, capsys, option)


def test_plot_output_name_too_long_is_one_line(tmp_path, capsys):
    run_dir = _run_dir(tmp_path / "run")
    refused(["plot", str(run_dir), "-o", str(tmp_path / (LONG + ".png"))], capsys, "-o")


def test_a_secret_that_is_not_text_is_one_line_naming_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPKIT_RDZV_SECRET", os.fsdecode(b"\xff" * 40))  # bytes that are not UTF-8
    refused(
        ["run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29461", HELLO],
        capsys,
        "DDPKIT_RDZV_SECRET",
    )


@pytest.mark.parametrize(
    "kind",
    [
        "fifo",
        *(
            pytest.param(k, marks=pytest.mark.slow)
            for k in ("folder", "/proc/self/mem", "/dev/zero")
        ),
    ],
)
def test_a_secret_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """A FIFO used to block the launch forever, waiting for a writer: a real process, with a
    timeout."""
    path = tmp_path / "secret"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "folder":
        path.mkdir(mode=0o700)
    else:
        path = Path(kind)
    argv = [
        "run",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "127.0.0.1:29462",
        "--rdzv-secret-file",
        str(path),
        HELLO,
    ]
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "--rdzv-secret-file" in lines[0], out.stderr


@pytest.mark.parametrize("command", ["bench", "check"])
def test_bench_and_check_refuse_an_abbreviated_option_as_run_does(capsys, no_measuring, command):
    # A script's own options follow these commands' (`ddpkit bench train.py --npro 2` is the
    # script's): an abbreviation would take one of them. Control: argparse's default reads
    # `--npro` as `--nproc`.
    code, out, err = ddpkit([command, "--npro", "2"], capsys)
    assert code == 2 and "unrecognized arguments: --npro" in err and out == "", err
    default = argparse.ArgumentParser()
    default.add_argument("--nproc", type=int)
    assert default.parse_args(["--npro", "2"]).nproc == 2
