"""When each pipeline action ran, on the host or on the GPU (this code runs ON the engines).

On CPU an action is done when its Python call returns, so `perf_counter` before and after is its span (one clock for
every process of a host). On a GPU the call only queues kernels, and waiting for a message on NCCL only makes the
compute stream wait: host times would show launches, not work. There every action is bracketed by CUDA events on the
current stream, read after the call's work is synchronised and placed on the host clock through an anchor (an event
recorded, after a synchronise, at the host time the call began), so measured timelines mean the same on both.
"""
from __future__ import annotations

import time

import torch


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
    """GPU: a mark is a CUDA event on the current stream; `seconds` is valid once `settle` has run."""

    deferred = True

    def __init__(self, device: torch.device):
        self.device = device
        self.anchor = None

    def call_began(self) -> None:
        torch.cuda.synchronize(self.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.anchor = (time.perf_counter(), event)

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return self.anchor, event

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    @staticmethod
    def seconds(mark) -> float:
        (host, anchor), event = mark
        return host + anchor.elapsed_time(event) / 1e3


def clock_for(device: torch.device):
    return CudaClock(device) if device.type == "cuda" else HostClock()
