"""How data-parallel replicas agree (runs ON the engines): synchronous all-reduce, local SGD, EASGD, SSP.

The Trainer runs one replica per rank of a data-parallel communicator and plugs one of these in:
`make(kind, model, optimizer, comm, options)` gives a `Synchronizer` whose `step` takes this replica's share of a
batch, computes its gradients and then does what the strategy says about the other replicas:

- "allreduce": average the gradients every step (one flat all-reduce), then step: every replica stays equal and
  trains as one process on the global batch would. The reference the others are compared against.
- "local-sgd": step on the replica's own gradients; average the *parameters* every `period` steps, after `warmup`
  steps of gradient averaging (post-local SGD). The rule is torch's `PeriodicModelAverager`'s, so that torch is the
  reference: average when step >= warmup and (step - warmup) % period == 0.
- "easgd": elastic averaging SGD (Zhang, Choromanska & LeCun 2015), synchronous: every `tau` steps each worker is
  pulled toward a center variable by alpha times their difference, and the center moves by the sum of those pulls.
- "ssp": stale-synchronous parallel (Ho et al. 2013), decentralised (nbdist/training/ranks/sync_ssp.py): no
  all-reduce at all; each replica sends its updates to the others and may run up to `staleness` clocks ahead of the
  slowest.

What they share (a private communicator, waits an interrupt can free, the time accounting) is in
nbdist/training/ranks/sync_base.py.
"""
from __future__ import annotations

import time
from numbers import Real

import torch
from torch import nn

from nbdist.checks import known_options
from nbdist.errors import DistUsageError
from nbdist.training.ranks.sync_base import Synchronizer, add, flatten, report, write
from nbdist.training.ranks.sync_ssp import StaleSynchronous

KINDS = ("allreduce", "local-sgd", "easgd", "ssp")
OPTIONS = {  # every option each kind takes, with its default (None: decided from the number of replicas)
    "allreduce": {},
    "local-sgd": {"period": 4, "warmup": 0},
    "easgd": {"alpha": None, "tau": 1},
    "ssp": {"staleness": 2},
}
EASGD_BETA = 0.9  # alpha = beta / replicas by default: the paper's choice of beta = p * alpha (section 5)


def make(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, comm, options: dict | None = None
         ) -> Synchronizer:
    """The synchronizer `kind` for this replica. `model` is the replica's plain module (every replica starts from
    the same parameters), `optimizer` steps it, `comm` is an mpi4py communicator of the replicas. Bad kinds and
    options are refused in one line before any communication."""
    options = check_options(kind, options or {}, comm.Get_size())
    return {"allreduce": AllReduce, "local-sgd": LocalSGD, "easgd": ElasticAveraging, "ssp": StaleSynchronous}[kind](
        model, optimizer, comm, options)


