"""Bytes per accelerator: the model states (ZeRO paper's accounting) and the activations (Korthikanti et al.).

Model states per parameter a rank holds, Ψ of them (Rajbhandari et al., arXiv 1910.02054): mixed precision
(bf16/fp16) keeps 2 bytes of weights, 2 of gradients and K = 12 of optimizer state (fp32 master weights, Adam's
momentum and variance); fp32 training 4, 4 and 8. ZeRO shards them over the data-parallel group: stage 1 the
optimizer state, stage 2 the gradients too, stage 3 the weights too; ZeRO-3 then holds, gathered whole, the
layer running and the next one (prefetched): "gathered layers".

A rank's Ψ: its layers (the tensor-parallel split part / t, the rest whole), plus on the first pipeline rank the
token embedding (its vocabulary slice, V·h/t) and learned positions, on the last the output layer (an untied
one, or its copy of the tied embedding when it is not also the first rank) and the final norm. Layers are cut
as evenly as possible into p·v chunks; rank r holds chunks r, r+p, ...

Activations: per in-flight micro-batch chunk the chunk's layers' saved bytes (model.py), times the most chunks a
rank holds at once in the schedule (pipeline.peak_held: 1F1B's first rank holds p); plus, with full
recomputation, one block's full activations while it is recomputed; plus the last rank's fp32 logits.
"""
from __future__ import annotations

from nbdist.cost import memory as cost_memory
from nbdist.cost.hardware import HALF, Hardware
from nbdist.cost.memory import state_bytes
from nbdist.planner.model import GPT
from nbdist.planner.pipeline import peak_held
from nbdist.planner.shapes import Shape

PARTS = ("weights", "gradients", "optimizer", "gathered layers", "activations", "logits", "reserved")


def model_states(psi: float, dp: int, zero: int, dtype: str) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state for Ψ parameters under ZeRO stage `zero` over dp ranks
    (cost/memory.py's rule: the ZeRO paper's baseline (2+2+K)Ψ, stage 1 4Ψ + KΨ/N, stage 2 2Ψ + (2+K)Ψ/N, stage 3
    (2+2+K)Ψ/N)."""
    return cost_memory.model_states(psi, dp, zero, state_bytes(dtype))


def element_bytes(dtype: str) -> float:
    """Bytes of one activation element."""
    return 2.0 if dtype in HALF else 4.0


def chunk_layers(model: GPT, pieces: int) -> list[int]:
    """Layers per model chunk, cut as evenly as possible (the first chunks take one more)."""
    base, extra = divmod(model.layers, pieces)
    return [base + (1 if k < extra else 0) for k in range(pieces)]


def rank_parameters(model: GPT, s: Shape, rank: int) -> float:
    """Parameters pipeline rank `rank` holds on one tensor-parallel rank."""
    layers = sum(chunk_layers(model, s.pp * s.chunks)[rank::s.pp])
    split, whole = model.layer_split_parameters(), model.layer_parameters() - model.layer_split_parameters()
    held = layers * (split / s.tp + whole)
    token = model.padded_vocab(s.tp) * model.hidden / s.tp  # the token embedding's slice, as the output layer's
    if rank == 0:
        held += token + model.embedding_parameters() - model.vocab * model.hidden  # + learned positions
    if rank == s.pp - 1:  # the output layer: its own, or the tied embedding's copy on a last stage of its own
        held += (token if s.pp > 1 or not model.tied else 0) + model.norm_parameters
    return held


def rank_memory(model: GPT, s: Shape, hw: Hardware, dtype: str, rank: int) -> dict[str, float]:
    """Bytes on one accelerator of pipeline rank `rank`, by PARTS."""
    psi = rank_parameters(model, s, rank)
    w = state_bytes(dtype)[0]
    e = element_bytes(dtype)
    per_layer = model.activation_bytes_per_layer(s.microbatch, s.tp, s.recompute, s.sequence_parallel, e,
                                                 s.flash_attention, s.cp)
    chunks = chunk_layers(model, s.pp * s.chunks)[rank::s.pp]
    held = peak_held(s.schedule, s.pp, s.microbatches, s.chunks)[rank] if s.pp > 1 else 1
    activations = held * max(chunks) * per_layer
    if s.recompute == "full":
        activations += model.working_bytes_per_layer(s.microbatch, s.tp, s.sequence_parallel, e, s.flash_attention,
                                                     s.cp)
    return {
        **model_states(psi, s.replicas, s.zero, dtype),
        "gathered layers": 2 * model.layer_split_parameters() / s.tp * w if s.zero >= 3 else 0.0,  # this and next
        "activations": activations,
        "logits": model.output_bytes(s.microbatch, s.tp, s.cp) if rank == s.pp - 1 else 0.0,
        "reserved": hw.reserved_bytes,
    }


def peak_memory(model: GPT, s: Shape, hw: Hardware, dtype: str) -> tuple[int, dict[str, float]]:
    """(pipeline rank, its bytes by part) for the rank that holds the most: the first (most activations, the
    embedding) or the last (the output layer, the logits); ranks between hold less than the first."""
    candidates = {0, s.pp - 1}
    return max(((r, rank_memory(model, s, hw, dtype, r)) for r in sorted(candidates)),
               key=lambda item: sum(item[1].values()))
