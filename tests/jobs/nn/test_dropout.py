"""Global-batch dropout covers every dropout a model draws, or refuses what it cannot reach: torch's
own Transformer layers (their ``nn.Dropout`` modules), ``nn.Dropout2d``, a forward's own
``F.dropout``, ``scaled_dot_product_attention(dropout_p=...)``, on batches each rank pads to its own
length; ``nn.MultiheadAttention``'s own dropout is refused at build, naming it."""

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


VOCAB = 20


class Ragged(torch.utils.data.Dataset):
    """Sequences of 3 to 12 tokens, labelled by their first token's parity."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, VOCAB, (int(torch.randint(3, 13, (), generator=g)),), generator=g)
        return {"input_ids": ids, "labels": ids[0] % 2}


def pad(samples: list[dict]) -> dict[str, torch.Tensor]:
    """To the longest sequence of the batch, as Hugging Face's collators pad: each rank's batch its
    own length."""
    ids = nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "labels": torch.stack([s["labels"] for s in samples])}  # fmt: skip


class PaddedEncoder(nn.Module):
    """Embeddings, dropout, self-attention over the real tokens with its own attention dropout
    (``scaled_dot_product_attention(dropout_p=0.1)``, as Hugging Face's BERT), a mean over the
    real tokens and a functional dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv = nn.Embedding(VOCAB, D), nn.Linear(D, 3 * D)
        self.drop, self.head = nn.Dropout(0.2), nn.Linear(D, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        h = self.drop(self.embed(input_ids))
        q, k, v = self.qkv(h).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        keys = attention_mask[:, None, None, :].bool()
        p = 0.1 if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys, dropout_p=p)
        h = h + a.transpose(1, 2).reshape(b, t, D)
        real = attention_mask[..., None].to(h.dtype)
        return self.head(F.dropout((h * real).sum(1) / real.sum(1), 0.1, self.training))


def _padded_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])


def _train_padded(run_dir: str) -> dict[str, torch.Tensor]:
    model = PaddedEncoder()
    config = TrainerConfig(
        run_dir=run_dir, epochs=2, global_batch_size=8, grad_accum_steps=2, collate_fn=pad,
        global_batch_dropout=True, seed=3, num_workers=0,
        snapshot=ddpkit.SnapshotConfig(every_epochs=0),
        logging=ddpkit.LoggingConfig(progress=False),
    )  # fmt: skip
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), Ragged(), config,
                      batch_loss_fn=_padded_loss)  # fmt: skip
    trainer.fit()
    return {k: v.clone() for k, v in ddpkit.unwrap(trainer.model).state_dict().items()}


def _drawn_in_the_ranks_shape(
    input: torch.Tensor, p: float, layer_id: int, dim: int, channels: bool = False
) -> torch.Tensor:
    """The mask as it was drawn before: the global batch's, in the shape of this rank's input (its
    padded length), this rank's rows kept."""
    layout = dropout._layout
    call = dropout._calls.get(layer_id, 0)
    dropout._calls[layer_id] = call + 1
    g = torch.Generator().manual_seed(dropout.mix_seed(layout.key, layer_id, call))
    shape = list(input.shape[:2] if channels else input.shape)
    shape[dim] = layout.global_size
    keep = torch.rand(shape, generator=g).narrow(dim, layout.offset, input.shape[dim])
    if channels:
        keep = keep.reshape(*keep.shape, *([1] * (input.dim() - 2)))
    return input * (keep >= p).to(input.dtype) / (1 - p)


@pytest.mark.parametrize("mask", ["by-position", "control-in-the-ranks-shape"])
def test_padded_batches_get_each_samples_mask_whatever_the_ranks_padding(
    tmp_path, monkeypatch, mask
):
    # Each rank pads to the longest sequence of its own slice: at 2 ranks a sample's row is shorter
    # than at 1 process. Its masks (embedding dropout, attention dropout, pooled dropout) must be
    # the same all the same.
    if mask != "by-position":
        monkeypatch.setattr(dropout, "_masked", _drawn_in_the_ranks_shape)
    one = _train_padded(str(tmp_path / "one"))
    two = run_on_ranks(_train_padded, 2, args=(str(tmp_path / "two"),))
    diff = _rel(two[0], one)
    if mask == "by-position":
        assert diff < 1e-5, diff  # seen: 1.3e-07
    else:
        assert diff > 1e-3, diff  # seen: 0.26


