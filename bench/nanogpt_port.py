"""nanoGPT's training loop ported to ddpkit's primitives: the ``primitives`` variant of
``bench/nanogpt.py``.

The model is nanoGPT's own ``GPT``, imported from a checkout's ``model.py``; the data are a nanoGPT
data folder (``train.bin``, ``val.bin``: uint16 token ids; ``meta.pkl``: ``vocab_size``). The loop
follows nanoGPT's ``train.py`` step for step, with ddpkit in place of its DDP code:
``ddpkit.init()`` for the process group and the device, ``prepare_model`` for DDP, ``no_sync()`` for
gradient accumulation, ``print0`` and ``is_main`` for what only rank 0 does. It draws its random
numbers in nanoGPT's order (seed ``1337 + rank``, then the model's initial weights, the first batch,
rank 0's evaluation batches, one batch after each micro-batch's forward), so it prints the same
losses as nanoGPT, and ``bench/nanogpt.py`` checks that it does.

The options are nanoGPT's configuration keys with this benchmark's defaults, so that one list of
``--key=value`` serves nanoGPT's ``train.py`` and this script alike; ``gradient_accumulation_steps``
counts micro-batches over all ranks, as in nanoGPT (2 ranks x 2 micro-batches by default).

    ddpkit run --nproc 2 bench/nanogpt_port.py --nanogpt ~/nanoGPT --data DIR --out_dir DIR
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import math
import os
import pickle
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

import ddpkit

HYPER_PARAMETERS = {
    "batch_size": 8,  # sequences per micro-batch per rank
    "block_size": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "dropout": 0.0,
    "bias": False,
    "learning_rate": 1e-3,
    "min_lr": 1e-4,
    "warmup_iters": 10,
    "lr_decay_iters": 49,
    "max_iters": 49,  # the last iteration: nanoGPT runs iterations 0..max_iters
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "gradient_accumulation_steps": 4,  # over all ranks
    "eval_interval": 49,
    "eval_iters": 4,
}
"""nanoGPT's configuration keys and this benchmark's values: ``bench/nanogpt.py`` passes them to all
three variants as ``--key=value``."""

GET_NANOGPT = "git clone https://github.com/karpathy/nanoGPT"


def add_hyper_parameters(parser: argparse.ArgumentParser) -> None:
    for key, value in HYPER_PARAMETERS.items():
        kind = (lambda s: bool(ast.literal_eval(s))) if isinstance(value, bool) else type(value)
        parser.add_argument(f"--{key}", type=kind, default=value, metavar=type(value).__name__)


def nanogpt_model(checkout: str) -> ModuleType:
    """nanoGPT's ``model.py`` from a checkout, imported as the module ``nanogpt_model``."""
    path = Path(checkout).expanduser() / "model.py"
    if not path.is_file():
        raise SystemExit(
            f"{checkout}: no nanoGPT model.py there; get a checkout with: {GET_NANOGPT}"
        )
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their class's module up here
    spec.loader.exec_module(module)
    return module


def build_gpt(a: argparse.Namespace) -> torch.nn.Module:
    """nanoGPT's GPT with the options' shape and the data's vocabulary (from ``meta.pkl``)."""
    model = nanogpt_model(a.nanogpt)
    with open(os.path.join(a.data, "meta.pkl"), "rb") as f:
        vocab_size = pickle.load(f)["vocab_size"]
    shape = {
        k: getattr(a, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "dropout")
    }
    return model.GPT(model.GPTConfig(vocab_size=vocab_size, **shape))


def nanogpt_lr(it: int, a: argparse.Namespace) -> float:
    """nanoGPT's schedule: a linear warm-up to ``learning_rate``, a cosine down to ``min_lr`` at
    ``lr_decay_iters``, then ``min_lr``. The operations are in nanoGPT's order: the port's losses
    are compared with nanoGPT's bit for bit, and a rounding of the learning rate would show
    there."""
    if it < a.warmup_iters:
        return a.learning_rate * (it + 1) / (a.warmup_iters + 1)
    if it > a.lr_decay_iters:
        return a.min_lr
    progress = (it - a.warmup_iters) / (a.lr_decay_iters - a.warmup_iters)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (a.learning_rate - a.min_lr)


