"""A run killed at each boundary of an epoch's end, one epoch after another, for the tests of
resuming there (:mod:`tests.jobs.snapshot.test_epoch_end_kills`).

    ddpkit run --nproc 2 --max-restarts 6 epoch_end_job.py RUN_DIR OUT --variant V
        [--kills B1,B2,...] [--control snapshot-first|no-rewind]

Variants: ``trainer`` (copies in memory every step, a disk snapshot every epoch, validation, a
last global batch of the epoch that is partial), ``stream`` (the same on a ``JsonlStream``),
``step_fn`` (a step function; disk snapshots every 2 steps and every epoch) and ``hand`` (a
hand-written loop with ``ddpkit.Snapshots(memory=True)``, its own evaluation at each epoch's end).

Attempt ``a`` SIGKILLs rank 1 at boundary ``kills[a]`` of the end of epoch ``a + 1`` (counted from
1): ``last_step`` (after the epoch's last step, in its ``on_step_end``), ``validation`` (inside the
epoch's validation), ``on_validation_end``, ``on_epoch_end``, ``disk_write`` (inside the epoch's
disk snapshot, half a file written), ``after_end`` (in the next epoch's first step, the epoch's end
done). Every rank writes ``OUT.rank<r>``: its weights, optimizer state and how often each hook ran
(kept in the snapshots, so a hook that a resume skipped or ran twice shows).

Controls: ``snapshot-first``, the epoch's snapshots taken before its callbacks (the order before the
snapshots moved to the epoch's end), ``no-rewind``: the records written after a snapshot are kept
on resume.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
import ddpkit._fs
import ddpkit.tracking._metrics
from ddpkit import LoggingConfig, SnapshotConfig, Trainer, TrainerConfig
from ddpkit.testing import Job, run_job

N, FEATURES, GLOBAL_BATCH, EPOCHS = 100, 8, 24, 7  # 5 steps an epoch, the last of 4 samples
BOUNDARIES = (
    "last_step",
    "validation",
    "on_validation_end",
    "on_epoch_end",
    "disk_write",
    "after_end",
)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = N, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x[:, :2].sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def write_records(path: Path) -> Path:
    data = Data()
    with open(path, "w") as f:
        for x, y in zip(data.x, data.y):
            f.write(json.dumps({"x": x.tolist(), "y": int(y)}) + "\n")
    return path


def from_record(record: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(record["x"]), torch.tensor(record["y"])


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))


class Plan:
    """Where this attempt's kill lands: boundary ``kills[attempt]`` of epoch ``attempt + 1``."""

    def __init__(self, kills: list[str]) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.where = kills[self.attempt] if self.attempt < len(kills) else None
        self.epoch = self.attempt + 1  # the epoch (counted from 1) whose end it hits

    def at(self, where: str, epoch: int) -> None:
        """SIGKILL rank 1 if this is the planned boundary of the planned epoch's end."""
        if self.rank == 1 and where == self.where and epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)

    def in_disk_write(self, epoch: Any) -> None:
        """Half a file of the epoch's disk snapshot written, then SIGKILL (``epoch()``: epochs
        done)."""
        write = ddpkit._fs.write_atomic

        def dying(path: Path, data: bytes, **kw: Any) -> None:
            if self.rank == 1 and self.where == "disk_write" and epoch() == self.epoch:
                path.with_name(f".{path.name}.dead.tmp").write_bytes(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            write(path, data, **kw)

        ddpkit._fs.write_atomic = dying


class Hooks:
    """Counts every hook it sees, in each rank's snapshot state; kills where the plan says."""

    state_key = "hooks"

    def __init__(self, plan: Plan) -> None:
        self.plan, self.calls = plan, {"step": 0, "validation": 0, "epoch": 0}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.calls)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = dict(state)

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        self.calls["step"] += 1
        if trainer.cursor == trainer.sampler.num_samples:  # the epoch's last step
            self.plan.at("last_step", trainer.epoch + 1)
        elif trainer.cursor == trainer.sampler.global_batch_size:  # the next epoch's first
            self.plan.at("after_end", trainer.epoch)

    def on_validation_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        self.calls["validation"] += 1
        self.plan.at("on_validation_end", trainer.epoch)

    def on_epoch_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        self.calls["epoch"] += 1
        self.plan.at("on_epoch_end", trainer.epoch)


class SnapshotFirst(Trainer):
    """The control: the epoch's snapshots before its callbacks run (as they were taken before)."""

    def _end_epoch(self) -> dict[str, float]:
        callbacks, self.callbacks = self.callbacks, []
        try:
            metrics = super()._end_epoch()
        finally:
            self.callbacks = callbacks
        val = {k: v for k, v in metrics.items() if k.startswith("val/") or k in ("epoch", "step")}
        for cb in callbacks:
            if self.val_data is not None:
                cb.on_validation_end(self, val)
            cb.on_epoch_end(self, metrics)
        return metrics


