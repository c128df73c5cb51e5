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
from dataclasses import fields, replace
from typing import Callable

from nbdist.checks import one_of, whole_number
from nbdist.cluster.api import Cluster, current
from nbdist.errors import DistError, DistInterrupt, DistUsageError
from nbdist.layout import Layout
from nbdist.training import checkpoints, inputs, samples
from nbdist.training.history import History
from nbdist.training.live import DashboardOnceSent, open_dashboard, shown
from nbdist.training.pipeline_steps import PipelineSteps
from nbdist.training.ranks import inputs as rank_inputs
from nbdist.training.ranks import training as on_ranks
from nbdist.training.spec import (
    NONFINITE,
    PRECISIONS,
    SYNC_KINDS,
    Checkpointing,
    Data,
    Optimization,
    Telemetry,
    TrainSpec,
    WholeReplicas,
)
from nbdist.wire import portable

_numbers = itertools.count()


class NonFiniteLoss(DistError):
    """The loss was NaN or infinite at a step (on_nonfinite="stop"): the message names the step, the ranks, where
    the fit stopped and what the weights hold; the history keeps every step up to there."""


class Trainer:
    """A training run on the cluster (see the module docstring). Its options, by concern (each as keywords, or as
    one object: nbdist.training.spec):
    - layout, `plan`: None (data parallel over every engine), a Layout or a dict of nbdist.shard's choices (dp,
      tp, zero, ...), or a Plan;
    - `data=Data(batch_size, seed, eval_data_fn, eval_every, eval_batches)`;
    - `optimization=Optimization(precision, grad_accum, clip, lr_schedule, sync, sync_options, on_nonfinite)`:
      `sync` "allreduce" (the plan's own synchronous gradients), "local-sgd", "easgd" or "ssp" (each replica a
      whole model; `sync_options` e.g. {"period": 4}); `on_nonfinite` what a NaN or infinite loss does: "stop"
      the fit after that step (NonFiniteLoss, one line naming the step and the ranks), "warn" (one line, training
      goes on) or "ignore";
    - `checkpointing=Checkpointing(dir, every, asynchronous)` (keywords checkpoint_dir, checkpoint_every,
      async_checkpoint);
    - `telemetry=Telemetry(live, tensorboard, trace, straggler)`: `live` the dashboard in a notebook (True), none
      (False), or drawn even outside a notebook ("always": for measuring it); `straggler={rank: seconds}` slows a
      rank by that much per step (for teaching)."""

    def __init__(self, model_fn: Callable, data_fn: Callable, loss_fn: Callable, optimizer_fn: Callable,
                 plan=None, batch_size: int = 64, seed: int = 0, checkpoint_dir: str | None = None,
                 checkpoint_every: int | None = None, precision: str = "fp32", grad_accum: int = 1,
                 sync: str = "allreduce", *, sync_options: dict | None = None, clip: float | None = None,
                 lr_schedule: Callable[[int], float] | None = None, eval_data_fn: Callable | None = None,
                 eval_every: int | None = None, eval_batches: int = 4, straggler: dict | None = None,
                 async_checkpoint: bool = False, live: bool = True, tensorboard: str | None = None,
                 trace: str | None = None, on_nonfinite: str = "stop", cluster: Cluster | None = None,
                 data: Data | None = None, optimization: Optimization | None = None,
                 checkpointing: Checkpointing | None = None, telemetry: Telemetry | None = None):
        self.cluster = cluster or current()
        self.data = _one_place("data", data, Data(batch_size, seed, eval_data_fn, eval_every, eval_batches))
        self.optimization = _one_place("optimization", optimization, Optimization(
            precision, grad_accum, clip, lr_schedule, sync, dict(sync_options or {}), on_nonfinite))
        self.checkpointing = _one_place("checkpointing", checkpointing,
                                        Checkpointing(checkpoint_dir, checkpoint_every, bool(async_checkpoint)))
        self.telemetry = _one_place("telemetry", telemetry, Telemetry(live, tensorboard, trace, dict(straggler or {})))
        d, o, c = self.data, self.optimization, self.checkpointing
        inputs.check_functions(model_fn=model_fn, data_fn=data_fn, loss_fn=loss_fn, optimizer_fn=optimizer_fn,
                               lr_schedule=o.lr_schedule, eval_data_fn=d.eval_data_fn)
        _check(d, o, c, self.cluster.world_size)
        inputs.check_telemetry(self.telemetry.live, self.telemetry.straggler, self.cluster.world_size)
        if c.dir:
            c = self.checkpointing = replace(c, dir=checkpoints.writable(c.dir))  # one line if it cannot be
        self.id = f"train{next(_numbers)}"
        self.loss_fn, self.data_fn, self._example = loss_fn, data_fn, None
        self.plan = self._plan(model_fn, plan, o.grad_accum, o.sync)
        self.replicas = self.plan.dp if self.plan is not None else self.cluster.world_size
        parts = self.plan.microbatches if self.plan is not None else o.grad_accum
        if d.batch_size % (self.replicas * parts):
            raise DistUsageError(f"batch_size {d.batch_size} must divide evenly over {self.replicas} replica(s) × "
                                 f"{parts} micro-batch(es)")
        pipelined = self.plan is not None and self.plan.pp > 1
        prepared = self.cluster.run(rank_inputs.prepare, d.seed, portable(optimizer_fn))
        said = next((p["problem"] for p in prepared if p["problem"]), None)
        if said:  # optimizer_fn, tried on the ranks (building an optimizer here would import torch._dynamo)
            raise DistUsageError(said)
        samples.say_what_ssp_trains(o.sync, prepared[0]["optimizer"])
        self.model = self.plan.apply(optimizer_fn) if self.plan is not None else None  # built on the ranks
        try:
            self.mesh = self.model.mesh if self.model is not None else self.cluster.mesh(dp=self.replicas)
            evaluated = d.eval_data_fn if d.eval_every else None
            pipeline = ({"shapes": samples.pipeline_shapes(self, data_fn, loss_fn, d.batch_size, o.precision,
                                                           evaluated)} if pipelined else {})
            whole = WholeReplicas(portable(model_fn), portable(optimizer_fn)) if self.plan is None else None
            self.spec = TrainSpec(
                name=self.id, mesh=self.mesh.name, model=self.model.id if self.model else None,
                replicas=self.replicas, data_fn=portable(data_fn), loss=portable(loss_fn),
                data=replace(d, eval_data_fn=portable(d.eval_data_fn)),
                optimization=replace(o, lr_schedule=portable(o.lr_schedule)),
                checkpointing=c, straggler=self.telemetry.straggler,
                whole_replicas=whole, pipeline=pipeline)
            infos = self.cluster.run(on_ranks.setup, self.spec)
            said = inputs.failure_line(infos)
            if said:  # the inputs do not fit (the same line on every rank): nothing is left on the ranks
                self.cluster.run(on_ranks.close, self.id)
                raise DistUsageError(said)
        except BaseException:
            self._close_model()  # the plan's model was built on the ranks: free it with the failed trainer
            raise
        self.dataset_length = infos[0]["length"]
        self.history = History()
        self.pipeline_steps = PipelineSteps(self.model) if pipelined else None  # what bubbles() explains
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
            return shard(model_fn, **{"microbatches": grad_accum, **example, **plan}, cluster=self.cluster)
        if not isinstance(plan, Plan):
            raise DistUsageError(f"plan must be None, a Layout, a dict of nbdist.shard's choices or a Plan, got "
                                 f"{type(plan).__name__}")
        if grad_accum != 1 and plan.microbatches != grad_accum:
            raise DistUsageError(f"grad_accum={grad_accum} but the plan has microbatches={plan.microbatches}: give "
                                 "it in one place")
        return plan

    @property
    def example(self):
        """The data set's first two samples as the loop batches them, (inputs, targets or None), read on rank 0 when
        first needed (a model that is not a Sequential is profiled on them; a pipeline sizes its messages by them)."""
        if self._example is None:
            self._example = samples.read(self.cluster, self.data_fn, "data_fn", self.loss_fn)
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
        steps = inputs.steps_of(steps, epochs, self.dataset_length, self.data.batch_size)
        inputs.check_lr_schedule(self.optimization.lr_schedule, self.step, steps)
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
            self.history.add(result["records"])
            if self.pipeline_steps is not None:
                self.pipeline_steps.add(result["rank"], result.get("pipeline_step"))
        self.stopped = any(r.get("stopped") for r in results) or stop.asked
        if view is not None:
            view.close(self.history, summary=not background)
        self._export()
        failed = inputs.failure_line(results)
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
            print(f"stopped after step {self.step} (every rank at the same step boundary); fit() goes on from here")
        return self.history.records

    def bubbles(self, step: int | None = None):
        """Where a pipeline step's idle time came from (default: the newest step every rank reported; the last
        few are kept): by rank and cause, with the change that would save the most (debugging/bubbles.py)."""
        if self.pipeline_steps is None:
            raise DistUsageError("bubbles() explains pipeline steps: this trainer's plan has no pipeline (pp = 1)")
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
        return self.cluster.run(on_ranks.save, self.id, directory, asynchronous)[0]

    def resume(self, path: str | None = None) -> "Trainer":
        """Load a checkpoint (a step_* folder, or a checkpoint folder: its newest complete checkpoint) into this
        trainer's model and optimizer, on any engine count or plan; training goes on from its step."""
        path = checkpoints.find(path or self.checkpointing.dir)
        try:
            steps = self.cluster.run(on_ranks.load, self.id, path)
        except Exception as e:
            raise DistUsageError(checkpoints.unreadable(path, e)) from None
        problems = [f"rank {rank}: {said}" for rank, said in enumerate(steps) if isinstance(said, str)]
        if problems:
            raise DistUsageError(checkpoints.unreadable(path, "; ".join(problems)))
        step = steps[0]
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
        return dict(enumerate(self.cluster.run(on_ranks.tensor_devices, self.id)))

    def close(self) -> None:
        """Free what the trainer holds on the ranks (model, optimizer, data set)."""
        if self.cluster.running:
            self.cluster.run(on_ranks.close, self.id)
            self._close_model()

    def _close_model(self) -> None:
        if self.model is not None and self.cluster.running:
            try:
                self.model.close()
            except DistUsageError:  # the engines are gone (a dead rank): nothing is left to free
                pass

    def describe(self) -> str:
        """What it trains: the plan, or the sync mode and its replicas (a dashboard's subtitle, its repr)."""
        if self.plan is not None:
            return self.plan.describe()
        return f"{self.optimization.sync} over {self.replicas} replicas"

    def __repr__(self) -> str:
        return f"<nbdist Trainer {self.id}: {self.describe()}; step {self.step}>"


