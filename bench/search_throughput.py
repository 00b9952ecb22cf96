"""How fast a search finishes candidates with k ranks per candidate, and what the search machinery
costs.

A 2-rank job (gloo, CPU) runs the same budget of candidates twice on the digits CNN, each candidate
a fixed amount of training (so the two runs do the same work):
- k = 1: two groups of one rank, two candidates at a time;
- k = 2: one group of both ranks, one candidate at a time on all ranks (DDP), i.e. one after
  another.
Reported: candidates finished per minute for each, and the overhead per candidate: wall time of the
search the gap between the end of one candidate's objective and the start of the next on the same
group (telling the result, the progress line, asking for the next, the broadcasts of the parameters
and of the outcome), the median over all gaps of all groups. Target: under 50 ms.

    python bench/search_throughput.py                    # 8 candidates of 3 epochs each
    python bench/search_throughput.py --trials 12 --epochs 2
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import ddpkit
from ddpkit.demo._datasets import digits
from ddpkit.search import SearchConfig, choice, search, uniform
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._trainer import Trainer, TrainerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits_cnn import Net  # noqa: E402


def _job(search_dir: str, k: int, trials: int, epochs: int) -> dict:
    ddpkit.init()
    train_set, val_set = digits("train"), digits("test")
    spans: list[tuple[float, float]] = []

    def objective(candidate):
        t0 = time.perf_counter()
        ddpkit.seed_everything(0)
        model = Net(8, channels=candidate.params["channels"])
        config = TrainerConfig(
            run_dir=str(candidate.run_dir),
            epochs=epochs,
            global_batch_size=64,
            num_workers=0,
            logging=LoggingConfig(progress=False),
            snapshot=SnapshotConfig(every_epochs=0),
        )
        trainer = Trainer(
            model,
            torch.optim.Adam(model.parameters(), lr=candidate.params["lr"]),
            train_set,
            config,
            val_data=val_set,
            group=candidate.group,
        )
        metrics = trainer.fit()
        spans.append((t0, time.perf_counter()))
        return metrics

    t0 = time.perf_counter()
    search(
        objective,
        {"lr": uniform(1e-3, 1e-2, log=True), "channels": choice([16])},
        SearchConfig(
            n_trials=trials, group_size=k, pruner="none", search_dir=search_dir, plots=False
        ),
    )
    wall = time.perf_counter() - t0
    gaps = [start - end for (_, end), (start, _) in zip(spans, spans[1:])]
    return {"wall": wall, "inside": [e - s for s, e in spans], "gaps": gaps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()
    print(
        f"# {datetime.date.today()} {platform.node()} torch {torch.__version__}, 2 ranks, gloo, "
        f"CPU, {a.trials} candidates x {a.epochs} epoch(s) of the digits CNN, global batch 64"
    )
    rows = []
    for k in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            results = ddpkit.spawn(functools.partial(_job, tmp, k, a.trials, a.epochs), 2)
        wall = max(r["wall"] for r in results)
        per_min = a.trials / wall * 60
        inside = [t for r in results for t in r["inside"]]
        rows.append(
            (
                k,
                wall,
                per_min,
                statistics.median(inside),
                statistics.median([g for r in results for g in r["gaps"]]),
            )
        )
    print(
        f"{'ranks/candidate':>16} {'wall s':>8} {'cand/min':>9} {'median cand s':>14} "
        f"{'overhead ms/cand (median)':>27}"
    )
    for k, wall, per_min, med, over in rows:
        print(f"{k:>16} {wall:>8.1f} {per_min:>9.2f} {med:>14.2f} {1000 * over:>27.1f}")
    print(
        f"k=1 finishes {rows[0][2] / rows[1][2]:.2f}x the candidates per minute of k=2 (one after "
        "another on all ranks)"
    )


if __name__ == "__main__":
    main()
