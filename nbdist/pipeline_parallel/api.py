"""Pipeline and Stepper: the notebook-side face of pipeline parallelism.

    pipe = nbdist.pipeline(model, stages=4, schedule="1f1b", microbatches=8)
    loss = pipe.step(inputs, targets, torch.nn.functional.mse_loss)
    pipe.timeline.figure()                      # measured, per rank, per micro-batch
    stepper = pipe.stepper(inputs, targets, loss_fn)
    stepper.next(); stepper.state()             # tick by tick

`stages` is the number of pipeline ranks p (ranks 0..p-1 of the cluster); with `chunks` v each rank holds v model
pieces, so the model is cut into p*v stages. The notebook kernel only cuts the model and infers message shapes
on torch's "meta" device; all real compute happens on the engines.
"""
from __future__ import annotations

import copy
import itertools
from typing import Callable

import torch
from torch import nn

from nbdist.cluster import Cluster, current
from nbdist.errors import DistUsageError
from nbdist.pipeline_parallel import executor
from nbdist.pipeline_parallel.stages import boundaries, layer_counts, parameter_sizes, unsplit_key
from nbdist.pipeline_parallel.stepping import TickState, action_ticks, state_at, total_ticks
from nbdist.schedules.generators import build
from nbdist.schedules.schedule import Schedule

_ids = itertools.count()
LIVE_PUBLISH_SECONDS = 0.25  # how often ranks publish their spans while a live view watches (>= 2 updates/s)


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

    def _live(self, tick_state_of=None):
        """(publish interval, progress callback) when a view is attached, else (None, None)."""
        if self.view is None:
            return None, None

        def progress(ar) -> None:
            spans = {d["rank"]: d["spans"] for d in ar.data if isinstance(d, dict) and "spans" in d}
            if spans:
                self.view.refresh(spans, final=False, tick_state=tick_state_of() if tick_state_of else None)

        return LIVE_PUBLISH_SECONDS, progress

    # -- running ------------------------------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, timeout: float | None = None):
        """One training step (forward and backward of every micro-batch, then the optimizer if given) at full
        speed; returns the loss of the whole batch, and keeps the measured timeline in `.timeline`."""
        publish_every, progress = self._live()
        args = self._step_args(inputs, targets, loss_fn, publish_every)
        results = self.cluster.run_each(executor.step, args, timeout=timeout, progress=progress)
        return self._record(results)

    def _record(self, results: list[dict], tick_state=None) -> float:
        self.last_results = results
        self.loss = next(r["loss"] for r in results if r["loss"] is not None)
        if self.view is not None:
            self.view.refresh({r["rank"]: r["spans"] for r in results}, final=True, tick_state=tick_state,
                              throttle=tick_state is None)
        return self.loss

    def widget(self):
        """A live view (measured Gantt, the ideal beneath, busy/idle, bubble); later steps update it as they run."""
        from nbdist.widgets.pipeline_view import PipelineView

        self.view = PipelineView(self)
        if self.last_results:
            self.view.refresh({r["rank"]: r["spans"] for r in self.last_results})
        return self.view

    @property
    def timeline(self):
        """The measured timeline of the last step (seconds), with the same fields as a simulated one."""
        from nbdist.schedules.simulate import Timeline

        if not self.last_results:
            raise DistUsageError("no step has run yet: call step() or run a stepper first")
        spans = {r["rank"]: r["spans"] for r in self.last_results}
        return Timeline.from_spans(spans, name=f"{self.schedule.name} (measured)")

    def ideal(self):
        """The schedule simulated with the last step's measured durations and message latency: what this step would
        take with no overheads, stragglers or contention. The gap to `timeline` is what those cost."""
        from nbdist.schedules.simulate import measured_durations

        durations = measured_durations(self.timeline, self.schedule.stages, self.schedule.chunks)
        if durations is None:
            raise DistUsageError("the last step has no complete forward and backward to measure")
        ideal = self.schedule.simulate(**durations)
        ideal.unit = "s"
        return ideal

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
    """Runs one step of a pipeline tick by tick on the real ranks; `.state()` says where everything is."""

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
        pending = [r for r in self.pipe.ranks if not self._reports.get(r, {}).get("done")]
        publish_every, progress = self._live(target)
        args = {r: (self.pipe.id, target, publish_every) for r in pending}
        for report in self.pipe.cluster.run_each(executor.advance, args, progress=progress):
            self._reports[report["rank"]] = report
        self.tick = target
        if self.done:
            self.loss = self.pipe._record([self._reports[r] for r in sorted(self._reports)], self.state())
        elif self.view is not None:
            self.view.refresh(self.spans(), final=False, tick_state=self.state())
        return self.state()

    def _live(self, target: int):
        """Live updates only for runs of more than a few ticks (a single tick is drawn when it returns)."""
        if self.view is None or target - self.tick <= 1:
            return None, None
        return self.pipe._live(self.state)

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
            self.view.refresh({}, final=False, tick_state=self.state())

    def state(self) -> TickState:
        return state_at(self.pipe.schedule, self.pipe.ticks, self.tick)

    def spans(self) -> dict:
        """rank -> spans measured so far in this step."""
        return {rank: report["spans"] for rank, report in self._reports.items()}

    def widget(self):
        """Step / Run / Reset buttons over the live view; the measured Gantt grows tick by tick."""
        from nbdist.widgets.pipeline_view import PipelineView

        self.view = self.pipe.view = PipelineView(self.pipe, stepper=self)
        self.view.refresh(self.spans(), final=True, tick_state=self.state())
        return self.view


def portable(fn: Callable | None) -> bytes | None:
    """A user function as self-contained bytes (cloudpickle, by value with what it references), so a model
    builder or loss written in a notebook cell runs on the engines even if they never imported torch."""
    import cloudpickle

    return None if fn is None else cloudpickle.dumps(fn)


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