def trainer_run(a: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    hooks = Hooks(plan)
    model = build_model()
    common = dict(
        run_dir=a.run_dir, epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, drop_last=False,
        seed=5, logging=LoggingConfig(every_steps=2, progress=False),
    )  # fmt: skip
    cls = SnapshotFirst if a.control == "snapshot-first" else Trainer
    if a.variant == "step_fn":
        optimizer = {"net": torch.optim.Adam(model.parameters(), lr=0.01)}

        def step_fn(step: Any) -> None:
            for x, y in step.micro_batches():
                step.backward(F.cross_entropy(step.models["net"](x), y), "net")
            step.optimizer_step("net")

        config = TrainerConfig(
            **common, snapshot=SnapshotConfig(every_steps=2, keep=3, async_write=False)
        )
        trainer = cls({"net": model}, optimizer, Data(), config, step_fn=step_fn, callbacks=[hooks])
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        data: Any = Data()
        if a.variant == "stream":
            from ddpkit.data._stream_sources import JsonlStream

            data = JsonlStream(a.records, transform=from_record, window=32)
        config = TrainerConfig(
            **common,
            snapshot=SnapshotConfig(memory=True, memory_every_steps=1, keep=3, async_write=False),
        )

        def metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
            plan.at("validation", trainer.epoch)
            x, y = batch
            logits = model(x)
            return {
                "loss": F.cross_entropy(logits, y, reduction="none"),
                "accuracy": (logits.argmax(1) == y).float(),
            }

        trainer = cls(
            model, optimizer, data, config, val_data=Data(40, seed=2),
            loss_fn=F.cross_entropy, metric_fn=metrics, callbacks=[hooks],
        )  # fmt: skip
    plan.in_disk_write(lambda: trainer.epoch)
    trainer.fit()
    net = trainer.model["net"] if a.variant == "step_fn" else trainer.model
    opt = trainer.optimizer
    return {
        "model": ddpkit.unwrap(net).state_dict(),
        "optimizer": (opt["net"] if isinstance(opt, dict) else opt).state_dict(),
        "hooks": hooks.calls,
        "step": trainer.step,
    }


class Counts:
    """The hand loop's own counters, kept in its snapshots (``own``)."""

    def __init__(self) -> None:
        self.calls = {"step": 0, "evaluation": 0, "epoch": 0}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.calls)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = dict(state)


def val_loss(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    return {"loss": F.cross_entropy(model(batch[0]), batch[1], reduction="none")}


def hand_run(a: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    ddpkit.seed_everything(5)
    model = ddpkit.prepare_model(build_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    loader = ddpkit.build_loader(Data(), batch_size=GLOBAL_BATCH // 2, drop_last=False, seed=5)
    counts = Counts()
    snapshots = ddpkit.Snapshots(
        a.run_dir, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
        own={"counts": counts}, every_steps=3, memory=True, memory_every_steps=1, async_write=False,
    )  # fmt: skip
    plan.in_disk_write(lambda: loader.epoch)
    snapshots.resume()
    for epoch in range(loader.epoch, EPOCHS):
        for x, y in loader:
            if loader.batch_in_epoch == 1:
                plan.at("after_end", epoch)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            counts.calls["step"] += 1
            snapshots.step()
            if loader.finishing_epoch:
                plan.at("last_step", epoch + 1)
        plan.at("validation", epoch + 1)
        ddpkit.evaluate(
            model,
            Data(40, seed=2),
            lambda m, b: {"loss": F.cross_entropy(m(b[0]), b[1], reduction="none")},
        )
        counts.calls["evaluation"] += 1
        plan.at("on_validation_end", epoch + 1)
        scheduler.step()
        counts.calls["epoch"] += 1
        plan.at("on_epoch_end", epoch + 1)
    snapshots.close()
    return {
        "model": ddpkit.unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "hooks": counts.calls,
        "step": snapshots.steps,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--variant", choices=("trainer", "stream", "step_fn", "hand"), required=True)
    p.add_argument("--kills", default="", help="a boundary per attempt, comma-separated")
    p.add_argument("--records", default=None, help="the stream's JSON lines (variant stream)")
    p.add_argument("--control", choices=("snapshot-first", "no-rewind"), default=None)
    a = p.parse_args()
    kills = [k for k in a.kills.split(",") if k]
    assert all(k in BOUNDARIES for k in kills), kills
    if a.control == "no-rewind":
        ddpkit.tracking._metrics.MetricsWriter.load_state_dict = lambda self, state: None
    rt = ddpkit.init()
    plan = Plan(kills)
    got = hand_run(a, plan) if a.variant == "hand" else trainer_run(a, plan)
    got["attempt"] = plan.attempt
    torch.save(got, f"{a.out}.rank{rt.rank}")
    ddpkit.shutdown()


def under_launcher(
    tmp: Path, env: dict[str, str], name: str, variant: str, kills: str = "", *control: str
) -> Job:
    """This job's ``variant`` under ``ddpkit run`` in ``tmp`` with a restart for each of ``kills``,
    to its end: run directory ``tmp/name``, each rank's final state in ``tmp/name.out.rank<r>``;
    its :class:`~ddpkit.testing.Job`."""
    records = tmp / "records.jsonl"
    if variant == "stream" and not records.exists():
        write_records(records)
    args = [str(tmp / name), str(tmp / f"{name}.out"), "--variant", variant, "--kills", kills]
    args += ["--records", str(records), *(("--control", *control) if control else ())]
    restarts = ("--max-restarts", str(len(kills.split(",")) if kills else 0))
    done = run_job(
        __file__, *args, launcher_args=restarts, env=env, cwd=tmp, timeout=600, run_dir=tmp / name
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def finals(job: Job) -> list[dict]:
    """Each rank's final state, of a job of :func:`under_launcher`."""
    assert job.run_dir is not None
    out = f"{job.run_dir}.out"
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]


if __name__ == "__main__":
    main()
