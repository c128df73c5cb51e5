"""The alpha-beta (latency-bandwidth) model: a message of S bytes costs t(S) = α + β·S.

α (seconds) is what every call pays whatever its size: software, synchronisation, the first byte's latency.
β (seconds per byte) is the cost of each further byte; 1/β is the bandwidth. `fit_alpha_beta` fits the line to
the rows of a benchmark sweep (nbdist.collectives.benchmark).

With α and β taken as the cost of one message, an n-rank all-reduce that takes k steps with c critical-path bytes
costs k·α + c·β. The steps and bytes of each algorithm come from one table, `nbdist.cost.collectives` (which a
test checks against what the hand-built algorithms really send):

    ring                 2(n-1)·α + 2(n-1)/n·S·β    reduce-scatter then all-gather around a ring: 2(n-1) steps,
                                                    each moving S/n bytes
    binomial tree        2⌈log2 n⌉·(α + S·β)        reduce to a root, then broadcast back: ⌈log2 n⌉ rounds
                                                    each, every round moving the whole S
    recursive doubling   log2 n·(α + S·β)           log2 n rounds of swapping the whole S with the rank at
                                                    distance 1, 2, 4, ... and adding; when n is not a power of
                                                    two, ⌊log2 n⌋ + 2 rounds (the ranks beyond the largest power
                                                    of two fold in first and get the result back last)

Why large messages go round a ring and small ones up a tree: without in-network reduction, 2(n-1)/n·S is the least
any all-reduce built from point-to-point messages can move per rank (each element of the result needs n-1 additions
and n copies spread over n ranks, so 2(n-1) transfers of every element shared by n links; nccl-tests'
doc/PERFORMANCE.md derives this, and its bus bandwidth rests on it). The ring's bandwidth term is exactly that, so
the ring is bandwidth-optimal; but its latency term grows linearly with n. Tree and recursive doubling pay α only
about log2 n times but move the whole S in every round, so their bandwidth term grows with log2 n. Small S: α
dominates and few steps win; large S: β dominates and the ring wins. With in-network reduction (InfiniBand SHARP,
NVLink SHARP: NCCL's CollNet and NVLS algorithms) the switches do the adding: each rank sends its S once and
receives the sum once, which beats the bound for n > 2 (nccl-tests lists a separate bus-bandwidth factor for it).

What real libraries do is more refined than this model. MPICH uses recursive doubling for short all-reduces and, for
long ones, Rabenseifner's algorithm: a reduce-scatter by recursive halving, then an all-gather by recursive
doubling, 2·log2 n steps (n a power of two) moving the ring's 2(n-1)/n·S (Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005). NCCL does not pick by a binomial-tree
model: it estimates the time of every algorithm × protocol pair ({Ring, Tree, CollNet, NVLS, ...} × {LL, LL128,
Simple}) with its own tuning model and takes the fastest for each size (NVIDIA/nccl issue 457); its tree is a
pipelined double binary tree between nodes and a chain within a node (issues 919 and 545).

What the fit measures: the α and β of the *operation fitted*, as the library runs it on the measured ranks, seen as
one message. For the α and β of one message between two ranks, fit a 2-rank broadcast
(`benchmark(ops="broadcast", ranks=2)`), which is exactly one send: t = α + S·β.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from nbdist.cost import collectives as costs
from nbdist.errors import DistUsageError


def coefficients(algorithm: str, n: int) -> tuple[float, float]:
    """(multiple of α, multiple of S·β) in the cost of an n-rank all-reduce by `algorithm`: its steps and its
    critical-path bytes per byte of S, from the one table (nbdist.cost.collectives)."""
    return costs.coefficients(algorithm, n)


@dataclass(frozen=True, repr=False)
class AlphaBeta:
    """A fitted t(S) = alpha + beta·S (seconds, seconds per byte), with the measured points it came from."""

    alpha: float
    beta: float
    op: str = "all_reduce"
    via: str = "torch"
    ranks: int | None = None  # of the measured rows
    sizes: tuple[float, ...] = field(default=(), repr=False)
    seconds: tuple[float, ...] = field(default=(), repr=False)

    @property
    def bandwidth(self) -> float:
        """1/beta in bytes per second (inf if the fit found no cost per byte)."""
        return 1 / self.beta if self.beta > 0 else math.inf

    def predict(self, size):
        """alpha + beta·size: seconds for `size` bytes (a number, or an array of them)."""
        return self._evaluate(1.0, 1.0, size)

    def cost(self, algorithm: str, size, n: int):
        """Seconds an n-rank all-reduce of `size` bytes takes by `algorithm` ("ring", "tree",
        "recursive-doubling"; "recursive_doubling" works too), if one message costs alpha + beta·S."""
        a, b = coefficients(algorithm, n)
        return self._evaluate(a, b, size)

    def ring(self, size, n: int):
        """2(n-1)·α + 2(n-1)/n·S·β: bandwidth-optimal, latency linear in n."""
        return self.cost("ring", size, n)

    def gather(self, size, n: int):
        """A ring all-gather or reduce-scatter of a `size`-byte whole: (n-1)·α + (n-1)/n·S·β, half a ring."""
        return self.ring(size, n) / 2

    def tree(self, size, n: int):
        """2⌈log2 n⌉·(α + S·β): a binomial-tree reduce, then a broadcast."""
        return self.cost("tree", size, n)

    def recursive_doubling(self, size, n: int):
        """log2(n)·(α + S·β): pairwise exchanges of the whole buffer at distance 1, 2, 4, ...
        (⌊log2 n⌋ + 2 steps when n is not a power of two)."""
        return self.cost("recursive-doubling", size, n)

    def _evaluate(self, a: float, b: float, size):
        values = a * self.alpha + b * self.beta * np.asarray(size, dtype=float)
        return float(values) if values.ndim == 0 else values

    def crossover(self, n: int, versus: str = "tree") -> float:
        """The size (bytes) above which the ring all-reduce beats `versus` ("tree" or "recursive-doubling") on n
        ranks: where 2(n-1)α + 2(n-1)/n·Sβ = the other's cost. 0 when the ring is never slower (a tree on 2
        ranks: the same latency, twice the bytes); inf when it never wins (recursive doubling on 2 ranks: one
        exchange, the ring's two steps cost more latency and the same bytes)."""
        ring_a, ring_b = coefficients("ring", n)
        other_a, other_b = coefficients(versus, n)
        extra_latency = (ring_a - other_a) * self.alpha  # what the ring pays more per call
        saved_per_byte = (other_b - ring_b) * self.beta  # what it saves per byte
        if extra_latency <= 0 and saved_per_byte >= 0:
            return 0.0
        if saved_per_byte <= 0:
            return math.inf
        return extra_latency / saved_per_byte

    def figure(self, n: int | None = None, title: str | None = None):
        """Measured points, the fitted line, and ring / tree / recursive doubling for n ranks (default: the
        measured ranks), log-log, with the ring-vs-tree crossover marked."""
        from nbdist.viz.collectives import alpha_beta_figure

        return alpha_beta_figure(self, n or self.ranks or 2, title=title)

    def __repr__(self) -> str:
        ranks = f", {self.ranks} ranks" if self.ranks else ""
        return (f"alpha-beta fit of {self.op} via {self.via}{ranks}: alpha = {self.alpha * 1e6:.3g} us, "
                f"beta = {self.beta:.3g} s/byte (bandwidth {self.bandwidth / 1e9:.3g} GB/s)")


def fit_alpha_beta(rows: Iterable[dict], op: str = "all_reduce", via: str = "torch",
                   relative: bool = True) -> AlphaBeta:
    """Least-squares fit of t(S) = alpha + beta·S to the measured rows of one op through one via.

    relative=True minimises relative errors (each point weighted by 1/t²): a sweep from 1 KiB to 64 MiB spans
    four orders of magnitude in time, and plain least squares lets the large sizes' noise (a 1 % wobble at 30 ms
    is 300 us) swamp alpha, the small sizes' whole story. relative=False is plain least squares. Either recovers
    alpha and beta exactly from points on a line.
    """
    rows = list(rows)
    points = [(float(r["size_bytes"]), float(r["seconds"])) for r in rows
              if r.get("op") == op and r.get("via") == via and r.get("seconds")]
    if len({size for size, _ in points}) < 2:
        have = sorted({(r.get("op"), r.get("via")) for r in rows if r.get("seconds")})
        raise DistUsageError(f"fitting {op} via {via} needs measured rows at 2 or more sizes; the rows have "
                             f"{', '.join(f'{o} via {v}' for o, v in have) or 'no measured rows'}")
    sizes, seconds = (np.array(column) for column in zip(*points))
    weights = 1 / seconds if relative else np.ones_like(seconds)
    scale = sizes.max()  # sizes in units of the largest: both columns near 1, a well-conditioned solve
    design = np.column_stack([np.ones_like(sizes), sizes / scale]) * weights[:, None]
    (alpha, beta_scaled), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    beta = beta_scaled / scale
    ranks = {r.get("ranks") for r in rows if r.get("op") == op and r.get("via") == via}
    return AlphaBeta(float(alpha), float(beta), op, via, ranks.pop() if len(ranks) == 1 else None,
                     tuple(sizes.tolist()), tuple(seconds.tolist()))
