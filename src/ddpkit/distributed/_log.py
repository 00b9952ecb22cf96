"""Printing and logging from the main rank of a group only (the DDP tutorials'
``if rank == 0: print(...)``)."""

from __future__ import annotations

import builtins
import logging
from typing import Any

import torch.distributed as dist

from ddpkit._errors import checked_arguments
from ddpkit.distributed._collectives import is_live
from ddpkit.distributed._runtime import Group, get_runtime


def print0(*args: Any, group: Group = None, **kwargs: Any) -> None:
    """``print`` on rank 0 of ``group`` only."""
    if get_runtime(group).is_main:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


class _RankFilter(logging.Filter):
    """Tags each record with the rank in ``group``; ``main_only``: rank 0's records only."""

    def __init__(self, group: Group, main_only: bool) -> None:
        super().__init__()
        self.group, self.main_only = group, main_only

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_runtime(self.group).rank
        record.__dict__["rank"] = rank  # read by the format as %(rank)s
        return not self.main_only or rank == 0


@checked_arguments
def get_logger(
    name: str = "ddpkit", all_ranks: bool = False, group: Group = None
) -> logging.Logger:
    """A logger whose records are kept on rank 0 of ``group`` only, unless ``all_ranks`` (then
    tagged with the rank in ``group``)."""
    if group is not None and is_live(group):
        name = f"{name}.group{'-'.join(map(str, dist.get_process_group_ranks(group)))}"
    logger = logging.getLogger(name if not all_ranks else f"{name}.all_ranks")
    if not logger.handlers:
        handler = logging.StreamHandler()
        fmt = "[rank %(rank)s] %(message)s" if all_ranks else "%(message)s"
        handler.setFormatter(logging.Formatter(fmt))
        handler.addFilter(_RankFilter(group, main_only=not all_ranks))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
