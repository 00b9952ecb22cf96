"""``torch.nn`` modules, where ddpkit reaches past their public API: ``_BatchNorm``, a compiled
module's ``_orig_mod``, a module's ``_buffers``, and the buckets DDP rebuilds after a first step."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit._internals.contract import Internal, warn_lost


class BatchNormBase(nn.modules.batchnorm._BatchNorm):
    """torch's base of the BatchNorm layers, for inputs of 2 or more dimensions (``N, C, ...``)."""

    def check_input(self, input: torch.Tensor) -> None:
        self._check_input_dim(input)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")


def is_batchnorm(module: nn.Module) -> TypeGuard[nn.modules.batchnorm._BatchNorm]:
    """A BatchNorm layer of any dimension (torch's or ddpkit's), not an InstanceNorm."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, for its wrapper (None for any other module)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported here (~1 s)
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return None
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def buffer_slots(module: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """(the dict, the name) of each buffer of ``module``: ``slot[0][slot[1]]`` is its tensor."""
    return [(m._buffers, name) for m in module.modules() for name in m._buffers]


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


def _check_batchnorm() -> str | None:
    base = getattr(nn.modules.batchnorm, "_BatchNorm", None)
    if base is None or not issubclass(nn.BatchNorm2d, base):
        return "nn.modules.batchnorm._BatchNorm is not the base of BatchNorm2d"
    if not callable(getattr(base, "_check_input_dim", None)):
        return "it asks no _check_input_dim"
    return None


def _check_compiled() -> str | None:
    wrapped = nn.Linear(1, 1)
    compiled: Any = torch.compile(wrapped)
    found = compiled_inner(compiled)
    return None if found is wrapped else "a compiled module's _orig_mod is not the module compiled"


def _check_buffers() -> str | None:
    module = nn.BatchNorm1d(2)
    slots = buffer_slots(module)
    if not slots or any(d[name] is not getattr(module, name) for d, name in slots):
        return "_buffers is not where buffers are"
    return None


INTERNALS = [
    Internal(
        "torch.nn.modules.batchnorm._BatchNorm",
        "torch",
        "SyncBatchNorm on the CPU (gloo)",
        _check_batchnorm,
    ),
    Internal(
        "torch._dynamo OptimizedModule._orig_mod",
        "torch",
        "unwrap() and no_sync() see through torch.compile's wrapper",
        _check_compiled,
    ),
    Internal(
        "torch.distributed._compute_bucket_assignment_by_size, DDP._comm_hooks",
        "torch",
        "a model wrapped anew in DDP (a resumed run) reduces its first step in the buckets of the "
        "run it resumes: bitwise at 3 ranks and more; where it is gone, within rounding",
        _check_rebuilt_buckets,
    ),
    Internal(
        "torch.nn.Module._buffers",
        "torch",
        "memory snapshots find each buffer's tensor cheaply",
        _check_buffers,
    ),
]