def test_attention_whose_kernel_draws_its_own_dropout_is_refused_naming_it():
    layer = nn.TransformerEncoderLayer(D, 2, dropout=0.1, batch_first=True)
    with pytest.raises(
        dropout.DropoutRefused, match=r"self_attn \(nn.MultiheadAttention, dropout=0.1"
    ):
        convert_dropout(nn.Sequential(layer))
    layer.self_attn.dropout = 0.0
    convert_dropout(layer)  # control: with the attention's own dropout off, the rest is covered


def test_attention_dropout_follows_the_layout_whatever_the_padding():
    # A global batch of 8 sequences padded to 10 tokens, and its two halves padded to their own
    # lengths (7 and 10), as two ranks pad them: the real tokens' outputs are the same.
    g = torch.Generator().manual_seed(5)
    lengths = [3, 7, 5, 6, 10, 4, 9, 2]
    x = torch.zeros(8, 2, 10, 4)
    for i, n in enumerate(lengths):
        x[i, :, :n] = torch.randn(2, n, 4, generator=g)
    keys = torch.tensor([[j < n for j in range(10)] for n in lengths])[:, None, None, :]

    def attend(rows: slice, width: int, offset: int, p: float = 0.3, key: int = 7) -> torch.Tensor:
        q = x[rows, :, :width]
        layout = BatchLayout(global_size=8, offset=offset, key=key, size=q.shape[0])
        with batch_layout(layout):
            return F.scaled_dot_product_attention(
                q, q, q, attn_mask=keys[rows, ..., :width], dropout_p=p
            )

    whole = attend(slice(0, 8), 10, 0)
    halves = [attend(slice(0, 4), 7, 0), attend(slice(4, 8), 10, 4)]
    for i, n in enumerate(lengths):
        part = halves[i // 4][i % 4]
        assert torch.allclose(part[:, :n], whole[i, :, :n], atol=1e-6), i
    # controls: the dropout is drawn (not the attention without it), and by the layout's key
    assert not torch.allclose(whole, attend(slice(0, 8), 10, 0, p=0.0))
    assert not torch.allclose(whole, attend(slice(0, 8), 10, 0, key=8))
    assert torch.equal(whole, attend(slice(0, 8), 10, 0))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"is_causal": True}, {"mask": "bool"}, {"mask": "float"}, {"scale": 0.3},
     {"enable_gqa": True}, {"mask": "a row of nothing"}, {"mask": "a float row of nothing"}],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "plain",
)  # fmt: skip
def test_attention_under_the_layout_computes_what_torchs_attention_computes(kwargs):
    # Its dropout aside (p = 1e-12 drops no weight), the attention of the layout is torch's: masks,
    # causal, scale, grouped-query heads, and a query that sees no key (torch's reference: 0).
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 4, 5, 8, generator=g)
    kv_heads = 2 if kwargs.get("enable_gqa") else 4
    k, v = (torch.randn(4, kv_heads, 6, 8, generator=g) for _ in "kv")
    given = {key: value for key, value in kwargs.items() if key != "mask"}
    mask = kwargs.get("mask")
    if mask is not None:
        keep = torch.rand(4, 1, 5, 6, generator=g) > 0.3
        if mask == "a row of nothing":
            keep[0, 0, 2] = False
        given["attn_mask"] = (
            keep if mask != "float" else torch.zeros(4, 1, 5, 6).masked_fill(~keep, float("-inf"))
        )
    expected = F.scaled_dot_product_attention(q, k, v, **given)
    with batch_layout(BatchLayout(global_size=4, offset=0, key=1, size=4)):
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=1e-12, **given)
    assert torch.allclose(got, expected, atol=1e-6)


def test_alpha_dropout_and_a_flattened_batch_are_refused_at_the_call():
    q = torch.randn(4, 2, T, 8)
    layout = BatchLayout(global_size=8, offset=4, key=7, size=4)
    with batch_layout(layout), pytest.raises(dropout.DropoutRefused, match="alpha_dropout"):
        F.alpha_dropout(q, 0.2, True)
    with batch_layout(layout), pytest.raises(dropout.DropoutRefused, match="flattened"):
        F.dropout(q.flatten(0, 1), 0.2)  # the samples' rows mixed with the heads'
    with batch_layout(layout):  # control: the batch's own rows
        F.dropout(q, 0.2)


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
