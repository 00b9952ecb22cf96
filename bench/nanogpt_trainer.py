"""nanoGPT's model and hyper-parameters on ddpkit's Trainer: the ``trainer`` variant of
``bench/nanogpt.py``.

The same ``GPT`` (from a checkout's ``model.py``), data folder, AdamW
(``model.configure_optimizers``), warm-up and cosine (a ``LambdaLR`` stepped after every optimizer
step), clipping and gradient accumulation as ``bench/nanogpt_port.py``, with the same options. What
differs is the data's order: the Trainer reads a map-style dataset of every window of the token
file, shuffled by its sampler (a permutation per epoch), where nanoGPT draws offsets with
replacement from each rank's own stream; and there is no evaluation (nanoGPT's first one falls in
the iterations the benchmark drops). A callback times each optimizer step and prints nanoGPT's line,
``iter N: loss X, time Yms``, on rank 0, so that ``bench/nanogpt.py`` reads all variants alike.

    ddpkit run --nproc 2 bench/nanogpt_trainer.py --nanogpt ~/nanoGPT --data DIR --out_dir DIR
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from nanogpt_port import build_gpt, micro_batches_per_rank, nanogpt_lr, parse_arguments
from torch.utils.data import Dataset

import ddpkit


class TokenWindows(Dataset):
    """Every window of ``block_size + 1`` tokens of a token file, as (inputs, next-token
    targets)."""

    def __init__(self, path: str, block_size: int) -> None:
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


class IterationLines(ddpkit.Callback):
    """nanoGPT's per-iteration line on rank 0: the step's last micro-batch loss and the time between
    steps."""

    def on_fit_start(self, trainer) -> None:
        self.t0 = time.time()

    def on_step_end(self, trainer, taken, output) -> None:
        t1 = time.time()
        dt, self.t0 = t1 - self.t0, t1
        # output.losses: this rank's micro-batch means; nanoGPT prints rank 0's last one.
        ddpkit.print0(
            f"iter {output.step - 1}: loss {float(output.losses[-1]):.4f}, time {dt * 1000:.2f}ms"
        )


def main() -> None:
    a = parse_arguments(__doc__.split("\n")[0], "runs/nanogpt", "the Trainer's run directory")
    rt = ddpkit.init()
    accum = micro_batches_per_rank(a, rt.world_size)
    ddpkit.seed_everything(1337)  # the same initial weights as nanoGPT's (rank 0's, seeded 1337)
    gpt = build_gpt(a)
    optimizer = gpt.configure_optimizers(
        a.weight_decay, a.learning_rate, (a.beta1, a.beta2), rt.device.type
    )
    # LambdaLR multiplies the optimizer's lr by the factor of the steps taken so far: nanoGPT's lr
    # at iteration k.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: nanogpt_lr(it, a) / a.learning_rate
    )
    config = ddpkit.TrainerConfig(
        run_dir=a.out_dir,
        max_steps=a.max_iters + 1,  # nanoGPT's iterations 0..max_iters; the epoch is far longer
        batch_size=a.batch_size,  # per rank and micro-batch
        grad_accum_steps=accum,  # per rank, where nanoGPT's is global
        clip_grad_norm=a.grad_clip or None,
        scheduler_interval="step",
        num_workers=0,  # windows sliced from a memmap in the main process, as nanoGPT's get_batch
        seed=1337,
        logging=ddpkit.LoggingConfig(progress=False),
    )
    data = TokenWindows(os.path.join(a.data, "train.bin"), a.block_size)
    trainer = ddpkit.Trainer(
        gpt,
        optimizer,
        data,
        config,
        scheduler=scheduler,
        # GPT returns (logits, mean loss over tokens)
        batch_loss_fn=lambda model, batch: model(*batch)[1],
        callbacks=[IterationLines()],
    )
    trainer.fit()
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
