"""Stepper: one step of a pipeline, run tick by tick on the real ranks (notebook side).

    st = pipe.stepper(inputs, targets, loss_fn)
    st.next(); st.state()                       # what each rank did, messages in flight, activations held
    st.timeline; st.tick_timeline()             # the work so far (pauses between calls removed); on the tick axis
    st.widget()                                 # Step / Run / Reset over the live view

It drives the pipeline through the Pipeline's step interface (step_args, live, measured_timeline, record), the same
one Pipeline.step uses, so a stepped step ends exactly like a full-speed one: same loss, same optimizer step, same
place in `pipe.timeline`. With data parallelism every replica advances by the same ticks.
"""
from __future__ import annotations

from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel.ranks import pipeline as on_ranks
from nbdist.pipeline_parallel.stepping import TickState, state_at, tick_timeline, total_ticks
from nbdist.schedules.simulate import Timeline


class Stepper:
    """Runs one step of a pipeline tick by tick on the real ranks; `.state()` says where everything is.

    `.timeline` is the work done so far in seconds, with the pauses between calls (a person reading between two
    clicks) taken out; `.tick_timeline()` puts every action at its tick instead."""

    def __init__(self, pipe, inputs, targets, loss_fn):
        self.pipe = pipe
        self._batch = (inputs, targets, loss_fn)
        self.total_ticks = total_ticks(pipe.ticks)
        self.view = None
        self._begin()

    def _begin(self) -> None:
        self.tick = 0
        self.loss: float | None = None
        self._reports: dict[int, dict] = {}
        args = self.pipe.step_args(*self._batch)
        self.pipe.begin_step()
        self.pipe.cluster.run_each(on_ranks.begin, args)

    @property
    def done(self) -> bool:
        return self.tick >= self.total_ticks

    def next(self, k: int = 1) -> TickState:
        """Run the next k ticks on all ranks, then stop there."""
        if self.done:
            raise DistUsageError("the step is complete: make a new stepper for the next step (or reset())")
        target = min(self.tick + k, self.total_ticks)
        publish_every, progress = self._live(target)
        # every rank, also one whose list is done: each call starts with a barrier of all the pipeline's ranks
        args = {r: (self.pipe.id, target, publish_every, target == self.total_ticks) for r in self.pipe.ranks}
        for report in self.pipe.cluster.run_each(on_ranks.advance, args, progress=progress):
            self._reports[report["rank"]] = report
        self.tick = target
        if self.done:
            reports = [self._reports[r] for r in sorted(self._reports)]
            self.loss = self.pipe.record(reports, self.timeline, self.state())
        elif self.view is not None:
            self.view.refresh(self.timeline, final=True, tick_state=self.state())
        return self.state()

    def _live(self, target: int):
        """Live updates only for runs of more than a few ticks (a single tick is drawn when it returns)."""
        if self.view is None or target - self.tick <= 1:
            return None, None
        return self.pipe.live(lambda published: {**self._reports, **published}, self.state)

    def run(self) -> float:
        """Run to the end of the step; returns the loss."""
        if not self.done:
            self.next(self.total_ticks - self.tick)
        return self.loss

    def reset(self) -> None:
        """Start the step again from tick 0 (a step half-done is first completed, so no message is left over)."""
        if not self.done:
            self.next(self.total_ticks - self.tick)
        self._begin()
        if self.view is not None:
            self.view.refresh(self.timeline, final=True, tick_state=self.state())

    def state(self) -> TickState:
        return state_at(self.pipe.schedule, self.pipe.ticks, self.tick)

    def spans(self) -> dict:
        """rank -> spans measured so far in this step, as the ranks timed them (pauses between calls included)."""
        return {rank: report["spans"] for rank, report in self._reports.items()}

    @property
    def timeline(self) -> Timeline:
        """The work measured so far in this step (seconds), the pauses between calls taken out (see `.cuts`)."""
        reports = self._reports or {r: {} for r in self.pipe.ranks}
        return self.pipe.measured_timeline(reports, stepped=True)

    def tick_timeline(self, upto: int | None = None) -> Timeline:
        """Every action of the step at its tick, up to the current tick (`upto=None`), or to `upto`."""
        return tick_timeline(self.pipe.schedule, self.pipe.ticks, self.tick if upto is None else upto)

    def widget(self):
        """Step / Run / Reset buttons over the live view; the measured Gantt grows tick by tick."""
        from nbdist.pipeline_parallel.view import PipelineView

        self.view = self.pipe.view = PipelineView(self.pipe, stepper=self)
        self.view.refresh(self.timeline, final=True, tick_state=self.state())
        return self.view
