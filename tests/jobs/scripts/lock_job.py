"""A small 2-rank Trainer job that can hold its run directory: ``python lock_job.py RUN_DIR [--hold
READY GO]``.

With ``--hold``, rank 0 writes its host and pid to READY once ``fit()`` has started (the run
directory is then locked) and waits until GO exists before training; the test decides when it ends,
or kills it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch

import ddpkit
from ddpkit.testing import wait_until


class Hold:
    def __init__(self, ready: str, go: str) -> None:
        self.ready, self.go = Path(ready), Path(go)

    def on_fit_start(self, trainer) -> None:
        if not trainer.runtime.is_main:
            return
        self.ready.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        # waiting on the test's signal file, not standing in for one
        wait_until(self.go.exists, 90, what=str(self.go), interval=0.05, max_interval=0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--hold", nargs=2, metavar=("READY", "GO"))
    a = p.parse_args()
    ddpkit.init()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = torch.nn.Linear(4, 2)
    config = ddpkit.TrainerConfig(
        run_dir=a.run_dir,
        batch_size=8,
        epochs=2,
        num_workers=0,
        logging=ddpkit.training._config.LoggingConfig(progress=False),
    )
    trainer = ddpkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        config,
        callbacks=[Hold(*a.hold)] if a.hold else [],
    )
    trainer.fit()
    ddpkit.print0(f"trained to step {trainer.step}")
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
