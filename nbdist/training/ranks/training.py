"""The Trainer's loop, ON the ranks: batches made here, steps run back to back, the notebook only watches.

Why on the ranks: a step driven from the notebook pays a round trip (figures: benchmarks/README.md) and ships
every batch; a loop here pays neither. Each rank reads the global batch of step k from its own copy of the data set
(nbdist.data.batch_indices: the same on any engine count or plan) and keeps its replica's share. What a step runs
(a plan's sharded model, a pipeline's stages, a replica and its synchroniser) is training/ranks/runners.py.

At every step boundary the ranks agree, in one small MPI all-reduce over the mesh, on the step's loss and on
whether anyone was asked to stop (SIGUSR1, which the notebook's Trainer sends when the user presses stop; the
handler is installed once, when the trainer is set up): so all ranks stop after the same step, with model and
optimizer intact, and `fit` continues from there. The time a rank
waits in that all-reduce is its idle time (it finished before the slowest rank).

The same all-reduce counts the ranks whose loss was not finite (NaN or infinite) and the ranks whose first step
failed on the inputs (training/ranks/inputs.py): a non-finite loss stops every rank after the step at which they
learn of it (on_nonfinite="stop"; the replica modes learn `lag` steps late), and a first step that failed ends the
fit on every rank, each returning the line that says why instead of raising, so no rank traceback is shown. No
other collective is added to a step.

Each step's record: loss, learning rate, wall time, and per rank compute / communication / idle seconds
(communication: what backward waited for after its last gradient was computed, i.e. the all-reduce not hidden
behind compute, plus any explicit average); CPU utilisation and resident memory (psutil), GPU utilisation and
memory (NVML) sampled at most every PUBLISH_SECONDS and published to the notebook (ipyparallel datapub).
"""
from __future__ import annotations

import math
import signal
import time

import torch

from nbdist.backend.ranks import waiting
from nbdist.cluster.meshes.ranks import rank_mesh
from nbdist.errors import DistUsageError
from nbdist.models import batches
from nbdist.runtime.ranks import placement, registry
from nbdist.training.ranks import inputs, loss_scaling, runners, telemetry
from nbdist.training.ranks.clipping import clip_gradients
from nbdist.training.ranks.data_source import DataSource
from nbdist.training.ranks.inputs import seed_everything  # noqa: F401 - the tests' and the labs' name for it
from nbdist.training.replies import Failure, Fitted, Loaded, NonFinite, SetUp
from nbdist.wire import restore

KIND = "trainer"
STOP_SIGNAL = signal.SIGUSR1  # "stop at the next step boundary" (SIGINT stays the interrupt that frees any wait)
PUBLISH_SECONDS = 0.5
RECORDS_PUBLISHED = 256  # the newest records sent with each publication (the notebook merges them by step)
BOUNDARY_TIMEOUT_SECONDS = 600.0
FAILED_STEP_WAIT_SECONDS = 5.0  # how long a rank whose first step failed waits for the others at the boundary; a
# rank left behind (in a collective its failed peer never joined: a pipeline's messages) makes it raise instead
STOP, LOSS, LOSSES, NONFINITE, FAILED = range(5)  # the step boundary's sums


