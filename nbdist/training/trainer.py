"""nbdist.Trainer: full training from the notebook, the loop on the ranks, watched live, stoppable, resumable.

    tr = nbdist.Trainer(lambda: models.gpt(layers=4), lambda: data.text_dataset(seq=64), models.lm_loss,
                        lambda params: torch.optim.Adam(params, lr=1e-3), plan={"dp": 2}, batch_size=32,
                        checkpoint_dir="ckpt", checkpoint_every=50)
    tr.fit(steps=200)     # progress bar and dashboard; the stop button stops every rank at a step boundary
    tr.save(); tr.state_dict(); tr.step
    tr = nbdist.Trainer(...same...).resume("ckpt")   # after %dist_restart, on any engine count

The ranks run the loop (nbdist/training/ranks/training.py), read their own batches and checkpoint with DCP
(nbdist/training/ranks/checkpoint.py); this side builds the plan, sends one call per `fit`, draws what the ranks publish
(nbdist/training/dashboard.py) and keeps the history: one record per step with the loss, the learning rate and,
per rank, the step's compute, communication and idle seconds.
"""
from __future__ import annotations

import itertools
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from nbdist.cluster.api import Cluster, current
from nbdist.errors import DistError, DistInterrupt, DistUsageError
from nbdist.layout import Layout
from nbdist.training import checkpoints, inputs, samples
from nbdist.training import options as options_of
from nbdist.training.history import History
from nbdist.training.live import DashboardOnceSent, open_dashboard, shown
from nbdist.training.pipeline_steps import PipelineSteps
from nbdist.training.ranks import inputs as rank_inputs
from nbdist.training.ranks import training as on_ranks
from nbdist.training.replies import Failure
from nbdist.training.spec import Checkpointing, Data, Optimization, Telemetry, TrainSpec, WholeReplicas
from nbdist.wire import portable

if TYPE_CHECKING:
    from nbdist.sharding.plan import Plan

_numbers = itertools.count()


class NonFiniteLoss(DistError):
    """The loss was NaN or infinite at a step (on_nonfinite="stop"): the message names the step, the ranks, where
    the fit stopped and what the weights hold; the history keeps every step up to there."""


@dataclass(frozen=True)
class _Built:
    """What a trainer has on the ranks once something needed it (Trainer._built)."""

    model: Any  # the plan's Sharded model or Pipeline; None for whole replicas (the asynchronous modes)
    mesh: Any
    spec: TrainSpec
    dataset_length: int | None  # None: an iterable data set
    pipeline_steps: PipelineSteps | None


