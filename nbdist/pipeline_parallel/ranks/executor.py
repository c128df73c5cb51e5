"""Running one rank's list of pipeline actions for real (this code runs ON the engines).

A rank holds the modules of its stages. For a step it splits its replica's batch into micro-batches (first stage:
inputs, last stage: targets) and walks its action list: F runs a stage forward and keeps the activation, B (or I
then W) runs its backward, SEND/RECV move activations and gradients to the neighbouring stages. Sends never block;
a receive is posted before it is needed and waited for only when the data is needed, so communication overlaps
compute. Every action is timed: start, end, how long it waited for a message, and which call ran it.

How messages are posted depends on the transport. MPI's tags let a receive be posted a few actions early, in any
order. The torch transport (NCCL on GPUs, gloo on CPU) posts a rank's sends and receives in ROUNDS, each one group on
the pipeline's one communicator: round t holds this rank's send of tick t and the receives of what its neighbours
send at tick t (schedules/nccl.py says why: several communicators in flight at once, or sends and receives issued
one by one, can deadlock under NCCL; rounds cannot).

The same walk can stop at a tick boundary (`advance(until_tick)`) and resume later: that is how a Stepper runs a
schedule tick by tick. Ticks come from the lockstep order in which every dependency is met (see
pipeline_parallel/stepping.py), so stopping there never leaves a rank waiting for a message that was not sent; a call
posts every round before its boundary, also where this rank idles, so no message of it waits for the next call.

With data parallelism (a mesh with dp > 1) the same schedule runs on every replica's ranks at once, each on its
share of the batch; when a rank's list is done its gradients are averaged over its dp group before the optimizer
steps, so every replica takes the same step.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time

import torch
from torch import nn
from torch.func import functional_call

from nbdist.debugging.ranks import recorder
from nbdist.models import batches
from nbdist.pipeline_parallel.ranks.clocks import Span
from nbdist.pipeline_parallel.ranks.step_state import StepState, Walk
from nbdist.pipeline_parallel.ranks.transport import Drainer, cancel, message_tag
from nbdist.pipeline_parallel.spec import StageSpec
from nbdist.runtime.ranks.placement import clock_for
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

RECEIVE_LOOKAHEAD = 4  # MPI: receives posted ahead of need, overlap without holding every buffer at once

class StageExecutor:
    """One rank's part of a pipeline: its stages' modules, its action list, the messages of the current step."""

    def __init__(self, spec: StageSpec, modules: dict[int, nn.Module], device: torch.device, transport,
                 dp_average=None, optimizer=None, walks: dict | None = None):
        """walks: on the torch transport, "step" and "evaluation" -> (actions, ticks, rounds) of this rank
        (schedules/nccl.py: rank_walks); None on MPI: the step's list and ticks from `spec`."""
        self.spec = spec
        self.program = [Action.parse(a) for a in spec.program]
        if walks is None:
            forward = tuple(a for a in self.program if a.kind in (FORWARD, RECV_F, SEND_F))
            walks = {"step": (self.program, spec.ticks, None), "evaluation": (forward, (), None)}
        self.walks = {kind: Walk(tuple(acts), tuple(ticks), None if rounds is None else tuple(rounds))
                      for kind, (acts, ticks, rounds) in walks.items()}
        self.device = device
        self.clock = clock_for(device)  # host time on CPU, CUDA events on a GPU: runtime/ranks/placement.py
        self.modules = {s: m.to(device) for s, m in modules.items()}
        self.transport = transport
        self.dp_average = dp_average  # callable(list of gradient tensors) averaging them over the dp group, or None
        params = self.parameters()
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self.apply_optimizer = None  # set by the Trainer: its optimizer step (clipping) instead of optimizer.step()
        self.autocast_dtype: torch.dtype | None = None  # set by the Trainer: forwards under autocast (bf16, fp16)
        self.scale_loss = None  # set by the Trainer (fp16): the last stage's loss, scaled before its backward
        self.shapes: dict[int, tuple] = {}  # stage -> (shape, dtype) of its output for one micro-batch
        self.loss_fn = None
        self.tie_sum = None  # set by setup: sums tied tensors' gradients between the stages holding copies
        self.tie_comms: list = []  # the MPI communicators tie_sum uses (freed when the pipeline closes)
        self.epoch = 0  # steps begun: part of every message tag
        self.state = StepState(walk=self.walks["step"])
        self.drainer = Drainer()  # keeps a paused rank's sends moving (transport.py)

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules.values() for p in m.parameters()]

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held for the pipeline, by storage (a slice: its part)."""
        from nbdist.runtime.ranks.memory import state_bytes

        return state_bytes(nn.ModuleList(self.modules.values()), self.optimizer)

    def memory_bytes(self) -> int:
        """Parameters, gradients and optimizer state this rank holds for the pipeline, plus its buffers."""
        buffers = sum(b.numel() * b.element_size() for m in self.modules.values() for b in m.buffers())
        return sum(self.held_bytes().values()) + buffers

    def describe(self) -> str:
        stages = ", ".join(str(s) for s in sorted(self.modules))
        replica = f", one of {self.spec.replicas} replicas" if self.spec.replicas > 1 else ""
        return f"stage(s) {stages} of {self.spec.stages}, {len(self.program)} actions{replica}"

    # -- the step ---------------------------------------------------------------------------------------------

    @property
    def posts_rounds(self) -> bool:
        """True on the torch transport: each send's receive is posted within the call that sends it."""
        return self.walks["step"].rounds is not None

    def begin(self, shapes: dict, inputs, targets, loss_fn, walk: str = "step") -> None:
        """A new step: this replica's batch (first stage: inputs; last stage: targets), gradients cleared."""
        self.stop_draining()
        cancel(request for _, request in self.state.received.values())  # an interrupted step's (MPI) receives
        self.epoch += 1
        for p in self.parameters():
            p.grad = None
        self.shapes, self.loss_fn = shapes, loss_fn
        state = self.state = StepState(walk=self.walks[walk])
        m = self.spec.microbatches
        if self.spec.first_stage or self.spec.pruned:  # a pruned stage runs the model's forward from the top
            state.inputs = batches.split(batches.to(inputs, self.device), m)
        if self.spec.last_stage:
            state.targets = [None] * m if targets is None else list(targets.to(self.device).chunk(m))

    def advance(self, until_tick: int | None = None, publish=None) -> int:
        """Run actions until the next one belongs to tick `until_tick` (None: to the end). Returns actions run.

        `publish(state)`, if given, is called after each action (it decides itself how often to send anything)."""
        self.stop_draining()
        self.clock.call_began()
        state, ran = self.state, 0
        while state.position < len(state.walk.program):
            if until_tick is not None and state.walk.ticks[state.position] >= until_tick:
                break
            self._post_ahead()
            self._run(state.walk.program[state.position])
            state.position += 1
            ran += 1
            if publish is not None:
                publish(state)
        self._post_rounds(math.inf if until_tick is None else until_tick - 1)  # also the ticks this rank idles
        recorder.doing = None
        self._settle()
        return ran

    def _settle(self) -> None:
        """GPU: wait for the call's work on the compute stream (runtime/ranks/placement.py), then turn its event
        marks into spans (a receive's span is how long the compute stream waited for the message)."""
        state = self.state
        if not state.unsettled:
            return
        self.clock.settle()
        for action, start, end, wait, call in state.unsettled:
            start, end = self.clock.seconds(start), self.clock.seconds(end)
            wait = end - start if action.kind in (RECV_F, RECV_B) else wait
            state.spans.append(Span(str(action), start, end, wait, call))
        state.unsettled = []

    @property
    def done(self) -> bool:
        return self.state.position >= len(self.state.walk.program)

    def pause(self) -> None:
        """Between a Stepper's calls: keep the posted sends moving while this rank waits for the next call."""
        self.state.sends = self.drainer.start(self.state.sends)

    def stop_draining(self) -> None:
        self.drainer.stop()

    def finish(self, wait_for_sends: bool = True) -> dict:
        """Complete the sends, average the gradients over the replicas, step; report the loss and the timed spans."""
        state = self.state
        if wait_for_sends:  # on a GPU the compute stream waits, so the dp average's communicator runs after them
            self.stop_draining()
            for request in state.sends:
                request.wait()
        if self.tie_sum is not None:
            self.tie_sum()
        if self.dp_average is not None:
            self.dp_average([p.grad for p in self.parameters() if p.grad is not None])
        if self.optimizer is not None and self.spec.pipedream_lr is None:
            self.optimizer.step() if self.apply_optimizer is None else self.apply_optimizer(self.optimizer)
        loss = float(sum(state.losses) / self.spec.microbatches) if state.losses else None
        return {"loss": loss, "spans": [s.as_tuple() for s in state.spans], "calls": list(state.calls)}

    # -- actions ----------------------------------------------------------------------------------------------

    def _run(self, action: Action) -> None:
        walk, position = self.state.walk, self.state.position  # the flight recorder notes the tick and the action
        recorder.doing = ("pipeline tick {}: {}", walk.ticks[position] if walk.ticks else "-", action)
        started = self.clock.mark()
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
        ended, call = self.clock.mark(), len(self.state.calls) - 1
        if self.clock.deferred:
            self.state.unsettled.append((action, started, ended, wait or 0.0, call))
        else:  # perf_counter is one clock for every process of a host: the notebook lines the ranks up by it
            self.state.spans.append(Span(str(action), started, ended, wait or 0.0, call))

    def _forward(self, a: Action) -> None:
        state, key = self.state, (a.stage, a.microbatch)
        if a.stage == 0:
            x = None if self.spec.pruned else state.inputs[a.microbatch]
        elif self._local(a.stage - 1):
            x = state.stage_outputs[(a.stage - 1, a.microbatch)].detach().requires_grad_()
        else:
            x = state.received.pop(Action(a.stage, RECV_F, a.microbatch))[0].requires_grad_()
        module = self.modules[a.stage]
        with self._autocast():
            if self.spec.pipedream_lr is not None:
                version = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
                state.stashed[key] = version
                y = functional_call(module, version, (x,))
            elif self.spec.pruned:
                y = module(x, state.inputs[a.microbatch])
            else:
                y = module(x)
            if a.stage == self.spec.stages - 1:
                loss = batches.loss_of(y, state.targets[a.microbatch], self.loss_fn)
                state.losses.append(loss.detach())
                y = loss / self.spec.microbatches  # the batch loss is the mean over equal micro-batches
                y = y if self.scale_loss is None else self.scale_loss(y)
        if a.stage < self.spec.stages - 1 and self.autocast_dtype is not None:
            y = _as_message(y, self.shapes[a.stage][1])
        state.stage_inputs[key], state.stage_outputs[key] = x, y

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def evaluate(self, inputs, targets, loss_fn) -> float | None:
        """The loss of one batch without gradients (evaluation): the forward actions of this rank's list, in its
        order, each receive waited for at once. Keeping only the forward half of a list that lets every message
        arrive removes waits and adds none, so this cannot hang where training does not (on the torch transport
        its own rounds: schedules/nccl.py checks them too). A new step epoch, so its messages never match a
        training step's. Returns the mean over the micro-batches on the last stage, None on the others."""
        self.begin(self.shapes, inputs, targets, loss_fn, walk="evaluation")
        state = self.state
        with torch.no_grad():
            for a in state.walk.program:
                self._post_ahead()
                if a.kind == RECV_F:
                    self._receive(a)
                elif a.kind == FORWARD:
                    self._forward(a)
                    state.stage_inputs.pop((a.stage, a.microbatch))
                elif a.kind == SEND_F:
                    self._send_activation(a)
                state.position += 1
            self._post_rounds(math.inf)
            for request in state.sends:
                request.wait()
        state.sends = []
        return float(sum(state.losses) / len(state.losses)) if state.losses else None

    def _output_and_grad(self, a: Action) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A stage's output and the gradient that flows into it: none on the last stage (the output is the loss),
        from the next stage on this rank, or received."""
        state, key = self.state, (a.stage, a.microbatch)
        y = state.stage_outputs[key]
        if a.stage == self.spec.stages - 1:
            return y, None
        if key in state.output_grads:
            return y, state.output_grads.pop(key)
        return y, state.received.pop(Action(a.stage, RECV_B, a.microbatch))[0]

    def _backward(self, a: Action) -> None:
        y, grad = self._output_and_grad(a)
        torch.autograd.backward(y, grad)
        self._after_backward(a)

    def _backward_input(self, a: Action) -> None:
        """I: only the gradient w.r.t. the stage's input, keeping the graph (and the output gradient) for W.
        Stage 0 has no input gradient to compute: its I does nothing and its W is its whole backward."""
        state, key = self.state, (a.stage, a.microbatch)
        y, grad = self._output_and_grad(a)
        state.kept_for_weights[key] = grad
        x = state.stage_inputs[key]
        if a.stage > 0:
            (x.grad,) = torch.autograd.grad(y, [x], grad, retain_graph=True)
            self._hand_on_input_grad(a, x.grad)

    def _backward_weight(self, a: Action) -> None:
        """W: the weight gradients, from the graph I kept."""
        state, key = self.state, (a.stage, a.microbatch)
        y, grad = state.stage_outputs[key], state.kept_for_weights.pop(key)
        params = self._grad_targets(a)
        if params:
            torch.autograd.backward(y, grad, inputs=params)
        self._after_backward(a)

    def _grad_targets(self, a: Action) -> list:
        stash = self.state.stashed.get((a.stage, a.microbatch))
        return list(stash.values()) if stash else list(self.modules[a.stage].parameters())

    def _hand_on_input_grad(self, a: Action, grad: torch.Tensor) -> None:
        """The gradient w.r.t. stage s's input is stage s-1's output gradient: kept here if s-1 is on this rank,
        else sent by the SEND_B that follows."""
        key = (a.stage - 1, a.microbatch)
        if self._local(a.stage - 1):
            self.state.output_grads[key] = grad
        else:
            self.state.grads_to_send[(a.stage, a.microbatch)] = grad

    def _after_backward(self, a: Action) -> None:
        """Free the activation; hand the input gradient on (after B: I already did); pipedream: update now."""
        state, key = self.state, (a.stage, a.microbatch)
        x = state.stage_inputs.pop(key)
        state.stage_outputs.pop(key)
        if a.kind == BACKWARD and a.stage > 0:
            self._hand_on_input_grad(a, x.grad)
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
                p -= self.spec.pipedream_lr * g

    def _send_activation(self, a: Action) -> None:
        self._send(a, self.state.stage_outputs[(a.stage, a.microbatch)].detach())

    def _send_gradient(self, a: Action) -> None:
        grad = self.state.grads_to_send.pop((a.stage, a.microbatch), None)
        if grad is None:
            raise RuntimeError(f"pipeline rank {self.spec.pipeline_rank}: {a} has no input gradient to send "
                               "(its backward has not run)")
        self._send(a, grad)

    def _send(self, a: Action, tensor: torch.Tensor) -> None:
        state = self.state
        if state.walk.rounds is not None:  # torch: posted with the receives of its round
            self._post_rounds(state.walk.ticks[state.position], send=(a, tensor))
        else:
            tag = message_tag(self.spec, self.epoch, a.matching(), self.transport.max_tag)
            state.sends.append(self.transport.isend(tensor, self._rank_of(a.peer_stage()), tag))

    def _receive(self, a: Action) -> float:
        _, request = self.state.received[a]
        waited = time.perf_counter()
        request.wait()
        return time.perf_counter() - waited

    def _post_ahead(self) -> None:
        """Before the next action: MPI posts the irecv of the next few receives, so that messages land while we
        compute; the torch transport posts every round before the action's tick."""
        state = self.state
        if state.walk.rounds is not None:
            self._post_rounds(state.walk.ticks[state.position] - 1)
            return
        receives = (a for a in state.walk.program[state.position:] if a.kind in (RECV_F, RECV_B))
        for a in itertools.islice(receives, RECEIVE_LOOKAHEAD):
            if a not in state.received:
                buffer, tag = self._buffer(a), message_tag(self.spec, self.epoch, a, self.transport.max_tag)
                state.received[a] = (buffer, self.transport.irecv(buffer, self._rank_of(a.peer_stage()), tag))

    def _post_rounds(self, through: float, send: tuple | None = None) -> None:
        """Torch transport: post the walk's rounds up to tick `through`, in order, each as one group of sends and
        receives. `send`: (action, tensor) of the SEND being run, the one send a round may hold (its own tick)."""
        state, rounds = self.state, self.state.walk.rounds
        while rounds is not None and state.round < len(rounds) and rounds[state.round][0] <= through:
            ops = []
            for a in rounds[state.round][1]:
                peer = self._rank_of(a.peer_stage())
                if a.kind in (RECV_F, RECV_B):
                    ops.append((False, self._buffer(a), peer))
                elif send is not None and send[0] == a:
                    ops.append((True, send[1], peer))
                else:
                    raise RuntimeError(f"pipeline rank {self.spec.pipeline_rank}: {a} is due in the round of tick "
                                       f"{rounds[state.round][0]} but has not run")
            request = self.transport.post(ops)
            for a, (sending, tensor, _) in zip(rounds[state.round][1], ops):
                if sending:
                    state.sends.append(request)
                else:
                    state.received[a] = (tensor, request)
            state.round += 1

    def _buffer(self, a: Action) -> torch.Tensor:
        """Where receive `a` lands: an activation into stage s has stage s-1's output shape, a gradient into stage s
        has stage s's output's."""
        shape, dtype = self.shapes[a.stage - 1 if a.kind == RECV_F else a.stage]
        return torch.empty(shape, dtype=dtype, device=self.device)

    # -- placement ----------------------------------------------------------------------------------------------

    def _rank_of(self, stage: int) -> int:
        """The pipeline rank holding `stage` (looped placement: stage s on rank s mod p)."""
        return stage % self.spec.pipeline_ranks

    def _local(self, stage: int) -> bool:
        return stage in self.modules


def _as_message(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stage's output in the dtype its message was sized for (float32 under bf16 autocast: an autocast op's
    output may be bf16). The cast is part of the graph, so the gradient that comes back is cast back too."""
    return y.to(dtype) if y.is_floating_point() and dtype.is_floating_point and y.dtype != dtype else y

