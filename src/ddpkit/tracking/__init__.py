"""What a run records: metrics files, progress, experiment trackers, and curves."""

from ddpkit.tracking._curves import plot, read_curves
from ddpkit.tracking._trackers import MLflowLogger, WandbLogger

__all__ = ["MLflowLogger", "WandbLogger", "plot", "read_curves"]