class Trainer:
    """A training run on the cluster (see the module docstring).

    Each option is given once: as one object per concern (nbdist.training.spec), or as keywords, each routed to
    its concern's object (training/options.py: the objects' field names; both for one concern is refused):
    - layout, `plan`: None (data parallel over every engine), a Layout or a dict of nbdist.shard's choices (dp,
      tp, zero, ...), or a Plan; a pipeline (pp > 1) given no micro-batches gets a valid count of its own
      (options.microbatches: about 2·pp);
    - `data=Data(batch_size=64, seed=0, eval_data_fn=None, eval_every=None, eval_batches=4)`;
    - `optimization=Optimization(precision="fp32", grad_accum=1, clip=None, lr_schedule=None, sync="allreduce",
      sync_options={}, on_nonfinite="stop", zero3_sync="every")`: `sync` "allreduce" (the plan's synchronous
      gradients), "local-sgd", "easgd" or "ssp" (whole replicas; `sync_options` e.g. {"period": 4}); `on_nonfinite`
      what a NaN or infinite loss does: "stop" the fit (NonFiniteLoss, one line naming the step and the ranks),
      "warn" or "ignore"; `zero3_sync="last"`: ZeRO-3 reduce-scatters once per step of grad_accum micro-batches;
    - `checkpointing=Checkpointing(dir=None, every=None, asynchronous=False)`: as keywords these three keep their
      older names, checkpoint_dir, checkpoint_every and async_checkpoint (options.ALIASES);
    - `telemetry=Telemetry(live=True, tensorboard=None, trace=None, straggler={})`: `live` the dashboard in a
      notebook (True), none (False), or drawn even outside a notebook ("always": for measuring it);
      `straggler={rank: seconds}` slows a rank by that much per step (for teaching).

    Making a Trainer checks all this and plans the layout in the kernel, and builds nothing on the ranks: it asks
    rank 0 only what a check needs and rank 0 tells cheaply (the data's first samples, where the plan of a model
    that is not a Sequential is made on them or a pipeline's evaluation samples are compared with them; with
    sync="ssp", the optimizer's class, which its warning names). The ranks build the model, the mesh and their side
    of the loop at the first call that needs them (fit, resume, save, state_dict, tensor_devices, .model, .mesh,
    .spec, .dataset_length, .pipeline_steps): what only they can judge (a data set on every rank, the optimizer on
    the model) is said there, in one line, and a failed build leaves nothing on them."""

    def __init__(self, model_fn: Callable, data_fn: Callable, loss_fn: Callable | None, optimizer_fn: Callable,
                 plan: Layout | dict | Plan | None = None, *, cluster: Cluster | None = None, data: Data | None = None,
                 optimization: Optimization | None = None, checkpointing: Checkpointing | None = None,
                 telemetry: Telemetry | None = None, **options: Any):
        groups = options_of.grouped({"data": data, "optimization": optimization, "checkpointing": checkpointing,
                                     "telemetry": telemetry}, options)
        self.cluster = cluster or current()
        self.data, self.optimization = groups["data"], groups["optimization"]
        self.checkpointing, self.telemetry = groups["checkpointing"], groups["telemetry"]
        d, o, c = self.data, self.optimization, self.checkpointing
        inputs.check_functions(model_fn=model_fn, data_fn=data_fn, loss_fn=loss_fn, optimizer_fn=optimizer_fn,
                               lr_schedule=o.lr_schedule, eval_data_fn=d.eval_data_fn)
        options_of.check(d, o, c, self.cluster.world_size)
        inputs.check_telemetry(self.telemetry.live, self.telemetry.straggler, self.cluster.world_size)
        if c.dir:
            c = self.checkpointing = replace(c, dir=checkpoints.writable(c.dir))  # one line if it cannot be
        self.id = f"train{next(_numbers)}"
        self.model_fn, self.data_fn, self.loss_fn, self.optimizer_fn = model_fn, data_fn, loss_fn, optimizer_fn
        self._example, self._build, self._closed = None, None, False
        self.plan = self._plan(model_fn, options_of.with_zero3_sync(plan, o), o.grad_accum, o.sync)
        self.replicas = self.plan.dp if self.plan is not None else self.cluster.world_size
        parts = self.plan.microbatches if self.plan is not None else o.grad_accum
        if d.batch_size % (self.replicas * parts):
            raise DistUsageError(f"batch_size {d.batch_size} must divide evenly over {self.replicas} replica(s) × "
                                 f"{parts} micro-batch(es)")
        if o.sync == "ssp":  # its warning names the optimizer's class, which only the ranks make (torch._dynamo)
            tried = self.cluster.run(rank_inputs.prepare, d.seed, portable(optimizer_fn), ranks=[0])[0]
            if tried.problem:
                raise DistUsageError(tried.problem)
            samples.say_what_ssp_trains(o.sync, tried.optimizer)
        if self.pipelined and d.eval_every:  # the training sample is the build's anyway
            samples.check_evaluated_like_trained(self, d.eval_data_fn, loss_fn)
        self.history = History()
        self.stopped = False

    def _plan(self, model_fn, plan, grad_accum: int, sync: str):
        """The Plan of this run (checked in the kernel; nothing built yet), or None for the asynchronous modes."""
        from nbdist.sharding.plan import Plan, shard
        from nbdist.sharding.reading import FromData

        world = self.cluster.world_size
        if isinstance(plan, Layout):  # the same choices as a dict of nbdist.shard's keywords
            plan = {f.name: getattr(plan, f.name) for f in fields(plan) if getattr(plan, f.name) != f.default}
        if sync != "allreduce":
            if plan is not None and not (isinstance(plan, dict) and set(plan) <= {"dp"}):
                raise DistUsageError(f"sync={sync!r} trains whole replicas: give plan=None (or {{'dp': {world}}}), "
                                     "not tensor, pipeline or ZeRO sharding")
            return None
        # a model that is not a Sequential is profiled on the data's own samples (where the plan gives none); a
        # Sequential's input is made as before, so a sample it cannot take is said as the ranks say it
        example = {"example_input": FromData(lambda: self.example[0])}
        if plan is None:
            return shard(model_fn, dp=world, microbatches=grad_accum, cluster=self.cluster, **example)
        if isinstance(plan, dict):
            parts = options_of.microbatches(plan, grad_accum, self.data.batch_size)
            return shard(model_fn, **{"microbatches": parts, **example, **plan}, cluster=self.cluster)
        if not isinstance(plan, Plan):
            raise DistUsageError(f"plan must be None, a Layout, a dict of nbdist.shard's choices or a Plan, got "
                                 f"{type(plan).__name__}")
        if grad_accum != 1 and plan.microbatches != grad_accum:
            raise DistUsageError(f"grad_accum={grad_accum} but the plan has microbatches={plan.microbatches}: give "
                                 "it in one place")
        return plan

    @property
    def pipelined(self) -> bool:
        return self.plan is not None and self.plan.pp > 1

    # -- built on the ranks at first need -----------------------------------------------------------------------

    model = property(lambda self: self._built().model, doc="The plan's model on the ranks (None: whole replicas).")
    mesh = property(lambda self: self._built().mesh, doc="The mesh the run trains over.")
    spec = property(lambda self: self._built().spec, doc="What every rank was given to run its loop.")
    dataset_length = property(lambda self: self._built().dataset_length, doc="Samples (None: an iterable).")
    pipeline_steps = property(lambda self: self._built().pipeline_steps,
                              doc="The pipeline's reported steps, what bubbles() explains (None: no pipeline).")

    def _built(self) -> _Built:
        """The ranks' side of this run, built by the first call that needs it. A build that fails leaves nothing
        on the ranks (the next call tries again)."""
        if self._closed:
            raise DistUsageError(f"Trainer {self.id} is closed (close() freed it on the ranks): make a new Trainer")
        if self._build is None:
            self._build = self._build_on_ranks()
        return self._build

    def _build_on_ranks(self) -> _Built:
        d, o = self.data, self.optimization
        prepared = self.cluster.run(rank_inputs.prepare, d.seed, portable(self.optimizer_fn))
        said = next((p.problem for p in prepared if p.problem), None)
        if said:  # optimizer_fn, tried on the ranks (building an optimizer here would import torch._dynamo)
            raise DistUsageError(said)
        model = self.plan.apply(self.optimizer_fn) if self.plan is not None else None
        try:
            mesh = model.mesh if model is not None else self.cluster.mesh(dp=self.replicas)
            pipeline = ({"shapes": samples.pipeline_shapes(self, model, self.data_fn, self.loss_fn, d.batch_size,
                                                           o.precision)} if self.pipelined else {})
            whole = (WholeReplicas(portable(self.model_fn), portable(self.optimizer_fn)) if self.plan is None
                     else None)
            spec = TrainSpec(
                name=self.id, mesh=mesh.name, model=model.id if model else None,
                replicas=self.replicas, data_fn=portable(self.data_fn), loss=portable(self.loss_fn),
                data=replace(d, eval_data_fn=portable(d.eval_data_fn)),
                optimization=replace(o, lr_schedule=portable(o.lr_schedule)),
                checkpointing=self.checkpointing, straggler=self.telemetry.straggler,
                whole_replicas=whole, pipeline=pipeline)
            infos = self.cluster.run(on_ranks.setup, spec)
            said = inputs.failure_line({r.rank: Failure(r.problem) for r in infos if r.problem is not None})
            refused, warning = inputs.optimizer_lines(infos) if not said else (None, None)
            if said or refused:  # the inputs do not fit (the same line on every rank): nothing is left on the ranks
                self.cluster.run(on_ranks.close, self.id)
                raise DistUsageError(said or refused)
            if warning:  # before the first step: the parameters it names would never change
                sys.stderr.write(f"warning: {warning}\n")
        except BaseException:
            _close(model, self.cluster)  # the plan's model was built on the ranks: free it with the failed build
            raise
        return _Built(model, mesh, spec, infos[0].length, PipelineSteps(model) if self.pipelined else None)

    def _unbuild(self) -> None:
        """Free what the ranks hold for this run; a later need builds it anew."""
        built, self._build = self._build, None
        if built is not None and self.cluster.running:
            self.cluster.run(on_ranks.close, self.id)
            _close(built.model, self.cluster)

    @property
    def example(self):
        """The data set's first two samples as the loop batches them, (inputs, targets or None), read on rank 0 when
        first needed (a model that is not a Sequential is profiled on them; a pipeline sizes its messages by them)."""
        if self._example is None:
            self._example = samples.read(self.cluster, self.data_fn, "data_fn", self.loss_fn, self.data.batch_size)
        return self._example

    # -- the run ----------------------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps done (also after a resume: the checkpoint's step)."""
        return self.history.step

    def fit(self, steps: int | None = None, epochs: float | None = None, wait: bool = True):
        """Train `steps` more steps (or `epochs` passes over the data set); returns the whole history (one record
        per step). In a notebook a dashboard shows it live; the stop button stops every rank after the step it is
        in (model and optimizer kept: call fit again to go on).

        wait=False: training goes on in the background and the notebook stays free (the cluster itself is busy
        until it ends); returns a TrainingRun: `.stop()`, `.wait() -> history`, `.running`."""
        steps = inputs.steps_of(steps, epochs, lambda: self.dataset_length, self.data.batch_size)
        inputs.check_lr_schedule(self.optimization.lr_schedule, self.step, steps)
        self._built()  # here, not in a background fit's thread
        live = self.telemetry.live
        if not (live and shown(always=live == "always")):
            return self._train(steps, None) if wait else TrainingRun(self, steps, None)
        if wait:  # the dashboard is opened once the ranks have their work (training/live.py)
            return self._train(steps, DashboardOnceSent(self, steps))
        return TrainingRun(self, steps, open_dashboard(self, steps))

    def _train(self, steps: int, view, background: bool = False) -> list[dict]:
        publish_every = on_ranks.PUBLISH_SECONDS if view is not None else None
        args = {rank: (self.id, steps, publish_every) for rank in range(self.cluster.world_size)}
        with _graceful_stop(self) as stop:
            try:
                results = self.cluster.run_each(on_ranks.fit, args, progress=view.progress if view else None)
            except DistInterrupt:
                if not stop.asked:
                    raise
                results = self.cluster.run(on_ranks.records, self.id, self.step)
        for result in results:
            self.history.add(result.records)
            if self.pipeline_steps is not None:
                self.pipeline_steps.add(result.rank, result.pipeline_step)
        self.stopped = any(r.stopped for r in results) or stop.asked
        if view is not None:
            view.close(self.history, summary=not background)
        self._export()
        failed = inputs.failure_line({r.rank: r.failure for r in results if r.failure is not None})
        if failed:  # the first step failed on the inputs, the same on every rank
            raise DistUsageError(failed)
        policy = self.optimization.on_nonfinite
        said = inputs.nonfinite_line(results, policy)
        if said and policy == "stop":
            raise NonFiniteLoss(said)
        if said:
            sys.stderr.write(f"warning: {said}\n")
        said = inputs.nonfinite_eval_line(results) if policy != "ignore" else None
        if said:  # the weights trained on finite losses: worth a line, not stopping the fit
            sys.stderr.write(f"warning: {said}\n")
        if self.stopped and not background:
            print(f"stopped after step {self.step - 1} (every rank at the same step boundary); fit() goes on from step "
                  f"{self.step}")
        return self.history.records

    def bubbles(self, step: int | None = None):
        """Where a pipeline step's idle time came from (default: the newest step every rank reported; the last
        few are kept): by rank and cause, with the change that would save the most (debugging/bubbles.py)."""
        if not self.pipelined:
            raise DistUsageError("bubbles() explains pipeline steps: this trainer's plan has no pipeline (pp = 1)")
        if self._build is None:
            raise DistUsageError("no pipeline step reported by every rank yet: train first (fit)")
        return self.pipeline_steps.breakdown(step)

    def request_stop(self) -> None:
        """Ask every rank to stop after the step it is in (what the stop button does while fit waits)."""
        for rank in range(self.cluster.world_size):  # on every host (Cluster.signal_rank)
            self.cluster.signal_rank(rank, on_ranks.STOP_SIGNAL)

    def _export(self) -> None:
        t = self.telemetry
        if t.tensorboard:
            self.history.to_tensorboard(t.tensorboard)
        if t.trace:
            self.history.to_chrome_trace(t.trace)

    # -- checkpoints ------------------------------------------------------------------------------------------

    def save(self, directory: str | None = None, asynchronous: bool = False) -> str:
        """Write a checkpoint of this step now (into `directory` or the checkpoint_dir); returns its folder once
        it is complete (`asynchronous`: written by DCP's async_save, as the periodic ones with async_checkpoint)."""
        directory = os.path.abspath(directory) if directory else self.checkpointing.dir
        if directory is None:
            raise DistUsageError("save() needs a folder: give save(directory) or Trainer(checkpoint_dir=...)")
        directory = checkpoints.writable(directory)
        self._built()
        return self.cluster.run(on_ranks.save, self.id, directory, asynchronous)[0]

    def resume(self, path: str | None = None) -> "Trainer":
        """Load a checkpoint (a step_* folder, or a checkpoint folder: its newest complete checkpoint) into this
        trainer's model and optimizer, on any engine count or plan; training goes on from its step. Where this is
        the first need of the ranks' side and the checkpoint does not load, what was built for it is freed."""
        path = checkpoints.find(path or self.checkpointing.dir)
        first = self._build is None
        self._built()
        try:
            loaded = self.cluster.run(on_ranks.load, self.id, path)
            problems = [f"rank {rank}: {r.problem}" for rank, r in enumerate(loaded) if r.problem is not None]
        except Exception as e:  # noqa: BLE001 - what the ranks raised, said as the checkpoint's problem
            said = checkpoints.unreadable(path, e)
        else:
            said = checkpoints.unreadable(path, "; ".join(problems)) if problems else None
        if said is not None:
            if first:
                self._unbuild()
            raise DistUsageError(said) from None
        step = loaded[0].step
        self.history.truncate(step)
        return self

    # -- results ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The model's parameters and buffers gathered into the notebook under the unsplit model's keys (the
        asynchronous modes first bring the replicas to one model)."""
        if self.model is not None:  # the plan's model (sharded or pipeline) gathers itself
            return self.model.state_dict()
        self.cluster.run(on_ranks.finish, self.id)
        return next(t for t in self.cluster.run(on_ranks.tensors, self.id) if t is not None)

    def tensor_devices(self) -> dict[int, list[str]]:
        """Per rank, the devices its model and optimizer state lie on: `[cluster.devices[rank]]` where every
        tensor is on the engine's own device (its GPU, or the CPU), which is what `%dist_status` shows."""
        self._built()
        return dict(enumerate(self.cluster.run(on_ranks.tensor_devices, self.id)))

    def close(self) -> None:
        """Free what the trainer holds on the ranks (model, optimizer, data set); it trains no more."""
        self._unbuild()
        self._closed = True

    def describe(self) -> str:
        """What it trains: the plan, or the sync mode and its replicas (a dashboard's subtitle, its repr)."""
        if self.plan is not None:
            return self.plan.describe()
        return f"{self.optimization.sync} over {self.replicas} replicas"

    def __repr__(self) -> str:
        return f"<nbdist Trainer {self.id}: {self.describe()}; step {self.step}>"


