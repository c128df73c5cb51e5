"""Pipeline and Stepper: the notebook-side face of pipeline parallelism.

    pipe = nbdist.pipeline(model, stages=4, schedule="1f1b", microbatches=8)
    loss = pipe.step(inputs, targets, torch.nn.functional.mse_loss)
    pipe.timeline.figure()                      # measured, per rank, per micro-batch
    stepper = pipe.stepper(inputs, targets, loss_fn)
    stepper.next(); stepper.state()             # tick by tick
    stepper.timeline; stepper.tick_timeline()   # the work so far (pauses between calls removed); on the tick axis

`stages` is the number of pipeline ranks p (ranks 0..p-1 of the cluster); with `chunks` v each rank holds v model
pieces, so the model is cut into p*v stages. The notebook kernel only cuts the model and infers message shapes
on torch's "meta" device; all real compute happens on the engines.
"""
from __future__ import annotations

import copy
import itertools
from collections import deque
from typing import Callable

import torch
from torch import nn

from nbdist.cluster import Cluster, current
from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel import executor
from nbdist.pipeline_parallel.stages import boundaries, layer_counts, parameter_sizes, unsplit_key
from nbdist.pipeline_parallel.stepping import (
    TickState,
    action_ticks,
    state_at,
    tick_timeline,
    total_ticks,
    work_timeline,
)
from nbdist.schedules.generators import build
from nbdist.schedules.schedule import Schedule
from nbdist.schedules.simulate import Timeline, measured_durations

_ids = itertools.count()
LIVE_PUBLISH_SECONDS = 0.25  # how often ranks publish their spans while a live view watches (>= 2 updates/s)
RECENT_STEPS = 5  # steps whose durations the ideal takes medians over (a cold first step is outvoted)


def pipeline(
    model: nn.Sequential | Callable[[], nn.Sequential],
    stages: int,
    schedule: str | Schedule = "1f1b",
    microbatches: int = 8,
    chunks: int = 1,
    balance: list[int] | None = None,
    *,
    cluster: Cluster | None = None,
    optimizer: Callable | None = None,
    lr: float = 0.01,
    transport: str = "auto",
) -> "Pipeline":
    """Split `model` across `stages` ranks and prepare `schedule` (a name, or a Schedule you built or wrote).

    model: an nn.Sequential, or a zero-argument function that builds it (each rank then builds its own part).
    balance: layers per stage (p*v entries); None balances by parameter count.
    optimizer: e.g. `lambda params: torch.optim.SGD(params, lr=0.1)`, built on each rank for its parameters and
    stepped after each `step()`. For "pipedream", each stage instead takes an SGD step of size `lr` after every
    micro-batch's backward, with the weights stashed at that micro-batch's forward.
    transport: "auto" (MPI for CPU tensors, torch.distributed on GPUs), "mpi" or "torch".
    """
    return Pipeline(model, stages, schedule, microbatches, chunks, balance, cluster or current(), optimizer, lr,
                    transport)


