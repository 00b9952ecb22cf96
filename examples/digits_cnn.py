"""A small CNN on handwritten digits with DistributedDataParallel: the DDP tutorials' MNIST example,
minus the boilerplate.

Runs the same on 1 or N processes, CPU or GPUs:

    ddpkit run --nproc 2 examples/digits_cnn.py
    torchrun --nproc-per-node 2 examples/digits_cnn.py
    python examples/digits_cnn.py

By default it trains on scikit-learn's bundled 8x8 digits (no download). For MNIST, put the four IDX
files (train-images-idx3-ubyte ... t10k-labels-idx1-ubyte, raw or .gz) in a folder and pass
``--data mnist --data-dir FOLDER``.
"""

import argparse
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.demo import (
    DigitsCNN as Net,  # the DDP tutorials' CNN; other examples import it from here
)
from ddpkit.demo import digits, mnist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="per rank: the global batch is this x world size"
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", choices=["digits", "mnist"], default="digits")
    parser.add_argument(
        "--data-dir", default="data/mnist", help="folder of the MNIST IDX files (--data mnist)"
    )
    parser.add_argument(
        "--sync-bn", action="store_true", help="BatchNorm statistics over the global batch"
    )
    args = parser.parse_args()

    rt = ddpkit.init()  # rank, world size, device; a world of one under plain python
    # same initial weights on every rank (DDP also broadcasts rank 0's)
    ddpkit.seed_everything(args.seed)

    # Rank 0 builds the data first while the others wait, then they read what it prepared: the place
    # for a download or a cache, so N processes do not write the same files at once. Both datasets
    # here are read-only.
    with ddpkit.main_first():
        if args.data == "digits":
            train_set, test_set = digits("train", seed=args.seed), digits("test", seed=args.seed)
        else:
            train_set, test_set = mnist(args.data_dir, "train"), mnist(args.data_dir, "test")

    model = ddpkit.prepare_model(Net(train_set[0][0].shape[-1]), sync_batchnorm=args.sync_bn)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # Tensors already in memory: worker processes would only add start-up and copying.
    loader = ddpkit.build_loader(
        train_set, batch_size=args.batch_size, seed=args.seed, num_workers=0
    )
    ddpkit.print0(
        f"{len(train_set)} train / {len(test_set)} test samples, {rt.world_size} process(es), "
        f"global batch {args.batch_size * rt.world_size}, {len(loader)} steps per epoch"
    )

    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        train_loss = ddpkit.MetricSums()
        for x, y in loader:  # a new shuffle every epoch: no set_epoch to forget
            x, y = x.to(rt.device), y.to(rt.device)
            losses = F.cross_entropy(model(x), y, reduction="none")
            optimizer.zero_grad(set_to_none=True)
            losses.mean().backward()  # DDP averages the gradients over ranks during backward
            optimizer.step()
            # detached: summing the graph would keep every batch alive
            train_loss.update("loss", losses)
        # One collective per epoch: every rank's loss sum and sample count, divided once.
        loss = train_loss.compute()["loss"]
        ddpkit.print0(
            f"epoch {epoch + 1}/{args.epochs} | train loss {loss:.4f} | {time.time() - t0:.1f}s"
        )

    # Every rank evaluates its own unpadded share (a rank skipping evaluation would leave the others
    # waiting in the reduction); the shares add up to the test set, so every sample counts exactly
    # once.
    test_loader = ddpkit.build_eval_loader(test_set, batch_size=256, num_workers=0)
    accuracy = ddpkit.evaluate(model, test_loader)["accuracy"]
    count = ddpkit.all_reduce(len(test_loader.sampler))
    ddpkit.print0(f"test accuracy: {accuracy:.4f} ({count} samples)")
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
