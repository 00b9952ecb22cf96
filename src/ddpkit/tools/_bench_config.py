"""What ``ddpkit bench`` is asked to measure and predict: :class:`BenchConfig`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ddpkit._errors import ConfigError, check_types
from ddpkit._launch.options import MAX_NPROC
from ddpkit.tools import _predict as predict

MAX_STEPS = 100_000
"""The most --steps, --warmup or --rounds: past that a bench measures nothing more, for days."""
MAX_WORLD = 1_000_000
"""The largest world size --predict extrapolates to."""


@dataclass(kw_only=True)
class BenchConfig:
    """What ``ddpkit bench`` measures and predicts."""

    script: str | None = None
    """A training script defining ``ddpkit_workload()``; None for the DDP tutorials' CNN on sklearn
    digits."""
    nproc: int = 2
    """Largest world size measured on this machine (one GPU per rank, or CPU processes over
    gloo)."""
    steps: int = 60
    """Timed steps per job (as many untimed no_sync steps are interleaved to split off the
    all-reduce)."""
    warmup: int = 10
    rounds: int = 3
    """Jobs per world size; medians over rounds. World sizes are interleaved round by round."""
    predict_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    gpus_per_node: int = 8
    """Ranks per node for the prediction: beyond it, the ring crosses nodes over
    ``interconnect``."""
    intra: str = "measured"
    """The link within a node for the prediction: ``measured`` (this machine's all-reduce) or a
    preset."""
    interconnect: str = "infiniband"
    """The link between nodes: ``nvlink``, ``infiniband`` or ``ethernet`` (see
    ddpkit.tools._predict.PRESETS)."""
    bandwidth_gbps: float | None = None
    """Bus bandwidth of the link between nodes in GB/s, replacing the preset's."""
    latency_us: float | None = None
    """Latency of one ring step between nodes in microseconds, replacing the preset's."""
    knobs: bool = True
    """Try DDP's and the loader's knobs at ``nproc`` ranks."""
    out: str = "ddpkit-bench"
    """Folder for bench.json and bench.png."""
    pin: bool = True
    """On the CPU, pin each rank to a core of its own when there are enough (a quiet machine's best
    case; on a machine busy with other work, a pinned rank cannot move away from a busy core)."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.nproc < 2:
            raise ConfigError(
                f"--nproc {self.nproc}: measure at least 2 ranks, or there is nothing to scale"
            )
        for name in ("steps", "rounds", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.warmup < 0:
            raise ConfigError(f"--warmup {self.warmup}: give the untimed steps before timing, >= 0")
        for name in ("steps", "warmup", "rounds"):
            if getattr(self, name) > MAX_STEPS:
                raise ConfigError(f"--{name} {getattr(self, name)}: at most {MAX_STEPS}")
        if self.nproc > MAX_NPROC or self.gpus_per_node > MAX_NPROC:
            name = "nproc" if self.nproc > MAX_NPROC else "gpus-per-node"
            raise ConfigError(
                f"--{name} {max(self.nproc, self.gpus_per_node)}: at most {MAX_NPROC}"
            )
        if max(self.predict_sizes, default=1) > MAX_WORLD:
            raise ConfigError(
                f"--predict {max(self.predict_sizes)}: world sizes of at most {MAX_WORLD}"
            )
        if self.interconnect not in predict.PRESETS:
            raise ConfigError(
                f"--interconnect {self.interconnect!r}: choose one of {', '.join(predict.PRESETS)}"
            )
        if self.intra != "measured" and self.intra not in predict.PRESETS:
            raise ConfigError(
                f"--intra {self.intra!r}: choose measured or one of {', '.join(predict.PRESETS)}"
            )
        # 1 PB/s: no link is faster
        if self.bandwidth_gbps is not None and not (0 < self.bandwidth_gbps <= 1e6):
            raise ConfigError(
                f"--bandwidth {self.bandwidth_gbps}: give a bus bandwidth in GB/s, > 0 and <= 1e6"
            )
        if self.latency_us is not None and not (0 <= self.latency_us <= 1e9):  # NaN fails both
            raise ConfigError(
                f"--latency-us {self.latency_us}: give the latency of one ring step in "
                "microseconds, a number >= 0"
            )
        gpus = torch.cuda.device_count()
        if gpus and self.nproc > gpus:
            hint = (
                "lower --nproc"
                if gpus >= 2
                else "DDP needs 2 ranks; with CUDA_VISIBLE_DEVICES= the bench measures CPU "
                "processes over gloo"
            )
            raise ConfigError(
                f"--nproc {self.nproc}: this machine has {gpus} GPU(s), one per rank: {hint}"
            )

    def inter_link(self) -> predict.Interconnect:
        link = predict.PRESETS[self.interconnect]
        if self.bandwidth_gbps is not None:
            link = replace(
                link,
                busbw_bytes_per_s=self.bandwidth_gbps * 1e9,
                note=link.note + " (bandwidth given)",
            )
        if self.latency_us is not None:
            link = replace(
                link, hop_latency_s=self.latency_us * 1e-6, note=link.note + " (latency given)"
            )
        return link