class Pipeline:
    def __init__(self, model, stages, schedule, microbatches, chunks, balance, cluster, optimizer, lr, transport):
        self.cluster = cluster
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            raise DistUsageError(f"stages must be a positive whole number, got {stages!r}")
        if stages > cluster.world_size:
            raise DistUsageError(f"stages={stages} needs {stages} ranks but the cluster has {cluster.world_size}")
        if isinstance(schedule, Schedule):
            if schedule.ranks != stages:
                raise DistUsageError(f"the schedule is for {schedule.ranks} ranks, not stages={stages}")
            self.schedule = schedule
        else:
            self.schedule = build(schedule, stages, microbatches, chunks)
        self.meta_model = _meta_model(model)
        pieces = self.schedule.stages
        if pieces > len(self.meta_model):
            raise DistUsageError(
                f"the model has {len(self.meta_model)} layers, fewer than stages × chunks = {pieces} pieces"
            )
        self.balance = layer_counts(parameter_sizes(self.meta_model), pieces, balance)
        self.ranges = boundaries(self.balance)
        self.ticks = action_ticks(self.schedule)
        self.number = next(_ids)
        self.id = f"pipe{self.number}"
        self.ranks = list(range(stages))
        self._shapes: dict = {}
        self.last_results: list[dict] = []
        self.recent: deque[Timeline] = deque(maxlen=RECENT_STEPS)  # measured (work) timelines of the last steps
        self.loss: float | None = None
        self.view = None  # a PipelineView, once widget() was called: steps then update it live
        self._setup(model, optimizer, lr if self.schedule.name == "pipedream" else None, transport)

    # -- set-up ---------------------------------------------------------------------------------------------------

    def _setup(self, model, optimizer, pipedream_lr, transport) -> None:
        args = {}
        for rank in self.ranks:
            my_stages = self.schedule.stages_of(rank)
            if isinstance(model, nn.Module):
                modules = {s: nn.Sequential(*list(model)[slice(*self.ranges[s])]) for s in my_stages}
            else:
                modules = ("build", portable(model), {s: self.ranges[s] for s in my_stages})
            args[rank] = (self.id, self.number, rank, self.schedule.ranks, self.schedule.actions[rank],
                          self.ticks[rank], modules, self.schedule.stages, self.schedule.microbatches, transport,
                          portable(optimizer), pipedream_lr)
        self.cluster.run_each(executor.setup, args)

    def _message_shapes(self, inputs: torch.Tensor) -> dict:
        """stage -> (shape, dtype) of its output for one micro-batch, found on the meta device (no compute)."""
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._shapes:
            m = self.schedule.microbatches
            x = torch.empty((inputs.shape[0] // m, *inputs.shape[1:]), dtype=inputs.dtype, device="meta")
            shapes = {}
            with torch.no_grad():
                for stage, (a, b) in enumerate(self.ranges):
                    for layer in list(self.meta_model)[a:b]:
                        x = layer(x)
                    shapes[stage] = (tuple(x.shape), x.dtype)
            self._shapes[key] = shapes
        return self._shapes[key]

    def _check_batch(self, inputs, targets) -> None:
        m = self.schedule.microbatches
        for name, t in (("inputs", inputs), ("targets", targets)):
            if not isinstance(t, torch.Tensor):
                raise DistUsageError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.shape[0] % m:
                raise DistUsageError(f"batch of {t.shape[0]} {name} does not split into {m} equal micro-batches")
        if inputs.shape[0] != targets.shape[0]:
            raise DistUsageError(f"{inputs.shape[0]} inputs but {targets.shape[0]} targets")

    def _step_args(self, inputs, targets, loss_fn, *extra) -> dict:
        """Each rank gets only what it needs: the first stage the inputs, the last stage the targets."""
        self._check_batch(inputs, targets)
        shapes = self._message_shapes(inputs)
        last_rank = self.schedule.rank_of(self.schedule.stages - 1)
        loss_fn = portable(loss_fn)
        return {
            r: (self.id, shapes, inputs if r == 0 else None, targets if r == last_rank else None, loss_fn, *extra)
            for r in self.ranks
        }

    def _live(self, reports_of=None, tick_state_of=None):
        """(publish interval, progress callback) when a view is attached, else (None, None).

        The ranks publish their spans so far; `reports_of(published)` merges them with what earlier calls reported
        (a Stepper's), so the view draws the whole step's work timeline as it grows."""
        if self.view is None:
            return None, None

        def progress(ar) -> None:
            published = {d["rank"]: d for d in ar.data if isinstance(d, dict) and "spans" in d}
            if published:
                reports = reports_of(published) if reports_of else published
                self.view.refresh(self._work_timeline(reports, stepped=reports_of is not None), final=False,
                                  tick_state=tick_state_of() if tick_state_of else None)

        return LIVE_PUBLISH_SECONDS, progress

    def _work_timeline(self, reports: dict, stepped: bool) -> Timeline:
        kind = "measured work, pauses between calls removed" if stepped else "measured"
        return work_timeline(reports, name=f"{self.schedule.name} ({kind})")

    # -- running ------------------------------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, timeout: float | None = None):
        """One training step (forward and backward of every micro-batch, then the optimizer if given) at full
        speed; returns the loss of the whole batch, and keeps the measured timeline in `.timeline`."""
        publish_every, progress = self._live()
        args = self._step_args(inputs, targets, loss_fn, publish_every)
        results = self.cluster.run_each(executor.step, args, timeout=timeout, progress=progress)
        return self._record(results, self._work_timeline({r["rank"]: r for r in results}, stepped=False))

    def _record(self, results: list[dict], timeline: Timeline, tick_state=None) -> float:
        self.last_results = results
        self.recent.append(timeline)
        self.loss = next(r["loss"] for r in results if r["loss"] is not None)
        if self.view is not None:
            self.view.refresh(timeline, final=True, tick_state=tick_state, throttle=tick_state is None)
        return self.loss

    def widget(self):
        """A live view (measured Gantt, the ideal beneath, busy/idle, bubble); later steps update it as they run."""
        from nbdist.widgets.pipeline_view import PipelineView

        self.view = PipelineView(self)
        if self.recent:
            self.view.refresh(self.recent[-1])
        return self.view

    @property
    def timeline(self) -> Timeline:
        """The measured timeline of the last step (seconds), with the same fields as a simulated one.

        After a stepped step it is the work timeline: the pauses between the Stepper's calls are taken out (its
        name says so, and `.cuts` says where and how long)."""
        if not self.recent:
            raise DistUsageError("no step has run yet: call step() or run a stepper first")
        return self.recent[-1]

    def ideal(self, current: Timeline | None = None) -> Timeline:
        """The schedule simulated with measured durations and message latency: what a step would take with no
        overheads, stragglers or contention. The gap to `timeline` is what those cost.

        Durations are medians per stage and kind over the micro-batches of the last few steps (`RECENT_STEPS`,
        see schedules.simulate.measured_durations), so one cold action does not stretch the ideal. `current`: a
        step in progress (a Stepper's), counted with the steps before it."""
        durations = measured_durations(self._duration_sources(current), self.schedule.stages, self.schedule.chunks)
        if durations is None:
            raise DistUsageError("no step has a complete forward and backward to measure yet")
        ideal = self.schedule.simulate(**durations)
        ideal.unit = "s"
        ideal.name = f"{self.schedule.name} (ideal)"
        return ideal

    def _duration_sources(self, current: Timeline | None) -> list[Timeline]:
        """The timelines the ideal's medians are taken over: the recent steps, and a step in progress."""
        recent = list(self.recent)
        if current is not None and current is not (recent[-1] if recent else None) and any(current.spans.values()):
            recent = recent[1:] if len(recent) == RECENT_STEPS else recent
            recent.append(current)
        return recent

    def stepper(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable) -> "Stepper":
        return Stepper(self, inputs, targets, loss_fn)

    # -- gathering ----------------------------------------------------------------------------------------------

    def _gather(self, grads: bool) -> dict:
        per_rank = self.cluster.run(executor.parameters, self.id, grads, ranks=self.ranks)
        out = {
            unsplit_key(self.ranges[stage][0], key): value
            for stage_tensors in per_rank
            for stage, tensors in stage_tensors.items()
            for key, value in tensors.items()
        }
        return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split(".")[0]), kv[0])))

    def state_dict(self) -> dict:
        """The whole model's parameters and buffers under the unsplit model's keys ('0.weight', ...)."""
        return self._gather(grads=False)

    def grads(self) -> dict:
        """Every parameter's gradient after the last step, under the unsplit model's keys."""
        return self._gather(grads=True)

    def close(self) -> None:
        """Free the stage modules on the engines."""
        if self.cluster.running:
            self.cluster.run(executor.close, self.id, ranks=self.ranks)

    def __repr__(self) -> str:
        return (f"<Pipeline {self.schedule.name}: {self.schedule.ranks} ranks × {self.schedule.chunks} chunk(s), "
                f"{self.schedule.microbatches} micro-batches, layers per stage {self.balance}>")


