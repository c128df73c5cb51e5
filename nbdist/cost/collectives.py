"""What each all-reduce algorithm costs on n ranks, in one table: steps (each pays α) and bytes (each pays β).

Everything that prices an algorithm reads this table: the α-β model (`costmodel`: predictions, crossover, the
figure's legend) and the step and byte counts of the hand-built algorithms (`message_counts`). A test
checks the table against what `trace()` records on real ranks (n = 2, 3, 4, 5, 6, 8), so the model charges what
the code does.

S is the tensor's size in bytes; every rank starts with S and ends with the sum.

    algorithm           steps                  largest message   critical-path bytes   most bytes one rank sends
    ring                2(n-1)                 S/n               2(n-1)/n·S            2(n-1)/n·S
    tree (binomial)     2⌈log2 n⌉              S                 2⌈log2 n⌉·S           ⌈log2 n⌉·S (rank 0)
    recursive doubling  log2 n                 S                 log2 n·S              log2 n·S
      n not a power of 2: ⌊log2 n⌋ + 2 (fold-in, exchanges, fold-out), (⌊log2 n⌋ + 2)·S, (⌊log2 n⌋ + 1)·S

Two byte counts, because they answer two questions:
- critical-path bytes: the sum over the steps of each step's largest message. The steps run one after another and
  a step ends when its largest message has arrived, so with α per step and β per byte an all-reduce takes
  steps·α + critical-path bytes·β. That is what the α-β model charges.
- most bytes one rank sends: the busiest rank's total (`Trace.bytes_sent`). It is smaller than the critical path
  where ranks take turns: the tree's critical path moves the whole S 2⌈log2 n⌉ times, but no rank sends more than
  ⌈log2 n⌉·S (rank 0 only sends in the broadcast, the others once in the reduce and a few times in the broadcast).

Exchanges count once: a rank that sends S and receives S in the same step pays S·β (links are full-duplex).

Names: "ring", "tree", "recursive-doubling" (the names `trace` takes); `canonical` also accepts
"recursive_doubling", the spelling of `AlphaBeta.recursive_doubling`. This is the one place that knows the alias.

Plain data, imported on both sides: the engines' algorithms (nbdist/collectives/ranks/allreduce.py) read which phases
add, the notebook's model, trace and figures read the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.checks import is_whole
from nbdist.errors import DistUsageError

ALGORITHMS = ("ring", "tree", "recursive-doubling")
ALIASES = {"recursive_doubling": "recursive-doubling"}
LEGEND = {  # algorithm -> (name in a legend, its cost in α and β, general n)
    "ring": ("ring", "2(n-1)α + 2(n-1)/n·Sβ"),
    "tree": ("binomial tree", "2⌈log2 n⌉·(α + Sβ)"),
    "recursive-doubling": ("recursive doubling", "log2 n·(α + Sβ); ⌊log2 n⌋+2 steps if n is no power of 2"),
}
# The phases of the algorithms' steps. In a reducing phase the receiver adds the chunk that arrived to its own; in
# the others ("all-gather", "broadcast", "fold-out") the chunk replaces its own.
REDUCING_PHASES = ("reduce-scatter", "reduce", "exchange", "fold-in")


def canonical(algorithm: str) -> str:
    """The table's name for `algorithm` ("recursive_doubling" -> "recursive-doubling"); DistUsageError if unknown."""
    name = ALIASES.get(algorithm, algorithm) if isinstance(algorithm, str) else algorithm
    if name not in ALGORITHMS:
        raise DistUsageError(f"unknown all-reduce algorithm {algorithm!r}: choose {', '.join(ALGORITHMS)}")
    return name


def _check_ranks(n: int, least: int = 1) -> None:
    if not is_whole(n) or n < least:
        raise DistUsageError(f"an all-reduce algorithm needs n >= {least} ranks (a whole number), got {n!r}")


def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def _is_power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def steps(algorithm: str, n: int) -> int:
    """Rounds of messages an n-rank all-reduce takes by `algorithm`; each costs one α. 0 on one rank."""
    algorithm = canonical(algorithm)
    _check_ranks(n)
    if n == 1:
        return 0
    if algorithm == "ring":
        return 2 * (n - 1)
    if algorithm == "tree":
        return 2 * _log2_ceil(n)
    return _log2_floor(n) + (0 if _is_power_of_two(n) else 2)


def message_share(algorithm: str, n: int) -> float:
    """The largest message of a step, as a share of S: 1/n for the ring's chunks, the whole tensor otherwise."""
    algorithm = canonical(algorithm)
    _check_ranks(n)
    return 1 / n if algorithm == "ring" else 1.0


