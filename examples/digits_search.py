"""Hyper-parameter search over the digits CNN: every candidate trains with DDP on its own group of
ranks.

    # 2 candidates at a time, 2 ranks each
    ddpkit run --nproc 4 examples/digits_search.py --trials 12
    # survives a crash, same study
    ddpkit run --nproc 2 --max-restarts 2 examples/digits_search.py

The study (a journal file), each trial's run directory, trials.csv and the plots are in
--search-dir; run it again with the same folder and it goes on where it stopped, up to --trials
finished trials.
"""

import argparse
import sys
from pathlib import Path

import torch

import ddpkit
from ddpkit import LoggingConfig, SnapshotConfig, Trainer, TrainerConfig
from ddpkit.demo import digits
from ddpkit.search import SearchConfig, choice, search, uniform

sys.path.insert(0, str(Path(__file__).parent))
from digits_cnn import Net  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--trials", type=int, default=12)
parser.add_argument("--ranks-per-candidate", type=int, default=2)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--sampler", default="tpe", help="tpe, evolution, nsga2, cmaes, random")
parser.add_argument("--search-dir", default="runs/digits_search")
args = parser.parse_args()

ddpkit.init()
train_set, val_set = digits("train"), digits("test")

space = {
    "lr": uniform(3e-4, 3e-2, log=True),
    "channels": choice([8, 16, 32]),
    "dropout": uniform(0.0, 0.5),
    "batch_size": choice([16, 32, 64]),  # per rank
}


def objective(candidate):
    """Train one candidate on its group's ranks; the search reads val/loss after every epoch
    (pruning)."""
    p = candidate.params
    ddpkit.seed_everything(0)
    model = Net(image_size=8, channels=p["channels"], dropout=p["dropout"])
    config = TrainerConfig(
        run_dir=str(candidate.run_dir),
        epochs=args.epochs,
        batch_size=p["batch_size"],
        num_workers=0,
        logging=LoggingConfig(progress=False),
        snapshot=SnapshotConfig(every_steps=10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=p["lr"])
    trainer = Trainer(
        model,
        optimizer,
        train_set,
        config,
        val_data=val_set,
        group=candidate.group,
        callbacks=[candidate],
    )  # it reports val/loss after each epoch: pruning
    trainer.fit()
    # also right for a trial resumed after it had finished
    return trainer.evaluate(val_set, prefix="val")


search(
    objective,
    space,
    SearchConfig(
        n_trials=args.trials,
        group_size=args.ranks_per_candidate,
        metric="val/loss",
        sampler=args.sampler,
        search_dir=args.search_dir,
    ),
)
ddpkit.shutdown()