def _one_place(concern: str, given, from_keywords):
    """The options of one concern: its object, or the keywords' (refused when both are given)."""
    if given is None:
        return from_keywords
    if not isinstance(given, type(from_keywords)):
        raise DistUsageError(f"{concern} must be a {type(from_keywords).__name__}, got {type(given).__name__}")
    if from_keywords != type(from_keywords)():
        raise DistUsageError(f"give the {concern} options in one place: {concern}={type(given).__name__}(...) or "
                             "keywords, not both")
    return given


def _check(d: Data, o: Optimization, c: Checkpointing, world: int) -> None:
    """One line for the first option that cannot work, before anything is built."""
    from nbdist.training.ranks.sync_modes import check_options

    one_of(o.precision, PRECISIONS, "precision")
    one_of(o.sync, SYNC_KINDS, "sync")
    one_of(o.on_nonfinite, NONFINITE, "on_nonfinite")
    if not isinstance(o.sync_options, dict):
        raise DistUsageError(f"sync_options must be a dict (e.g. {{'period': 4}}), got {type(o.sync_options).__name__}")
    check_options(o.sync, o.sync_options, world)
    whole_number(d.batch_size, "batch_size")
    whole_number(o.grad_accum, "grad_accum")
    whole_number(d.seed, "seed", 0)
    whole_number(d.eval_batches, "eval_batches")
    for label, every in (("checkpoint_every", c.every), ("eval_every", d.eval_every)):
        if every is not None:
            whole_number(every, label)
    if c.every and not c.dir:
        raise DistUsageError("checkpoint_every needs a checkpoint_dir to write into")
    if d.eval_every and d.eval_data_fn is None:
        raise DistUsageError("eval_every needs an eval_data_fn (the evaluation data set)")
    if d.eval_data_fn is not None and not d.eval_every:
        raise DistUsageError("eval_data_fn is evaluated every eval_every steps: give eval_every too")
    if d.eval_batches != Data.eval_batches and d.eval_data_fn is None:
        raise DistUsageError(f"eval_batches={d.eval_batches} needs an eval_data_fn (the evaluation data set)")
    if o.clip is not None and not (isinstance(o.clip, (int, float)) and o.clip > 0):
        raise DistUsageError(f"clip must be a positive number (the largest gradient norm), got {o.clip!r}")


class _graceful_stop:
    """While fit waits: the first SIGINT (the notebook's stop button) asks every rank to stop at the next step
    boundary (engine/training.STOP_SIGNAL); a second one interrupts as usual (frees any wait, see remote.Waiter)."""

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
