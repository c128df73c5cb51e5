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
                  flash_attention: bool) -> list[Kernel]:
    """One block's forward kernels on one of tp ranks, for a micro-batch of `micro_batch` sequences."""
    s, h, t = model.seq, model.hidden, tp
    tokens = micro_batch * s
    whole = tokens / t if sequence_parallel else tokens  # tokens the replicated element-wise kernels touch
    layernorm = Kernel("LayerNorm", 0.0, 2 * e * whole * h, False)
    residual = Kernel("bias+dropout+add", 0.0, (3 * e + MASK_BYTES) * whole * h, False)
    return [layernorm, _matmul("q, k, v", tokens, h, 3 * h / t, e), *attention_kernels(model, micro_batch, tp, e,
                                                                                        flash_attention),
            _matmul("attention out", tokens, h / t, h, e), residual, layernorm,
            _matmul("mlp fc", tokens, h, model.ff / t, e), Kernel("bias+GeLU", 0.0, 2 * e * tokens * model.ff / t, False),
            _matmul("mlp proj", tokens, model.ff / t, h, e), residual]


def attention_kernels(model: GPT, micro_batch: int, tp: int, e: float, flash_attention: bool) -> list[Kernel]:
    """The attention core: scores, softmax, dropout, weighted values (or one FlashAttention kernel)."""
    s, h, t = model.seq, model.hidden, tp
    tokens, heads = micro_batch * s, model.heads / t
    head_dim = h / model.heads
    product_flops = 2 * heads * micro_batch * s * s * head_dim
    if flash_attention:
        return [Kernel("flash attention", 2 * product_flops, 4 * e * tokens * h / t, True)]
    scores = heads * micro_batch * s * s
    return [Kernel("scores q·kᵀ", product_flops, e * (2 * tokens * h / t + scores), True),
            Kernel("softmax", 0.0, 2 * e * scores, False),
            Kernel("attention dropout", 0.0, (2 * e + MASK_BYTES) * scores, False),
            Kernel("probabilities · v", product_flops, e * (scores + 2 * tokens * h / t), True)]


def first_kernels(model: GPT, micro_batch: int, tp: int, e: float) -> list[Kernel]:
    """The first chunk's extra: the embedding lookup plus positions, and its dropout."""
    tokens = micro_batch * model.seq
    return [Kernel("embedding", 0.0, (3 * e + MASK_BYTES) * tokens * model.hidden, False)]


def last_kernels(model: GPT, micro_batch: int, tp: int, e: float) -> list[Kernel]:
    """The last chunk's extra: the final LayerNorm, the logits of the rank's vocabulary slice, and the fp32
    softmax cross-entropy over them (read the logits, write fp32 probabilities)."""
    tokens, h = micro_batch * model.seq, model.hidden
    vocab = model.vocab / tp
    return [Kernel("final LayerNorm", 0.0, 2 * e * tokens * h, False), _matmul("logits", tokens, h, vocab, e),
            Kernel("cross-entropy", 0.0, (e + 4) * tokens * vocab, False)]
