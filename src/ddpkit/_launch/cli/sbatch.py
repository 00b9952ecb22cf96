"""``ddpkit sbatch``: write and submit a SLURM batch script that trains, survives pre-emption and
resumes: one task per GPU (or CPU share) under ``srun``; SIGUSR1 before the time limit, on which a
Trainer saves and exits 75, and the script then requeues the job (docs/many-machines.md).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit import _fs as fs
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit._launch.cli import options
from ddpkit._launch.cli.options import argument, shown


@dataclass(kw_only=True)
class BatchConfig:
    """What ``ddpkit sbatch`` asks SLURM for, and what it runs."""

    script: str
    """The training script, run as ``python SCRIPT ARGS`` by every task."""
    script_args: list[str] = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: int | None = None
    """Tasks (ranks) per node: the GPU count by default, else 1."""
    cpus_per_task: int | None = None
    time: str | None = None
    signal_lead: int = 120
    """Seconds before the time limit at which SIGUSR1 asks the job to save and stop."""
    job_name: str | None = None
    partition: str | None = None
    account: str | None = None
    output_dir: str = "slurm-logs"
    sbatch_options: list[str] = field(default_factory=list)
    python: str = sys.executable
    workdir: str = field(default_factory=os.getcwd)

    def __post_init__(self) -> None:
        for name, low, high in _RANGES:  # sbatch's --signal takes at most 65535 s
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: use {low} to {high}")
        for option, value in self._texts():
            _check_text(option, value)
        limit = time_limit_seconds(self.time) if self.time is not None else None
        if limit is not None and self.signal_lead >= limit:
            raise ConfigError(
                f"--signal-lead {self.signal_lead}: longer than the job may run (--time "
                f"{self.time} is {limit} s), so the signal to save and stop would be due before "
                "the job starts; give a shorter lead (with time left for a snapshot) or a longer "
                "--time"
            )
        if self.job_name is not None and not _JOB_NAME.fullmatch(self.job_name):
            raise ConfigError(
                f"--job-name {self.job_name!r}: use letters, digits and . _ + - only, starting "
                "with a letter or digit (it names the batch script and the output file in "
                "--output-dir)"
            )
        for option, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not re.fullmatch(r"[^\s\"'\\#]+", value):
                raise ConfigError(
                    f"{option} {value!r}: a SLURM name has no spaces, quotes, backslashes or #"
                )

    def _texts(self) -> list[tuple[str, str]]:
        """Every string that goes into the batch script, with what gave it."""
        out = [
            ("SCRIPT", self.script),
            ("--output-dir", self.output_dir),
            ("the current folder", self.workdir),
            ("the Python (sys.executable)", self.python),
        ]
        out += [("a script argument", a) for a in self.script_args]
        out += [("--sbatch-option", o) for o in self.sbatch_options]
        out += [
            (f"--{n.replace('_', '-')}", getattr(self, n))
            for n in ("job_name", "partition", "account", "time")
            if getattr(self, n) is not None
        ]
        return out

    @property
    def tasks_per_node(self) -> int:
        return self.ntasks_per_node or self.gpus_per_node or 1

    @property
    def name(self) -> str:
        return (
            self.job_name
            or re.sub(r"[^A-Za-z0-9._+-]", "_", Path(self.script).stem).lstrip(".-")
            or "ddpkit"
        )


_MAX_COUNT = 100_000
_RANGES = (
    ("nodes", 1, _MAX_COUNT),
    ("signal_lead", 0, 65535),
    ("gpus_per_node", 0, _MAX_COUNT),
    ("ntasks_per_node", 1, _MAX_COUNT),
    ("cpus_per_task", 1, _MAX_COUNT),
)
_MAX_TIME = 365 * 86400
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")
_SCRIPT_SINGLE_LINE = {
    "--sbatch-option", "--job-name", "--partition", "--account", "--time", "--output-dir",
}  # fmt: skip


def _check_text(option: str, value: str) -> None:
    """Refuse text that is not UTF-8, or a control character that would end an #SBATCH line."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"{option} {value.encode('utf-8', 'surrogateescape')!r}: not valid UTF-8, and the "
            "batch script is UTF-8 text: rename it (or the folder it is in)"
        ) from None
    if option in _SCRIPT_SINGLE_LINE and any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(
            f"{option} {value!r}: a line break or control character would end the #SBATCH line "
            "and run the rest as shell commands: remove it"
        )


