"""ddpkit against nanoGPT's own training loop: the same model, data and hyper-parameters, time per
iteration.

Three variants train nanoGPT's ``GPT`` (from the checkout given with ``--nanogpt``, imported at run
time) on the same character-level data, 2 ranks over gloo on the CPU, with the same hyper-parameters
(``HYPER_PARAMETERS`` in ``bench/nanogpt_port.py``: 4 layers, 4 heads, width 128, 64 tokens, dropout
0, no bias, AdamW at 1e-3 with nanoGPT's warm-up and cosine, clipping at 1, 2 micro-batches of 8
sequences per rank and iteration):

- ``nanogpt``: nanoGPT's ``train.py``, launched as its README says
  (``torchrun --standalone --nproc_per_node 2 train.py --key=value ...``) from a temporary copy of
  the checkout, patched at run time to run DDP on the CPU (it assumes CUDA under DDP; the patch is
  printed);
- ``primitives``: ``bench/nanogpt_port.py``, nanoGPT's loop on ddpkit's primitives, under
  ``ddpkit run --nproc 2``;
- ``trainer``: ``bench/nanogpt_trainer.py``, the same on ddpkit's Trainer, under
  ``ddpkit run --nproc 2``.

The data: Python's own standard-library sources (``ddpkit.demo._datasets.python_source``: nothing is
downloaded), written once as nanoGPT's shakespeare_char prepare step writes its folder
(``train.bin`` and ``val.bin``, uint16 token ids; ``meta.pkl`` with ``vocab_size``).

Time per iteration is what each prints on rank 0 (``iter N: loss X, time Yms``: from one optimizer
step to the next, so data, forward, backward and its all-reduce, clipping, update and logging). The
first ``--skip`` iterations (warm-up) and those that start with an evaluation in any variant
(iterations 0 and the last) are dropped; per run, the median of the others. A round runs every
variant once, in an order that rotates (and reverses) from round to round, so that other load on the
machine falls on all; reported: each variant's median over rounds, and for ``primitives / nanogpt``
and ``trainer / nanogpt`` the median over rounds of the per-round ratio with a distribution-free 95%
interval. The same ``OMP_NUM_THREADS`` for every variant.

The port draws its random numbers as nanoGPT does (seed 1337 + rank, the global RNG for every
batch), so it must print nanoGPT's loss at every iteration and hold nanoGPT's weights and AdamW
state at the last evaluation's checkpoint; the largest loss difference and the checkpoints'
comparison are reported for every round. The Trainer draws its batches from a shuffled sampler
instead: its losses are not compared.

    git clone https://github.com/karpathy/nanoGPT ~/nanoGPT
    # 8 rounds x 40 iterations, ~5 minutes
    python bench/nanogpt.py --nanogpt ~/nanoGPT
    # a quick check
    python bench/nanogpt.py --nanogpt ~/nanoGPT --rounds 2 --iters 20
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import math
import os
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from nanogpt_port import GET_NANOGPT, HYPER_PARAMETERS
from trainer_overhead import median_interval

from ddpkit.demo._datasets import CHARS, IGNORE_INDEX, python_source
from ddpkit.platforms._cpus import cpu_count

BENCH = Path(__file__).resolve().parent
VARIANTS = ("nanogpt", "primitives", "trainer")
DATASET = "python_stdlib"
ITER = re.compile(r"^iter (\d+): loss (\S+), time ([\d.]+)ms", re.M)
EVAL = re.compile(r"^step (\d+): train loss", re.M)

# nanoGPT's train.py under DDP sets the device to cuda:LOCAL_RANK and passes it to DDP. Removed
# here: the device is then --device=cpu, and DDP wraps a CPU module (device_ids must be None there);
# --backend=gloo.
PATCH = (
    ("device = f'cuda:{ddp_local_rank}'", None),
    ("torch.cuda.set_device(device)", None),
    ("model = DDP(model, device_ids=[ddp_local_rank])", "model = DDP(model)"),
)


def patch_train_py(path: Path) -> str:
    """Apply PATCH to nanoGPT's train.py at ``path``; return the unified diff."""
    before = path.read_text().splitlines(keepends=True)
    edits = {}
    for old, new in PATCH:
        found = [k for k, line in enumerate(before) if line.strip() == old]
        if len(found) != 1:
            raise SystemExit(
                f"{path}: {len(found)} lines read {old!r} where the CPU patch expects one; "
                "this nanoGPT's train.py differs from the one the patch was written for"
            )
        line = before[found[0]]
        edits[found[0]] = (
            [] if new is None else [line[: len(line) - len(line.lstrip())] + new + "\n"]
        )
    after = [new for k, line in enumerate(before) for new in edits.get(k, [line])]
    path.write_text("".join(after))
    return "".join(difflib.unified_diff(before, after, "train.py", "train.py (patched)", n=0))


