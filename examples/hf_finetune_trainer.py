"""The Hugging Face-style fine-tune of ``examples/hf_finetune.py`` on ddpkit's Trainer: the same
model, data, collate function, weight-decay groups and warm-up schedule; the loop, the accumulation,
the clipping, the snapshots and the exact evaluation are the Trainer's.

    ddpkit run --nproc 2 --max-restarts 3 examples/hf_finetune_trainer.py
    ddpkit check examples/hf_finetune_trainer.py  # do 2 ranks train what 1 process trains?

``global_batch_size`` keeps the global batch (and so the schedule's length) at any world size;
``global_batch_dropout`` gives every sample its dropout masks (the attention's too) whatever the
world size and each rank's padding.
"""

import argparse
import math
import sys
from pathlib import Path

import torch

import ddpkit
from ddpkit import SnapshotConfig, Trainer, TrainerConfig

sys.path.insert(0, str(Path(__file__).parent))
from hf_finetune import (  # noqa: E402  (the hand-written loop's model and data)
    BertConfig,
    BertForSequenceClassification,
    collate,
    correct,
    get_linear_schedule_with_warmup,
    sentences,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--num-train-epochs", type=int, default=4)
parser.add_argument("--global-batch-size", type=int, default=8, help="per micro-batch")
parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
parser.add_argument("--learning-rate", type=float, default=1e-3)
parser.add_argument("--weight-decay", type=float, default=0.01)
parser.add_argument("--num-warmup-steps", type=int, default=10)
parser.add_argument("--max-grad-norm", type=float, default=1.0)
parser.add_argument("--train-samples", type=int, default=1000)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--output-dir", default="runs/hf_finetune_trainer")
args = parser.parse_args()

ddpkit.init()
ddpkit.seed_everything(args.seed)
train_dataset, eval_dataset = sentences(args.train_samples, 1), sentences(200, 2)
model = BertForSequenceClassification(BertConfig())
no_decay = ["bias", "norm.weight"]  # no weight decay for biases and LayerNorm weights
optimizer = torch.optim.AdamW(
    [
        {
            "params": [p for n, p in model.named_parameters() if not any(d in n for d in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(d in n for d in no_decay)],
            "weight_decay": 0.0,
        },
    ],
    lr=args.learning_rate,
)
accum = args.gradient_accumulation_steps
batches = len(train_dataset) // args.global_batch_size  # an epoch's global batches
max_train_steps = args.num_train_epochs * math.ceil(batches / accum)
lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.num_warmup_steps, max_train_steps)
config = TrainerConfig(
    run_dir=args.output_dir,
    epochs=args.num_train_epochs,
    global_batch_size=args.global_batch_size * accum,  # an optimizer step's samples
    grad_accum_steps=accum,
    clip_grad_norm=args.max_grad_norm,
    scheduler_interval="step",
    global_batch_dropout=True,
    collate_fn=collate,
    seed=args.seed,
    num_workers=0,  # the sentences are in memory
    snapshot=SnapshotConfig(every_steps=10, memory=True),
)
trainer = Trainer(
    model,
    optimizer,
    train_dataset,
    config,
    val_data=eval_dataset,
    scheduler=lr_scheduler,
    batch_loss_fn=lambda model, batch: model(**batch)["loss"],
    metric_fn=correct,
)
trainer.fit()
ddpkit.print0(f"eval accuracy: {trainer.evaluate(eval_dataset)['test/accuracy']:.4f}")
ddpkit.shutdown()
