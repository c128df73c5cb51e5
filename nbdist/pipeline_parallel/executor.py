"""Running one rank's list of pipeline actions for real (this code runs ON the engines).

A rank holds the modules of its stages. For a step it splits the batch into micro-batches (first stage: inputs,
last stage: targets) and walks its action list: F runs a stage forward and keeps the activation, B (or I then W)
runs its backward, SEND/RECV move activations and gradients to the neighbouring stages. Sends never block; a
receive is posted a few actions early and waited for only when the data is needed, so communication overlaps
compute. Every action is timed: start, end, and how long it waited for a message.

The same walk can stop at a tick boundary (`advance(until_tick)`) and resume later: that is how a Stepper runs
a schedule tick by tick. Ticks come from the lockstep order in which every dependency is met (see stepping.py),
so stopping there never leaves a rank waiting for a message that was not sent. Every call starts with a barrier
of the pipeline's ranks and records when it left it, and every span records its call: the notebook takes the
pauses between calls out of the timeline (stepping.work_timeline).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from nbdist.pipeline_parallel.transport import make_transport
from nbdist.schedules.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
)

WAKE_SECONDS = 0.005  # a stepping call first keeps its core busy this long: see _wake
RECEIVE_LOOKAHEAD = 4  # receives posted ahead of need: overlap without holding every buffer at once
TAG_EPOCHS = 64  # steps before message tags repeat


@dataclass
class Span:
    action: str
    start: float
    end: float
    wait: float = 0.0  # seconds spent waiting for a message
    call: int = 0  # which advance() call of the step ran it


@dataclass
class StepState:
    """Everything one step keeps between actions (and between Stepper calls)."""

    inputs: list = field(default_factory=list)  # micro-batches of the first stage's input
    targets: list = field(default_factory=list)  # micro-batches of the last stage's targets
    stage_inputs: dict = field(default_factory=dict)  # (stage, mb) -> input tensor (requires grad)
    stage_outputs: dict = field(default_factory=dict)  # (stage, mb) -> output tensor, or the loss on the last stage
    grads_in: dict = field(default_factory=dict)  # (stage, mb) -> gradient w.r.t. the stage's output
    stashed: dict = field(default_factory=dict)  # (stage, mb) -> parameter version used by the forward (pipedream)
    received: dict = field(default_factory=dict)  # action -> (buffer, request)
    sends: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    position: int = 0
    calls: list = field(default_factory=list)  # when each advance() call of this step left its barrier
    report: dict | None = None  # the finished step's report (kept: a finished rank is still called while stepping)


class StageExecutor:
    def __init__(
        self,
        rank: int,
        program: list[Action],
        ticks: list[int],
        modules: dict[int, nn.Module],
        stages: int,
        microbatches: int,
        boundary_shapes: dict[int, tuple],
        device: str,
        transport: str = "auto",
        optimizer=None,
        pipedream_lr: float | None = None,
    ):
        self.rank, self.program, self.ticks = rank, program, ticks
        self.device = torch.device(device)
        self.modules = {s: m.to(self.device) for s, m in modules.items()}
        self.stages, self.microbatches = stages, microbatches
        self.boundary_shapes = boundary_shapes  # stage -> (shape, dtype) of its output (= next stage's input)
        self.transport = make_transport(transport, self.device)
        params = [p for m in self.modules.values() for p in m.parameters()]
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self.pipedream_lr = pipedream_lr
        self.world_ranks = None
        self.number = 0  # the pipeline's number, and the step's epoch: both go into message tags
        self._drainer: threading.Thread | None = None
        self._drain_stop = threading.Event()
        self.epoch = 0
        self.state = StepState()

    # -- the step ---------------------------------------------------------------------------------------------

    def begin(self, inputs, targets, loss_fn) -> None:
        self._stop_draining()
        self._abandon(self.state)
        self.epoch += 1
        for module in self.modules.values():
            for p in module.parameters():
                p.grad = None
        state = self.state = StepState()
        if 0 in self.modules:
            state.inputs = list(inputs.to(self.device).chunk(self.microbatches))
        if self.stages - 1 in self.modules:
            state.targets = list(targets.to(self.device).chunk(self.microbatches))
        self.loss_fn = loss_fn

    def advance(self, until_tick: int | None = None, publish_every: float | None = None) -> int:
        """Run actions until the next one belongs to tick `until_tick` (None: to the end). Returns actions run.

        With `publish_every`, the spans so far are published to the notebook (ipyparallel's datapub) at most that
        often, for a live timeline; the check costs one clock read per action.
        """
        self._stop_draining()
        state, ran = self.state, 0
        last_publish = time.perf_counter()
        while state.position < len(self.program):
            if until_tick is not None and self.ticks[state.position] >= until_tick:
                break
            self._post_receives(state.position)
            self._run(self.program[state.position])
            state.position += 1
            ran += 1
            if publish_every is not None and state.spans[-1].end - last_publish > publish_every:
                last_publish = state.spans[-1].end
                _publish(self.rank, state)
        return ran

    def pause(self) -> None:
        """Between Stepper calls: keep the posted sends moving while this rank waits for the next call.

        A large MPI message (rendezvous protocol) completes only while the *sender* also calls into MPI, and a
        paused rank calls nothing; a small thread tests the pending sends until they are done or the rank
        resumes. (A rank must not block on them either: the receive may only be posted at a later tick.)
        """
        pending = [r for r in self.state.sends if not r.is_completed()]
        self.state.sends = pending
        if pending:
            self._drain_stop = threading.Event()
            self._drainer = threading.Thread(target=_drain, args=(pending, self._drain_stop), daemon=True)
            self._drainer.start()

    def _stop_draining(self) -> None:
        if self._drainer is not None:
            self._drain_stop.set()
            self._drainer.join()
            self._drainer = None

    def finish(self, wait_for_sends: bool = True) -> dict:
        """Complete the sends, apply the optimizer, report the loss (last stage) and the timed spans."""
        state = self.state
        if wait_for_sends:
            for request in state.sends:
                request.wait()
        if self.optimizer is not None and self.pipedream_lr is None:
            self.optimizer.step()
        loss = float(sum(state.losses) / self.microbatches) if state.losses else None
        return {"rank": self.rank, "loss": loss, "spans": _as_tuples(state.spans), "calls": list(state.calls)}

    @property
    def done(self) -> bool:
        return self.state.position >= len(self.program)

    # -- actions ----------------------------------------------------------------------------------------------

    def _run(self, action: Action) -> None:
        started = time.perf_counter()
        wait = {
            FORWARD: self._forward,
            BACKWARD: self._backward,
            BACKWARD_INPUT: self._backward_input,
            BACKWARD_WEIGHT: self._backward_weight,
            SEND_F: self._send_activation,
            SEND_B: self._send_gradient,
            RECV_F: self._receive,
            RECV_B: self._receive,
        }[action.kind](action)
        # perf_counter is one clock for every process of a host: the notebook lines the ranks up by it
        call = len(self.state.calls) - 1
        self.state.spans.append(Span(str(action), started, time.perf_counter(), wait or 0.0, call))

    def _forward(self, a: Action) -> None:
        state, key = self.state, (a.stage, a.microbatch)
        if a.stage == 0:
            x = state.inputs[a.microbatch]
        elif (a.stage - 1, a.microbatch) in state.stage_outputs and self._local(a.stage - 1):
            x = state.stage_outputs[(a.stage - 1, a.microbatch)].detach().requires_grad_()
        else:
            x = state.received.pop(Action(a.stage, RECV_F, a.microbatch))[0].requires_grad_()
        module = self.modules[a.stage]
        if self.pipedream_lr is not None:
            version = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
            state.stashed[key] = version
            y = functional_call(module, version, (x,))
        else:
            y = module(x)
        if a.stage == self.stages - 1:
            loss = self.loss_fn(y, state.targets[a.microbatch])
            state.losses.append(loss.detach())
            y = loss / self.microbatches  # the batch loss is the mean over equal micro-batches
        state.stage_inputs[key], state.stage_outputs[key] = x, y

    def _output_and_grad(self, a: Action):
        state, key = self.state, (a.stage, a.microbatch)
        y = state.stage_outputs[key]
        if a.stage == self.stages - 1:
            return y, None
        if key in state.grads_in:
            return y, state.grads_in.pop(key)
        return y, state.received.pop(Action(a.stage, RECV_B, a.microbatch))[0]

    def _backward(self, a: Action) -> None:
        y, grad = self._output_and_grad(a)
        torch.autograd.backward(y, grad)
        self._after_backward(a)

    def _backward_input(self, a: Action) -> None:
        """I: only the gradient w.r.t. the stage's input, keeping the graph for W."""
        state, key = self.state, (a.stage, a.microbatch)
        y, grad = self._output_and_grad(a)
        state.grads_in[("W",) + key] = grad
        x = state.stage_inputs[key]
        if a.stage > 0:
            (x.grad,) = torch.autograd.grad(y, [x], grad, retain_graph=True)
            if self._local(a.stage - 1):
                state.grads_in[(a.stage - 1, a.microbatch)] = x.grad

    def _backward_weight(self, a: Action) -> None:
        """W: the weight gradients, from the graph I kept."""
        state, key = self.state, (a.stage, a.microbatch)
        y, grad = state.stage_outputs[key], state.grads_in.pop(("W",) + key)
        params = self._grad_targets(a)
        if params:
            torch.autograd.backward(y, grad, inputs=params)
        self._after_backward(a)

    def _grad_targets(self, a: Action) -> list:
        stash = self.state.stashed.get((a.stage, a.microbatch))
        return list(stash.values()) if stash else [p for p in self.modules[a.stage].parameters()]

    def _after_backward(self, a: Action) -> None:
        """Free the activation; pass the input gradient to a local previous stage; pipedream: update now."""
        state, key = self.state, (a.stage, a.microbatch)
        x = state.stage_inputs.pop(key)
        state.stage_outputs.pop(key)
        if a.kind == BACKWARD and a.stage > 0:  # after I the input gradient was already handed on
            target = (a.stage - 1, a.microbatch) if self._local(a.stage - 1) else ("send",) + key
            state.grads_in[target] = x.grad
        stash = state.stashed.pop(key, None)
        if stash is not None:
            self._pipedream_update(a.stage, stash)

    def _pipedream_update(self, stage: int, stash: dict) -> None:
        """PipeDream: after each backward, the stage's weights take an SGD step with this micro-batch's gradient
        (computed with the weights stashed at its forward); .grad accumulates the gradients for reporting."""
        with torch.no_grad():
            for name, p in self.modules[stage].named_parameters():
                g = stash[name].grad
                if g is None:
                    continue
                p.grad = g.clone() if p.grad is None else p.grad + g
                p -= self.pipedream_lr * g

    def _send_activation(self, a: Action) -> None:
        y = self.state.stage_outputs[(a.stage, a.microbatch)]
        peer = a.matching()
        self.state.sends.append(self.transport.isend(y.detach(), self._rank_of(peer.stage), self._tag(peer)))

    def _send_gradient(self, a: Action) -> None:
        state, key = self.state, (a.stage, a.microbatch)
        grad = state.grads_in.pop(("send",) + key, None)
        if grad is None:  # after a split I, the input (and its gradient) is still held for W
            grad = self._input_grad(a)
        peer = a.matching()
        self.state.sends.append(self.transport.isend(grad, self._rank_of(peer.stage), self._tag(peer)))

    def _input_grad(self, a: Action):
        x = self.state.stage_inputs.get((a.stage, a.microbatch))
        if x is None or x.grad is None:
            raise RuntimeError(f"rank {self.rank}: {a} has no input gradient to send (backward not run?)")
        return x.grad

    def _receive(self, a: Action) -> float:
        buffer, request = self.state.received[a]
        waited = time.perf_counter()
        request.wait()
        return time.perf_counter() - waited

    def _post_receives(self, position: int) -> None:
        """Post the irecv of the next few receive actions, so that messages land while we compute."""
        posted = 0
        for a in self.program[position:]:
            if posted >= RECEIVE_LOOKAHEAD:
                break
            if a.kind not in (RECV_F, RECV_B):
                continue
            posted += 1
            if a not in self.state.received:
                shape, dtype = self._message_shape(a)
                buffer = torch.empty(shape, dtype=dtype, device=self.device)
                peer_rank = self._rank_of(a.peer_stage())
                self.state.received[a] = (buffer, self.transport.irecv(buffer, peer_rank, self._tag(a)))

    def _message_shape(self, a: Action):
        # an activation into stage s has stage s-1's output shape; a gradient into stage s has stage s's output's
        return self.boundary_shapes[a.stage - 1 if a.kind == RECV_F else a.stage]

    # -- placement ----------------------------------------------------------------------------------------------

    def _rank_of(self, stage: int) -> int:
        return stage % self.world_ranks

    def _local(self, stage: int) -> bool:
        return stage in self.modules

    def _tag(self, receive: Action) -> int:
        """One tag per message: (pipeline, step epoch, direction, receiving stage, micro-batch). The pipeline and
        the epoch keep a message left over by an interrupted step from matching a receive of a later one."""
        direction = 0 if receive.kind == RECV_F else 1
        per_step = 2 * self.stages * self.microbatches
        within = (direction * self.stages + receive.stage) * self.microbatches + receive.microbatch
        steps = max(1, self.transport.max_tag // per_step)
        return ((self.number * TAG_EPOCHS + self.epoch % TAG_EPOCHS) * per_step + within) % (steps * per_step)

    @staticmethod
    def _abandon(state: StepState) -> None:
        """Cancel the receives an interrupted step left posted (MPI would fill those buffers later)."""
        for _, request in state.received.values():
            cancel = getattr(request, "cancel", None)
            if cancel is not None:
                cancel()


# -- entry points the notebook calls on each rank (through Cluster.run / run_each) -------------------------------

_PIPELINES: dict[str, StageExecutor] = {}


def _restore(payload):
    """Undo api.portable: cloudpickled bytes back to the user's function."""
    import cloudpickle

    return cloudpickle.loads(payload) if isinstance(payload, bytes) else payload


def _executor(pipeline_id: str) -> StageExecutor:
    try:
        return _PIPELINES[pipeline_id]
    except KeyError:
        raise RuntimeError(
            "this pipeline's stages are gone from the engines (were they restarted?): create the pipeline again"
        ) from None


def setup(pipeline_id: str, number: int, rank: int, world: int, program: list[str], ticks: list[int], modules: dict,
          stages: int, microbatches: int, transport: str, optimizer, pipedream_lr) -> str:
    """Build this rank's executor. `modules` maps stage -> module, or is ("build", fn, {stage: layer range}): then
    this rank builds the model itself and keeps its layers (nothing large crosses the network)."""
    from nbdist.engine.boot import boot

    optimizer = _restore(optimizer)
    if isinstance(modules, tuple):  # ("build", model function, {stage: (first layer, end layer)})
        _, build_model, ranges = modules
        layers = list(_restore(build_model)())
        built = {s: nn.Sequential(*layers[a:b]) for s, (a, b) in ranges.items()}
    else:
        built = modules
    _warm_up()
    executor = StageExecutor(rank, [Action.parse(a) for a in program], ticks, built, stages, microbatches, {},
                             boot().device, transport, optimizer, pipedream_lr)
    executor.world_ranks = world
    executor.number = number
    executor.group = _pipeline_communicator(world)
    _PIPELINES[pipeline_id] = executor
    return executor.device.type


def _warm_up() -> None:
    """The first backward given an output gradient makes torch import sympy (0.5-1 s, once per process): pay
    that here, not inside the first measured backward, where it would look like a 100x slower stage. A tiny graph
    of our own: the user's modules (and their buffers or random state) are not touched."""
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    torch.autograd.backward(y, torch.ones_like(y))


def begin(pipeline_id: str, shapes: dict, inputs, targets, loss_fn) -> None:
    executor = _executor(pipeline_id)
    executor.boundary_shapes = shapes
    executor.begin(inputs, targets, _restore(loss_fn))


def advance(pipeline_id: str, until_tick: int | None, publish_every: float | None = None) -> dict:
    """Run to the tick boundary. Reports the spans so far, and when the rank's list is done, finishes the step.

    Every call, on every pipeline rank (also one whose list is done), starts with a barrier of the pipeline's
    ranks: the notebook's requests reach the ranks one after another, and without the barrier that skew would be
    counted as bubble. When each rank left it is reported ("calls"), so the notebook can take the pauses between
    calls out of the timeline. (The barrier costs tens of microseconds on one host.) Stepping (until_tick given),
    the other ranks may post the receives of our last sends only at a later tick, so we do not wait for those
    sends here: `pause` keeps them moving.
    """
    executor = _executor(pipeline_id)
    state = executor.state
    executor._stop_draining()
    if until_tick is not None:
        _wake(WAKE_SECONDS)
    executor.group.Barrier()
    state.calls.append(time.perf_counter())
    stepping = until_tick is not None
    if state.report is None:
        executor.advance(until_tick, publish_every)
    if stepping:
        executor.pause()
    if executor.done:
        if state.report is None:
            state.report = {**executor.finish(wait_for_sends=not stepping), "done": True}
        return {**state.report, "calls": list(state.calls)}
    return {"rank": executor.rank, "loss": None, "spans": _as_tuples(state.spans), "calls": list(state.calls),
            "done": False}


def _wake(seconds: float) -> None:
    """Keep this core busy for `seconds` before a stepping call's barrier.

    Between two clicks a rank sleeps for seconds; the first actions after such a pause ran 2-5x slower than the
    same actions a millisecond later (the core and the process wake up), which a person stepping through the
    schedule would read as bubble. Measured on 2 CPU engines, 2-stage 1F1B of 64-wide layers, 3 s between
    clicks: the stepped bubble was 11 points above full speed without this, 3-6 with it. It costs 5 ms a click."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _pipeline_communicator(ranks: int):
    """An MPI communicator of the pipeline's ranks 0..ranks-1 (only they call this, so Create_group, not Split)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return world.Create_group(world.group.Incl(list(range(ranks))))


def _drain(requests: list, stop: threading.Event) -> None:
    while requests and not stop.is_set():
        requests = [r for r in requests if not r.is_completed()]
        time.sleep(0.0005)


def step(pipeline_id: str, shapes: dict, inputs, targets, loss_fn, publish_every: float | None = None) -> dict:
    """A whole step at full speed: one call, so one barrier before the first action and no synchronisation
    between ticks. (The barrier costs tens of microseconds on one host.)"""
    begin(pipeline_id, shapes, inputs, targets, loss_fn)
    return advance(pipeline_id, None, publish_every)


def _as_tuples(spans: list) -> list[tuple]:
    return [(s.action, s.start, s.end, s.wait, s.call) for s in spans]


def _publish(rank: int, state: StepState) -> None:
    from ipyparallel.datapub import publish_data

    publish_data({"rank": rank, "spans": _as_tuples(state.spans), "calls": list(state.calls)})


def parameters(pipeline_id: str, grads: bool) -> dict:
    """stage -> {local key: tensor} of this rank's parameters (or their gradients), on the CPU."""
    out = {}
    for stage, module in _executor(pipeline_id).modules.items():
        if grads:
            out[stage] = {k: None if p.grad is None else p.grad.detach().cpu() for k, p in module.named_parameters()}
        else:
            out[stage] = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return out


def close(pipeline_id: str) -> None:
    _PIPELINES.pop(pipeline_id, None)