_TIME = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+)(?::([0-9]+))?)?")


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a SLURM time limit (``MIN``, ``MIN:SEC``, ``H:MIN:SEC``, ``D-H``, ``D-H:MIN``,
    ``D-H:MIN:SEC``); None for no limit (``0``, ``UNLIMITED``, ``INFINITE``). Raises
    :class:`ConfigError` for anything else."""
    if text.lower() in ("unlimited", "infinite"):
        return None
    match = _TIME.fullmatch(text)
    if match is None:
        raise ConfigError(
            f"--time {text!r}: use MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS as SLURM "
            "does"
        )
    days, *clock = match.groups()
    numbers = [int(n) for n in clock if n is not None]
    # after D-: H[:MIN[:SEC]]; alone: MIN, MIN:SEC or H:MIN:SEC
    weights = (3600, 60, 1) if days is not None or len(numbers) == 3 else (60, 1)
    seconds = int(days or 0) * 86400 + sum(w * n for w, n in zip(weights, numbers, strict=False))
    if seconds > _MAX_TIME:
        raise ConfigError(f"--time {text[:40]!r}: at most 365 days; for no limit give UNLIMITED")
    return seconds or None  # SLURM reads a limit of 0 as none


def _sbatch_value(text: str) -> str:
    """``text`` as one argument on an #SBATCH line (split at spaces, quoted as a shell reads it)."""
    if re.fullmatch(r"[A-Za-z0-9_./%:=,@+-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def batch_script(cfg: BatchConfig) -> str:
    """The text of the batch script for ``cfg``."""
    out = Path(cfg.output_dir).absolute()
    lines = [
        "#!/bin/bash",
        f"# Written by `ddpkit sbatch`; submit with `sbatch {cfg.name}.sbatch`.",
        f"#SBATCH --job-name={cfg.name}",
        f"#SBATCH --nodes={cfg.nodes}",
        f"#SBATCH --ntasks-per-node={cfg.tasks_per_node}",
    ]
    for name in ("gpus_per_node", "cpus_per_task", "time", "partition", "account"):
        if getattr(cfg, name):
            lines.append(f"#SBATCH --{name.replace('_', '-')}={getattr(cfg, name)}")
    lines += [
        # To the tasks (not B:, the batch shell): the Trainer in each rank saves and exits 75.
        f"#SBATCH --signal=USR1@{cfg.signal_lead}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        # %x (job name) and %j (job id) are SLURM's; a % of the folder's own is written %%.
        f"#SBATCH --output={_sbatch_value(str(out).replace('%', '%%') + '/%x-%j.out')}",
        *(f"#SBATCH {option}" for option in cfg.sbatch_options),
        "",
        f"cd {shlex.quote(str(Path(cfg.workdir).absolute()))}",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}",
        'echo "ddpkit: job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on '
        '$SLURM_JOB_NODELIST"',
        "srun " + shlex.join([cfg.python, "-u", cfg.script, *cfg.script_args]),
        "code=$?",
        f"if [ $code -eq {PREEMPTED_EXIT_CODE} ]; then",
        '  echo "ddpkit: pre-empted after saving a snapshot; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $code",
        "",
    ]
    return "\n".join(lines)


def submit(cfg: BatchConfig, dry_run: bool = False) -> tuple[Path, str | None]:
    """Write ``OUTPUT_DIR/NAME.sbatch`` and, unless ``dry_run``, submit it; (path, job id)."""
    options.check_script(cfg.script)
    out = Path(cfg.output_dir)
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(
                f"--output-dir {shown(cfg.output_dir)} is a file: give a folder for the batch "
                "script and the job's output (it is created if missing)"
            )
        fs.make_dirs(out)
        path = out / f"{cfg.name}.sbatch"
        # the names it holds as their bytes: a path that is not UTF-8 runs as given
        fs.write_atomic(path, batch_script(cfg).encode("utf-8", "surrogateescape"))
    except OSError as err:  # /proc, a read-only file system, a name too long
        raise ConfigError(
            f"--output-dir {shown(cfg.output_dir)}: cannot write the batch script there "
            f"({err.strerror or err}): give a folder you can write to"
        ) from None
    if dry_run:
        return path, None
    if shutil.which("sbatch") is None:
        raise ConfigError(
            f"sbatch is not on PATH: run on a SLURM login node, or submit {path} there"
        )
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {path}: {done.stderr.strip()}")
    return path, done.stdout.strip().split(";")[0]


DESCRIPTION = """Write a SLURM batch script for SCRIPT and submit it.

Every task runs `python SCRIPT ARGS` and finds its rank with ddpkit.init(). Before the time limit
SLURM sends SIGUSR1; the Trainer saves a snapshot and exits with code 75, and the batch script
requeues the job, which resumes from the snapshot. Everything after SCRIPT is passed to the
script."""

EXAMPLES = """examples:
  ddpkit sbatch --nodes 2 --gpus-per-node 4 --time 4:00:00 train.py --lr 0.1
  ddpkit sbatch --ntasks-per-node 8 --cpus-per-task 4 --partition cpu train.py
  ddpkit sbatch --dry-run train.py        # write slurm-logs/train.sbatch only"""

OPTIONS = [
    argument("--nodes", type=int, default=1, help="nodes (default 1)"),
    argument("--gpus-per-node", type=int, default=0,
             help="GPUs per node, one task each (default 0: a CPU job)"),
    argument("--ntasks-per-node", type=int, default=None,
             help="tasks (ranks) per node (default: GPUs, else 1)"),
    argument("--cpus-per-task", type=int, default=None,
             help="cores per task; sets OMP_NUM_THREADS"),
    argument("--time", default=None, help="time limit, e.g. 4:00:00 (default: the partition's)"),
    argument("--signal-lead", type=int, default=120,
             help="seconds before the limit to save and stop (default 120)"),
    argument("--job-name", default=None, help="job name (default: the script's name)"),
    argument("--partition", default=None, help="SLURM partition"),
    argument("--account", default=None, help="SLURM account"),
    argument("--output-dir", default="slurm-logs",
             help="folder for the script and the job's output (slurm-logs)"),
    argument("--sbatch-option", action="append", default=[],
             help="another #SBATCH option, e.g. --mem=32G"),
    argument("--dry-run", action="store_true", help="write the batch script, do not submit it"),
    argument("script", help="training script"),
]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    usage = "ddpkit sbatch [options] SCRIPT [ARGS...]"
    parser = options.command_parser("ddpkit sbatch", usage, DESCRIPTION, EXAMPLES, OPTIONS)
    ns, script_args = options.parse_command(parser, OPTIONS, sys.argv[1:] if argv is None else argv)
    cfg = options.config_from(BatchConfig, ns, script_args, sbatch_options=ns.sbatch_option)
    path, job = submit(cfg, dry_run=ns.dry_run)
    print(f"batch script: {path}")
    if job:
        print(
            f"submitted job {job}; output: {Path(cfg.output_dir).absolute()}/{cfg.name}-{job}.out"
        )
    return 0
