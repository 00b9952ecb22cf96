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


@checked_arguments
def get_logger(
    name: str = "ddpkit", all_ranks: bool = False, group: Group = None
) -> logging.Logger:
    """A logger kept on rank 0 of ``group`` only, unless ``all_ranks`` (records tagged by rank)."""
    if group is not None and is_live(group):
        name = f"{name}.group{'-'.join(map(str, dist.get_process_group_ranks(group)))}"
    logger = logging.getLogger(name if not all_ranks else f"{name}.all_ranks")
    if not logger.handlers:
        handler = logging.StreamHandler()
        fmt = "[rank %(rank)s] %(message)s" if all_ranks else "%(message)s"
        handler.setFormatter(logging.Formatter(fmt))

        def tag_rank(record: logging.LogRecord) -> bool:
            rank = get_runtime(group).rank
            record.__dict__["rank"] = rank  # read by the format as %(rank)s
            return all_ranks or rank == 0

        handler.addFilter(tag_rank)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
