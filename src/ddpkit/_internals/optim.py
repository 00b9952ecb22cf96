"""Optimizers, schedulers and gradients, where ddpkit reaches past torch's public API: a
scheduler's marks on its optimizer's step, the fused inf/NaN check, a sparse tensor's values, and
the buckets DDP rebuilds after its first step."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit._internals.contract import Internal, warn_lost

_MARK = "_wrapped_by_lr_sched"


def mark_stepped_like(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Where a scheduler marked ``old.step``, wrap ``new.step`` the same way."""
    if not hasattr(old.step, _MARK):
        return
    step = new.step

    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        new._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    setattr(tracked_step, _MARK, True)
    new.step = tracked_step  # type: ignore[method-assign]


def any_non_finite(group: list[torch.Tensor], flag: torch.Tensor, one: torch.Tensor) -> bool:
    """Whether any tensor of ``group`` (one device; one dtype for the kernel's fast route on CUDA)
    holds inf or NaN: ``flag`` (zero) is set by torch's fused check, ``one`` is its scale."""
    torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)
    return bool(flag.item())


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor, uncoalesced (coalescing sums, and could overflow)."""
    return t._values()


class _RebuiltBuckets:
    """The comm hook of :func:`reduce_in_rebuilt_buckets`, and the order the gradients of this
    step became ready in (parameter ids), recorded until the first step that all-reduces."""

    def __init__(self, ddp: DDP) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # the model holds this (its comm hook, its registration), this holds the model weakly
        self.ddp, self.allreduce = weakref.ref(ddp), allreduce_hook
        self.ready: list[int] = []
        self.seen = self.registered = self.ours = False
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.most = 4 * len(params)
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]
        # a wrapper dropped before its first step leaves no hook on the parameters
        weakref.finalize(ddp, _remove, self.handles)
        self.handles.append(ddp.register_forward_pre_hook(self._forward))
        self.inner: tuple[object, Callable[..., Any]] | None = None
        # DDP takes one comm hook: the caller's registrations come here (an instance attribute
        # shadows the method)
        vars(ddp)["register_comm_hook"] = self.register

    def register(self, state: object, hook: Callable[..., Any]) -> None:
        """``ddp.register_comm_hook``: before the first forward, torch's own (none of this one's
        then); after it, ``hook`` serves every bucket from then on in place of this one's."""
        ddp = self.ddp()
        assert ddp is not None  # called on it
        self.seen = self.registered = True
        if not self.ours:
            DDP.register_comm_hook(ddp, state, hook)
            return
        ddp._check_comm_hook(hook)
        if self.inner is not None:
            raise RuntimeError(
                "register_comm_hook can only be called once (DDP takes one comm hook): register "
                "yours once, before the model's first forward"
            )
        self.inner = (state, hook)

    def _ready(self, param: torch.Tensor) -> None:
        if len(self.ready) < self.most:
            self.ready.append(id(param))

    def _forward(self, ddp: DDP, args: Any) -> None:
        if not self.registered:  # at the first forward: a hook the caller registered comes first
            self.registered = True
            if ddp._comm_hooks or ddp._get_ddp_logging_data().get("comm_hook"):
                self.seen = True
            else:
                DDP.register_comm_hook(ddp, ddp.process_group, self.hook)
                self.ours = True
        if self.seen:  # the first all-reducing step is over: DDP's buckets are rebuilt
            _remove(self.handles)
        self.ready.clear()

    def hook(self, group, bucket):  # type: ignore[no-untyped-def]  # DDP reads no string annotation
        if self.inner is not None:
            return self.inner[1](self.inner[0], bucket)
        if not self.handles:
            return self.allreduce(group, bucket)
        self.seen = True
        # DDP's first all-reducing step gives every gradient of a dtype in one bucket, in the
        # parameters' order: reduced here in the buckets the reducer builds from rank 0's ready
        # order (DDP rebuilds from rank 0's too), each divided and summed as allreduce_hook does.
        # Every rank takes rank 0's order: a rank laying out its own would issue other all-reduces.
        params, buffer = bucket.parameters(), bucket.buffer()
        where = {id(p): i for i, p in enumerate(params)}
        mine = [where[i] for i in self.ready if i in where]
        whole = sorted(mine) == list(range(len(params))) and not buffer.is_sparse
        order = torch.tensor(mine if whole else [-1] * len(params), device=buffer.device)
        dist.broadcast(order, 0 if group is None else dist.get_global_rank(group, 0), group=group)
        if order[0] < 0:
            return self.allreduce(group, bucket)  # rank 0 saw a gradient accumulated twice
        ranked = order.tolist()
        ddp = self.ddp()
        assert ddp is not None  # its backward runs
        cap = ddp.bucket_bytes_cap
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if ddp.bucket_bytes_cap_default else cap
        layout, _ = dist._compute_bucket_assignment_by_size(
            [params[i] for i in ranked], [first, cap], [False] * len(ranked), ranked
        )
        views = buffer.split([p.numel() for p in params])
        for indices in layout:
            flat = torch.cat([views[i] for i in indices]).div_(dist.get_world_size(group))
            dist.all_reduce(flat, group=group)
            for i, part in zip(indices, flat.split([views[i].numel() for i in indices])):
                views[i].copy_(part)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def reduce_in_rebuilt_buckets(ddp: DDP) -> None:
    """Make every step of ``ddp`` all-reduce each gradient in the buckets DDP rebuilds after its
    first step, that first step included, so that a model wrapped anew (a resumed run) sums each
    gradient in the same order as one wrapped once. DDP's first step reduces every gradient in one
    bucket in the parameters' order and rebuilds its buckets from the order the gradients became
    ready; a ring all-reduce over 3 ranks or more sums an element in an order set by its place in
    its bucket, so that step would differ in the last bits. A comm hook (torch's
    ``allreduce_hook`` after the first step) does it; a comm hook the caller registers before the
    first forward replaces it, one registered later serves the buckets from then on. Nothing where
    DDP rebuilds later or never (``static_graph``, ``find_unused_parameters``, per-bucket sizes),
    under compiled autograd's reducer, or where torch lacks what it relies on."""
    if (
        ddp.find_unused_parameters
        or ddp.static_graph
        or getattr(ddp, "bucket_bytes_cap_list", None)
        or getattr(ddp, "_use_python_reducer", False)
    ):
        return
    if _check_rebuilt_buckets() is not None:
        warn_lost("DDP's bucket rebuild", "torch", "the first step reduced in rebuilt buckets")
        return
    _RebuiltBuckets(ddp)


