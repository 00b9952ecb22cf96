"""The demo models: the DDP tutorials' CNN, the benchmarks' residual blocks, and a small GPT."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two conv(5x5) + BatchNorm + ReLU + max-pool blocks and one linear layer, as in the DDP
    tutorials' MNIST example. ``image_size``: 28 for MNIST, 8 for scikit-learn's digits;
    ``channels``: the first block's width (the second's is twice); ``dropout`` before the linear
    layer."""

    def __init__(
        self, image_size: int = 28, num_classes: int = 10, channels: int = 16, dropout: float = 0.0
    ) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, kernel_size=5, padding=2),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(1, channels), block(channels, 2 * channels))
        side = image_size // 2 // 2  # each max-pool halves the side: 28 -> 7, 8 -> 2
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * channels * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(self.features(x).flatten(1)))


class Block(nn.Module):
    """A residual MLP block (``x + W2 relu(W1 x)``, 4x wide inside): the benchmarks' unit, and the
    class FSDP shards by (``shard_blocks=["Block"]``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a position sees only itself and those before it."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} does not divide into heads={heads}")
        self.heads, self.dropout = heads, dropout
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=2)
        )
        p = self.dropout if self.training else 0.0
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (4x wide, GELU)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT-style decoder: token and position embeddings, ``layers`` :class:`GPTBlock`, a
    final LayerNorm and a head tied to the token embedding; ``forward(tokens [B, T])`` returns
    logits ``[B, T, vocab]`` (about 210K parameters at the defaults)."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        width: int = 64,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(block_size, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        self.apply(_gpt_init)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than block_size={self.block_size}"
            )
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``tokens [B, T]`` by ``new_tokens`` sampled ones (context: ``block_size``)."""
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.block_size :])[:, -1] / temperature
            nxt = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens


def _gpt_init(module: nn.Module) -> None:
    # GPT-2's: normal(0, 0.02) weights, zero biases (LayerNorm keeps its ones and zeros).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
