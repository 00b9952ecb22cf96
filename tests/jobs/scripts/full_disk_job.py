"""A Trainer whose run directory fills up between snapshots: at step FILL rank 0 fills the file
system (a small tmpfs the test mounted), so the next record of ``metrics.jsonl`` meets a full disk.

    ddpkit run --nproc 2 full_disk_job.py RUN_DIR FILL [--old]

``--old``: a failed write of the run directory raises where it happens, on rank 0 alone (the
behaviour before, for the control).
"""

import sys
from pathlib import Path

import torch

import ddpkit
from ddpkit.tracking._metrics import MetricsWriter
from tests.tmpfs import fill

run_dir, at = sys.argv[1], int(sys.argv[2])
if "--old" in sys.argv:

    def raise_it(self, path, err):
        raise err

    MetricsWriter.record_fault = raise_it  # type: ignore[method-assign]
rt = ddpkit.init()


class FillAt:
    def on_step_end(self, trainer, taken, output):
        if trainer.step == at and rt.is_main:
            trainer.wait_for_snapshot()
            fill(Path(run_dir))


torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
data = torch.utils.data.TensorDataset(torch.randn(192, 4), torch.randint(0, 2, (192,)))
config = ddpkit.TrainerConfig(
    run_dir=run_dir, global_batch_size=8, epochs=2,
    snapshot=ddpkit.SnapshotConfig(every_steps=6, async_write=False),
    logging=ddpkit.LoggingConfig(every_steps=1, progress=False),
)  # fmt: skip
trainer = ddpkit.Trainer(
    model, torch.optim.SGD(model.parameters(), lr=0.1), data, config, callbacks=[FillAt()]
)
trainer.fit()
print(f"rank {rt.rank} done", flush=True)
