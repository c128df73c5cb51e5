"""A Trainer's pipeline steps, explained (kernel side): the newest step every rank of the pipeline has reported, as
a measured timeline and its bubble breakdown (debugging/bubbles.py), for the dashboard while the Trainer runs and
for `Trainer.bubbles()` after it.

Why here and not in the Pipeline: the Trainer's loop runs its steps on the ranks without the notebook in between, so
the ranks hand their newest step's spans to the notebook in what they publish (training/ranks/telemetry.py) and in
what fit() returns; the Pipeline of the plan reads them as it reads its own steps' (`measured_timeline`,
`bubbles`). The ranks publish on their own clocks, each at most every PUBLISH_SECONDS, so a step is explained once
every rank has reported it: the newest step all of them have, from the last KEPT each one sent.
"""
from __future__ import annotations

from dataclasses import replace

from nbdist.errors import DistUsageError

KEPT = 8  # steps kept per rank until every rank has reported one of them


class PipelineSteps:
    """Steps reported by the ranks of a Trainer's pipeline (rank -> step -> report: spans, calls, host)."""

    def __init__(self, pipeline):
        self.pipeline = pipeline  # the plan's Pipeline (pipeline_parallel/api.py)
        self.by_rank: dict[int, dict[int, dict]] = {}
        self._explained: tuple[int, object] | None = None  # (step, its BubbleBreakdown), made once per step

    def add(self, rank: int, report: dict | None) -> None:
        """A rank's newest step (None from a rank that has run none)."""
        if not report:
            return
        steps = self.by_rank.setdefault(rank, {})
        steps[report["step"]] = report
        for old in sorted(steps)[:-KEPT]:
            del steps[old]

    def newest(self) -> int | None:
        """The newest step every rank of the pipeline has reported, or None."""
        ranks = self.pipeline.ranks
        if any(r not in self.by_rank for r in ranks):
            return None
        common = set.intersection(*(set(self.by_rank[r]) for r in ranks))
        return max(common) if common else None

    def timeline(self, step: int | None = None):
        """Step `step` (default the newest every rank reported) as a measured Timeline."""
        step = self._step(step)
        reports = {r: self.by_rank[r][step] for r in self.pipeline.ranks}
        timeline = self.pipeline.measured_timeline(reports, stepped=False)
        return replace(timeline, name=f"{timeline.name}, training step {step}")

    def breakdown(self, step: int | None = None):
        """Where step `step`'s idle time came from (a BubbleBreakdown; made once per step)."""
        step = self._step(step)
        if self._explained is None or self._explained[0] != step:
            self._explained = (step, self.pipeline.bubbles(self.timeline(step)))
        return self._explained[1]

    def _step(self, step: int | None) -> int:
        newest = self.newest()
        if newest is None:
            raise DistUsageError("no pipeline step reported by every rank yet: train first (fit)")
        if step is None:
            return newest
        if any(step not in self.by_rank[r] for r in self.pipeline.ranks):
            kept = sorted(self.by_rank[self.pipeline.ranks[0]])
            raise DistUsageError(f"step {step} is not kept by every rank (steps kept: {kept})")
        return step
