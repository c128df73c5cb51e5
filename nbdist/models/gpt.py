"""A small GPT-style transformer as ONE flat nn.Sequential: [Embedding, Block x layers, Head] (nanoGPT's shape).

Why flat: nbdist.pipeline cuts an nn.Sequential between its items, so every block boundary is a cut point and
`model[:k]`, `model[k:]` compose to the whole model.

Why attention reads the number of heads from the tensor: under tensor parallelism (DTensor's ColwiseParallel on
q, k, v and RowwiseParallel on out) a rank's q holds hidden/tp features, i.e. heads/tp whole heads. Viewing q's
output as (B, T, -1, head_dim) makes the same code compute the full attention or its share of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from nbdist.checks import whole_number
from nbdist.errors import DistUsageError
from nbdist.models.mlp import seeded


@dataclass(frozen=True)
class GPTConfig:
    """The sizes a plan reads from `model.config` (e.g. heads and hidden, to choose a tensor-parallel degree)."""

    vocab: int
    seq: int
    layers: int
    hidden: int
    heads: int
    ff: int


class Embedding(nn.Module):
    """Tokens (B, T) -> token embedding + learned position embedding, (B, T, hidden)."""

    def __init__(self, vocab: int, seq: int, hidden: int):
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.seq:
            raise DistUsageError(f"gpt: {length} tokens per sequence, but the model was built for seq={self.seq}")
        return self.tok(tokens) + self.pos(torch.arange(length, device=tokens.device))


class Attention(nn.Module):
    """Causal multi-head self-attention; q, k, v, out are plain Linears so tensor parallelism can split them."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads  # not the head count: under tensor parallelism a rank holds fewer heads
        self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (part(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for part in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads here, T, head_dim)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """hidden -> ff -> hidden with GELU (tanh approximation, as GPT-2): fc splits by columns, proj by rows."""

    def __init__(self, hidden: int, ff: int):
        super().__init__()
        self.fc = nn.Linear(hidden, ff)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(ff, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, hidden: int, heads: int, ff: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection -> logits (B, T, vocab).

    Not tied to the token embedding (GPT-2 ties them): the two sit at opposite ends of a pipeline, on different
    ranks, where one shared tensor cannot live."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def gpt(vocab: int = 256, seq: int = 64, layers: int = 4, hidden: int = 64, heads: int = 4, ff: int | None = None,
        seed: int = 0) -> nn.Sequential:
    """`[Embedding, Block x layers, Head]`, weights depending only on `seed` and the sizes; `model.config` holds them."""
    config = _config(vocab, seq, layers, hidden, heads, ff)
    with seeded(seed):
        model = nn.Sequential(Embedding(config.vocab, config.seq, config.hidden),
                              *(Block(config.hidden, config.heads, config.ff) for _ in range(config.layers)),
                              Head(config.hidden, config.vocab))
        _init_gpt2_style(model)
    model.config = config
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token logits (B, T, V) against targets (B, T): a pipeline's loss function."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _config(vocab, seq, layers, hidden, heads, ff) -> GPTConfig:
    """The sizes checked, each failure one line naming the size."""
    sizes = {"vocab": vocab, "seq": seq, "layers": layers, "hidden": hidden, "heads": heads}
    for name, value in sizes.items():
        whole_number(value, f"gpt {name}")
    if hidden % heads:
        raise DistUsageError(f"gpt hidden ({hidden}) must be divisible by heads ({heads})")
    ff = 4 * hidden if ff is None else whole_number(ff, "gpt ff")
    return GPTConfig(ff=ff, **sizes)


def _init_gpt2_style(model: nn.Module) -> None:
    """GPT-2's init, written out so a change in torch's defaults cannot change the model: Linear and Embedding
    weights normal(0, 0.02), biases zero, LayerNorms the identity. Small weights make the first logits nearly
    uniform, so an untrained model's loss is about ln(vocab)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
