"""Pipeline: the notebook-side face of pipeline parallelism (the Stepper is in stepper.py).

    pipe = nbdist.pipeline(model, stages=4, schedule="1f1b", microbatches=8)
    loss = pipe.step(inputs, targets, torch.nn.functional.mse_loss)
    pipe.timeline.figure()                      # measured, per rank, per micro-batch
    stepper = pipe.stepper(inputs, targets, loss_fn)

    m = nbdist.mesh(dp=2, pp=2)                 # data parallel x pipeline parallel on 4 ranks
    pipe = nbdist.pipeline(model, mesh=m, schedule="1f1b", microbatches=4, optimizer=...)
    pipe.step(x, y, loss_fn)                    # the global batch, split across the 2 replicas

A pipeline runs on the `pp` dimension of a mesh, one pipeline per data-parallel replica (the `dp` dimension); its
stages sit on the ranks of each pp group and each stage's gradients are averaged over its dp group before the
optimizer steps. `stages=p` without a mesh is the mesh pp=p on ranks 0..p-1. With `chunks` v each rank holds v
model pieces, so the model is cut into p*v stages. The notebook kernel only cuts the model and infers message shapes
on torch's "meta" device; all real compute happens on the engines (nbdist/pipeline_parallel/ranks/pipeline.py).
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Callable

import torch
from torch import nn

from nbdist.checks import one_of, whole_number
from nbdist.cluster.api import Cluster, current
from nbdist.cluster.meshes.mesh import Mesh
from nbdist.errors import DistUsageError
from nbdist.models import batches
from nbdist.models.gathered import GatheredModel
from nbdist.pipeline_parallel.cut import Cut, Cutting
from nbdist.pipeline_parallel.inputs import check_batch, check_pipeline_zero, check_step_inputs
from nbdist.pipeline_parallel.ranks import pairs
from nbdist.pipeline_parallel.ranks import pipeline as on_ranks
from nbdist.pipeline_parallel.spec import TRANSPORTS, StageSpec
from nbdist.pipeline_parallel.stages import unsplit_key
from nbdist.pipeline_parallel.stepping import action_ticks, work_timeline
from nbdist.schedules.generators import build
from nbdist.schedules.nccl import check_nccl
from nbdist.schedules.schedule import Schedule
from nbdist.schedules.simulate import Timeline, measured_durations
from nbdist.wire import portable

_numbers = itertools.count()
LIVE_PUBLISH_SECONDS = 0.25  # how often ranks publish their spans while a live view watches (>= 2 updates/s)
HISTORY_STEPS = 200  # measured steps kept for export_trace (a step's timeline: a few KB)
RECENT_STEPS = 5  # steps whose durations the ideal takes medians over (a cold first step is outvoted)


def pipeline(
    model: nn.Sequential | Callable[[], nn.Sequential],
    stages: int | None = None,
    schedule: str | Schedule = "1f1b",
    microbatches: int = 8,
    chunks: int = 1,
    balance: list[int] | None = None,
    *,
    mesh: Mesh | None = None,
    cluster: Cluster | None = None,
    optimizer: Callable | None = None,
    lr: float = 0.01,
    transport: str = "auto",
    tp_plan: dict[int, dict[str, str]] | None = None,
    zero: int = 0,
    split_points: list[str] | None = None,
    example_input=None,
    sync_batchnorm: bool = False,
    read_model: nn.Module | None = None,
) -> "Pipeline":
    """Split `model` across `stages` ranks (or a mesh's pp dimension) and prepare `schedule` (a name, or a
    Schedule you built or wrote).

    model: an nn.Sequential, or a zero-argument function that builds any nn.Module (each rank then builds its
    own part); or a list of functions, one per stage, each building that stage's module (forward(x) -> the next
    stage's input; the last stage's output goes to the loss).
    split_points: for a model that is not a Sequential, the module names that begin each later stage (torch's
    pipelining vocabulary: ["model.layers.2"]); each stage is then a pruned copy of the model
    (pipeline_parallel/split.py). Without them the model's units (models/structure.py) are balanced by
    parameters. Either way each cut is proven on `example_input` (a few samples of what the model takes) before
    anything runs on the ranks. read_model: the kernel's copy of a model built by a function, when the caller has
    built it and proven its cuts (nbdist.shard's plan does): not built again.
    mesh: run one pipeline per data-parallel replica of the mesh (its pp size is the number of stages; dp, if
    present, the number of replicas); the batch given to step() is split across the replicas.
    balance: layers (units) per stage (p*v entries); None balances by parameter count.
    optimizer: e.g. `lambda params: torch.optim.SGD(params, lr=0.1)`, built on each rank for its parameters and
    stepped after each `step()`. For "pipedream", each stage instead takes an SGD step of size `lr` after every
    micro-batch's backward, with the weights stashed at that micro-batch's forward.
    transport: "auto" (MPI for CPU tensors, torch.distributed on GPUs), "mpi" or "torch".
    tp_plan: stage -> {Linear name in the stage: "colwise" | "rowwise"}: each stage's layers split over the mesh's
    tp dimension (nbdist.shard makes it; a mesh with tp > 1 needs it).
    zero: 1 shards each stage's optimizer state over its data-parallel replicas (ZeRO-1, Megatron's distributed
    optimizer), 2 its gradients too and 3 its weights too (FSDP2 on each stage); 0 keeps it all whole on every
    replica.
    """
    cluster = cluster or current()
    mesh = _pipeline_mesh(cluster, mesh, stages, tp_plan is not None)
    return Pipeline(model, mesh, schedule, microbatches, chunks, balance, cluster, optimizer, lr, transport, tp_plan,
                    zero, Cutting(split_points, example_input, sync_batchnorm, read_model))


def _pipeline_mesh(cluster: Cluster, mesh: Mesh | None, stages: int | None, tensor_parallel: bool = False) -> Mesh:
    """The mesh a pipeline runs on: the one given (checked), or pp=stages over the first ranks."""
    if mesh is None:
        if stages is None:
            raise DistUsageError("give stages=p (ranks 0..p-1) or mesh=nbdist.mesh(dp=..., pp=...)")
        whole_number(stages, "stages")
        if stages > cluster.world_size:
            raise DistUsageError(f"stages={stages} needs {stages} ranks but the cluster has {cluster.world_size}")
        return cluster.mesh(pp=stages)
    if not isinstance(mesh, Mesh):
        raise DistUsageError(f"mesh must be made by nbdist.mesh(...), got {type(mesh).__name__}")
    cluster.check_fresh(mesh.generation, f"mesh {mesh.name}")
    if "pp" not in mesh.names:
        raise DistUsageError(f"a pipeline runs along a mesh's pp dimension; {mesh.name} has none")
    if stages is not None and stages != mesh.dim_size("pp"):
        raise DistUsageError(f"stages={stages} but the mesh has pp={mesh.dim_size('pp')}: give one or the other")
    if not tensor_parallel and "tp" in mesh.names and mesh.dim_size("tp") > 1:
        raise DistUsageError(f"tp={mesh.dim_size('tp')} needs a tensor-parallel plan for each stage: build the "
                             f"pipeline with nbdist.shard(model_fn, pp=..., tp=...).apply()")
    other = [f"{n}={s}" for n, s in mesh.dims if n not in ("pp", "dp", "tp") and s > 1]
    if other:
        raise DistUsageError(f"a pipeline uses a mesh's pp, dp and tp dimensions only; {', '.join(other)} is not "
                             "supported (make that dimension 1)")
    return mesh


class Pipeline(GatheredModel):
    def __init__(self, model, mesh: Mesh, schedule, microbatches, chunks, balance, cluster, optimizer, lr,
                 transport, tp_plan=None, zero: int = 0, cutting: Cutting | None = None):
        self.cluster, self.mesh, self.tp_plan = cluster, mesh, tp_plan
        p = mesh.dim_size("pp")
        self.replicas = mesh.dim_size("dp") if "dp" in mesh.names else 1
        self.schedule = _schedule(schedule, p, microbatches, chunks)
        split = tp_plan is not None and mesh.dim_size("tp") > 1
        self.zero = check_pipeline_zero(zero, self.replicas, self.schedule.splits_backward, split)
        if self.replicas > 1 and self.schedule.name == "pipedream":
            raise DistUsageError("pipedream updates weights after every micro-batch, which data parallelism "
                                 "(dp > 1) would have to average each time: not supported; use a mesh without dp")
        self.cut = Cut(model, self.schedule, balance, cutting or Cutting(), zero)
        self.meta_model, self.whole = self.cut.meta_model, self.cut.whole  # whole: a model cut by its units
        self.balance, self.ranges = self.cut.balance, self.cut.ranges
        self.ticks = action_ticks(self.schedule)
        self.number = next(_numbers)
        self.id = f"pipe{self.number}"
        self.pipelines = mesh.groups("pp")  # one list of ranks per replica (and tp slice), in pipeline-rank order
        self.ranks = sorted(r for ranks in self.pipelines for r in ranks)
        self.transport = self._transport(transport)
        self._shapes: dict = {}
        self.last_results: list[dict] = []
        self.recent: deque[Timeline] = deque(maxlen=RECENT_STEPS)  # measured (work) timelines of the last steps
        self.history: deque[Timeline] = deque(maxlen=HISTORY_STEPS)  # the same, further back: export_trace's
        self.loss: float | None = None
        self.view = None  # a PipelineView, once widget() was called: steps then update it live
        self.unfinished = False  # a step began and has not been recorded (interrupted, or a stepper left midway)
        if self.transport == "torch":
            check_nccl(self.schedule)  # the torch transport matches messages in order, as NCCL does
            self.cluster.run(pairs.connect, self.id, mesh)  # every rank: making groups is collective
        pipedream_lr = lr if self.schedule.name == "pipedream" else None
        self.cut.check_tp_plan(tp_plan)
        self.cluster.run_each(on_ranks.setup, {r: (self._spec(r, self.cut.model, optimizer, pipedream_lr),) for r in self.ranks})

    # -- set-up ---------------------------------------------------------------------------------------------------

    def _transport(self, transport: str) -> str:
        """"auto" -> "mpi" when every rank of the pipeline computes on CPU, else "torch"; checked here, in one line,
        rather than on every rank."""
        one_of(transport, TRANSPORTS, "transport")
        on_gpu = [r for r in self.ranks if not self.cluster.devices[r].startswith("cpu")]
        if transport == "mpi" and on_gpu:
            raise DistUsageError(f"transport='mpi' moves CPU tensors only, but rank {on_gpu[0]} computes on "
                                 f"{self.cluster.devices[on_gpu[0]]}: use transport='torch' (or 'auto')")
        if transport == "auto":
            return "torch" if on_gpu else "mpi"
        return transport

    def _spec(self, rank: int, model, optimizer, pipedream_lr) -> StageSpec:
        coords = self.mesh.coords(rank)
        pipeline_rank = coords["pp"]
        layers = {s: self.ranges[s] for s in self.schedule.stages_of(pipeline_rank)}
        if isinstance(model, nn.Sequential):
            model = {s: nn.Sequential(*list(model)[a:b]) for s, (a, b) in layers.items()}
        elif not isinstance(model, nn.Module):
            model = portable(model)
        return StageSpec(
            name=self.id, number=self.number, mesh=self.mesh.name, replicas=self.replicas,
            pipeline_rank=pipeline_rank, pipeline_ranks=self.schedule.ranks,
            program=tuple(self.schedule.actions[pipeline_rank]), ticks=tuple(self.ticks[pipeline_rank]),
            stages=self.schedule.stages, microbatches=self.schedule.microbatches, layers=layers, model=model,
            transport=self.transport, optimizer=portable(optimizer), pipedream_lr=pipedream_lr,
            tp_plan=None if self.tp_plan is None else {s: self.tp_plan[s] for s in layers}, zero=self.zero,
            units=None if self.whole is None else tuple(self.cut.units),
            tied=tuple(tuple(g) for g in self.cut.tied), sync_batchnorm=self.cut.cutting.sync_batchnorm,
        )

    def message_shapes(self, inputs) -> dict:
        """stage -> (shape, dtype) of its output for one micro-batch, found on the meta device (no compute); for a
        model cut by its units, by running the kernel's copy once on one micro-batch, which also proves the cuts
        (pipeline_parallel/split.py)."""
        if self.whole is not None:
            return self.cut.message_shapes(inputs, self.replicas * self.schedule.microbatches)
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._shapes:
            per_microbatch = inputs.shape[0] // (self.replicas * self.schedule.microbatches)
            x = torch.empty((per_microbatch, *inputs.shape[1:]), dtype=inputs.dtype, device="meta")
            shapes = {}
            with torch.no_grad():
                for stage, (a, b) in enumerate(self.ranges):
                    for layer in list(self.meta_model)[a:b]:
                        x = layer(x)
                    shapes[stage] = (tuple(x.shape), x.dtype)
            self._shapes[key] = shapes
        return self._shapes[key]

    def _check_batch(self, inputs, targets, loss_fn) -> None:
        check_batch(inputs, targets, self.replicas, self.schedule.microbatches)
        if loss_fn is None and self.whole is None:
            raise DistUsageError("loss_fn=None trains on the loss the model's output carries, but a Sequential's "
                                 "output is a tensor: give loss_fn(output, targets)")
        if self.whole is None and not isinstance(inputs, torch.Tensor):
            raise DistUsageError(f"a Sequential's pipeline takes its inputs as one tensor, got {type(inputs).__name__}")
        check_step_inputs(self.meta_model, inputs, loss_fn)

    # -- the interface a step's driver uses (step() here, the Stepper) ----------------------------------------------

    def begin_step(self) -> None:
        """Before a step's first message: a step abandoned on the torch transport may have left receives posted
        that nothing can cancel (they would take this step's messages, which match in order): new pair groups."""
        if self.unfinished and self.transport == "torch":
            self.cluster.run(pairs.connect, self.id, self.mesh)
        self.unfinished = True

    def step_args(self, inputs, targets, loss_fn, *extra) -> dict:
        """rank -> what it receives to begin a step: each replica its share of the global batch, and within it the
        first stage the inputs, the last stage the targets (nothing else crosses the network)."""
        self.cluster.check_fresh(self.mesh.generation, f"pipeline {self.id}")
        self._check_batch(inputs, targets, loss_fn)
        shapes = self.message_shapes(inputs)
        inputs_of = batches.split(inputs, self.replicas)
        targets_of = targets.chunk(self.replicas) if targets is not None else [None] * self.replicas
        last = self.schedule.rank_of(self.schedule.stages - 1)
        loss_fn = portable(loss_fn)
        args = {}
        for ranks in self.pipelines:
            replica = self.mesh.coords(ranks[0]).get("dp", 0)  # the tp slices of a replica get the same share
            for pipeline_rank, rank in enumerate(ranks):
                # a pruned stage runs the model's forward from the top: every stage takes the inputs
                x = inputs_of[replica] if pipeline_rank == 0 or self.whole is not None else None
                y = targets_of[replica] if pipeline_rank == last else None
                args[rank] = (self.id, shapes, x, y, loss_fn, *extra)
        return args

    def live(self, reports_of=None, tick_state_of=None):
        """(publish interval, progress callback) while a view is attached, else (None, None).

        The ranks publish their spans so far; `reports_of(published)` merges them with what earlier calls reported
        (a Stepper's), so the view draws the whole step's work timeline as it grows."""
        if self.view is None:
            return None, None

        def progress(ar) -> None:
            published = {d["rank"]: d for d in ar.data if isinstance(d, dict) and "spans" in d}
            if published:
                reports = reports_of(published) if reports_of else published
                self.view.refresh(self.measured_timeline(reports, stepped=reports_of is not None), final=False,
                                  tick_state=tick_state_of() if tick_state_of else None)

        return LIVE_PUBLISH_SECONDS, progress

    def measured_timeline(self, reports: dict, stepped: bool) -> Timeline:
        """The step the ranks reported (rank -> report) as a Timeline; a stepped one without its pauses."""
        kind = "measured work, pauses between calls removed" if stepped else "measured"
        several = len(self.pipelines) > 1  # replicas (dp), tensor slices (tp), or both
        return work_timeline(reports, name=f"{self.schedule.name} ({kind})",
                             pipelines=self.pipelines if several else (),
                             pipeline_names=self.pipeline_names() if several else ())

    def pipeline_names(self) -> list[str]:
        """'replica 1' with data parallelism alone; 'dp 0, tp 1' once tensor slices run pipelines too."""
        sliced = "tp" in self.mesh.names and self.mesh.dim_size("tp") > 1
        names = []
        for ranks in self.pipelines:
            coords = self.mesh.coords(ranks[0])
            dp = coords.get("dp", 0)
            names.append(f"dp {dp}, tp {coords['tp']}" if sliced else f"replica {dp}")
        return names

    def record(self, results: list[dict], timeline: Timeline, tick_state=None) -> float:
        """Keep a finished step (its reports and timeline) and return its loss: the mean over the replicas of the
        mean over their micro-batches (equal shards, so the loss of the whole batch)."""
        self.unfinished = False
        self.last_results = results
        self.recent.append(timeline)
        self.history.append(timeline)
        losses = [r["loss"] for r in results if r["loss"] is not None]
        self.loss = sum(losses) / len(losses)
        if self.view is not None:
            self.view.refresh(timeline, final=True, tick_state=tick_state, throttle=tick_state is None)
        return self.loss

    # -- running ------------------------------------------------------------------------------------------------

    def step(self, inputs, targets: torch.Tensor | None = None, loss_fn: Callable | None = None,
             timeout: float | None = None, memory: bool = False):
        """One training step (forward and backward of every micro-batch on every replica, gradients averaged over
        the replicas, then the optimizer if given) at full speed; returns the loss of the whole batch, and keeps
        the measured timeline in `.timeline`. `memory=True` also measures the bytes each rank holds
        (measured_memory())."""
        publish_every, progress = self.live()
        args = self.step_args(inputs, targets, loss_fn, publish_every, memory)
        self.begin_step()
        results = self.cluster.run_each(on_ranks.step, args, timeout=timeout, progress=progress)
        if memory:
            self.memory_results = results
        return self.record(results, self.measured_timeline({r["rank"]: r for r in results}, stepped=False))

    def measured_memory(self) -> list[dict]:
        """Per rank, the bytes it held in the last step run with memory=True: its stages' params, grads, optimizer
        state (counted by storage: a tensor slice's own part) and the peak of activations saved for backward."""
        results = getattr(self, "memory_results", None)
        if not results:
            raise DistUsageError("no step measured memory yet: run step(..., memory=True)")
        return [{"rank": r["rank"], **r["memory"]} for r in sorted(results, key=lambda r: r["rank"])]

    def step_seconds(self) -> float:
        """The last step's time: first rank's start to last rank's end (the ranks share one host clock)."""
        if not self.recent:
            raise DistUsageError("no step measured yet: run step(...)")
        return self.recent[-1].end - self.recent[-1].start

    def side_by_side(self) -> list[dict]:
        """Per rank, the plan's prediction beside the measurement (a pipeline built by nbdist.shard(...).apply())."""
        plan = getattr(self, "plan", None)
        if plan is None:
            raise DistUsageError("this pipeline was not built from a plan: nbdist.shard(..., pp=N).apply() makes "
                                 "one whose side_by_side() compares with the plan's prediction")
        return plan.side_by_side(self)

    def widget(self):
        """A live view (measured Gantt, the ideal beneath, busy/idle, bubble); later steps update it as they run."""
        from nbdist.pipeline_parallel.view import PipelineView

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
        durations = measured_durations(self.duration_sources(current), self.schedule.stages, self.schedule.chunks)
        if durations is None:
            raise DistUsageError("no step has a complete forward and backward to measure yet")
        ideal = self.schedule.simulate(**durations)
        ideal.unit = "s"
        ideal.name = f"{self.schedule.name} (ideal)"
        return ideal

    def bubbles(self, timeline: Timeline | None = None):
        """Where the last step's idle time came from, by rank and cause (warm-up / cool-down, stage imbalance,
        transfer, waiting on a late peer, host overhead), and the change that would save the most with its predicted
        step time (debugging/bubbles.py). `timeline`: another measured step of this pipeline (a Stepper's)."""
        from nbdist.debugging.bubbles import decompose

        return decompose(timeline if timeline is not None else self.timeline, self.schedule)

    def export_trace(self, path, steps: int | slice | None = None, ranks: list[int] | None = None):
        """Save measured steps as a Chrome / Perfetto trace (open it in https://ui.perfetto.dev): one track per
        rank, each idle stretch named by its cause, each step's bubble breakdown beside (debugging/trace.py).
        `steps`: the last N steps (an int) or a slice of the kept steps (the last HISTORY_STEPS; default: all);
        `ranks`: some ranks only (default: every rank). Returns the file's path."""
        from nbdist.debugging import trace

        kept = list(self.history)
        chosen = kept[-steps:] if isinstance(steps, int) else kept[steps] if isinstance(steps, slice) else kept
        if not chosen:
            raise DistUsageError("no measured step to export: run step() or a stepper first" if not kept else
                                 f"steps={steps!r} chooses none of the {len(kept)} kept steps")
        unknown = sorted(set(ranks or ()) - set(self.ranks))
        if unknown:
            raise DistUsageError(f"ranks {unknown} are not ranks of this pipeline (its ranks: {self.ranks})")
        return trace.write(path, chosen, self.schedule, ranks)

    def duration_sources(self, current: Timeline | None = None) -> list[Timeline]:
        """The timelines the ideal's medians are taken over: the recent steps, and a step in progress."""
        recent = list(self.recent)
        if current is not None and current is not (recent[-1] if recent else None) and any(current.spans.values()):
            recent = recent[1:] if len(recent) == RECENT_STEPS else recent
            recent.append(current)
        return recent

    def stepper(self, inputs, targets: torch.Tensor | None = None, loss_fn: Callable | None = None):
        """Run the next step tick by tick (see pipeline_parallel/stepper.py)."""
        from nbdist.pipeline_parallel.stepper import Stepper

        return Stepper(self, inputs, targets, loss_fn)

    # -- gathering ----------------------------------------------------------------------------------------------

    def _gather(self, grads: bool) -> dict:
        """The replicas hold equal copies (the gradients averaged, the same optimizer step): read replica 0's. Under
        ZeRO-2/3 they hold shards, which every replica helps gather (each then returns the same whole tensors)."""
        self.cluster.check_fresh(self.mesh.generation, f"pipeline {self.id}")
        first = [ranks for ranks in self.pipelines if self.mesh.coords(ranks[0]).get("dp", 0) == 0 or self.zero >= 2]
        per_rank = self.cluster.run(on_ranks.parameters, self.id, grads, ranks=sorted(r for g in first for r in g))
        per_rank = [tensors for tensors in per_rank if tensors is not None]  # a tp slice gathers, its first keeps
        if self.whole is not None:  # pruned stages hold the model's own names (under "model.")
            return self.cut.gathered(per_rank, grads)
        out = {
            unsplit_key(self.ranges[stage][0], key): value
            for stage_tensors in per_rank
            for stage, tensors in stage_tensors.items()
            for key, value in tensors.items()
        }
        return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split(".")[0]), kv[0])))

    def close(self) -> None:
        """Free the stage modules on the engines."""
        if self.cluster.running and self.cluster.generation == self.mesh.generation:
            self.cluster.run(on_ranks.close, self.id, ranks=self.ranks)

    def __repr__(self) -> str:
        replicas = f" × {self.replicas} replicas (dp)" if self.replicas > 1 else ""
        return (f"<Pipeline {self.schedule.name}: {self.schedule.ranks} ranks × {self.schedule.chunks} chunk(s)"
                f"{replicas}, {self.schedule.microbatches} micro-batches, layers per stage {self.balance}>")


def _schedule(schedule: str | Schedule, ranks: int, microbatches: int, chunks: int) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.ranks != ranks:
            raise DistUsageError(f"the schedule is for {schedule.ranks} ranks, not {ranks} pipeline stages")
        return schedule
    return build(schedule, ranks, microbatches, chunks)
