"""A GPT-style transformer as the planner sees it: sizes, parameters, FLOPs, and the bytes each kind of state takes.

Counts follow the papers the planner is checked against, written for any feed-forward size `ff` (4·hidden in
GPT-2/3 and Megatron-LM):
- parameters per layer: attention q, k, v, out (4h² + 4h), MLP (2h·ff + ff + h), two LayerNorms (4h); plus the
  token embedding (V·h, tied to the output layer), learned positions (s·h) and the final LayerNorm (2h). With
  ff = 4h that is Megatron-LM's P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) plus the final LayerNorm's 2h
  (arXiv 2104.04473, appendix; GPT-2 small comes out at its 124,439,808).
- FLOPs per token and layer, forward: matmuls 2·(4h² + 2h·ff) (a multiply-add is 2 FLOPs) and attention's
  score and value products 4·s·h; the logits 2·h·V. Backward costs twice the forward. Full recomputation runs
  each layer's forward again, selective recomputation only attention's products (Korthikanti et al., arXiv
  2205.05198). Per iteration of B sequences: B·s·[k·l·(2(4h² + 2h·ff) + 4sh) + 6hV], k = 3 without
  recomputation, 4 with full: with ff = 4h that is Megatron-LM's 72 (or 96) · B·s·l·h²·(1 + s/(6h) + V/(16lh)).
- activations saved per layer (bytes, 2-byte activations; Korthikanti et al., table 2): s·b·h·(34 + 5as/h)
  unsplit; with tensor parallelism t, s·b·h·(10 + 24/t + 5as/(ht)); with sequence parallelism too,
  s·b·h·(34/t + 5as/(ht)). Selective recomputation drops the 5as/(ht) term; full recomputation keeps only the
  layer's input, 2·s·b·h (/t with sequence parallelism).

Plain data: no torch here.
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.checks import one_of, whole_number
from nbdist.errors import DistUsageError

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class GPT:
    """The sizes of a GPT-style model (pre-LayerNorm blocks, learned positions, output tied to the embedding)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ff: int
    name: str = ""

    # -- parameters --------------------------------------------------------------------------------------------

    def layer_parameters(self) -> int:
        """Parameters of one transformer block."""
        h, f = self.hidden, self.ff
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def layer_split_parameters(self) -> int:
        """The part of a block tensor parallelism divides: q, k, v and fc (weights and biases: column-parallel),
        out and proj weights (row-parallel). The row-parallel biases and the LayerNorms stay whole: 6h."""
        return self.layer_parameters() - 6 * self.hidden

    def embedding_parameters(self) -> int:
        """Token embedding (split over tensor-parallel ranks by vocabulary) and positions (replicated)."""
        return self.vocab * self.hidden + self.seq * self.hidden

    @property
    def parameters(self) -> int:
        """Every parameter once: blocks, embeddings (the output layer shares the token embedding), final
        LayerNorm."""
        return self.layers * self.layer_parameters() + self.embedding_parameters() + 2 * self.hidden

    def megatron_parameters(self) -> float:
        """Megatron-LM's closed form, 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), exact for ff = 4h without the
        final LayerNorm."""
        l, h, v, s = self.layers, self.hidden, self.vocab, self.seq
        return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))

    # -- FLOPs -------------------------------------------------------------------------------------------------

    def dense_flops_per_token(self) -> float:
        """Forward FLOPs of one block's weight matmuls for one token: 2·(4h² + 2h·ff)."""
        return 2 * (4 * self.hidden**2 + 2 * self.hidden * self.ff)

    def attention_flops_per_token(self) -> float:
        """Forward FLOPs of one block's score (QK^T) and value (AV) products for one token: 4·s·h."""
        return 4 * self.seq * self.hidden

    def logit_flops_per_token(self) -> float:
        """Forward FLOPs of the output layer for one token: 2·h·V."""
        return 2 * self.hidden * self.vocab

    def flops_per_iteration(self, batch: int, recompute: str = "none") -> float:
        """FLOPs of one training iteration on `batch` sequences, the recomputed forward included (what the
        accelerators execute; Megatron-LM reports its TFLOP/s this way)."""
        one_of(recompute, RECOMPUTE, "recompute")
        layer = self.dense_flops_per_token() + self.attention_flops_per_token()
        again = {"none": 0.0, "selective": self.attention_flops_per_token(), "full": layer}[recompute]
        per_token = self.layers * (3 * layer + again) + 3 * self.logit_flops_per_token()
        return batch * self.seq * per_token

    def model_flops_per_iteration(self, batch: int) -> float:
        """FLOPs the model needs, without recomputation: what MFU counts."""
        return self.flops_per_iteration(batch, "none")

    def megatron_flops(self, batch: int, recompute: bool = True) -> float:
        """Megatron-LM's formula: 96 (72 without recomputation) · B·s·l·h²·(1 + s/(6h) + V/(16·l·h)). The 96
        version is exact (flops_per_iteration with full recomputation, ff = 4h); the 72 version also scales the
        logits by 3/4, which are never recomputed, so it counts 1.5·B·s·h·V fewer than flops_per_iteration."""
        l, h, v, s = self.layers, self.hidden, self.vocab, self.seq
        return (96 if recompute else 72) * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    # -- activations -------------------------------------------------------------------------------------------

    def activation_bytes_per_layer(self, micro_batch: int, tp: int, recompute: str, sequence_parallel: bool,
                                   element_bytes: float = 2, flash_attention: bool = False) -> float:
        """Bytes one block keeps for backward per micro-batch on one tensor-parallel rank (Korthikanti et al.,
        eq. 2-5), scaled from their 2-byte activations to `element_bytes`. Their 5·a·s/h term is the attention
        scores (softmax input and output, dropout mask: a·s² per sequence); a fused attention (FlashAttention)
        never stores them and keeps instead one fp32 log-sum-exp per row and head (4·a·s·b bytes), as selective
        recomputation drops them by recomputing the attention core."""
        s, b, h, a = self.seq, micro_batch, self.hidden, self.heads
        statistics = 0.0
        if recompute == "full":
            kept = 2 * s * b * h / (tp if sequence_parallel else 1)
        else:
            fused = flash_attention and recompute == "none"
            scores = 0.0 if recompute == "selective" or fused else 5 * a * s / (h * tp)
            statistics = 4 * a * s * b / tp if fused else 0.0
            whole = 34 / tp if sequence_parallel else 10 + 24 / tp
            kept = s * b * h * (whole + scores)
        return kept * element_bytes / 2 + statistics

    def working_bytes_per_layer(self, micro_batch: int, tp: int, sequence_parallel: bool,
                                element_bytes: float = 2, flash_attention: bool = False) -> float:
        """Bytes of one block's full activations: what a block being recomputed (or run) holds at once."""
        return self.activation_bytes_per_layer(micro_batch, tp, "none", sequence_parallel, element_bytes,
                                               flash_attention)

    def output_bytes(self, micro_batch: int, tp: int) -> float:
        """The loss's working memory on the last stage: fp32 logits of the rank's vocabulary slice (4·s·b·V/t)."""
        return 4 * self.seq * micro_batch * self.vocab / tp

    def describe(self) -> str:
        name = f"{self.name}: " if self.name else ""
        return (f"{name}{self.parameters / 1e9:.3g} B parameters: {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads, ff {self.ff}, sequence {self.seq}, vocabulary {self.vocab}")


def gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, ff: int | None = None, name: str = "") -> GPT:
    """A GPT-style model's sizes, checked (each failure one line naming the size)."""
    for label, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq), ("vocab", vocab)):
        whole_number(value, f"gpt {label}")
    if hidden % heads:
        raise DistUsageError(f"gpt hidden ({hidden}) must be divisible by heads ({heads})")
    ff = 4 * hidden if ff is None else whole_number(ff, "gpt ff")
    return GPT(layers, hidden, heads, seq, vocab, ff, name)