def check_options(kind: str, options: dict, replicas: int) -> dict:
    """`options` completed with the kind's defaults; an unknown kind, an unknown option or a bad value raises
    DistUsageError naming it."""
    if kind not in OPTIONS:
        raise DistUsageError(f"unknown synchronization {kind!r}; choose one of {', '.join(KINDS)}")
    known_options(options, OPTIONS[kind], kind)
    chosen = {**OPTIONS[kind], **options}
    if kind == "local-sgd":
        _integer(kind, "period", chosen["period"], 1)
        _integer(kind, "warmup", chosen["warmup"], 0)
    elif kind == "easgd":
        _integer(kind, "tau", chosen["tau"], 1)
        if chosen["alpha"] is None:
            chosen["alpha"] = EASGD_BETA / replicas
        alpha = chosen["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, Real) or not 0 < alpha * replicas <= 1:
            raise DistUsageError(f"easgd: alpha must be a number > 0 with alpha x replicas <= 1 (so that the center "
                                 f"is a moving average of the workers), got alpha={alpha!r} for {replicas} replicas")
        chosen["alpha"] = float(alpha)
    elif kind == "ssp":
        _integer(kind, "staleness", chosen["staleness"], 0)
    return chosen


def _integer(kind: str, name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise DistUsageError(f"{kind}: {name} must be an integer >= {least}, got {value!r}")


class AllReduce(Synchronizer):
    """Synchronous data parallelism by hand: average the gradients, then every replica takes the same step."""

    kind = "allreduce"

    def step(self, step: int, inputs, targets, loss_fn, microbatches: int = 1) -> dict:
        self.usable()
        start = time.perf_counter()
        loss = self.backward(inputs, targets, loss_fn, microbatches)
        backward = time.perf_counter() - start
        idle, comm = self.average(self.grads(), "the gradient all-reduce")
        start = time.perf_counter()
        self.step_optimizer()
        self.steps += 1
        return report(loss, backward + time.perf_counter() - start, comm, idle)


class LocalSGD(Synchronizer):
    """(Post-)local SGD: `warmup` steps of synchronous gradient averaging, then each replica steps alone and the
    parameters are averaged after the steps where (step - warmup) % period == 0 (step counted from 0).

    This is torch's PostLocalSGDOptimizer with a PeriodicModelAverager(period, warmup_steps=warmup) over DDP with
    the post-local SGD hook (start_localSGD_iter=warmup, no gradient all-reduce after it), so torch is the test's
    reference. Why warm up: early steps move the parameters most, and replicas that drift apart there average
    into a worse point; after the warm-up they only need to meet now and then. Optimizer states (momentum, Adam's
    moments) stay per replica, as in torch: only parameters are averaged."""

    kind = "local-sgd"

    @property
    def lag(self) -> int:
        return self.options["period"]

    def step(self, step: int, inputs, targets, loss_fn, microbatches: int = 1) -> dict:
        self.usable()
        period, warmup = self.options["period"], self.options["warmup"]
        start = time.perf_counter()
        loss = self.backward(inputs, targets, loss_fn, microbatches)
        compute, idle, comm = time.perf_counter() - start, 0.0, 0.0
        if self.steps < warmup:
            idle, comm = self.average(self.grads(), "the warm-up gradient all-reduce")
        start = time.perf_counter()
        self.step_optimizer()
        compute += time.perf_counter() - start
        if self.steps >= warmup and (self.steps - warmup) % period == 0:
            waited, moved = self.average(self.params, "the parameter average")
            idle, comm = idle + waited, comm + moved
        self.steps += 1
        return report(loss, compute, comm, idle)

    def finish(self) -> None:
        """Average the parameters once more: whatever the steps since the last average did, the replicas agree."""
        self.usable()
        self.average(self.params, "the final parameter average")


class ElasticAveraging(Synchronizer):
    """Synchronous EASGD (Zhang, Choromanska & LeCun 2015, equations 5-6): with the gradient g_i taken at x_i,

        x_i <- x_i - eta g_i - alpha (x_i - center)      center <- center + alpha sum_i (x_i - center)

    where the elastic terms apply at steps t with t % tau == 0 (t from 0, as the paper's Algorithm 1). Here
    `eta g_i` is whatever this replica's optimizer does with its own gradient (its state stays its own), and both
    elastic terms use x_i from before that step, as the equations do. The center is kept on every replica,
    identically: the sum of the pulls is one all-reduce, and every replica adds the same sum. So finish() needs no
    communication: every worker takes the center.

    Why elastic: workers may explore apart (alpha small) while the center, a moving average of them, is the
    model; alpha x replicas <= 1 keeps it an average (checked in make)."""

    kind = "easgd"

    @property
    def lag(self) -> int:
        return self.options["tau"]

    def __init__(self, model, optimizer, comm, options):
        super().__init__(model, optimizer, comm, options)
        self.center = flatten(self.params)  # every replica starts from the same parameters

    def step(self, step: int, inputs, targets, loss_fn, microbatches: int = 1) -> dict:
        self.usable()
        start = time.perf_counter()
        loss = self.backward(inputs, targets, loss_fn, microbatches)
        elastic = self.steps % self.options["tau"] == 0
        pull = flatten(self.params).sub_(self.center).mul_(self.options["alpha"]) if elastic else None
        self.step_optimizer()
        compute, idle, comm = time.perf_counter() - start, 0.0, 0.0
        if elastic:
            start = time.perf_counter()
            total = pull.clone()
            idle, _ = self.sum_over_replicas(total, "the elastic all-reduce")
            add(pull.neg_(), self.params)
            self.center.add_(total)
            comm = time.perf_counter() - start - idle
        self.steps += 1
        return report(loss, compute, comm, idle)

    def finish(self) -> None:
        """Every worker := the center (equal on every replica already, so no communication)."""
        self.usable()
        write(self.center, self.params)

    def state(self) -> dict:
        return {**super().state(), "center": self.center.clone()}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        if state["center"].numel() != self.center.numel():
            raise DistUsageError(f"easgd: the saved center has {state['center'].numel()} values, this model "
                                 f"{self.center.numel()}")
        self.center = state["center"].detach().to("cpu", torch.float32).clone()
