"""A step function's Trainer (a student distilled from a frozen teacher) whose
``ddpkit_workload()`` ``ddpkit check`` checks in its place: the student, with the teacher inside its
loss.
``--batchnorm``: the student normalises each rank's slice of the batch (the check's control)."""

import sys
from typing import Any

import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.tools._workload import Workload
from tests.jobs.scripts.check_common import mlp, sgd, toy_data


def nets() -> tuple[nn.Module, nn.Module]:
    teacher = mlp().requires_grad_(False)
    student = mlp(nn.BatchNorm1d(16)) if "--batchnorm" in sys.argv else mlp()
    return teacher, student


def ddpkit_workload() -> Workload:
    teacher, student = nets()
    return Workload(
        model=student, dataset=toy_data(), optimizer=sgd, batch_size=8,
        batch_loss_fn=lambda model, batch: F.mse_loss(model(batch[0]), teacher(batch[0])),
    )  # fmt: skip


def distill(step: Any) -> None:
    for x, _ in step.micro_batches():
        target = step.models["teacher"](x)
        step.backward(F.mse_loss(step.models["student"](x), target), "student")
    step.optimizer_step("student")


if __name__ == "__main__":
    ddpkit.seed_everything(0)
    teacher, student = nets()
    config = ddpkit.TrainerConfig(run_dir="runs/distill", epochs=1, batch_size=8, num_workers=0)
    trainer = ddpkit.Trainer(
        {"teacher": teacher, "student": student}, {"student": sgd(student.parameters())},
        toy_data(), config, step_fn=distill,
    )  # fmt: skip
    trainer.fit()
