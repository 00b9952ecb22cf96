"""train_job's model and Trainer on the device ddpkit picks, for the device tests
(``ddpkit run ... RUN_DIR``).

What it adds to :mod:`train_job`: a mixed ``--precision``, deterministic algorithms (with the cuBLAS
workspace the environment sets on CUDA), a dataset whose ``__getitem__`` draws its noise on the
rank's device (on a GPU, from the CUDA generator, as GPU augmentation does), and a control that
restores every part of a snapshot but the CUDA generators' states. Dropout in the model draws on the
device too.
"""

from __future__ import annotations

import argparse

import torch

import ddpkit
from tests.jobs.scripts import train_job


class DeviceNoise(train_job.IndexedData):
    """The resume tests' data, each read perturbed by noise drawn on the rank's device."""

    def __getitem__(self, i: int):
        x, y, i = super().__getitem__(i)
        noise = torch.randn(x.shape, device=ddpkit.get_runtime().device)
        # Back to the host: the loader pins batches for the copy to the GPU, and only CPU tensors
        # can be pinned.
        return x + 0.3 * noise.cpu(), y, i


def _restore_all_but_cuda_rng() -> None:
    """Make the Trainer's resume leave the CUDA generators where this fresh process seeded them (a
    control)."""
    load = train_job.SabotagedTrainer.load_state_dict

    def load_state_dict(self, state):
        before = torch.cuda.get_rng_state_all()
        load(self, state)
        torch.cuda.set_rng_state_all(before)

    train_job.SabotagedTrainer.load_state_dict = load_state_dict


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--sample-log", default=None)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--drop-cuda-rng", action="store_true")
    a = p.parse_args()
    # Bitwise resume needs the same kernels doing the same sums: deterministic algorithms where
    # torch has them (warn_only: an op without one warns, and a difference would then show in the
    # comparison).
    torch.use_deterministic_algorithms(True, warn_only=True)
    ddpkit.init()
    if a.drop_cuda_rng:
        _restore_all_but_cuda_rng()
    data_class = train_job.AugmentedData
    # train(augment=True) reads the data set through this name
    train_job.AugmentedData = DeviceNoise
    try:
        train_job.train(
            a.run_dir,
            out=a.out,
            sample_log=a.sample_log,
            precision=a.precision,
            kill_rank=0,
            kill_step=a.kill_step,
            augment=True,
            num_workers=0,
            catch_preempted=False,
        )
    finally:
        train_job.AugmentedData = data_class
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
