"""`search`: for a model, a cluster and a global batch, every plan that fits, ranked by predicted throughput.

The plans enumerated: tp among the divisors of the GPU count that divide the heads and ff, up to one host (tensor
parallelism belongs on the fastest links); pp among the divisors of what is left, up to the layers; micro-batch
sizes 1, 2, 4, ... up to `max_microbatch`; chunks per rank v = 1, or v >= 2 dividing each stage's layers (up to
`max_chunks`); ZeRO 0-3 where dp > 1; recomputation none, selective, full;
sequence parallelism whenever tp > 1 (it only saves: memory, and element-wise time); context parallelism cp among
the divisors up to `max_cp` (1 unless asked: long sequences) that cut the sequence into 2·cp equal pieces.

Why two passes: the simulator plays every micro-batch of every pipeline rank, seconds for thousands of GPUs, and
a search meets thousands of candidates. So each candidate is first ranked by an estimate, the bubble's closed form
(p-1)/(m·v) of its slowest rank's work plus the messages of the fill and drain; then the best `exact` of those
that fit are predicted in full (the simulator, as `predict` does) and re-ranked. The estimate only chooses which
plans are simulated; every plan returned carries the simulator's prediction.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from nbdist.checks import whole_number
from nbdist.cost.hardware import Hardware
from nbdist.errors import DistUsageError
from nbdist.planner import memory as mem
from nbdist.planner import step
from nbdist.planner.model import GPT, RECOMPUTE
from nbdist.planner.prediction import Prediction, predict_shape
from nbdist.planner.shapes import Shape, shape
from nbdist.units import format_bytes


@dataclass(frozen=True)
class Candidate:
    """A plan before simulation: its shape, bytes per GPU, and estimated tokens per second."""

    shape: Shape
    memory: float
    fits: bool
    estimated_tokens_per_second: float


@dataclass
class SearchResult:
    """`plans`: the simulated plans that fit, best first. `candidates`: every plan enumerated, with its estimate
    (the frontier figure draws them). `refused`: why the other shapes are impossible, and how many."""

    model: GPT
    hardware: Hardware
    gpus: int
    global_batch: int
    plans: list[Prediction]
    candidates: list[Candidate]
    refused: dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> Prediction:
        if not self.plans:
            raise DistUsageError(f"no plan of {self.model.describe()} fits on {self.gpus} × {self.hardware.name} "
                                 f"with global batch {self.global_batch}")
        return self.plans[0]

    def __iter__(self):
        return iter(self.plans)

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, index):
        return self.plans[index]

    def why(self) -> str:
        """Why the best plan wins: its largest terms, against the runner-up and the best plan of another shape."""
        best = self.best
        lines = [f"best: {best.why()}"]
        others = [p for p in self.plans[2:] if (p.shape.tp, p.shape.pp) != (best.shape.tp, best.shape.pp)]
        for other in self.plans[1:2] + others[:1]:
            lines.append(f"vs {other.shape.describe()}: {other.tokens_per_second / best.tokens_per_second:.1%} of "
                         f"its throughput; {_difference(best, other)}")
        return "\n".join(lines)

    def points(self) -> list[dict]:
        """Every candidate as plain data: plan, memory (bytes per GPU), tokens_per_second (estimated), fits."""
        return [{"plan": c.shape.describe(), "memory": c.memory, "tokens_per_second": c.estimated_tokens_per_second,
                 "fits": c.fits} for c in self.candidates]

    def figure(self, title: str | None = None):
        """Memory per GPU against throughput for every candidate (estimated), the frontier, the best plan marked
        (simulated)."""
        from nbdist.viz.cluster_plan import frontier_figure

        best = None
        if self.plans:
            p = self.plans[0]
            best = {"plan": p.shape.describe(), "memory": p.memory_per_gpu, "tokens_per_second": p.tokens_per_second}
        return frontier_figure(self.points(), self.hardware.memory_bytes, best, title=title or (
            f"{len(self.candidates)} plans of {self.model.parameters / 1e9:.3g} B parameters on {self.gpus} × "
            f"{self.hardware.name}, global batch {self.global_batch}"))

    def table(self) -> list[dict]:
        """One row per simulated plan: shape, tokens/s, TFLOP/s per GPU, MFU, bytes per GPU."""
        return [{"plan": p.shape.describe(), "tokens/s": p.tokens_per_second, "TFLOP/s per GPU": p.tflops_per_gpu,
                 "MFU": p.mfu, "memory per GPU": format_bytes(p.memory_per_gpu),
                 "bubble": p.pipeline.bubble_fraction} for p in self.plans]


def _difference(best: Prediction, other: Prediction) -> str:
    """The terms where `other` loses most time per token against `best`."""
    a, b = best.breakdown["time"], other.breakdown["time"]
    per_token = {k: b[k] / other.tokens_per_step - a[k] / best.tokens_per_step for k in a}
    own = other.step_seconds / other.tokens_per_step
    worst = [(k, v / own) for k, v in sorted(per_token.items(), key=lambda kv: -kv[1])[:2] if v / own >= 0.005]
    if not worst:
        return "no term is much larger: the two steps are nearly as long"
    return "it spends more on " + " and ".join(f"{k} (+{share:.0%} of its time)" for k, share in worst)


def search(model: GPT, hw: Hardware, gpus: int, global_batch: int, *, max_microbatch: int = 8, max_chunks: int = 4,
           max_tp: int | None = None, recompute: tuple[str, ...] = RECOMPUTE, zero: tuple[int, ...] = (0, 1, 2, 3),
           flash_attention: bool = True, dtype: str | None = None, overlap: bool = True, top: int = 10,
           exact: int = 16, max_cp: int = 1) -> SearchResult:
    """The plans of `model` on `gpus` × `hw` for `global_batch` that fit in memory, best first (see the module
    docstring); at most `top` of them, each predicted in full."""
    whole_number(gpus, "gpus")
    whole_number(global_batch, "global_batch")
    dtype = dtype or hw.dtype
    refused: dict[str, int] = {}
    candidates = []
    for s in _shapes(model, gpus, global_batch, max_microbatch, max_chunks, max_tp or hw.gpus_per_host, recompute,
                     zero, flash_attention, refused, whole_number(max_cp, "max_cp")):
        candidates.append(_estimate(model, hw, s, dtype, overlap))
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: -c.estimated_tokens_per_second)
    plans = sorted((predict_shape(model, hw, c.shape, dtype, overlap) for c in fitting[:exact]),
                   key=lambda p: -p.tokens_per_second)
    return SearchResult(model, hw, gpus, global_batch, [p for p in plans if p.fits][:top], candidates, refused)


def _shapes(model: GPT, gpus: int, batch: int, max_b: int, max_v: int, max_tp: int, recompute, zero, flash,
            refused: dict[str, int], max_cp: int = 1):
    splits = (model.heads, model.groups, model.ff)  # tp must divide each
    tps = [t for t in _divisors(gpus) if t <= max_tp and all(n % t == 0 for n in splits)]
    for tp, cp in ((t, c) for t in tps for c in _divisors(gpus // t) if c <= max_cp and model.seq % (2 * c) == 0):
        for pp in (p for p in _divisors(gpus // (tp * cp)) if p <= model.layers):
            dp = gpus // (tp * cp * pp)
            chunks = [1] + ([v for v in range(2, max_v + 1) if model.layers % (pp * v) == 0] if pp > 1 else [])
            stages = [z for z in zero if z == 0 or dp > 1]
            for b, v, z, r in ((b, v, z, r) for b in _powers(max_b) for v in chunks for z in stages for r in recompute):
                try:
                    yield shape(model, gpus, tp, pp, batch, b, v, z, r, tp > 1, flash, cp)
                except DistUsageError as e:
                    reason = re.sub(r"\d+", "N", str(e).split(":")[0])  # one entry per kind of refusal
                    refused[reason] = refused.get(reason, 0) + 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def _estimate(model: GPT, hw: Hardware, s: Shape, dtype: str, overlap: bool) -> Candidate:
    """Memory exactly; tokens/s with the bubble's closed form instead of the simulator."""
    _, bytes_ = mem.peak_memory(model, s, hw, dtype)
    total = sum(bytes_.values())
    c = step.costs(model, s, hw, dtype, overlap)
    per_rank = [sum(k.forward + k.backward for k in c.chunks[r::s.pp]) for r in range(s.pp)]
    slowest = max(per_rank)
    makespan = slowest * (s.microbatches + (s.pp - 1) / s.chunks) + 2 * (s.pp - 1) * c.message
    seconds = makespan + c.dp_sync + c.dp_gather + c.embedding_sync + c.optimizer
    return Candidate(s, total, total <= hw.memory_bytes, s.global_batch * model.seq / seconds)
