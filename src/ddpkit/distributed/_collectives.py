"""What every script writes by hand: barriers, main-first sections, reductions, broadcasts. Each
takes an optional ``group``; without a process group each is the identity over a world of one."""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist

from ddpkit._errors import checked_arguments
from ddpkit.distributed import _progress as progress
from ddpkit.distributed._runtime import Group, get_runtime, is_live

T = TypeVar("T")


def comm_device(group: Group = None) -> torch.device:
    """Where tensors must be for a collective on ``group``: CUDA for nccl, the CPU otherwise."""
    if is_live(group) and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _watched(op: str, group: Group) -> AbstractContextManager[None]:
    """The collective marked in this rank's progress record, on the world only."""
    return progress.collective(op) if group is None else nullcontext()


def barrier(group: Group = None) -> None:
    """Wait until every rank of ``group`` gets here."""
    if is_live(group):
        with _watched("barrier", group):
            if dist.get_backend(group) == "nccl":
                dist.barrier(group, device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier(group)


@checked_arguments
@contextmanager
def main_first(local: bool = False, group: Group = None) -> Iterator[None]:
    """Run the body on rank 0 first while the others wait (on local rank 0 of every node with
    ``local=True``), then on the others. If the first rank raises, the launcher stops the others."""
    first = get_runtime().is_local_main if local else get_runtime(group).is_main
    if not first:
        barrier(group)
        yield
        return
    # the others wait in the barrier: the stall watch gives this body its long allowance
    with progress.phase(progress.Phase.MAIN_FIRST) if group is None else nullcontext():
        yield
    barrier(group)


def _flatten(values: Mapping[str, Any]) -> tuple[torch.Tensor, list[tuple[str, Any, torch.Size]]]:
    parts, layout = [], []
    for key, value in values.items():
        # float64 keeps integer counts exact up to 2**53 and sums of float32 values without loss.
        t = torch.as_tensor(value, dtype=torch.float64, device="cpu").detach()
        layout.append((key, value, t.shape))
        parts.append(t.reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64), layout


def _unflatten(flat: torch.Tensor, layout: list[tuple[str, Any, torch.Size]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    offset = 0
    for key, original, shape in layout:
        n = shape.numel()
        chunk = flat[offset : offset + n].reshape(shape)
        offset += n
        if isinstance(original, torch.Tensor):
            out[key] = chunk.to(original.device, original.dtype)
        elif isinstance(original, bool):
            out[key] = bool(chunk.item())
        elif isinstance(original, int):
            out[key] = int(round(chunk.item()))
        else:
            out[key] = chunk.item()
    return out


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(value: T, op: Literal["sum", "max", "min"] = "sum", group: Group = None) -> T:
    """Reduce a number, a tensor, or a dict of them over ``group``; every rank gets the result.

    A dict travels as one flat float64 tensor: one collective. ``op`` is ``"sum"``, ``"max"`` or
    ``"min"``; no ``"mean"``: reduce sums and counts, then divide, so each sample weighs the same.
    """
    if op not in _OPS:
        raise ValueError(
            f"op={op!r}: use one of {sorted(_OPS)} (for a mean, reduce a sum and a count)"
        )
    values = value if isinstance(value, Mapping) else {"_": value}
    flat, layout = _flatten(values)
    if is_live(group):
        with _watched("all_reduce", group):
            flat = flat.to(comm_device(group))
            dist.all_reduce(flat, op=_OPS[op], group=group)
            flat = flat.cpu()
    out = _unflatten(flat, layout)
    return out if isinstance(value, Mapping) else out["_"]  # type: ignore[return-value]


def gather_values(values: Mapping[str, Any], group: Group = None) -> list[dict[str, Any]]:
    """Every rank's ``values`` (numbers and tensors, as :func:`all_reduce` takes them), in rank
    order, on the host: one all-gather of one flat float64 tensor, copied to the host once."""
    flat, layout = _flatten(values)
    # a tensor comes back on the CPU, with its dtype: no copy back to a device per rank
    host = [
        (key, torch.empty(0, dtype=v.dtype) if isinstance(v, torch.Tensor) else v, shape)
        for key, v, shape in layout
    ]
    if not is_live(group):
        return [_unflatten(flat, host)]
    with _watched("all_gather", group):
        mine = flat.to(comm_device(group))
        size = dist.get_world_size(group)
        table = torch.empty((size, mine.numel()), dtype=mine.dtype, device=mine.device)
        # rows of one contiguous buffer, each contiguous as all_gather asks
        dist.all_gather(list(table.unbind(0)), mine, group=group)
        table = table.cpu()
    return [_unflatten(row, host) for row in table]


@checked_arguments
def gather_tensors(
    tensor: torch.Tensor, group: Group = None, *, grad: bool = False
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 in rank order (lengths may differ).

    ``grad=True``: the result carries gradients back to each rank's ``tensor`` (a contrastive loss
    whose negatives are every rank's embeddings): a row's gradient is the sum over the ranks of
    their losses' gradients of it, so that under DDP's mean of the ranks' gradients a loss that is
    each rank's mean over its own rows trains what one process trains on the whole batch. A
    collective in the backward too: every rank must run it. Else the result is detached."""
    if not is_live(group):
        return tensor
    with _watched("gather_tensors", group):
        if grad:
            return cast(torch.Tensor, _GatherWithGrad.apply(tensor, group))
        local = tensor.detach().to(comm_device(group))
        return torch.cat(_all_gather_uneven(local, group)).to(tensor.device)


class _GatherWithGrad(torch.autograd.Function):
    """:func:`gather_tensors` with ``grad=True``: the backward all-reduces the gathered batch's
    gradient (every rank's loss's share of each row) and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        chunks = _all_gather_uneven(tensor.detach().to(comm_device(group)), group)
        rank = dist.get_rank(group)
        ctx.group, ctx.device = group, tensor.device
        ctx.rows = (sum(len(c) for c in chunks[:rank]), len(chunks[rank]))
        return torch.cat(chunks).to(tensor.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.to(comm_device(ctx.group), copy=True).contiguous()  # not the caller's tensor
        dist.all_reduce(summed, group=ctx.group)
        start, n = ctx.rows
        return summed[start : start + n].to(ctx.device), None


def _all_gather_uneven(local: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``local``, whose lengths along dim 0 may differ, in rank order."""
    device = local.device
    sizes = [
        torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(sizes, torch.tensor([local.shape[0]], device=device), group=group)
    lengths = [int(s.item()) for s in sizes]
    # all_gather needs equal shapes: padded to the longest, the padding cut away after
    padded = local.new_zeros((max(lengths), *local.shape[1:]))
    padded[: local.shape[0]] = local
    chunks = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(chunks, padded, group=group)
    return [chunk[:n] for chunk, n in zip(chunks, lengths)]


# Objects travel as pickled bytes in uint8 tensors, read back without numpy.


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj))
    # never empty: a pickle has an opcode at least
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU tensor, without numpy."""
    flat = tensor.reshape(-1).view(torch.uint8)
    data = bytearray(flat.numel())
    if data:
        torch.frombuffer(data, dtype=torch.uint8).copy_(flat)
    return bytes(data)


def all_gather_object(obj: T, group: Group = None) -> list[T]:
    """Every rank's picklable ``obj``, in rank order, on every rank; without a process group,
    ``[obj]``."""
    if not is_live(group):
        return [obj]
    with _watched("all_gather_object", group):
        chunks = _all_gather_uneven(_pickled(obj, comm_device(group)), group)
        return [pickle.loads(tensor_bytes(chunk.cpu())) for chunk in chunks]


def gather_object(obj: T, dst: int = 0, group: Group = None) -> list[T] | None:
    """Every rank's picklable ``obj``, in rank order, on rank ``dst`` of ``group`` (None on the
    others): torch's ``gather_object``, which reads the objects back through numpy (a caller's
    runs need it: the disk snapshots of several ranks); without a process group, ``[obj]``."""
    if not is_live(group):
        return [obj]
    with _watched("gather_object", group):
        receiver = dist.get_rank(group) == dst
        out: list[Any] | None = [None] * dist.get_world_size(group) if receiver else None
        global_dst = dist.get_global_rank(group, dst) if group is not None else dst
        dist.gather_object(obj, out, dst=global_dst, group=group)
        return out


def first_failure(mine: str | None, group: Group = None) -> str | None:
    """The failure of the lowest rank of ``group`` that had one (``mine``: this rank's, or None), on
    every rank, with that rank named on the others; None if no rank had one."""
    if not is_live(group):
        return mine
    with _watched("first_failure", group):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        first = int(all_reduce(rank if mine is not None else size, op="min", group=group))
        if first == size:
            return None
        failure = broadcast_object(mine, src=first, group=group)
        return failure if first == rank else f"{failure} (on rank {first})"


def broadcast_object(obj: T, src: int = 0, group: Group = None) -> T:
    """Rank ``src``'s picklable ``obj`` (a rank within ``group``) on every rank."""
    if not is_live(group):
        return obj
    with _watched("broadcast_object", group):
        device = comm_device(group)
        global_src = dist.get_global_rank(group, src) if group is not None else src
        sender = dist.get_rank(group) == src
        payload = _pickled(obj, device) if sender else None
        size = torch.tensor(
            [payload.numel() if payload is not None else 0], dtype=torch.int64, device=device
        )
        dist.broadcast(size, src=global_src, group=group)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src=global_src, group=group)
        return obj if sender else pickle.loads(tensor_bytes(payload.cpu()))


class MetricSums:
    """Sums and counts of named metrics, reduced once across ranks and divided once.

    ``update("loss", per_sample_losses)`` adds a batch; ``compute()`` returns the means over every
    sample every rank saw (one collective for all metrics).
    """

    def __init__(self) -> None:
        # Sums stay tensors on the values' device: no host sync per batch on CUDA.
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def update(self, name: str, values: torch.Tensor | float, count: int | None = None) -> None:
        """Add per-sample ``values`` (a tensor), or ``values`` summed over ``count`` samples."""
        if count is None:
            if not isinstance(values, torch.Tensor):
                raise ValueError(
                    f"metric {name!r}: give per-sample values as a tensor, or pass count="
                )
            count = values.numel()
        total = torch.as_tensor(values, dtype=torch.float64).detach().sum()
        self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.counts[name] = self.counts.get(name, 0) + int(count)

    def reduced(self, group: Group = None) -> dict[str, tuple[float, int]]:
        """(sum, count) of each metric over all ranks."""
        # a rank that saw no sample does not know the names: agree on them first
        names = sorted(set().union(*all_gather_object(sorted(self.sums), group)))
        flat = {f"s/{n}": self.sums.get(n, 0.0) for n in names} | {
            f"c/{n}": self.counts.get(n, 0) for n in names
        }
        flat = all_reduce(flat, group=group)
        return {n: (float(flat[f"s/{n}"]), int(flat[f"c/{n}"])) for n in names}

    def compute(self, group: Group = None) -> dict[str, float]:
        """Mean of each metric over all samples of all ranks."""
        return {n: (s / c if c else float("nan")) for n, (s, c) in self.reduced(group).items()}
