"""Global-batch dropout covers every dropout a model draws, or refuses what it cannot reach: torch's
own Transformer layers (their ``nn.Dropout`` modules), ``nn.Dropout2d``, a forward's own
``F.dropout``; attention whose kernel draws its own mask is refused at build, naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit import Trainer, TrainerConfig
from ddpkit._errors import ConfigError
from ddpkit.nn import _dropout as dropout
from ddpkit.nn._dropout import BatchLayout, batch_layout, convert_dropout
from ddpkit.testing import run_on_ranks

N, T, D = 48, 6, 16


class Encoder(nn.Module):
    """torch's Transformer layer (batch first), a Dropout2d over its output viewed as channels,
    and a functional dropout of the forward's own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=32, dropout=0.2,
                                                batch_first=True)  # fmt: skip
        self.layer.self_attn.dropout = 0.0  # its attention kernel's: out of reach, refused
        self.channels = nn.Dropout2d(0.3)
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(x)
        h = self.channels(h.unsqueeze(-1)).squeeze(-1)
        return self.head(F.dropout(h.mean(1), 0.25, self.training))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, T, D, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0, 0] > 0).long())


def _train(run_dir: str, global_dropout: bool) -> dict[str, torch.Tensor]:
    model = Encoder()
    config = TrainerConfig(
        run_dir=run_dir, epochs=2, global_batch_size=12, global_batch_dropout=global_dropout,
        seed=3, snapshot=ddpkit.SnapshotConfig(every_epochs=0),
        logging=ddpkit.LoggingConfig(progress=False),
    )  # fmt: skip
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), config,
        loss_fn=F.cross_entropy,
    )  # fmt: skip
    trainer.fit()
    return {k: v.clone() for k, v in ddpkit.unwrap(trainer.model).state_dict().items()}


def _rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)) for k in b)


@pytest.mark.parametrize("how", ["covered", "control-per-rank", "control-modules-only"])
def test_two_ranks_train_what_one_process_trains_with_every_kind_of_dropout(
    tmp_path, monkeypatch, how
):
    if how == "control-modules-only":  # nn.Dropout swapped, functional dropout left to each rank
        monkeypatch.setattr(
            dropout._Dropouts, "__torch_function__",
            lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})),
        )  # fmt: skip
    on = how != "control-per-rank"
    one = _train(str(tmp_path / "one"), on)
    two = run_on_ranks(_train, 2, args=(str(tmp_path / "two"), on))
    diff = _rel(two[0], one)
    if how == "covered":
        assert diff < 1e-5, diff  # seen: 2.2e-07
    else:  # the masks of Dropout2d and F.dropout drawn per rank: another model (seen: 0.63)
        assert diff > 1e-3, diff


def test_attention_whose_kernel_draws_its_own_dropout_is_refused_naming_it():
    layer = nn.TransformerEncoderLayer(D, 2, dropout=0.1, batch_first=True)
    with pytest.raises(ConfigError, match=r"self_attn \(nn.MultiheadAttention, dropout=0.1"):
        convert_dropout(nn.Sequential(layer))
    layer.self_attn.dropout = 0.0
    convert_dropout(layer)  # control: with the attention's own dropout off, the rest is covered


def test_a_forwards_attention_dropout_and_alpha_dropout_are_refused_at_the_call():
    q = torch.randn(4, 2, T, 8)
    layout = BatchLayout(global_size=8, offset=4, key=7, size=4)
    with batch_layout(layout), pytest.raises(ConfigError, match="dropout_p=0.1"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with batch_layout(layout), pytest.raises(ConfigError, match="alpha_dropout"):
        F.alpha_dropout(q, 0.2, True)
    with batch_layout(layout):  # control: without dropout, attention runs
        F.scaled_dot_product_attention(q, q, q)


def test_a_mode_left_without_a_layout_lets_dropout_draw_its_own_mask(monkeypatch):
    # A block entered and never left keeps its mode on torch's stack (a forked child inherits it);
    # once the layout is gone, dropout is torch's own again.
    x = torch.ones(4, 64)
    torch.manual_seed(0)
    plain = F.dropout(x, 0.5)
    block = batch_layout(BatchLayout(global_size=4, offset=0, key=1, size=4))
    block.__enter__()
    try:
        torch.manual_seed(0)
        masked = F.dropout(x, 0.5)  # control: the layout's mask, not the RNG's
        monkeypatch.setattr(dropout, "_layout", None)
        torch.manual_seed(0)
        stale = F.dropout(x, 0.5)
    finally:
        monkeypatch.undo()
        block.__exit__(None, None, None)
    assert torch.equal(stale, plain) and not torch.equal(masked, plain)


def _hand_loop(global_dropout: bool) -> dict[str, torch.Tensor]:
    """A hand-written loop on ``build_loader`` and ``prepare_model`` (global batch 12 at any world
    size), its forward inside ``ddpkit.nn.global_batch`` or not."""
    from contextlib import nullcontext

    ddpkit.seed_everything(3)
    model = ddpkit.prepare_model(Encoder())
    world = ddpkit.get_runtime().world_size
    loader = ddpkit.build_loader(_data(), batch_size=12 // world, seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in loader:
            with ddpkit.nn.global_batch(loader) if global_dropout else nullcontext():
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}


@pytest.mark.parametrize("global_dropout", [True, False], ids=["global-batch", "control-per-rank"])
def test_a_hand_loop_inside_global_batch_trains_what_one_process_trains(global_dropout):
    one = _hand_loop(global_dropout)
    two = run_on_ranks(_hand_loop, 2, args=(global_dropout,))
    diff = _rel(two[0], one)
    assert diff < 1e-5 if global_dropout else diff > 1e-3, diff


def test_global_batch_before_any_batch_is_refused():
    loader = ddpkit.build_loader(_data(), batch_size=4)
    with pytest.raises(ConfigError, match="no batch of this epoch yet"):
        with ddpkit.nn.global_batch(loader):
            pass
