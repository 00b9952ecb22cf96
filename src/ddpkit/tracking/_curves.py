"""``ddpkit plot RUN_DIR``: the training and validation curves of a run, from its ``metrics.jsonl``,
to a PNG: one panel per quantity (the losses together, each other validation metric, the learning
rate, the speed, each rank's busy time) against the optimizer step; of a step recorded twice (work
redone after a crash), the later record. Needs matplotlib: ``pip install 'ddpkit[plot]'``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError


def read_curves(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """``{name: {step: value}}`` for every numeric value of the train, epoch and test records, and
    each rank's busy time per step (``busy_ms/rank0``, ...) from the ``ranks`` records."""
    path = Path(run_dir) / "metrics.jsonl"
    refuse_bad_name(path, "RUN_DIR", "give the run directory")
    if not path.is_file():
        what = f"{path} is not a file" if path.exists() else f"no {path}"
        raise ConfigError(
            f"{what}: give the run directory of a Trainer run (TrainerConfig.run_dir)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(
            f"{path} is not a metrics file (not UTF-8 text): give the run directory of a Trainer "
            "run (TrainerConfig.run_dir)"
        ) from None
    curves: dict[str, dict[int, float]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if not isinstance(record, dict) or record.get("kind") not in _KINDS:
            continue
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ConfigError(
                f"{path} line {number}: a {record['kind']!r} record without an integer 'step': not "
                "a Trainer's metrics file; give the run directory of a Trainer run"
            )
        if record["kind"] == "ranks":
            busy = record.get("busy_ms")
            named = {
                f"busy_ms/rank{r}": v for r, v in enumerate(busy if isinstance(busy, list) else [])
            }
        else:
            named = {k: v for k, v in record.items() if k not in ("kind", "step", "time", "epoch")}
        for name, value in named.items():
            if type(value) in (int, float) and math.isfinite(value):  # JSON's numbers, not bool
                curves.setdefault(name, {})[step] = float(value)
    return curves


_KINDS = ("train", "epoch", "val", "test", "ranks")


SPEED = ("samples_per_s", "tokens_per_s", "mfu")
RANKS_PANEL = "busy ms per step, by rank (step time less comm wait)"


def panels(curves: dict[str, dict[int, float]]) -> list[tuple[str, list[str]]]:
    """How the curves are grouped: (title, names) per panel."""
    losses = [n for n in curves if n.endswith("loss")]
    ranks = sorted(
        (n for n in curves if n.startswith("busy_ms/rank")),
        key=lambda n: int(n.removeprefix("busy_ms/rank")),
    )
    skip = {"ms_per_step", "epoch_seconds", "grad_norm", "lr", *losses, *SPEED, *ranks}
    out = [("loss", losses)] if losses else []
    out += [(n, [n]) for n in curves if n not in skip]
    out += [("lr", ["lr"])] if "lr" in curves else []
    out += [(n, [n]) for n in SPEED if n in curves]
    out += [(RANKS_PANEL, ranks)] if ranks else []
    return out


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of ``run_dir`` to ``out`` (default ``run_dir/curves.png``); return its path.

    The format follows ``out``'s extension (``.png``, ``.svg``, ``.pdf``, ...). The file is written
    whole or not at all, by a rename that replaces a link at its name rather than writing through
    it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as err:
        raise ImportError("ddpkit plot needs matplotlib: pip install 'ddpkit[plot]'") from err
    curves = read_curves(run_dir)
    path = Path(out) if out is not None else Path(run_dir) / "curves.png"
    kind = _check_out(path, FigureCanvasBase.get_supported_filetypes(), out is not None)
    groups = panels(curves)
    if not groups:
        raise ConfigError(
            f"{Path(run_dir) / 'metrics.jsonl'} holds no training or validation record yet"
        )
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(7, 2.6 * len(groups)), sharex=True, squeeze=False
    )
    for ax, (title, names) in zip(axes[:, 0], groups):
        for name in names:
            steps = sorted(curves[name])
            style = "-" if name.startswith("train/") and name != "train/epoch_loss" else "o-"
            ax.plot(steps, [curves[name][s] for s in steps], style, label=name, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(shown(run_dir), fontsize=10)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=kind, dpi=100)
    plt.close(fig)
    try:
        fs.write_atomic(path, image.getvalue())
    except OSError as err:
        raise ConfigError(
            f"cannot write {path}: {err.strerror}: give -o a file in a folder you can write to"
        ) from None
    return path


def _check_out(path: Path, formats: dict[str, str], given: bool) -> str:
    """The image format of ``path`` (its extension); a :class:`ConfigError` names what to change."""
    option = "-o" if given else "the default output"
    refuse_bad_name(path, option, "give a shorter file name")
    if path.is_dir():
        raise ConfigError(
            f"{option} {str(path)!r} is a folder: give a file name, e.g. "
            f"{str(path / 'curves.png')!r}"
        )
    if not path.parent.is_dir():
        raise ConfigError(
            f"{option} {str(path)!r}: the folder {str(path.parent)!r} does not exist: create it, "
            "or give a file in an existing folder"
        )
    kind = path.suffix.lower().removeprefix(".")
    if kind not in formats:
        raise ConfigError(
            f"{option} {str(path)!r}: give a file name ending in an image format matplotlib writes "
            f"({', '.join('.' + k for k in sorted(formats))})"
        )
    return kind


def refuse_bad_name(path: Path, option: str, fix: str) -> None:
    """A :class:`ConfigError` naming ``option`` and ``fix`` when the file system refuses ``path``'s
    name (one longer than it allows)."""
    try:
        path.exists()
    except OSError as err:
        text = str(path)
        if len(text) > 80:
            text = f"{text[:80]}... ({len(text)} characters)"
        raise ConfigError(f"{option} {text!r}: {err.strerror}: {fix}") from None


def shown(path: str | Path) -> str:
    """``path`` as text that prints: bytes of a name that are not UTF-8 are shown as \\xNN."""
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddpkit plot",
        description="Draw a run's training and validation curves from RUN_DIR/metrics.jsonl to a "
        "PNG.",
        epilog="example: ddpkit plot runs/digits        # writes runs/digits/curves.png",
    )
    parser.add_argument("run_dir", help="the run directory (TrainerConfig.run_dir)")
    parser.add_argument(
        "-o",
        "--out",
        help="the image to write, its format from its extension: .png, .svg, .pdf, ... (default: "
        "RUN_DIR/curves.png)",
    )
    args = parser.parse_args(argv)
    print(f"ddpkit plot: wrote {shown(plot(args.run_dir, args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