class Stepper:
    """Runs one step of a pipeline tick by tick on the real ranks; `.state()` says where everything is.

    `.timeline` is the work done so far in seconds, with the pauses between calls (a person reading between two
    clicks) taken out; `.tick_timeline()` puts every action at its tick instead."""

    def __init__(self, pipe: Pipeline, inputs, targets, loss_fn):
        self.pipe = pipe
        self._batch = (inputs, targets, loss_fn)
        self.total_ticks = total_ticks(pipe.ticks)
        self.view = None
        self._begin()

    def _begin(self) -> None:
        self.tick = 0
        self.loss: float | None = None
        self._reports: dict[int, dict] = {}
        self.pipe.cluster.run_each(executor.begin, self.pipe._step_args(*self._batch))

    @property
    def done(self) -> bool:
        return self.tick >= self.total_ticks

    def next(self, k: int = 1) -> TickState:
        """Run the next k ticks on all ranks, then stop there."""
        if self.done:
            raise DistUsageError("the step is complete: make a new stepper for the next step (or reset())")
        target = min(self.tick + k, self.total_ticks)
        publish_every, progress = self._live(target)
        # every rank, also one whose list is done: each call starts with a barrier of the pipeline's ranks
        args = {r: (self.pipe.id, target, publish_every) for r in self.pipe.ranks}
        for report in self.pipe.cluster.run_each(executor.advance, args, progress=progress):
            self._reports[report["rank"]] = report
        self.tick = target
        if self.done:
            reports = [self._reports[r] for r in sorted(self._reports)]
            self.loss = self.pipe._record(reports, self.timeline, self.state())
        elif self.view is not None:
            self.view.refresh(self.timeline, final=True, tick_state=self.state())
        return self.state()

    def _live(self, target: int):
        """Live updates only for runs of more than a few ticks (a single tick is drawn when it returns)."""
        if self.view is None or target - self.tick <= 1:
            return None, None
        return self.pipe._live(lambda published: {**self._reports, **published}, self.state)

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
        return self.pipe._work_timeline(reports, stepped=True)

    def tick_timeline(self, upto: int | None = None) -> Timeline:
        """Every action of the step at its tick, up to the current tick (`upto=None`), or to `upto`."""
        return tick_timeline(self.pipe.schedule, self.pipe.ticks, self.tick if upto is None else upto)

    def widget(self):
        """Step / Run / Reset buttons over the live view; the measured Gantt grows tick by tick."""
        from nbdist.widgets.pipeline_view import PipelineView

        self.view = self.pipe.view = PipelineView(self.pipe, stepper=self)
        self.view.refresh(self.timeline, final=True, tick_state=self.state())
        return self.view


def portable(fn: Callable | None) -> bytes | None:
    """A user function as self-contained bytes (cloudpickle, by value with what it references), so a model
    builder or loss written in a notebook cell runs on the engines even if they never imported torch."""
    import cloudpickle

    from nbdist.remote import remember_source

    if fn is None:
        return None
    remember_source(fn)  # a traceback through it on a rank then shows its source, not "<dynamic-code>"
    return cloudpickle.dumps(fn)


def _meta_model(model) -> nn.Sequential:
    """A copy of the model on torch's meta device: shapes and parameter counts, no memory, no compute."""
    if isinstance(model, nn.Sequential):
        return nn.Sequential(*[copy.deepcopy(layer).to("meta") for layer in model])
    if isinstance(model, nn.Module):
        kind = type(model).__name__
        raise DistUsageError(f"the model must be an nn.Sequential (or a function building one), got {kind}")
    if not callable(model):
        raise DistUsageError(f"the model must be an nn.Sequential or a function building one, got {model!r}")
    with torch.device("meta"):
        built = model()
    if not isinstance(built, nn.Sequential):
        raise DistUsageError(f"the model function must return an nn.Sequential, got {type(built).__name__}")
    return built
