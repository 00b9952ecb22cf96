"""Three trainings in one script, as the phases test runs it: ``python phases_job.py OUT RUN_DIR
KILL_STEP MODE``.

A teacher, then two students distilled from it, each a ``phase`` of RUN_DIR. On the first attempt,
rank 1 is SIGKILLed after the second student's step KILL_STEP (negative: never). Each rank writes
every phase's final state (models and optimizers), ``fit()``'s metrics and the attempt to
``OUT.rank<r>``. MODE: ``phases``; ``no_phase`` (control: the trainings share RUN_DIR, without
``phase=``); ``no_restore`` (control: after ``fit()`` of a finished phase, its model and optimizer
are put back as the script built them).
"""

from __future__ import annotations

import copy
import os
import signal
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

out, run_dir, kill_step, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rt = ddpkit.init()


class Kill:
    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        if rt.restart_count == 0 and rt.rank == 1 and trainer.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
data = TensorDataset(x, torch.sin(x).sum(1, keepdim=True))


def config(phase: str) -> ddpkit.TrainerConfig:
    return ddpkit.TrainerConfig(
        run_dir=run_dir, phase=None if mode == "no_phase" else phase, epochs=3, batch_size=8,
        num_workers=0, weights_format=None, snapshot=ddpkit.SnapshotConfig(every_steps=5),
        logging=ddpkit.LoggingConfig(every_steps=1, progress=False),
    )  # fmt: skip


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def distill(step: Any) -> None:
    teacher, student = step.models["teacher"], step.models["student"]
    for xb, yb in step.micro_batches():
        with torch.no_grad():
            target = teacher(xb)
        pred = student(xb)
        step.backward(F.mse_loss(pred, target) + 0.5 * F.mse_loss(pred, yb), "student")
    step.optimizer_step("student")


def fit(trainer: ddpkit.Trainer, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    built = copy.deepcopy((model.state_dict(), opt.state_dict()))  # plain torch: no side effect
    last = trainer.fit()
    if mode == "no_restore" and trainer.resumed_from == trainer.step:  # a finished phase
        model.load_state_dict(built[0])
        opt.load_state_dict(built[1])
    return last


teacher = net(0)
opt = torch.optim.Adam(teacher.parameters(), lr=1e-2)
trainers = {"teacher": ddpkit.Trainer(teacher, opt, data, config("teacher"), loss_fn=F.mse_loss)}
metrics = {"teacher": fit(trainers["teacher"], teacher, opt)}
teacher.requires_grad_(False)
for name, seed in (("student1", 1), ("student2", 2)):
    student = net(seed)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    trainers[name] = ddpkit.Trainer(
        {"student": student, "teacher": teacher},
        {"student": opt},
        data,
        config(name),
        step_fn=distill,
        callbacks=[Kill()] if name == "student2" else [],
    )
    metrics[name] = fit(trainers[name], student, opt)
states = {name: t.strategy.full_state_dict() for name, t in trainers.items()}
torch.save(
    {"states": states, "metrics": metrics, "attempt": rt.restart_count},
    f"{out}.rank{rt.rank}",
)