def prepare_data(folder: Path, train_chars: int, val_chars: int) -> int:
    """nanoGPT's data folder from the standard library's sources; returns the training tokens."""
    folder.mkdir(parents=True)
    sizes = {}
    for split, name, chars in (("train", "train", train_chars), ("test", "val", val_chars)):
        tokens, labels = python_source(split, HYPER_PARAMETERS["block_size"], chars).tensors
        # The windows' inputs whose label counts, in order: each file's text but its last character,
        # the files one after the other (the padding of each file's last window is left out).
        stream = tokens[labels != IGNORE_INDEX].numpy().astype(np.uint16)
        stream.tofile(folder / f"{name}.bin")
        sizes[name] = len(stream)
    meta = {
        "vocab_size": len(CHARS),
        "itos": dict(enumerate(CHARS)),
        "stoi": {c: i for i, c in enumerate(CHARS)},
    }
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return sizes["train"]


def run(name: str, command: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise SystemExit(f"{name} failed (exit code {done.returncode}):\n{tail}")
    return done.stdout


def parse(output: str) -> tuple[dict[int, tuple[float, float]], set[int]]:
    """(loss and ms by iteration, the iterations that ran an evaluation) from rank 0's lines."""
    lines = {int(n): (float(loss), float(ms)) for n, loss, ms in ITER.findall(output)}
    if not lines:
        raise SystemExit(f"no 'iter N: loss X, time Yms' line in:\n{output[-2000:]}")
    return lines, {int(n) for n in EVAL.findall(output)}


def same_checkpoints(theirs: Path, ours: Path) -> float:
    """The largest |difference| between two ckpt.pt's weights and AdamW state (0.0: equal, bit for
    bit)."""
    a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in (theirs, ours))
    if a["model"].keys() != b["model"].keys() or a["iter_num"] != b["iter_num"]:
        return math.inf
    pairs = [(a["model"][k], b["model"][k]) for k in a["model"]]
    for k, state in a["optimizer"]["state"].items():
        pairs += [(t, b["optimizer"]["state"][k][name]) for name, t in state.items()]
    if all(torch.equal(x, y) for x, y in pairs):
        return 0.0
    return max(float((x.double() - y.double()).abs().max()) for x, y in pairs)


def commands(a: argparse.Namespace, checkout: Path, tmp: Path, data: Path) -> dict[str, list[str]]:
    """Each variant's command line, run in the patched copy of nanoGPT; the ports get their out_dir
    last."""
    last = a.iters - 1
    # One evaluation at iteration 0 and one at the last, both left out of the timing; the last one
    # writes the checkpoints compared. The lr decays to min_lr at the last iteration.
    hyper = {**HYPER_PARAMETERS, "max_iters": last, "lr_decay_iters": last, "eval_interval": last}
    keys = [f"--{k}={v}" for k, v in hyper.items()]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(a.nproc),
    ]
    nanogpt = [
        "train.py",
        f"--dataset={DATASET}",
        "--device=cpu",
        "--backend=gloo",
        "--dtype=float32",
    ]
    ddpkit = Path(sys.executable).with_name("ddpkit")
    ddpkit_run = [str(ddpkit)] if ddpkit.exists() else [sys.executable, "-m", "ddpkit.cli"]
    ddpkit_run += ["run", "--nproc", str(a.nproc), "--log-dir", str(tmp / "ddpkit-logs")]
    ours = ["--nanogpt", str(checkout.resolve()), "--data", str(data), *keys, "--out_dir"]
    return {
        "nanogpt": [*torchrun, *nanogpt, "--compile=False", *keys],
        "primitives": [*ddpkit_run, str(BENCH / "nanogpt_port.py"), *ours],
        "trainer": [*ddpkit_run, str(BENCH / "nanogpt_trainer.py"), *ours],
    }


