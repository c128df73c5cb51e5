"""What training holds per parameter, and which of it ZeRO shards: the one rule every memory prediction reads.

Per parameter, training keeps weights, gradients and optimizer state. Mixed precision (bf16/fp16) keeps 2 bytes of
weights, 2 of gradients and K = 12 of optimizer state (fp32 master weights, Adam's momentum and variance); fp32
training 4, 4 and 8 (Adam's two states). ZeRO (Rajbhandari et al., arXiv 1910.02054) shards them over the N
data-parallel ranks: stage 1 the optimizer state, stage 2 the gradients too, stage 3 the weights too
(`SHARDED_FROM`). The local predictor (sharding/memory.py) applies the rule to each tensor as torch's
ZeroRedundancyOptimizer and FSDP2 cut it; the cluster-scale planner (planner/memory.py) to Ψ parameters; the ZeRO
lab (notebook 32) shows the paper's figures from `zero_paper_bytes`.
"""
from __future__ import annotations

from nbdist.checks import is_whole
from nbdist.cost.hardware import HALF
from nbdist.errors import DistUsageError

ZERO_STAGES = (0, 1, 2, 3)
PARTS = ("weights", "gradients", "optimizer")
SHARDED_FROM = {"optimizer": 1, "gradients": 2, "weights": 3}  # the first ZeRO stage that shards each part
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}  # state tensors of a parameter's size


def check_zero(zero: int) -> int:
    if not is_whole(zero) or zero not in ZERO_STAGES:
        raise DistUsageError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero!r}")
    return zero


def sharded(part: str, zero: int) -> bool:
    """Whether ZeRO stage `zero` shards `part` ("weights", "gradients", "optimizer") over the data-parallel ranks."""
    return check_zero(zero) >= SHARDED_FROM[part]


def zero1_owners(sizes: list[int], replicas: int) -> list[int]:
    """ZeRO-1's partition: the replica that steps each parameter of `sizes` elements. Largest first, each to the
    replica with the fewest elements so far (ties to the lowest), as torch's ZeroRedundancyOptimizer cuts them; read
    by TensorParallelZero (data_parallel/ranks/zero_optimizer.py) and by the local memory prediction."""
    held, owner = [0] * replicas, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        owner[i] = held.index(min(held))
        held[owner[i]] += sizes[i]
    return owner


def state_bytes(dtype: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter: mixed precision 2, 2, 12; fp32 4, 4, 8."""
    return (2.0, 2.0, 12.0) if dtype in HALF else (4.0, 4.0, 8.0)


def model_states(psi: float, dp: int, zero: int, per_parameter: tuple[float, float, float]) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state a rank holds for Ψ parameters under ZeRO stage `zero` over
    dp ranks, `per_parameter` bytes of each: every part whole, or 1/dp of it from the stage that shards it."""
    return {part: b * psi / (dp if sharded(part, zero) else 1) for part, b in zip(PARTS, per_parameter)}


def zero_paper_bytes(psi: float, n: int, stage: int, k: float = 12) -> float:
    """Bytes per device in the ZeRO paper (fig. 1): mixed-precision Adam, fp16 parameters and gradients (2Ψ each)
    and K·Ψ of optimizer state (K = 12), over N data-parallel devices. Baseline (2+2+K)Ψ, ZeRO-1 4Ψ + KΨ/N, ZeRO-2
    2Ψ + (2+K)Ψ/N, ZeRO-3 (2+2+K)Ψ/N."""
    return sum(model_states(psi, n, stage, (2.0, 2.0, k)).values())


def fp32_zero_bytes(psi: float, n: int, stage: int) -> float:
    """Bytes per device our fp32 engines hold with Adam: parameters 4Ψ, gradients 4Ψ, Adam's two states 8Ψ.

    Baseline 16Ψ; ZeRO-1 (ZeroRedundancyOptimizer) 8Ψ + 8Ψ/N; ZeRO-3 (FSDP2) 16Ψ/N, plus one layer unsharded.
    ZeRO-2 is FSDP2 with reshard_after_forward=False, and there it differs from the paper: the paper keeps one
    replica of the parameters and shards the rest, 4Ψ + 12Ψ/N in fp32; FSDP2 keeps its sharded copy (4Ψ/N)
    separately from the unsharded parameters it holds from forward to backward (4Ψ), so 4Ψ + 16Ψ/N.
    """
    fsdp2_sharded_copy = 4 * psi / n if stage == 2 else 0.0
    return sum(model_states(psi, n, stage, state_bytes("fp32")).values()) + fsdp2_sharded_copy
