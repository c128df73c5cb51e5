"""Cutting a `torch.nn.Sequential` into contiguous pieces, one per pipeline stage.

`balance` says how many layers each stage gets. Without it we balance by parameter count: the cut that makes the
largest stage as small as possible (a small dynamic programme; layers without parameters ride along for free).
Uneven splits are allowed on purpose: the lab shows what they cost.
"""
from __future__ import annotations

from typing import Sequence

from nbdist.checks import is_whole
from nbdist.errors import DistUsageError


def layer_counts(sizes: Sequence[int], pieces: int, balance: Sequence[int] | None = None,
                 starts: set[int] | None = None) -> list[int]:
    """Layers per stage: `balance` checked, or the min-max split of `sizes` (parameters per layer) in which a stage
    begins only at a position in `starts` (default: anywhere)."""
    layers = len(sizes)
    if pieces > layers:
        raise DistUsageError(f"the model has {layers} layers, fewer than the {pieces} stages asked for")
    if balance is not None:
        balance = list(balance)
        if len(balance) != pieces:
            raise DistUsageError(f"balance has {len(balance)} entries but there are {pieces} stages")
        if any(not is_whole(b) or b < 1 for b in balance):
            raise DistUsageError(f"balance entries must be positive layer counts, got {balance}")
        if sum(balance) != layers:
            raise DistUsageError(f"balance {balance} sums to {sum(balance)}, but the model has {layers} layers")
        return balance
    return _min_max_split(list(sizes), pieces, starts)


def _min_max_split(sizes: list[int], pieces: int, starts: set[int] | None = None) -> list[int]:
    """Contiguous split of `sizes` into `pieces` non-empty runs minimising the largest run's sum, runs beginning
    only at positions in `starts` (and 0). One line when no such split exists."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest possible max-sum splitting the first i layers into k pieces; cut[k][i]: where piece k starts
    best = [[inf] * (n + 1) for _ in range(pieces + 1)]
    cut = [[0] * (n + 1) for _ in range(pieces + 1)]
    best[0][0] = 0
    for k in range(1, pieces + 1):
        for i in range(k, n - (pieces - k) + 1):
            for j in range(k - 1, i):
                if j and starts is not None and j not in starts:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                # ties go to the later cut, so parameter-free layers join the earlier stage
                if cost < best[k][i] or (cost == best[k][i] and j > cut[k][i]):
                    best[k][i], cut[k][i] = cost, j
    if best[pieces][n] == inf:
        raise DistUsageError(f"the model cannot be cut into {pieces} stages where each cut is on its main path "
                             f"(only before {sorted(starts or ())}): use fewer stages or give split_points")
    counts, i = [], n
    for k in range(pieces, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def boundaries(counts: Sequence[int]) -> list[tuple[int, int]]:
    """[(first layer, end layer), ...] for each stage, from layers per stage."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def parameter_sizes(model) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def unsplit_key(first_layer: int, key: str) -> str:
    """A stage's parameter key under the whole model's numbering: '1.weight' of a stage starting at layer 4 is
    '5.weight' (stages are nn.Sequential slices of the model, numbered from 0)."""
    local, _, rest = key.partition(".")
    return f"{first_layer + int(local)}.{rest}"