Trainer.__signature__ = options_of.signature(Trainer.__init__)  # every option by name, for help() and tooltips


def _close(model, cluster: Cluster) -> None:
    """Free a plan's model on the ranks (None: whole replicas, freed with the trainer)."""
    if model is not None and cluster.running:
        try:
            model.close()
        except DistUsageError:  # the engines are gone (a dead rank): nothing is left to free
            pass


class _graceful_stop:
    """While fit waits: the first SIGINT (the notebook's stop button) asks every rank to stop at the next step
    boundary (training/ranks/training.STOP_SIGNAL); a second one interrupts as usual (frees any wait, see
    remote.Waiter)."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.asked, self.previous = trainer, False, None

    def __enter__(self) -> "_graceful_stop":
        import threading

        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._ask)
        return self

    def _ask(self, *_):
        if self.asked:
            signal.signal(signal.SIGINT, self.previous or signal.default_int_handler)
            raise KeyboardInterrupt
        self.asked = True
        self.trainer.request_stop()
        sys.stderr.write("stopping every rank at the next step boundary (press stop again to interrupt now)\n")

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class TrainingRun:
    """A fit running in the background (Trainer.fit(wait=False)): the notebook stays free; the cluster refuses other
    work until the run ends (`wait()` or `stop()` first)."""

    def __init__(self, trainer: Trainer, steps: int, view):
        import threading

        self.trainer, self.view, self.error, self.history = trainer, view, None, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(steps, view), daemon=True,
                                        name=f"nbdist-{trainer.id}")
        trainer.cluster.reserve(self._thread, f"{trainer.id} is training in the background")
        self._thread.start()

    def _run(self, steps: int, view) -> None:
        try:
            self.history = self.trainer._train(steps, view, background=True)
        except BaseException as e:  # noqa: BLE001 - given to whoever waits
            self.error = e
        finally:
            self.trainer.cluster.release(self._thread)
            self._done.set()

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def stop(self) -> list[dict]:
        """Stop every rank at the next step boundary; returns the history once they have."""
        self.trainer.request_stop()
        return self.wait()

    def wait(self, timeout: float | None = None) -> list[dict]:
        if not self._done.wait(timeout):
            raise DistUsageError(f"the training run is still going after {timeout:g} s (stop() ends it)")
        if self.error is not None:
            raise self.error
        return self.history

    def __repr__(self) -> str:
        state = "running" if self.running else ("failed" if self.error else "done")
        return f"<nbdist TrainingRun of {self.trainer.id}: {state}, step {self.trainer.step}>"
