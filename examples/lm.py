"""A small GPT on Python's own standard-library sources, character by character, on ddpkit's
Trainer.

    ddpkit run --nproc 2 examples/lm.py                  # a few minutes on 2 CPU cores
    ddpkit run --nproc 2 examples/lm.py --compile        # the same under torch.compile
    python examples/lm.py --epochs 1 --max-chars 20000   # one process, a short run

The loss is the mean over every token of a step's global batch (``count_fn``): a document's last
window is padded, so micro-batches hold different numbers of tokens, and a mean of their means would
weigh a token of a short window more. The learning rate warms up linearly, then follows a cosine to
a tenth; gradients accumulate over ``--grad-accum`` micro-batches; ``val/loss`` is measured on
held-out files every ``--val-every`` optimizer steps (``best.pt`` keeps the best of those) and once
more at the end. bf16 autocast on a GPU; fp32 on the CPU, where bf16 autocast made this model 1.5x
slower (2-core CI machine). At the end rank 0 samples a few lines.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit import EarlyStoppingConfig, LoggingConfig, SnapshotConfig, Trainer, TrainerConfig
from ddpkit.demo import CHARS, IGNORE_INDEX, TinyGPT, decode, encode, python_source

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--run-dir", default="runs/lm")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument(
    "--global-batch", type=int, default=32, help="sequences per optimizer step, over all ranks"
)
parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--block-size", type=int, default=64, help="tokens per sequence")
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3, help="the peak, after the warm-up")
parser.add_argument("--warmup", type=int, default=30, help="optimizer steps of linear warm-up")
parser.add_argument(
    "--val-every", type=int, default=100, help="optimizer steps between validations"
)
parser.add_argument("--max-chars", type=int, default=600_000, help="characters of training text")
parser.add_argument("--val-chars", type=int, default=30_000, help="characters of held-out text")
parser.add_argument(
    "--precision", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on a GPU"
)
parser.add_argument("--compile", action="store_true", help="torch.compile the wrapped model")
parser.add_argument(
    "--sample-chars", type=int, default=240, help="characters sampled at the end (0: none)"
)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

rt = ddpkit.init()
ddpkit.seed_everything(args.seed)  # every rank builds the same initial weights
train_set = python_source("train", args.block_size, args.max_chars)
val_set = python_source("test", args.block_size, args.val_chars)
model = TinyGPT(len(CHARS), args.block_size, args.width, args.layers, args.heads)

# AdamW with weight decay on matrices only (not on biases, LayerNorm, or the position embedding).
decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("pos")]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith("pos")]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
    lr=args.lr,
    betas=(0.9, 0.95),
)
# Optimizer steps in all: an epoch has len // (global batch / accum) micro-batches (drop_last),
# `accum` a step.
micro_global = args.global_batch // args.grad_accum
total_steps = args.epochs * math.ceil(len(train_set) // micro_global / args.grad_accum)


def warmup_cosine(step: int) -> float:
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def token_loss(model, batch):
    """The mean cross-entropy over the batch's tokens whose label counts (padding is
    IGNORE_INDEX)."""
    tokens, labels = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def count_tokens(batch):
    """How many tokens token_loss averages over: the Trainer weighs each micro-batch by it."""
    return (batch[1] != IGNORE_INDEX).sum()


def token_metrics(model, batch):
    """Validation: the loss summed over the batch's tokens, and their count; the report is sum /
    count."""
    tokens, labels = batch
    logits = model(tokens).flatten(0, 1)
    loss = F.cross_entropy(
        logits.float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return {"loss": (loss, count_tokens(batch))}


on_gpu = rt.device.type == "cuda"
precision = args.precision if args.precision != "auto" else ("bf16" if on_gpu else "fp32")
config = TrainerConfig(
    run_dir=args.run_dir,
    epochs=args.epochs,
    global_batch_size=args.global_batch,
    grad_accum_steps=args.grad_accum,
    val_every_steps=args.val_every,
    eval_batch_size=128,
    precision=precision,
    clip_grad_norm=1.0,
    scheduler_interval="step",
    seed=args.seed,
    num_workers=0,  # tensors in memory
    compile=args.compile,
    snapshot=SnapshotConfig(every_epochs=1),
    # best.pt: the best validation's weights
    early_stopping=EarlyStoppingConfig(metric="val/loss", patience=None),
    logging=LoggingConfig(every_steps=20, progress=False),
)
trainer = Trainer(
    model,
    optimizer,
    train_set,
    config,
    val_data=val_set,
    scheduler=scheduler,
    batch_loss_fn=token_loss,
    count_fn=count_tokens,
    metric_fn=token_metrics,
)
start = time.perf_counter()
trainer.fit()
# where training ended (the last validation was at a multiple)
metrics = trainer.evaluate(val_set, prefix="val")
ddpkit.print0(
    f"val/loss {metrics['val/loss']:.4f} (nats per character) after {trainer.step} steps, "
    f"{time.perf_counter() - start:.0f} s, {precision}, {rt.world_size} rank(s)"
)

# Sampling needs the whole model: gathered on rank 0 (a collective under sharding, so every rank
# calls it).
weights = trainer.strategy.model_weights()
if rt.is_main and args.sample_chars:
    sampler = TinyGPT(len(CHARS), args.block_size, args.width, args.layers, args.heads)
    sampler.load_state_dict(weights)
    sampler.eval()
    out = sampler.generate(
        encode("def ").unsqueeze(0), args.sample_chars, generator=torch.Generator().manual_seed(0)
    )
    print("sample:\n" + decode(out[0].tolist()), flush=True)
ddpkit.shutdown()
