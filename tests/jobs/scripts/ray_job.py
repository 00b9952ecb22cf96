"""The Ray Train tests' job: ``examples/ray_train.py``'s training loop, each worker first writing
what its runtime says (launcher, ranks, restarts, its node's rank in Ray) to
``FACTS/rank<r>-start<n>.json``; with ``--kill-rank R``, that worker of the first start SIGKILLs
itself at a random instant after the snapshot of step 10 is whole (a thread polls for its marker
while the loop trains); with ``--hold-for-notice``, every worker of the first start waits after step
11 until Ray's pre-emption notice is out (asking Ray, as the Trainer does, the same number of times
on every rank), so that the Trainer meets it at its next agreement, not after training has ended.

    python tests/jobs/scripts/ray_job.py --address HOST:PORT --run-dir DIR --facts DIR
        [--kill-rank R] [--hold-for-notice] [--snapshot-every STEPS]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def loop(config: dict) -> None:
    import ddpkit

    # A run that does not end is asked for every thread's stack: the test sends SIGUSR2 to the pid
    # each file is named by, and the stacks are written into it. Open for the process's life.
    stacks = Path(config["facts"], f"stacks-{os.getpid()}").open("w")
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    rt = ddpkit.init()
    facts = {
        "launcher": rt.launcher,
        "rank": rt.rank,
        "local_rank": rt.local_rank,
        "world_size": rt.world_size,
    }
    facts |= {"local_world_size": rt.local_world_size, "restart_count": rt.restart_count}
    facts |= {
        "node_rank": int(os.environ["NODE_RANK"]),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }
    facts |= {"node_id": ray.get_runtime_context().get_node_id()}
    Path(config["facts"], f"rank{rt.rank}-start{rt.restart_count}.json").write_text(
        json.dumps(facts)
    )
    if config["kill_rank"] == rt.rank and rt.restart_count == 0:
        marker = Path(config["run_dir"], "snapshots", "step-00000010", "complete.json")

        def kill() -> None:
            while not marker.exists():
                time.sleep(0.005)
            time.sleep(0.05 * (os.getpid() % 7))  # a different instant from run to run
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
    if config["hold_for_notice"] and rt.restart_count == 0:
        trainer_class = ddpkit.Trainer

        class HeldTrainer(trainer_class):  # type: ignore[misc,valid-type]
            def __init__(self, *args, callbacks=(), **kwargs):
                super().__init__(
                    *args, callbacks=[*callbacks, HoldForNotice(config["facts"])], **kwargs
                )

        ddpkit.Trainer = HeldTrainer  # train_loop imports it from ddpkit once called
    sys.path.insert(0, str(EXAMPLES))
    from ray_train import train_loop

    train_loop(config)


class HoldForNotice:
    def __init__(self, facts: str) -> None:
        self.facts = Path(facts)

    def on_step_end(self, trainer, taken, output) -> None:
        if trainer.step == 11:
            (self.facts / "holding").touch()  # the test drains a node once it sees this
            # Ray's value on rank 0, so every rank loops alike
            while ray.train.get_preemption_info() is None:
                time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--facts", required=True)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--hold-for-notice", action="store_true")
    p.add_argument("--snapshot-every", type=int, default=10)
    args = p.parse_args()
    ray.init(address=args.address)
    config = {
        "run_dir": args.run_dir,
        "facts": args.facts,
        "kill_rank": args.kill_rank,
        "epochs": args.epochs,
    }
    config |= {"hold_for_notice": args.hold_for_notice}
    config |= {
        "batch_size": 32,
        "lr": 2e-3,
        "seed": 0,
        "snapshot_every": args.snapshot_every,
        "examples": str(EXAMPLES),
    }
    TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=Path(args.run_dir).name, failure_config=FailureConfig(max_failures=2)
        ),
    ).fit()


if __name__ == "__main__":
    main()