def _check_rebuilt_buckets() -> str | None:
    layout = dist._compute_bucket_assignment_by_size(
        [torch.zeros(2), torch.zeros(3)], [1 << 20], [False, False], [1, 0]
    )
    if layout[0] != [[1, 0]]:
        return f"_compute_bucket_assignment_by_size gives {layout[0]} where [[1, 0]] was meant"
    missing = [
        name
        for name in ("_comm_hooks", "_get_ddp_logging_data", "bucket_bytes_cap_default")
        if not hasattr(DDP, name) and name not in DDP.__init__.__code__.co_names
    ]
    if missing or not isinstance(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None), int):
        return f"DDP lacks {missing or '_DEFAULT_FIRST_BUCKET_BYTES'}"
    return None


def _check_scheduler_marks() -> str | None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)
    if not hasattr(optimizer.step, _MARK):
        return f"a scheduler no longer marks its optimizer's step with {_MARK}"
    optimizer.step()
    if not getattr(optimizer, "_opt_called", False):
        return "the marked step no longer sets _opt_called"
    return None


def _check_fused_check() -> str | None:
    fn = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fn is None:
        return "torch has no _amp_foreach_non_finite_check_and_unscale_"
    flag, one = torch.zeros(1), torch.ones(1)
    fn([torch.tensor([1.0, float("inf")])], flag, one)
    return None if flag.item() == 1.0 else "it does not flag an inf"


def _check_sparse_values() -> str | None:
    t = torch.sparse_coo_tensor(
        torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=False
    )  # two at one index: uncoalesced
    if t._values().tolist() != [1.0, 2.0]:
        return "_values() of an uncoalesced tensor is not its stored values"
    return None


INTERNALS = [
    Internal(
        "torch.optim.lr_scheduler: optimizer.step._wrapped_by_lr_sched / optimizer._opt_called",
        "torch",
        "a scheduler moved to ZeRO's optimizer does not warn that it stepped before the optimizer",
        _check_scheduler_marks,
    ),
    Internal(
        "torch._amp_foreach_non_finite_check_and_unscale_",
        "torch",
        "one fused inf/NaN check of all gradients per device and dtype",
        _check_fused_check,
    ),
    Internal(
        "torch.Tensor._values",
        "torch",
        "the inf/NaN check of sparse gradients",
        _check_sparse_values,
    ),
    Internal(
        "torch.distributed._compute_bucket_assignment_by_size, DDP._comm_hooks",
        "torch",
        "a model wrapped anew in DDP (a resumed run) reduces its first step in the buckets of the "
        "run it resumes: bitwise at 3 ranks and more; where it is gone, within rounding",
        _check_rebuilt_buckets,
    ),
]
