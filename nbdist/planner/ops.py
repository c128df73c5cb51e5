"""The kernels of one transformer block's forward on one tensor-parallel rank, each with its FLOPs and the bytes it
moves through memory, so each can be timed on a roofline: max(FLOPs / matmul rate, bytes / memory bandwidth).

Why a roofline per kernel rather than FLOPs / (peak × efficiency): a block is not only large matmuls. The
attention score products multiply over a head's dimension only (64-160), so they move about as many bytes as
they compute and run at memory speed; softmax, dropout, LayerNorm, GELU and the residual adds compute next to
nothing and stream whole tensors. Their share falls as the hidden size grows (matmul FLOPs grow with h², the
bytes with h and with a·s²), which is why small models reach a smaller share of peak.

The kernels are Megatron-LM's (arXiv 2104.04473, section 4.2: fused bias+GeLU, fused bias+dropout+add, fused
scale+mask+softmax), T = b·s tokens of the micro-batch, e bytes per element:

    LayerNorm                     read + write T·h
    q, k, v                       matmul T × h × 3h/t
    scores q·kᵀ  (unfused)        a/t·b batched s × hd × s products: read q, k, write a/t·b·s² scores
    scale+mask+softmax (fused)    read + write the scores
    attention dropout             read + write the scores, write a 1-byte mask
    probabilities · v             read the probabilities and v, write T·h/t
    attention out                 matmul T × h/t × h
    bias+dropout+add (fused)      read two T·h, write one, a 1-byte mask
    LayerNorm                     read + write T·h
    mlp fc                        matmul T × h × ff/t
    bias+GeLU (fused)             read + write T·ff/t
    mlp proj                      matmul T × ff/t × h
    bias+dropout+add (fused)      as above

Grouped-query attention narrows k and v to kv_width = kv_heads·hd columns (the q, k, v matmul is T × h ×
(h + 2·kv_width)/t, the score kernels read k and v that wide); a gated MLP (SwiGLU) has one matmul T × h ×
2ff/t for the gate and the up projection, then silu(gate)·up (read two T·ff/t, write one). Without dropout the
attention dropout kernel and the masks go, and the adds move three tensors; without learned positions the
embedding is a lookup (read and write T·h).

Context parallelism (`cp`) gives each rank s/cp of every sequence's tokens: every token-wise kernel runs on T/cp
tokens, the score kernels on its s/cp queries against all s keys (the k and v of the other ranks arrive over the
ring: step.py prices that).

With FlashAttention (Dao et al. 2022; `flash_attention=True`) the four score kernels are one that never writes
the scores: it reads q, k, v and writes the output. With sequence parallelism the LayerNorms, dropouts and adds
run on T/t tokens. The backward of every kernel costs twice its forward (two products per matmul; the gradient
read and written beside the saved input elsewhere).
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.planner.model import GPT

MASK_BYTES = 1.0  # dropout masks are bytes
SCORE_KERNELS = ("scores q·kᵀ", "softmax", "attention dropout", "probabilities · v", "flash attention")


@dataclass(frozen=True)
class Kernel:
    """One kernel of a forward: FLOPs, bytes moved through memory, and whether it is a matmul."""

    name: str
    flops: float
    bytes: float
    matmul: bool

    def seconds(self, matmul_flops: float, bandwidth: float) -> float:
        """The roofline: a matmul takes the longer of its compute and its traffic; the rest stream their bytes."""
        return max(self.flops / matmul_flops, self.bytes / bandwidth) if self.matmul else self.bytes / bandwidth


def _matmul(name: str, rows: float, inner: float, cols: float, e: float) -> Kernel:
    return Kernel(name, 2 * rows * inner * cols, e * (rows * inner + inner * cols + rows * cols), True)


def block_kernels(model: GPT, micro_batch: int, tp: int, sequence_parallel: bool, e: float,
                  flash_attention: bool, cp: int = 1) -> list[Kernel]:
    """One block's forward kernels on one of tp (× cp) ranks, for a micro-batch of `micro_batch` sequences."""
    s, h, t, ff = model.seq, model.hidden, tp, model.ff
    tokens = micro_batch * s / cp
    whole = tokens / t if sequence_parallel else tokens  # tokens the replicated element-wise kernels touch
    mask = MASK_BYTES if model.dropout else 0.0
    norm = Kernel("LayerNorm" if model.norm == "layernorm" else "RMSNorm", 0.0, 2 * e * whole * h, False)
    residual = Kernel("bias+dropout+add" if model.dropout else "add", 0.0, (3 * e + mask) * whole * h, False)
    if model.gated:
        activation = Kernel("silu × up", 0.0, 3 * e * tokens * ff / t, False)
        mlp = [_matmul("mlp gate, up", tokens, h, 2 * ff / t, e), activation]
    else:
        mlp = [_matmul("mlp fc", tokens, h, ff / t, e), Kernel("bias+GeLU", 0.0, 2 * e * tokens * ff / t, False)]
    qkv = _matmul("q, k, v", tokens, h, (h + 2 * model.kv_width) / t, e)
    attention = attention_kernels(model, micro_batch, tp, e, flash_attention, cp)
    out = _matmul("attention out", tokens, h / t, h, e)
    return [norm, qkv, *attention, out, residual, norm, *mlp, _matmul("mlp proj", tokens, ff / t, h, e), residual]


def attention_kernels(model: GPT, micro_batch: int, tp: int, e: float, flash_attention: bool,
                      cp: int = 1) -> list[Kernel]:
    """The attention core: scores, softmax, dropout, weighted values (or one FlashAttention kernel); with cp > 1
    this rank's s/cp queries against all s keys."""
    s, h, t = model.seq, model.hidden, tp
    queries, keys = micro_batch * s / cp, micro_batch * s  # tokens: this rank's, and all the sequence's
    heads, kv = model.heads / t, model.kv_width
    head_dim = h / model.heads
    product_flops = 2 * heads * queries * s * head_dim
    if flash_attention:
        return [Kernel("flash attention", 2 * product_flops, 2 * e * (queries * h + keys * kv) / t, True)]
    scores = heads * queries * s
    dropout = [Kernel("attention dropout", 0.0, (2 * e + MASK_BYTES) * scores, False)] if model.dropout else []
    return [Kernel("scores q·kᵀ", product_flops, e * ((queries * h + keys * kv) / t + scores), True),
            Kernel("softmax", 0.0, 2 * e * scores, False), *dropout,
            Kernel("probabilities · v", product_flops, e * (scores + (keys * kv + queries * h) / t), True)]


def first_kernels(model: GPT, micro_batch: int, tp: int, e: float, cp: int = 1) -> list[Kernel]:
    """The first chunk's extra: the embedding lookup, plus learned positions and dropout where the model has them."""
    tokens = micro_batch * model.seq / cp
    moved = 3 * e + MASK_BYTES if model.positions == "learned" or model.dropout else 2 * e
    return [Kernel("embedding", 0.0, moved * tokens * model.hidden, False)]


def last_kernels(model: GPT, micro_batch: int, tp: int, e: float, cp: int = 1) -> list[Kernel]:
    """The last chunk's extra: the final norm, the logits of the rank's slice of the (padded) vocabulary, and the
    fp32 softmax cross-entropy over them (read the logits, write fp32 probabilities)."""
    tokens, h = micro_batch * model.seq / cp, model.hidden
    vocab = model.padded_vocab(tp) / tp
    return [Kernel("final norm", 0.0, 2 * e * tokens * h, False), _matmul("logits", tokens, h, vocab, e),
            Kernel("cross-entropy", 0.0, (e + 4) * tokens * vocab, False)]
