"""The contrastive model of ``examples/contrastive.py`` on ddpkit's Trainer: the same views, model
and InfoNCE loss over every rank's embeddings (gathered with their gradients); the loop, the
snapshots and the per-sample seeding of the views are the Trainer's.

    ddpkit run --nproc 2 --max-restarts 3 examples/contrastive_trainer.py
    ddpkit check examples/contrastive_trainer.py  # do 2 ranks train what 1 process trains?

``global_batch_size`` keeps the global batch (the negatives of each image) at any world size;
``sync_batchnorm`` normalises over it.
"""

import argparse
import sys
from pathlib import Path

import torch

import ddpkit
from ddpkit import SnapshotConfig, Trainer, TrainerConfig
from ddpkit.demo import digits

sys.path.insert(0, str(Path(__file__).parent))
from contrastive import (  # noqa: E402  (the hand-written loop's model and loss)
    Contrastive,
    TwoViews,
    info_nce,
    retrieval_accuracy,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--global-batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--run-dir", default="runs/contrastive_trainer")
args = parser.parse_args()

rt = ddpkit.init()
ddpkit.seed_everything(args.seed)
train, test = digits("train", seed=args.seed), digits("test", seed=args.seed)
model = Contrastive()
config = TrainerConfig(
    run_dir=args.run_dir,
    epochs=args.epochs,
    global_batch_size=args.global_batch_size,
    sync_batchnorm=True,
    seed=args.seed,
    num_workers=0,  # the images are in memory
    snapshot=SnapshotConfig(every_steps=10, memory=True),
)
trainer = Trainer(
    model,
    torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4),
    TwoViews(train.tensors[0]),
    config,
    batch_loss_fn=lambda model, views: info_nce(*model(*views)),
)
trainer.fit()
accuracy = retrieval_accuracy(ddpkit.unwrap(trainer.model), test.tensors[0], rt.device)
ddpkit.print0(f"retrieval accuracy: {accuracy:.4f} ({len(test)} test images)")
ddpkit.shutdown()
