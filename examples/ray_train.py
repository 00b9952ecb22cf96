"""The digits CNN on ddpkit's Trainer inside Ray Train: Ray places and restarts the workers, ddpkit
trains.

    python examples/ray_train.py --workers 2 --run-dir /shared/runs/digits   # on the Ray head node

Each Ray worker runs ``train_loop``: ``ddpkit.init()`` takes the process group Ray made (launcher
"ray"), the Trainer snapshots into ``--run-dir``, which every node must reach (a shared file
system), and after a worker or a node is lost Ray starts the group again and the Trainer resumes
from the newest snapshot, bit for bit.
"""

import argparse
import sys
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_loop(config: dict) -> None:
    import torch

    import ddpkit
    from ddpkit import SnapshotConfig, Trainer, TrainerConfig
    from ddpkit.demo import digits

    sys.path.insert(0, config["examples"])
    from digits_cnn import Net

    rt = ddpkit.init()
    ddpkit.seed_everything(config["seed"])
    model = Net(image_size=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    trainer_config = TrainerConfig(
        run_dir=config["run_dir"],
        epochs=config["epochs"],
        batch_size=config["batch_size"],
        seed=config["seed"],
        snapshot=SnapshotConfig(every_steps=config["snapshot_every"]),
    )
    train_set, test_set = digits("train", seed=config["seed"]), digits("test", seed=config["seed"])
    trainer = Trainer(model, optimizer, train_set, trainer_config, val_data=test_set)
    metrics = trainer.fit()
    ddpkit.print0(
        f"{rt.launcher}: rank 0 of {rt.world_size}, restarts {rt.restart_count}: {metrics}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/ray-digits")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=10, help="optimizer steps")
    parser.add_argument("--max-failures", type=int, default=3, help="restarts of the worker group")
    parser.add_argument(
        "--address", default=None, help="a running cluster (default: start one here)"
    )
    args = parser.parse_args()

    ray.init(address=args.address)
    config = vars(args) | {
        "run_dir": str(Path(args.run_dir).absolute()),
        "examples": str(Path(__file__).parent),
    }
    TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="ddpkit-digits", failure_config=FailureConfig(max_failures=args.max_failures)
        ),
    ).fit()


if __name__ == "__main__":
    main()
