"""The digits CNN on ddpkit's Trainer: snapshots, resume after a crash, exact validation and test
metrics.

    ddpkit run --nproc 2 examples/digits_trainer.py --run-dir runs/digits
    # survives crashes
    ddpkit run --nproc 2 --max-restarts 3 examples/digits_trainer.py --run-dir runs/digits

Run it again with the same --run-dir and it resumes from the newest snapshot; kill a worker
(``kill -9 <pid>``) under ``--max-restarts`` and the agent restarts the job, which resumes on its
own.
"""

import argparse
import sys
from pathlib import Path

import torch

import ddpkit
from ddpkit import EarlyStoppingConfig, SnapshotConfig, Trainer, TrainerConfig
from ddpkit.demo import digits

sys.path.insert(0, str(Path(__file__).parent))
from digits_cnn import Net  # noqa: E402  (the same model as the hand-written loop)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--run-dir", default="runs/digits")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

ddpkit.init()
ddpkit.seed_everything(args.seed)
train_set, val_set = digits("train", seed=args.seed), digits("test", seed=args.seed)
model = Net(image_size=8)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
config = TrainerConfig(
    run_dir=args.run_dir,
    epochs=args.epochs,
    batch_size=args.batch_size,
    seed=args.seed,
    num_workers=0,  # tensors in memory
    snapshot=SnapshotConfig(every_steps=10),
    early_stopping=EarlyStoppingConfig(metric="val/loss"),  # best.pt keeps the best epoch's weights
)
trainer = Trainer(model, optimizer, train_set, config, val_data=val_set, scheduler=scheduler)
trainer.fit()
test = trainer.evaluate(val_set)  # the held-out split (the digits ship no third one)
ddpkit.print0(f"test accuracy: {test['test/accuracy']:.4f}")
ddpkit.shutdown()
