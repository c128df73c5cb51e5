"""When each pipeline action ran, on the host or on the GPU (this code runs ON the engines).

On CPU an action is done when its Python call returns, so `perf_counter` before and after is its span (one clock for
every process of a host). On a GPU the call only queues kernels, and waiting for a message on NCCL only makes the
compute stream wait: host times would show launches, not work. There every action is bracketed by CUDA events on the
compute stream, read once the call's last event has completed and placed on the host clock through an anchor (an
event recorded, with the compute stream idle, at the host time the call began), so measured timelines mean the same
on both: a compute span is the work, a receive's span how long the compute stream (the host, on CPU) waited for the
message, a send's span its posting (its completion is never read: it is no rank's work).

What a call waits for, on a GPU: its compute stream, up to the call's last event. That holds the call's compute and
the message batches of the receives it ran, whose partners are all posted by the end of the call (schedules/nccl.py:
rounds, check_stepping). Never `torch.cuda.synchronize()`, which waits for the whole device: NCCL's streams too,
where a message posted for a later call (a Stepper stops the ranks between two ticks) may still wait for its peer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Span:
    action: str
    start: float
    end: float
    wait: float = 0.0  # seconds spent waiting for a message
    call: int = 0  # which call of the step ran it (a Stepper's clicks; a full-speed step is one call)

    def as_tuple(self) -> tuple:
        return (self.action, self.start, self.end, self.wait, self.call)


class HostClock:
    """CPU: a mark is the host time; nothing to settle."""

    deferred = False

    def call_began(self) -> None:
        pass

    def mark(self):
        return time.perf_counter()

    def settle(self) -> None:
        pass

    def seconds(self, mark) -> float:
        return mark


class CudaClock:
    """GPU: a mark is a CUDA event on the compute stream; `seconds` is valid once `settle` has run."""

    deferred = True

    def __init__(self, device: torch.device):
        self.device = device
        self.anchor = None
        self.last = None  # the latest event recorded: settling waits for it, and so for everything before it

    def call_began(self) -> None:
        """The anchor: the compute stream is idle (its earlier calls settled), so an event recorded now completes at
        about this host time."""
        torch.cuda.current_stream(self.device).synchronize()
        self.anchor = (time.perf_counter(), self._record())

    def mark(self):
        return self.anchor, self._record()

    def settle(self) -> None:
        """Wait for the call's work on the compute stream: its last event (not the device: see the module's doc)."""
        if self.last is not None:
            self.last.synchronize()

    def _record(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self.last = event
        return event

    @staticmethod
    def seconds(mark) -> float:
        (host, anchor), event = mark
        return host + anchor.elapsed_time(event) / 1e3


def clock_for(device: torch.device):
    return CudaClock(device) if device.type == "cuda" else HostClock()