def header(a: argparse.Namespace, checkout: Path, threads: int, tokens: int) -> str:
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True
    )
    h = HYPER_PARAMETERS
    return (
        f"date {datetime.datetime.now():%Y-%m-%d %H:%M}  machine {platform.machine()}, "
        f"{cpu_count()} cores, load average {os.getloadavg()[0]:.1f}  python "
        f"{platform.python_version()}  torch {torch.__version__}  nanoGPT "
        f"{commit.stdout.decode().strip() or checkout}\nconfig: {a.nproc} ranks (gloo, CPU, "
        f"{threads} thread(s) each); nanoGPT's GPT, {h['n_layer']} layers, {h['n_head']} heads, "
        f"width {h['n_embd']}, {h['block_size']} tokens, dropout {h['dropout']}, bias {h['bias']}, "
        f"vocabulary {len(CHARS)}; {tokens:,} training tokens (the standard library's sources); "
        f"AdamW lr {h['learning_rate']}, warm-up {h['warmup_iters']} then cosine to {h['min_lr']}, "
        f"weight decay {h['weight_decay']}, clip {h['grad_clip']}; "
        f"{h['gradient_accumulation_steps'] // a.nproc} micro-batches of {h['batch_size']} "
        f"sequences per rank and iteration; {a.rounds} rounds x {a.iters} iterations, the first "
        f"{a.skip} and the evaluations (iterations 0 and {a.iters - 1}) left out"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nanogpt", help=f"a nanoGPT checkout ({GET_NANOGPT})")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument(
        "--iters", type=int, default=40, help="iterations per run (nanoGPT's max_iters + 1)"
    )
    p.add_argument(
        "--skip", type=int, default=5, help="first iterations of each run left out (warm-up)"
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--train-chars", type=int, default=1_000_000, help="characters of training text")
    a = p.parse_args()
    checkout = Path(a.nanogpt).expanduser() if a.nanogpt else None
    if (
        checkout is None
        or not (checkout / "train.py").is_file()
        or not (checkout / "model.py").is_file()
    ):
        where = f"{a.nanogpt} is not a nanoGPT checkout" if a.nanogpt else "no --nanogpt PATH given"
        sys.exit(f"{where}: get one with `{GET_NANOGPT}` and pass --nanogpt nanoGPT")
    if a.iters <= max(a.skip, HYPER_PARAMETERS["warmup_iters"]) + 1:
        sys.exit(f"--iters {a.iters}: too few for {a.skip} warm-up iterations and the lr warm-up")
    threads = max(1, cpu_count() // a.nproc)
    # torchrun gives each worker OMP_NUM_THREADS=1 when unset, ddpkit run cores // nproc: the same
    # for all. The port matches nanoGPT bit for bit only at the same thread count (a matmul's sums
    # are split by thread).
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    loss_diffs, weight_diffs = [], []
    with tempfile.TemporaryDirectory(prefix="ddpkit-nanogpt-") as name:
        tmp = Path(name)
        work = tmp / "nanoGPT"
        shutil.copytree(checkout, work, ignore=shutil.ignore_patterns(".git", "out", "data"))
        diff = patch_train_py(work / "train.py")
        data = work / "data" / DATASET
        tokens = prepare_data(data, a.train_chars, a.train_chars // 10)
        cmds = commands(a, checkout, tmp, data)
        print(header(a, checkout, threads, tokens))
        print("nanoGPT's train.py, patched in a copy to run DDP on the CPU:\n" + diff.rstrip())
        for variant, cmd in cmds.items():
            out_dir = "" if variant == "nanogpt" else f" $TMP/{variant}-<round>"
            print(
                f"{variant} (in $TMP/nanoGPT): {' '.join(cmd).replace(str(tmp), '$TMP')}{out_dir}"
            )
        print(
            "round  order                           nanogpt ms  primitives ms  trainer ms  |loss "
            "diff|  |ckpt diff|"
        )
        for r in range(a.rounds):
            k = r % len(VARIANTS)
            order = list(VARIANTS[k:] + VARIANTS[:k])
            # every variant in every place, before and after each
            order = order if r % 2 == 0 else order[::-1]
            out_dirs = {v: [str(tmp / f"{v}-{r}")] for v in ("primitives", "trainer")}
            runs = {v: parse(run(v, cmds[v] + out_dirs.get(v, []), work, env)) for v in order}
            # An iteration that starts with an evaluation (and a checkpoint) in any variant is
            # dropped from all, so that every variant is timed over the same iterations.
            dropped = set(range(a.skip)).union(*(evaluated for _, evaluated in runs.values()))
            for v, (lines, _) in runs.items():
                ms[v].append(
                    statistics.median(t for n, (_, t) in lines.items() if n not in dropped)
                )
            theirs, ours = runs["nanogpt"][0], runs["primitives"][0]
            if theirs.keys() != ours.keys():
                sys.exit(
                    f"round {r}: nanogpt printed iterations {sorted(theirs)}, primitives "
                    f"{sorted(ours)}"
                )
            loss_diffs.append(
                max(abs(theirs[n][0] - ours[n][0]) for n in theirs.keys() | ours.keys())
            )
            weight_diffs.append(
                same_checkpoints(work / "out" / "ckpt.pt", tmp / f"primitives-{r}" / "ckpt.pt")
            )
            times = "".join(f"{ms[v][-1]:{len(v) + 3}.2f}  " for v in VARIANTS)
            print(
                f"{r:5d}  {', '.join(order):30s}  {times}{loss_diffs[-1]:11.4f}  "
                f"{weight_diffs[-1]:11.3g}"
            )

    print(
        f"ms per iteration ({a.iters - len(dropped)} timed per run), median over rounds: "
        + ", ".join(f"{v} {statistics.median(ms[v]):.2f}" for v in VARIANTS)
    )
    print("time per iteration, median over rounds of the per-round ratio (95% interval):")
    for variant in ("primitives", "trainer"):
        ratios = sorted(x / y for x, y in zip(ms[variant], ms["nanogpt"]))
        lo, hi = median_interval(ratios)
        print(f"  {variant} / nanogpt: {statistics.median(ratios):.3f} ({lo:.3f}-{hi:.3f})")
    equal = sum(d == 0.0 for d in weight_diffs)
    print(
        f"primitives vs nanogpt: losses at all {a.iters} iterations of each round, largest "
        f"|difference| {max(loss_diffs):.4f} (nanoGPT prints 4 decimals); weights and AdamW state "
        f"after {a.iters - 1} updates equal bit for bit in {equal} of {a.rounds} rounds"
        + ("" if equal == a.rounds else f", else largest |difference| {max(weight_diffs):.3g}")
    )


if __name__ == "__main__":
    main()
