"""When each pipeline action ran, on the host or on the GPU (this code runs ON the engines): a Span per action,
measured with the rank's clock (runtime/ranks/placement.py: HostClock, CudaClock).

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

from dataclasses import dataclass


@dataclass
class Span:
    action: str
    start: float
    end: float
    wait: float = 0.0  # seconds spent waiting for a message
    call: int = 0  # which call of the step ran it (a Stepper's clicks; a full-speed step is one call)

    def as_tuple(self) -> tuple:
        return (self.action, self.start, self.end, self.wait, self.call)
