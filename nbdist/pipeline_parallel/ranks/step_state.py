"""What one rank's pipeline step keeps between actions and between a Stepper's calls (runs ON the engines): the
action list it walks and, by (stage, micro-batch), the activations, gradients and messages of the step
(executor.py runs the actions)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nbdist.pipeline_parallel.ranks.clocks import Span
from nbdist.schedules.actions import Action

Key = tuple[int, int]  # (stage, micro-batch)


@dataclass(frozen=True)
class Walk:
    """An action list as this rank walks it: its actions, their lockstep ticks, and on the torch transport the
    rounds its messages are posted in (schedules/nccl.py: rounds); None on MPI (receives posted ahead, by tag)."""

    program: tuple[Action, ...]
    ticks: tuple[int, ...]
    rounds: tuple | None = None


@dataclass
class StepState:
    """Everything one step keeps between actions (and between a Stepper's calls), by (stage, micro-batch)."""

    inputs: list = field(default_factory=list)  # micro-batches of the first stage's input
    targets: list = field(default_factory=list)  # micro-batches of the last stage's targets
    stage_inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # what F took (requires grad)
    stage_outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # what F made (the loss on the last stage)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # gradient of an output, from a local stage
    kept_for_weights: dict[Key, torch.Tensor | None] = field(default_factory=dict)  # output gradient I keeps for W
    grads_to_send: dict[Key, torch.Tensor] = field(default_factory=dict)  # input gradients a SEND_B will send
    stashed: dict[Key, dict] = field(default_factory=dict)  # parameter version the forward used (pipedream)
    walk: Walk | None = None  # the list being walked: the step's, or evaluation's forward-only one
    round: int = 0  # torch transport: the next of the walk's rounds to post
    received: dict[Action, tuple] = field(default_factory=dict)  # receive action -> (buffer, request)
    sends: list = field(default_factory=list)  # requests of sends not known to be complete
    losses: list = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    unsettled: list[tuple] = field(default_factory=list)  # (action, start mark, end mark, wait, call) on a GPU clock
    position: int = 0  # the next action of the walk
    calls: list[float] = field(default_factory=list)  # when each call of this step left its barrier
    report: dict | None = None  # the finished step's report (kept: a finished rank is still called while stepping)
