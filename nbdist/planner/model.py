"""A GPT-style transformer as the planner sees it: sizes, parameters, FLOPs, and the bytes each kind of state takes.

Counts follow the papers the planner is checked against, written for any feed-forward size `ff` (4·hidden in
GPT-2/3 and Megatron-LM). Models as they are built now differ in five places, each a field (`llama()` sets all
five as Llama 2/3 do): grouped-query attention (`kv_heads` < heads: k and v have kv_heads·hd columns, hd =
h/heads), a gated feed-forward (SwiGLU: three h×ff matrices), an output layer of its own (`tied=False`), no biases,
RMSNorm (h parameters, not 2h), rotary positions (no parameters) and no dropout. The formulas below are the GPT
case; the code counts each matrix, so the general case is the same sums with those sizes (Llama 3 8B comes out at
its 8,030,261,248 parameters, 70B at 70,553,706,496). `vocab_multiple=128` pads the vocabulary as Megatron-LM
does (to a multiple of 128·t) where it costs time and memory; parameter and FLOP counts use the model's own.
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
  layer's input, 2·s·b·h (/t with sequence parallelism). Their sums, by tensor: 10 = LayerNorm inputs 4, the
  attention's and the MLP's inputs 2 + 2, dropout masks 1 + 1; 24 = q, k 4, v 2, the attention output's input 2,
  the GeLU's input and the projection's input 8 + 8. With kv_heads/heads = r and ff/h = f that is 8 - dropout's 2
  unsplit and 4 + 4r + 4f split (6f gated: the gate's and the up projection's outputs and their product); the
  scores keep 5as/h with dropout, 2as/h (the softmax output) without.

Plain data: no torch here.
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.checks import one_of, whole_number
from nbdist.errors import DistUsageError
from nbdist.units import format_parameters

RECOMPUTE = ("none", "selective", "full")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")


@dataclass(frozen=True)
class GPT:
    """The sizes of a transformer decoder (pre-norm blocks). Defaults: GPT-2/3 and Megatron-LM (multi-head
    attention, GeLU MLP, biases, LayerNorm, learned positions, dropout, output tied to the embedding)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ff: int
    name: str = ""
    kv_heads: int | None = None  # heads of k and v (grouped-query attention); None: as many as q's
    gated: bool = False  # SwiGLU feed-forward: silu(x·W_gate) * (x·W_up), then W_down
    tied: bool = True  # the output layer is the token embedding
    bias: bool = True
    norm: str = "layernorm"
    positions: str = "learned"
    dropout: bool = True
    vocab_multiple: int = 1  # Megatron-LM pads the vocabulary to a multiple of this × tp (its default: 128)

    # -- sizes -------------------------------------------------------------------------------------------------

    @property
    def groups(self) -> int:
        """Heads of k and v: kv_heads, or heads without grouped-query attention."""
        return self.kv_heads or self.heads

    @property
    def kv_width(self) -> int:
        """Columns of k (and of v): groups × head dimension."""
        return self.groups * (self.hidden // self.heads)

    @property
    def norm_parameters(self) -> int:
        """One norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary as the embedding and the output layer hold it: padded to a multiple of vocab_multiple·tp
        when the framework pads (Megatron-LM), else as it is."""
        if self.vocab_multiple == 1:
            return self.vocab
        multiple = self.vocab_multiple * tp
        return -(-self.vocab // multiple) * multiple

    # -- parameters --------------------------------------------------------------------------------------------

    def _matrices(self) -> int:
        """Weights of one block's matmuls: q and out h×h, k and v h×kv_width, the MLP's two (three gated) h×ff."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + (3 if self.gated else 2) * h * self.ff

    def layer_parameters(self) -> int:
        """Parameters of one transformer block."""
        h, f = self.hidden, self.ff
        biases = (2 * h + 2 * self.kv_width + (2 if self.gated else 1) * f + h) if self.bias else 0
        return self._matrices() + biases + 2 * self.norm_parameters

    def layer_split_parameters(self) -> int:
        """The part of a block tensor parallelism divides: q, k, v and fc (and gate) weights and biases
        (column-parallel), out and proj weights (row-parallel). The two row-parallel biases and the norms stay
        whole: 6h for GPT."""
        return self.layer_parameters() - 2 * self.norm_parameters - (2 * self.hidden if self.bias else 0)

    @property
    def block_tensors(self) -> int:
        """Parameter tensors of one block as Megatron-LM holds them: q/k/v fused, out, fc (gate and up fused), proj,
        their biases, two norms (LayerNorm: weight and bias): 12 for GPT, 6 for Llama. A ZeRO-3 that gathers one
        tensor at a time makes that many calls per block (cost/zero3.py)."""
        return 4 + (4 if self.bias else 0) + 2 * (2 if self.norm == "layernorm" else 1)

    def embedding_parameters(self) -> int:
        """Token embedding (split over tensor-parallel ranks by vocabulary) and learned positions (replicated)."""
        return self.vocab * self.hidden + (self.seq * self.hidden if self.positions == "learned" else 0)

    def output_parameters(self) -> int:
        """The output layer's own weights: none when tied to the token embedding."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """Every parameter once: blocks, embeddings, the output layer when untied, the final norm."""
        return (self.layers * self.layer_parameters() + self.embedding_parameters() + self.output_parameters()
                + self.norm_parameters)

    def megatron_parameters(self) -> float:
        """Megatron-LM's closed form, 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), exact for ff = 4h without the
        final LayerNorm."""
        l, h, v, s = self.layers, self.hidden, self.vocab, self.seq
        return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))

    # -- FLOPs -------------------------------------------------------------------------------------------------

    def dense_flops_per_token(self) -> float:
        """Forward FLOPs of one block's weight matmuls for one token: 2 per weight, 2·(4h² + 2h·ff) for GPT."""
        return 2 * self._matrices()

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
                                   element_bytes: float = 2, flash_attention: bool = False, cp: int = 1) -> float:
        """Bytes one block keeps for backward per micro-batch on one tensor-parallel rank (Korthikanti et al.,
        eq. 2-5), scaled from their 2-byte activations to `element_bytes`. Their 5·a·s/h term is the attention
        scores (softmax input and output, dropout mask: a·s² per sequence); a fused attention (FlashAttention)
        never stores them and keeps instead one fp32 log-sum-exp per row and head (4·a·s·b bytes), as selective
        recomputation drops them by recomputing the attention core. Context parallelism (`cp`) keeps s/cp of the
        sequence's tokens on each rank; their scores still span all s keys."""
        s, b, h, a = self.seq, micro_batch, self.hidden, self.heads
        here = s / cp  # the tokens this rank holds
        statistics = 0.0
        if recompute == "full":
            kept = 2 * here * b * h / (tp if sequence_parallel else 1)
        else:
            fused = flash_attention and recompute == "none"
            per_score = 5 if self.dropout else 2
            scores = 0.0 if recompute == "selective" or fused else per_score * a * s / (h * tp)
            statistics = 4 * a * here * b / tp if fused else 0.0
            unsplit, split = self._saved_per_token()
            whole = (unsplit + split) / tp if sequence_parallel else unsplit + split / tp
            kept = here * b * h * (whole + scores)
        return kept * element_bytes / 2 + statistics

    def _saved_per_token(self) -> tuple[float, float]:
        """(unsplit, split) bytes a block saves per token and hidden unit, 2-byte activations: (10, 24) for GPT
        (see the module's docstring)."""
        r, f = self.groups / self.heads, self.ff / self.hidden
        unsplit = 8 + (2 if self.dropout else 0)
        return unsplit, 4 + 4 * r + (6 if self.gated else 4) * f

    def working_bytes_per_layer(self, micro_batch: int, tp: int, sequence_parallel: bool,
                                element_bytes: float = 2, flash_attention: bool = False, cp: int = 1) -> float:
        """Bytes of one block's full activations: what a block being recomputed (or run) holds at once."""
        return self.activation_bytes_per_layer(micro_batch, tp, "none", sequence_parallel, element_bytes,
                                               flash_attention, cp)

    def output_bytes(self, micro_batch: int, tp: int, cp: int = 1) -> float:
        """The loss's working memory on the last stage: fp32 logits of the rank's vocabulary slice for its s/cp
        tokens (4·s·b·V/(t·cp))."""
        return 4 * self.seq / cp * micro_batch * self.padded_vocab(tp) / tp

    def describe(self) -> str:
        name = f"{self.name}: " if self.name else ""
        heads = f"{self.heads} heads" + (f" ({self.groups} k/v)" if self.groups != self.heads else "")
        ff = f"{'SwiGLU ' if self.gated else ''}ff {self.ff}"
        return (f"{name}{format_parameters(self.parameters)}: {self.layers} layers, hidden {self.hidden}, "
                f"{heads}, {ff}, sequence {self.seq}, vocabulary {self.vocab}" + ("" if self.tied else ", untied"))


def gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, ff: int | None = None, name: str = "", *,
        kv_heads: int | None = None, gated: bool = False, tied: bool = True, bias: bool = True,
        norm: str = "layernorm", positions: str = "learned", dropout: bool = True, vocab_multiple: int = 1) -> GPT:
    """A transformer decoder's sizes, checked (each failure one line naming the size). Defaults: GPT-2/3."""
    for label, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq), ("vocab", vocab)):
        whole_number(value, f"gpt {label}")
    if hidden % heads:
        raise DistUsageError(f"gpt hidden ({hidden}) must be divisible by heads ({heads})")
    if kv_heads is not None and (whole_number(kv_heads, "gpt kv_heads") > heads or heads % kv_heads):
        raise DistUsageError(f"gpt kv_heads ({kv_heads}) must divide heads ({heads}): each k/v head serves a "
                             f"whole group of query heads")
    one_of(norm, NORMS, "gpt norm")
    one_of(positions, POSITIONS, "gpt positions")
    ff = 4 * hidden if ff is None else whole_number(ff, "gpt ff")
    return GPT(layers, hidden, heads, seq, vocab, ff, name, kv_heads, bool(gated), bool(tied), bool(bias), norm,
               positions, bool(dropout), whole_number(vocab_multiple, "gpt vocab_multiple"))


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ff: int, seq: int = 8192, vocab: int = 128256,
          name: str = "") -> GPT:
    """A Llama-2/3-style model: grouped-query attention, SwiGLU, untied output, no biases, RMSNorm, rotary
    positions, no dropout. Llama 3 8B: llama(32, 4096, 32, 8, 14336); 70B: llama(80, 8192, 64, 8, 28672)."""
    return gpt(layers, hidden, heads, seq, vocab, ff, name, kv_heads=kv_heads, gated=True, tied=False, bias=False,
               norm="rmsnorm", positions="rotary", dropout=False)