def busiest_rank_share(algorithm: str, n: int) -> float:
    """Bytes the busiest rank sends, as a share of S (see the module docstring)."""
    algorithm = canonical(algorithm)
    _check_ranks(n)
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) / n
    if algorithm == "tree":
        return float(_log2_ceil(n))
    return float(_log2_floor(n) + (0 if _is_power_of_two(n) else 1))


def coefficients(algorithm: str, n: int) -> tuple[int, float]:
    """(multiple of α, multiple of S·β) in the α-β cost of an n-rank all-reduce by `algorithm` (n >= 2):
    its steps, and its critical-path bytes as a share of S."""
    _check_ranks(n, least=2)
    k = steps(algorithm, n)
    return k, k * message_share(algorithm, n)


def legend(algorithm: str, n: int) -> str:
    """A legend entry: the general formula and what it is on n ranks, e.g. 'ring: 2(n-1)α + 2(n-1)/n·Sβ; n=4:
    6α + 1.5·Sβ'."""
    name, formula = LEGEND[canonical(algorithm)]
    a, b = coefficients(algorithm, n)
    return f"{name}: {formula}; n={n}: {a}α + {b:.3g}·Sβ"



# -- seconds, given what one message costs ---------------------------------------------------------------------------


def all_reduce_seconds(size: float, n: int, alpha: float, beta: float, algorithm: str = "ring") -> float:
    """An n-rank all-reduce of `size` bytes when one message costs α + S·β: steps·α + critical-path bytes·β (0 on
    one rank). The α-β model (collectives/costmodel.py) and the planner's links (planner/shapes.py) price with it."""
    if n == 1:
        return 0.0
    a, b = coefficients(algorithm, n)
    return a * alpha + b * size * beta


def all_gather_seconds(size: float, n: int, alpha: float, beta: float) -> float:
    """A ring all-gather (or reduce-scatter) of a `size`-byte whole over n ranks: half a ring all-reduce, n-1 steps
    of S/n, so (n-1)·α + (n-1)/n·S·β (0 on one rank)."""
    return all_reduce_seconds(size, n, alpha, beta, "ring") / 2

# -- exact counts for a tensor of whole elements -------------------------------------------------------------------


def chunk_sizes(algorithm: str, n: int, elements: int) -> list[int]:
    """Elements of each chunk a tensor of `elements` is cut into: n nearly equal chunks for the ring (the larger
    first, as torch.tensor_split cuts them), the whole tensor as one chunk for the others."""
    parts = n if canonical(algorithm) == "ring" else 1
    return [elements // parts + (1 if c < elements % parts else 0) for c in range(parts)]


@dataclass(frozen=True)
class MessageCount:
    """Steps and bytes of one all-reduce of `size` bytes over n ranks (whole elements: the ring's chunks are
    torch.tensor_split's, so S/n rounds up for the largest one). Time ~ steps·α + critical_path_bytes·β."""

    algorithm: str
    n: int
    size: int
    steps: int
    message_bytes: int  # the largest message of a step
    critical_path_bytes: int  # steps · message_bytes: what the α-β model charges β for
    busiest_rank_bytes: int  # what the rank that sends most sends in all (Trace.bytes_sent's maximum)

    def seconds(self, alpha: float, beta: float) -> float:
        """Predicted time with latency alpha (s per step) and beta (s per byte)."""
        return self.steps * alpha + self.critical_path_bytes * beta


def message_counts(algorithm: str, n: int, size: int, itemsize: int = 4) -> MessageCount:
    """Steps and bytes of `algorithm` for `size` bytes over n ranks, in elements of `itemsize` bytes."""
    algorithm = canonical(algorithm)
    _check_ranks(n)
    if not is_whole(size) or size < 0 or size % itemsize:
        raise DistUsageError(f"size must be a whole number of {itemsize}-byte elements, in bytes; got {size!r}")
    k = steps(algorithm, n)
    if algorithm != "ring":
        message = size if k else 0
        return MessageCount(algorithm, n, size, k, message, k * message,
                            round(busiest_rank_share(algorithm, n)) * size)
    elements = size // itemsize
    chunks = chunk_sizes(algorithm, n, elements)
    # rank r sends every chunk but r+1 in the reduce-scatter and every chunk but r+2 in the all-gather
    busiest = max(2 * elements - chunks[(r + 1) % n] - chunks[(r + 2) % n] for r in range(n)) if k else 0
    message = max(chunks) * itemsize if k else 0
    return MessageCount(algorithm, n, size, k, message, k * message, busiest * itemsize)
