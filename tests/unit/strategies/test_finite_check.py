"""The step's NaN/inf verdict (``FiniteCheck``) on gradients laid out as DDP lays them: views back
to back in bucket buffers (ddpkit's default), beside gradients of their own, with NaN, inf, finite
values whose sum overflows, and storages swapped between steps, through one check kept from step to
step. Its answer is the exact one, element by element, every call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.strategies._ddp import FiniteCheck
from tests.fuzz import examples

FAST = examples(60)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
POISONS = ["nan", "inf", "-inf", "inf and -inf", "overflowing sum"]


def _exact(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _values(data: st.DataObject) -> torch.Generator:
    """The tensors' values from a seed hypothesis draws: a failure replays with the same values."""
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))


def _layout(
    data: st.DataObject, values: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients as DDP may leave them: buckets of views back to back (a gap where a parameter
    outside the optimizer sits), in any order, and gradients of their own. Returns the gradients and
    the tensors that hold them (the buckets, and the gradients of their own)."""
    grads: list[torch.Tensor] = []
    buffers = []
    dtype = data.draw(st.sampled_from(DTYPES))
    for _ in range(data.draw(st.integers(0, 3))):
        sizes = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
        gaps = data.draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
        buffer = torch.randn(sum(sizes) + sum(gaps), dtype=torch.float64, generator=values)
        buffer = buffer.to(dtype)
        buffers.append(buffer)
        at = 0
        for size, gap in zip(sizes, gaps, strict=True):
            at += gap
            grads.append(buffer[at : at + size])
            at += size
    for _ in range(data.draw(st.integers(0 if grads else 1, 3))):
        own = torch.randn(data.draw(st.integers(1, 30)), dtype=torch.float64, generator=values)
        own = own.to(dtype)
        grads.append(own)
        buffers.append(own)
    order = data.draw(st.permutations(range(len(grads))))
    return [grads[i] for i in order], buffers


def _poison(data: st.DataObject, grads: list[torch.Tensor]) -> None:
    filled = [t for t in grads if t.numel()]
    if not filled:
        return
    kind = data.draw(st.sampled_from(POISONS))
    t = data.draw(st.sampled_from(filled))
    i = data.draw(st.integers(0, t.numel() - 1))
    if kind == "overflowing sum":  # every element finite, the sum not: the exact check decides
        big = torch.finfo(t.dtype).max
        for u in filled:
            u.fill_(big / 2)
        return
    if kind == "inf and -inf":  # a sum of them is NaN
        u = data.draw(st.sampled_from(filled))
        t[i] = float("inf")
        u[data.draw(st.integers(0, u.numel() - 1))] = float("-inf")
        return
    t[i] = float(kind)


@FAST
@given(data=st.data())
def test_the_verdict_is_the_exact_one_for_every_layout_and_every_bad_element(data):
    values = _values(data)
    grads, buffers = _layout(data, values)
    check = FiniteCheck([g.detach().clone() for g in grads])
    for _ in range(data.draw(st.integers(1, 4))):  # the same check, step after step
        clean = data.draw(st.booleans())
        for b in buffers:  # a new step's gradients, in place
            b.copy_(torch.randn(b.shape, dtype=torch.float64, generator=values).to(b.dtype))
        if not clean:
            _poison(data, grads)
        assert check(grads) is _exact(grads)


@pytest.mark.parametrize(
    "how",
    [
        "another storage",  # at another address
        "strided, at the same address",  # same address and size, every 4th element
        "another dtype, at the same address",  # same address and size, half the bytes
    ],
)
def test_a_gradient_swapped_in_place_is_read_where_it_now_lies(how):
    """``p.grad.data = t`` keeps the gradient object and moves its elements: a check kept from step
    to step reads them where they now lie."""
    bucket = torch.zeros(40)
    grads = [bucket[:10], bucket[10:20]]
    check = FiniteCheck([g.clone() for g in grads])
    assert check(grads) is True
    kept = grads[0]
    if how == "another storage":
        kept.data = torch.zeros(10)
        kept.data[3] = float("nan")
    elif how == "strided, at the same address":
        kept.data = bucket[0:40:4]
        bucket[36] = float("nan")  # the swapped gradient's last element
    else:
        kept.data = bucket.view(torch.bfloat16)[:10]
        kept.data[8] = float("nan")  # the low half of the bucket's fifth float32
    assert check(grads) is False
    # Control: where the gradient lay before (the bucket's first 20 elements) still reads finite
    # (the bf16 NaN lies in the low half of a little-endian float32): a check that kept where the
    # gradients lay, by object or by address and size, would call this step finite.
    assert bool(torch.isfinite(bucket[:20].sum()))


@pytest.mark.parametrize("default", [torch.float64, torch.float32])
def test_the_check_runs_whatever_the_default_dtype(default):
    # A script (or ddpkit check's float64 runs) with float64 as the default dtype: the fused check
    # takes its flag and scale in float32 only, which the check made in the default dtype.
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        check = FiniteCheck([torch.zeros(3)])
        grads = [torch.tensor([1.0, float("nan"), 2.0])]
        assert check([torch.ones(3)]) and not check(grads)
    finally:
        torch.set_default_dtype(before)
