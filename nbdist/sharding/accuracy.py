"""Does a plan's prediction hold on this cluster? Each strategy planned, profiled, built and stepped, its predicted
step and memory set beside what the built model measured: the local table of the plans' claims (strategy,
predicted, measured, error, the term that dominates), for a notebook and for benchmarks/bench_shard_predict.py
alike.

The prediction is made first (`nbdist.shard(...).profile().predicted_step()`: the layers timed on the engines, the
links and the libraries' costs measured, the schedule simulated), then the plan is built and stepped; the first
step meters memory and warms up, the next `steps` are timed (first rank's start to last rank's end).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from nbdist.checks import whole_number

MEMORY_KINDS = ("params", "grads", "optimizer", "activations")


@dataclass
class Checked:
    """One strategy: what its plan predicted and what its built model measured."""

    strategy: str  # the plan's choices, e.g. "dp=2 zero=1"
    predicted_s: float
    terms: dict[str, float]  # the prediction's terms (StepTime.terms), seconds
    measured_s: list[float]  # each timed step
    memory: list[tuple[int, float, float]]  # per rank: (rank, measured bytes, predicted bytes)
    assumes: object = None  # the share of a core the prediction assumed (measured.CoreShare; None on GPUs)

    @property
    def measured_median_s(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def error(self) -> float:
        """measured / predicted - 1 of the median step: above 0, the plan predicted too little."""
        return self.measured_median_s / self.predicted_s - 1

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.__getitem__)

    @property
    def memory_error(self) -> float:
        """The largest |measured / predicted - 1| of any rank's bytes."""
        return max(abs(got / want - 1) for _, got, want in self.memory)


def label(settings: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


def check(model_fn: Callable, settings: dict, *, batch: int, batches: Callable[[int], tuple], loss_fn: Callable,
          optimizer_fn: Callable, steps: int = 5, cluster=None) -> Checked:
    """Plan `model_fn` with `settings` (nbdist.shard's choices) for a global batch of `batch`, predict, build it
    with `optimizer_fn`, step it `steps` + 1 times on `batches(step)` -> (inputs, targets) with `loss_fn`."""
    import nbdist

    whole_number(steps, "steps")
    plan = nbdist.shard(model_fn, batch=batch, cluster=cluster, **settings)
    predicted = plan.profile().predicted_step()
    predicted_memory = plan.predicted_memory()
    built = plan.apply(optimizer_fn)
    try:
        times = []
        for step in range(steps + 1):
            built.step(*batches(step), loss_fn, memory=step == 0)
            if step:
                times.append(built.step_seconds())
        memory = [(row["rank"], float(sum(row[k] for k in MEMORY_KINDS)),
                   float(predicted_memory[plan.layout.coords(row["rank"])["pp"]].total))
                  for row in built.measured_memory()]
    finally:
        built.close()
    return Checked(label(settings), predicted.total_s, predicted.terms(), times, memory, predicted.assumes)


def check_all(model_fn: Callable, strategies: Sequence[dict], **options) -> list[Checked]:
    """`check` for each strategy in turn (same options)."""
    return [check(model_fn, settings, **options) for settings in strategies]


def table(rows: Sequence[Checked], tolerance: float = 0.25) -> str:
    """The local table as text: strategy, predicted and measured step (ms), error, the dominating term, memory
    error; a row whose step error exceeds `tolerance` is marked."""
    lines = [f"{'strategy':34} {'predicted':>9} {'measured':>9} {'error':>7}  {'dominant term':30} {'memory':>7}"]
    for row in rows:
        mark = "  MISS" if abs(row.error) > tolerance else ""
        lines.append(f"{row.strategy:34} {row.predicted_s * 1e3:7.1f}ms {row.measured_median_s * 1e3:7.1f}ms "
                     f"{row.error:+7.1%}  {row.dominant:30} {row.memory_error:7.2%}{mark}")
    return "\n".join(lines)
