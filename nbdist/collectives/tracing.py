"""An all-reduce step by step, seen from the notebook: `trace("ring")` runs a hand-built algorithm on the cluster,
compares it with `dist.all_reduce`, and merges every rank's record into one list of steps.

    t = nbdist.collectives.trace("ring", size=1024)
    t                       # <ring all-reduce on 4 ranks, 1024 floats: 6 steps, matches dist.all_reduce (...)>
    t.figure()              # one frame per step, a slider (nbdist.viz.collective_steps)

The algorithms themselves run on the engines (nbdist/collectives/ranks/allreduce.py); this module only sends them and
reads what comes back. Whether the result matches the library is measured, not assumed: `max_diff` is the largest
|ours - dist.all_reduce| over ranks and elements, and `matches_library` compares it with a tolerance that scales
with the sum (the library adds in another order, so the last bits may differ). A trace that differs is still
returned, so that its steps can be looked at; its repr and its figure's title say DIFFERS.

(The module is tracing.py, not trace.py: a submodule named like the function would replace the function
`nbdist.collectives.trace` on the package once imported.)
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.checks import is_whole, whole_number
from nbdist.cost import collectives as costs
from nbdist.errors import DistError, DistUsageError

RELATIVE_TOLERANCE = 1e-5  # of the largest |sum| (at least 1): the library adds in another order, last bits differ


@dataclass
class Trace:
    """One all-reduce, step by step. `steps[k]`: {"step", "phase", "sends": [(src, dst, chunk)], "holds": per rank,
    per chunk, the sorted ranks whose contributions it holds after the step}."""

    algorithm: str
    world_size: int
    size: int  # float32 elements per rank
    chunk_sizes: list[int]  # elements of each chunk (one chunk, the whole tensor, for tree and recursive doubling)
    steps: list[dict]
    max_diff: float  # largest |ours - dist.all_reduce| over ranks and elements
    scale: float = 1.0  # largest |sum| over ranks and elements: what the tolerance is relative to

    @property
    def tolerance(self) -> float:
        """The largest difference from dist.all_reduce that still counts as the same sum."""
        return RELATIVE_TOLERANCE * max(self.scale, 1.0)

    @property
    def matches_library(self) -> bool:
        """Whether every rank's result equals dist.all_reduce of the same tensors, within `tolerance`."""
        return self.max_diff <= self.tolerance  # False for NaN too

    @property
    def verdict(self) -> str:
        """'matches dist.all_reduce (max diff 3e-07)' or 'DIFFERS FROM dist.all_reduce (max diff 1, tolerance
        1e-05)': what the repr and the figure's title say."""
        if self.matches_library:
            return f"matches dist.all_reduce (max diff {self.max_diff:.2g})"
        return f"DIFFERS FROM dist.all_reduce (max diff {self.max_diff:.3g}, tolerance {self.tolerance:.2g})"

    def figure(self, title: str | None = None):
        """A plotly figure with one frame per step and a slider (nbdist.viz.collective_steps)."""
        from nbdist.viz.collective_steps import collective_steps_figure

        return collective_steps_figure(self, title=title)

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each rank sent in total (float32), from the record; the largest is `message_counts(...)
        .busiest_rank_bytes`."""
        sent = [0] * self.world_size
        for step in self.steps:
            for src, _, chunk in step["sends"]:
                sent[src] += 4 * self.chunk_sizes[chunk]
        return sent

    @property
    def critical_path_bytes(self) -> int:
        """The sum over steps of each step's largest message (float32 bytes), from the record: what the alpha-beta
        model charges beta for (`message_counts(...).critical_path_bytes`)."""
        return sum(max((4 * self.chunk_sizes[chunk] for _, _, chunk in step["sends"]), default=0)
                   for step in self.steps)

    def __repr__(self) -> str:
        steps = f"{len(self.steps)} step" + ("" if len(self.steps) == 1 else "s")
        return (f"<{self.algorithm} all-reduce on {self.world_size} ranks, {self.size} floats: {steps}, "
                f"{self.verdict}>")


def trace(algorithm: str, world_size: int | None = None, size: int = 1024, cluster=None, *, seed: int = 0,
          timeout: float | None = 120.0) -> Trace:
    """Run `algorithm` ("ring", "tree", "recursive-doubling", or the alias "recursive_doubling") on ranks
    0..world_size-1 of the cluster (default: all) on random float32 tensors of `size` elements, compare it with
    `dist.all_reduce` of the same tensors (`Trace.matches_library`), and return every rank's record merged step by
    step. `.figure()` draws it."""
    from nbdist.cluster.api import current
    from nbdist.collectives.ranks import allreduce  # sent to the engines by reference: they import it themselves

    algorithm = costs.canonical(algorithm)  # one spelling, one alias, checked in one place
    cluster = cluster or current()
    n = cluster.world_size if world_size is None else world_size
    if not is_whole(n) or not 2 <= n <= cluster.world_size:
        raise DistUsageError(f"world_size must be 2..{cluster.world_size} (the cluster's ranks), got {world_size!r}"
                             " - one rank has nothing to reduce")
    whole_number(size, "size (float32 elements per rank)")
    results = cluster.run(allreduce.trace_rank, algorithm, n, size, seed, timeout=timeout)[:n]
    steps = _merge([r["record"] for r in results], algorithm)
    return Trace(algorithm, n, size, costs.chunk_sizes(algorithm, n, size), steps,
                 max_diff=max(r["max_diff"] for r in results), scale=max(r["scale"] for r in results))


def _merge(records: list[list[dict]], algorithm: str) -> list[dict]:
    """Per-rank records -> per-step entries with everyone's sends and holdings; checks the ranks agree and that
    every chunk ends fully reduced everywhere (the record's own proof of the result)."""
    n = len(records)
    phases = [[entry["phase"] for entry in record] for record in records]
    if any(p != phases[0] for p in phases):
        raise DistError(f"{algorithm}: the ranks recorded different steps: {phases}")
    steps = [
        {
            "step": k + 1,
            "phase": phase,
            "sends": sorted(send for record in records for send in record[k]["sends"]),
            "holds": [record[k]["holds"] for record in records],
        }
        for k, phase in enumerate(phases[0])
    ]
    everyone = list(range(n))
    missing = [(r, c) for r, holds in enumerate(steps[-1]["holds"]) for c, h in enumerate(holds) if h != everyone]
    if missing:
        raise DistError(f"{algorithm}: after the last step (rank, chunk) {missing} lack some ranks' contributions")
    return steps