class RankTrainer:
    """This rank's side of one Trainer: the data, the model (a sharded model or a replica with its synchroniser),
    the step counter and the records of every step done."""

    def __init__(self, spec):
        from nbdist.cluster.launching.ranks.boot import boot

        self.spec = spec
        self.rank = boot().rank
        self.device = torch.device(boot().device)
        self.me = rank_mesh.here(spec.mesh)
        self.replica = self.me.coords.get("dp", 0)
        data_fn, eval_data_fn = restore(spec.data_fn), restore(spec.data.eval_data_fn)
        self.data_label = inputs.named(data_fn, "data_fn")
        self.dataset = DataSource(data_fn(), self.data_label)  # training/ranks/data_source.py
        self.eval_set = (DataSource(eval_data_fn(), inputs.named(eval_data_fn, "eval_data_fn"))
                         if eval_data_fn else None)
        self.loss_fn = inputs.CheckedLoss(restore(spec.loss))
        self.loss_given = self.loss_fn.fn is not None  # None: the loss the model's output carries
        for source in filter(None, (self.dataset, self.eval_set)):
            source.check_batch_size(spec.data.batch_size)
            try:  # a sample as the loop splits it (pairs, or dicts with labels): one line at set-up
                batches.inputs_and_targets(source.first, self.loss_given, source.label)
            except DistUsageError as e:
                raise inputs.InputError(str(e)) from None
        self.lr_schedule = restore(spec.optimization.lr_schedule)
        self.runner = runners.make(spec, self.me)
        self.base_lrs = [g["lr"] for g in self.runner.optimizer.param_groups] if self.runner.optimizer else []
        self.scaler = loss_scaling.scaler(self.device.type, spec.optimization.precision, spec.model is not None)
        self.step = 0
        self.records: list[dict] = []
        self.stop_requested = False
        self.proven = False  # a step of this trainer ran: a failure now is no longer the inputs' first step
        self.failure: Failure | None = None  # this rank's first step failed on the inputs
        self.failed_elsewhere = False  # another rank's did (the boundary said so)
        self.nonfinite: dict[int, float] = {}  # step -> this rank's non-finite loss, until the boundary agrees on it
        self.nonfinite_seen: dict | None = None  # this fit's first agreed non-finite step, and how many followed
        self.telemetry = telemetry.Sampler(self.device)
        self.lag = _agreement_lag(self.runner)
        self.pending: list = []  # step agreements posted and not yet completed (lag > 0): (record, request, buffers)
        self.boundary = None  # the MPI communicator of the step boundary, made by each fit call
        self.pending_save = None  # an asynchronous checkpoint being written (training/ranks/checkpoint.py)
        self.writer_group = None
        self.last_save_stall_s: float | None = None

    # -- one step ---------------------------------------------------------------------------------------------

    def share(self, step: int, dataset=None, seed: int | None = None):
        """This replica's share of global batch `step` as (what the model takes, the targets or None), on this
        rank's device (data_source.py: the order)."""
        source = self.dataset if dataset is None else dataset
        collated = source.share(step, self.spec.data.batch_size, self.spec.data.seed if seed is None else seed,
                                self.spec.replicas, self.replica)
        x, y = batches.inputs_and_targets(collated, self.loss_given, source.label)
        return batches.to(x, self.device), None if y is None else y.to(self.device)

    def train_step(self) -> dict | None:
        """One step and its record; None if it was this trainer's first and failed on the inputs (self.failure)."""
        k = self.step
        self._set_learning_rate(k)
        x = y = None
        try:
            x, y = self.share(k)
            started = time.perf_counter()
            with placement.named_out_of_memory(f"step {k}", release=self._release_gradients):
                report = self.runner.run(k, x, y, self.loss_fn, self._autocast(), self._scale, self._apply)
        except Exception as error:
            if self.proven or not inputs.about_inputs(error):
                raise
            self._first_step_failed(k, error, x, y)
            return None
        delay = self.spec.straggler.get(self.rank, 0.0)
        if delay:
            time.sleep(delay)
        computed = time.perf_counter()
        comm = report.get("comm_s", 0.0)
        record = {"step": k, "loss": None, "lr": self._lr(), "rank": self.rank, "started": started,
                  "compute_s": max(0.0, computed - started - comm - report.get("idle_s", 0.0)),
                  "comm_s": comm, "samples": self.spec.data.batch_size, "staleness": report.get("staleness", [])}
        loss = report["loss"]
        finite = loss is None or math.isfinite(loss)
        if not finite:
            self.nonfinite[k] = loss
        waited = self._agree(record, loss, keep=self.lag if self.proven else 0, nonfinite=not finite)
        self.proven = True
        record["ended"] = time.perf_counter()
        record["idle_s"] = waited + report.get("idle_s", 0.0)
        first = batches.tensors(x)[0]  # a dict's first tensor: its input ids
        if first.dim() >= 2 and not first.is_floating_point():
            record["tokens"] = self.spec.data.batch_size * first.shape[1]
        self.step += 1
        self.records.append(record)
        return record

    def _release_gradients(self) -> None:
        """After a failed allocation: drop the step's gradients, so the engine has its memory back."""
        if self.runner.model is not None:
            self.runner.model.zero_grad(set_to_none=True)

    def _autocast(self):
        dtype = runners.AUTOCAST_DTYPES.get(self.spec.optimization.precision)
        return None if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def _scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def _apply(self, optimizer) -> None:
        """The optimizer's step with the Trainer's extras: unscale (fp16), clip the global gradient norm, step."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if self.spec.optimization.clip is not None:
            stages = self.me.comm("pp") if "pp" in self.me.mesh.names else None
            params = [p for g in optimizer.param_groups for p in g["params"]]
            clip_gradients(params, self.spec.optimization.clip, stages)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def _set_learning_rate(self, step: int) -> None:
        if self.lr_schedule is None or self.runner.optimizer is None:
            return
        factor = float(self.lr_schedule(step))
        for group, base in zip(self.runner.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def _lr(self) -> float | None:
        optimizer = self.runner.optimizer
        return float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None

    def _agree(self, record: dict, loss: float | None, keep: int = 0, nonfinite: bool = False,
               failed: bool = False, seconds: float = BOUNDARY_TIMEOUT_SECONDS) -> float:
        """The step boundary: post this step's agreement (one small MPI all-reduce over the mesh: whether any rank
        was asked to stop, the loss, how many ranks' loss was not finite, how many ranks' first step failed), then
        complete the posted ones until `keep` remain; each completed one gives its record the mean loss over the
        replicas. Returns the seconds spent waiting for the others.

        keep = 0 (the plans) completes it at once; the replica modes keep `lag` in flight, so replicas may run up to
        `lag` steps apart, as their strategy allows (SSP's staleness + 1, local SGD's period, EASGD's tau), yet every
        rank reads the same stop request at the same step."""
        import numpy as np
        from mpi4py import MPI

        mine = np.zeros(5)
        mine[STOP] = float(self.stop_requested or _STOP["asked"])
        mine[LOSS], mine[LOSSES] = (loss, 1.0) if loss is not None else (0.0, 0.0)
        mine[NONFINITE], mine[FAILED] = float(nonfinite), float(failed)
        total = np.zeros(5)
        self.pending.append((record, self.boundary.Iallreduce(mine, total, op=MPI.SUM), (mine, total)))
        return self.complete_agreements(keep, seconds)

    def complete_agreements(self, keep: int = 0, seconds: float = BOUNDARY_TIMEOUT_SECONDS) -> float:
        """Complete the oldest posted agreements until `keep` remain; returns the seconds waited."""
        started = time.perf_counter()
        while len(self.pending) > keep:
            record, request, (mine, total) = self.pending[0]
            try:
                waiting.complete_or_abandon([request], (mine, total), seconds,
                                             f"rank {self.rank} waited {seconds:g} s for the other "
                                             f"ranks to reach step {record['step']}")
            except BaseException:
                self._abandon_agreements()
                raise
            self.pending.pop(0)
            record["loss"] = float(total[LOSS] / total[LOSSES]) if total[LOSSES] else math.nan
            self.stop_requested = self.stop_requested or bool(total[STOP] > 0)
            self.failed_elsewhere = self.failed_elsewhere or bool(total[FAILED] > 0)
            if total[NONFINITE] > 0:
                self._nonfinite_agreed(record["step"])
        return time.perf_counter() - started

    def _nonfinite_agreed(self, step: int) -> None:
        """Every rank now knows that some rank's loss at `step` was not finite: the first such step of this fit is
        kept with this rank's own value (None where it was finite, or computed none), and the fit stops after the
        step in progress unless on_nonfinite says to go on."""
        seen = self.nonfinite_seen
        if seen is None:
            seen = self.nonfinite_seen = {"first": step, "mine": self.nonfinite.get(step), "count": 0}
        seen["count"] += 1
        self.nonfinite = {k: v for k, v in self.nonfinite.items() if k > step}

    def _first_step_failed(self, step: int, error: Exception, x, y) -> None:
        """This trainer's first step failed on the inputs: say so at the step boundary, where the other ranks (whose
        first step failed alike, as a rank's does on the same data and model) learn it too; then this rank returns
        the line. A rank left behind in a collective would never come: after a short wait this one raises it."""
        model = self.runner.model
        line = inputs.first_step_line(error, self.loss_fn, x, y, self.data_label, model)
        self.failure = Failure(line, inputs.traceback_text(error))
        del error  # its traceback holds the step's tensors
        self._release_gradients()
        try:
            self._agree({"step": step}, None, failed=True, seconds=FAILED_STEP_WAIT_SECONDS)
        except TimeoutError:
            raise inputs.InputError(line) from None

    def _abandon_agreements(self) -> None:
        for _, request, buffers in self.pending[1:]:  # the oldest was given up by complete_or_abandon
            waiting.abandoned.append(([request], buffers))
        self.pending = []
        self.boundary = None  # out of step with the others: the next fit makes a fresh one

    # -- evaluation and the loop ------------------------------------------------------------------------------

    def evaluate(self) -> float:
        """The mean loss over `eval_batches` fixed batches of the evaluation set (the same on any plan): each rank
        that computes a loss (every rank; a pipeline's last stage) reports it, the step boundary averages them."""
        model = self.runner.model
        model.eval()
        losses = []
        try:
            for j in range(self.spec.data.eval_batches):
                x, y = self.share(j, self.eval_set, self.spec.data.seed + 1)
                loss = self.runner.evaluate(x, y, self.loss_fn, self._autocast())
                if loss is not None:
                    losses.append(loss)
        finally:
            model.train()
        agreed = {"step": self.step}
        self._agree(agreed, sum(losses) / len(losses) if losses else None)
        return agreed["loss"]

    def fit(self, steps: int, publish_every: float | None) -> Fitted:
        """Train `steps` steps (fewer if stopped); return this rank's records of them."""
        from nbdist.training.ranks import checkpoint

        first = len(self.records)
        self.boundary = self.me.everyone.Dup()
        self.stop_requested = False  # (a request that arrived before this call began still counts: _STOP)
        self.failure, self.failed_elsewhere, self.nonfinite_seen = None, False, None
        publish = telemetry.Publisher(self, publish_every, RECORDS_PUBLISHED)
        try:
            for _ in range(steps):
                record = self.train_step()
                if record is None or self.failed_elsewhere:
                    break
                if self._due(self.spec.data.eval_every):
                    self.complete_agreements()
                    record["eval_loss"] = self.evaluate()
                checkpoint.settle(self, wait=False)
                if self.spec.checkpointing.dir and self._due(self.spec.checkpointing.every):
                    self.complete_agreements()
                    record["checkpoint"] = checkpoint.save(self, self.spec.checkpointing.dir,
                                                           self.spec.checkpointing.asynchronous)
                    record["checkpoint_stall_s"] = self.last_save_stall_s
                publish(force=False)
                if self.stop_requested or self._halted():
                    break
            self.complete_agreements()
            checkpoint.settle(self, wait=True)
        finally:
            if self.boundary is not None:
                self.boundary.Free()
            self.boundary = None
            if self.stop_requested:
                _STOP["asked"] = False  # answered: every rank stopped at this boundary
        publish(force=True)
        return Fitted(self.rank, self.records[first:], self.step, self.runner.last_step, self.stop_requested,
                      self.failure, self._nonfinite_report())

    def _halted(self) -> bool:
        return self.nonfinite_seen is not None and self.spec.optimization.on_nonfinite == "stop"

    def _nonfinite_report(self) -> NonFinite | None:
        """This fit's first non-finite step as this rank saw it, and whether the weights it holds are finite now."""
        seen = self.nonfinite_seen
        if seen is None or self.spec.optimization.on_nonfinite == "ignore":
            return None
        return NonFinite(**seen, weights_finite=inputs.finite_weights(self.runner.model), lag=self.lag)

    def _due(self, every: int | None) -> bool:
        return bool(every) and self.step % every == 0


def _agreement_lag(runner) -> int:
    """How many steps the replicas may run apart before the step boundary makes them wait (0: every step): the
    synchroniser's own bound (training/ranks/sync_base.Synchronizer.lag); the plans meet every step."""
    sync = getattr(runner, "sync", None)
    return sync.lag if sync is not None else 0


_STOP = {"asked": False}  # set by STOP_SIGNAL, any time: also before this rank's fit call has begun


def _ask_to_stop(*_) -> None:
    _STOP["asked"] = True


def install_stop_handler() -> None:
    """STOP_SIGNAL asks the running (or the next) fit to stop at a step boundary. Installed once, for good: the
    notebook may send it just before a rank has begun its fit call, and the signal's default action would kill
    the engine."""
    if signal.getsignal(STOP_SIGNAL) is not _ask_to_stop:
        signal.signal(STOP_SIGNAL, _ask_to_stop)


# -- what the notebook calls ------------------------------------------------------------------------------------


def setup(spec) -> SetUp:
    """This rank's side of a Trainer, registered; where its inputs do not fit (the data sets, the replica's model
    and optimizer, a sample against the model's first layer), the line that says why, the same on every rank."""
    from nbdist.cluster.launching.ranks.boot import boot

    install_stop_handler()
    trainer = None
    try:
        trainer = RankTrainer(spec)
        autocast = spec.optimization.precision != "fp32"
        for source, label in ((trainer.dataset, trainer.data_label), (trainer.eval_set, "eval_data_fn")):
            pair = source is not None and isinstance(source.first, (tuple, list))
            said = inputs.sample_mismatch(trainer.runner.model, source.first[0], label, autocast) if pair else None
            if said:
                raise inputs.InputError(said)
    except inputs.InputError as e:
        if trainer is not None and getattr(trainer.runner, "sync", None) is not None:
            trainer.runner.sync.close()
        return SetUp(boot().rank, problem=str(e))
    registry.put(KIND, spec.name, trainer)
    stepped, unstepped = inputs.optimizer_coverage(trainer.runner.model, trainer.runner.optimizer)
    return SetUp(trainer.rank, trainer.dataset.length, stepped=stepped, unstepped=unstepped)


def fit(name: str, steps: int, publish_every: float | None) -> Fitted:
    return registry.get(KIND, name).fit(steps, publish_every)


def finish(name: str) -> None:
    """Bring the replicas to one model (asynchronous modes; nothing to do for all-reduce)."""
    registry.get(KIND, name).runner.finish()


def records(name: str, since: int) -> Fitted:
    """This rank's records from step `since` on (what a fit returns, read after an interrupted one)."""
    trainer = registry.get(KIND, name)
    return Fitted(trainer.rank, [r for r in trainer.records if r["step"] >= since], trainer.step,
                  trainer.runner.last_step)


def tensors(name: str) -> dict | None:
    """A replica's parameters and buffers (the asynchronous modes, after finish()), on the first replica; None
    elsewhere. (Plans' models gather themselves: Sharded, Pipeline.)"""
    trainer = registry.get(KIND, name)
    out = {k: v.detach().cpu().clone() for k, v in trainer.runner.model.state_dict().items()}
    return out if not any(trainer.me.coords.values()) else None


def tensor_devices(name: str) -> list[str]:
    """The devices this rank's model and optimizer state lie on (placement.tensor_devices)."""
    runner = registry.get(KIND, name).runner
    return placement.tensor_devices(runner.model, runner.optimizer)


def save(name: str, directory: str, asynchronous: bool = False) -> str:
    """A checkpoint now (complete when this returns, also when written asynchronously)."""
    from nbdist.training.ranks import checkpoint

    trainer = registry.get(KIND, name)
    path = checkpoint.save(trainer, directory, asynchronous)
    checkpoint.settle(trainer, wait=True)
    return path


def load(name: str, path: str) -> Loaded:
    """The checkpoint's step once loaded; or what made it unreadable, for the kernel to say in one line (a raised
    error would also be shown as each rank's failure)."""
    from nbdist.training.ranks import checkpoint

    try:
        return Loaded(checkpoint.load(registry.get(KIND, name), path))
    except checkpoint.UnreadableCheckpoint as e:
        return Loaded(None, f"{type(e).__name__}: {e}")


def close(name: str) -> None:
    trainer = registry.find(KIND, name)
    if trainer is not None and getattr(trainer.runner, "sync", None) is not None:
        trainer.runner.sync.close()
    registry.drop(KIND, name)
