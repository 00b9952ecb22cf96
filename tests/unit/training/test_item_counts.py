"""Per-token weighting as arithmetic: the shares of :mod:`ddpkit.training._step` turn DDP's average
over ranks of summed micro-batch gradients into the gradient of the mean over every token (one
process, no ranks: the ranks' gradients are computed one after another and averaged as DDP
would)."""

import pytest
import torch
import torch.nn.functional as F

from ddpkit.training._step import _as_count, loss_divisor


def _grad(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, divisor: float) -> torch.Tensor:
    w = w.clone().requires_grad_()
    (F.cross_entropy(x @ w, y, ignore_index=-100) / divisor).backward()
    return w.grad


def _micro_batches():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 5, generator=g)
    out = []
    # 2 ranks x 2 micro-batches of different token counts (the rest is padding)
    for tokens in (3, 9, 1, 6):
        x, y = torch.randn(9, 4, generator=g), torch.randint(0, 5, (9,), generator=g)
        y[tokens:] = -100
        out.append((x, y))
    return w, out


def test_item_shares_give_the_gradient_of_the_mean_over_every_token():
    w, micro = _micro_batches()
    world = 2
    counts = [int((y != -100).sum()) for _, y in micro]
    total = torch.tensor(float(sum(counts)), dtype=torch.float64)
    shares = [
        float(loss_divisor(torch.tensor(float(c), dtype=torch.float64), world, total))
        for c in counts
    ]
    ranks = [
        sum(_grad(w, *micro[r * 2 + i], shares[r * 2 + i]) for i in range(2)) for r in range(world)
    ]
    ddp = sum(ranks) / world
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    assert torch.allclose(ddp, _grad(w, x, y, 1.0), atol=1e-6)
    # Control: the per-sample shares (each micro-batch's mean counted alike) are another gradient.
    same = loss_divisor(9, world, 36)
    ranks = [sum(_grad(w, *micro[r * 2 + i], same) for i in range(2)) for r in range(world)]
    assert (sum(ranks) / world - _grad(w, x, y, 1.0)).abs().max() > 1e-2


def test_a_count_must_be_one_number():
    assert float(_as_count(torch.tensor([7]))) == 7.0 and float(_as_count(3)) == 3.0
    with pytest.raises(ValueError, match="one number"):
        _as_count(torch.ones(2))
    with pytest.raises(TypeError, match="int or a 0-dim tensor"):
        _as_count("7")