def parse_arguments(description: str, out_dir: str, out_help: str) -> argparse.Namespace:
    """The options of both ports: the checkout, the data folder, the output and nanoGPT's keys."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--nanogpt", required=True, help=f"a nanoGPT checkout ({GET_NANOGPT})")
    p.add_argument(
        "--data", required=True, help="a nanoGPT data folder: train.bin, val.bin, meta.pkl"
    )
    p.add_argument("--out_dir", default=out_dir, help=out_help)
    add_hyper_parameters(p)
    return p.parse_args()


def micro_batches_per_rank(a: argparse.Namespace, world_size: int) -> int:
    """nanoGPT's ``gradient_accumulation_steps`` counts micro-batches over all ranks; a rank runs
    its share."""
    if a.gradient_accumulation_steps % world_size:
        raise SystemExit(
            f"--gradient_accumulation_steps={a.gradient_accumulation_steps}: not a multiple of the "
            f"{world_size} ranks"
        )
    return a.gradient_accumulation_steps // world_size


def main() -> None:
    a = parse_arguments(
        __doc__.split("\n")[0],
        "out",
        "where rank 0 writes ckpt.pt at each evaluation after the first",
    )
    # torchrun's variables: rank, world size, device (cuda:LOCAL_RANK or the CPU), backend
    rt = ddpkit.init()
    accum = micro_batches_per_rank(a, rt.world_size)
    # 1337 + rank, as nanoGPT: the ranks draw different batches. Their initial weights differ too,
    # until DDP replaces them with rank 0's when prepare_model wraps the model.
    ddpkit.seed_everything(1337, per_rank=True)
    gpt = build_gpt(a)
    model = ddpkit.prepare_model(gpt)  # to rt.device, inside DDP (or as it is in a world of one)
    optimizer = gpt.configure_optimizers(
        a.weight_decay, a.learning_rate, (a.beta1, a.beta2), rt.device.type
    )
    if rt.is_main:
        os.makedirs(a.out_dir, exist_ok=True)

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at random offsets of the split's tokens: inputs and next-token
        targets."""
        # A fresh memmap per batch: one kept open holds every page it read in this process's memory.
        tokens = np.memmap(os.path.join(a.data, f"{split}.bin"), dtype=np.uint16, mode="r")
        # From the global RNG, this rank's stream: the same draws as nanoGPT's, in the same order.
        starts = torch.randint(len(tokens) - a.block_size, (a.batch_size,))
        windows = [
            torch.from_numpy(tokens[s : s + a.block_size + 1].astype(np.int64))
            for s in starts.tolist()
        ]
        batch = torch.stack(windows)
        return batch[:, :-1].contiguous().to(rt.device), batch[:, 1:].contiguous().to(rt.device)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        """Mean loss over ``eval_iters`` random batches of each split. Rank 0 only, as in nanoGPT,
        and on the bare model: a DDP forward on one rank may start a collective (a buffer broadcast)
        the others never join. Its batches come from rank 0's stream, as nanoGPT's do, so the
        training batches after it match."""
        gpt.eval()
        means = {}
        for split in ("train", "val"):
            means[split] = float(
                torch.tensor([gpt(*get_batch(split))[1].item() for _ in range(a.eval_iters)]).mean()
            )
        gpt.train()
        return means

    x, y = get_batch("train")
    it = 0
    mfu = -1.0
    t0 = time.time()
    while True:
        lr = nanogpt_lr(it, a)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % a.eval_interval == 0 and rt.is_main:
            losses = estimate_loss()
            print(
                f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                flush=True,
            )
            # nanoGPT's always_save_checkpoint; bench/nanogpt.py compares it with nanoGPT's, bitwise
            if it > 0:
                state = {
                    "model": gpt.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": it,
                }
                torch.save(state, os.path.join(a.out_dir, "ckpt.pt"))

        for micro in range(accum):
            # Gradients add up over the micro-batches: each loss is divided by their number to make
            # a mean. Under no_sync() a backward only accumulates; the last micro-batch's backward
            # all-reduces the sum.
            with ddpkit.no_sync(model) if micro < accum - 1 else contextlib.nullcontext():
                loss = model(x, y)[1] / accum
                # the next batch before this backward: nanoGPT's order of draws
                x, y = get_batch("train")
                loss.backward()
        if a.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        # this rank's last micro-batch (rank 0's is printed), as nanoGPT's
        lossf = loss.item() * accum
        if it >= 5:  # as nanoGPT: the first iterations are slow
            now = gpt.estimate_mfu(a.batch_size * accum, dt)
            mfu = now if mfu == -1.0 else 0.9 * mfu + 0.1 * now
        ddpkit.print0(f"iter {it}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {mfu * 100:.2f}%")
        it += 1
        if it > a.max_iters:
            break
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
