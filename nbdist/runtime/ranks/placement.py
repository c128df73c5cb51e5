"""One engine, one device: where a rank's models, optimizer state, batches and measurements live (runs ON the
engines).

Why one module: an engine binds one device at boot (its GPU, or the CPU: runtime/ranks/devices.py decides), and
every path that builds a model or times a step must agree with it, or a GPU user's first step stops on a device
mismatch while `%dist_status` says `cuda:0`. So the paths ask here, not torch and not their own copy of the rule:
- `here()` is the rank's device; `place(model)` moves a model built on CPU by the user's function there, once,
  where a plan is applied (before tensor parallelism, FSDP2 or DDP wrap it); `to_here(*tensors)` moves batches.
- `synchronize()` waits for the rank's own device (never "the current device" of some thread: a fresh thread's is
  cuda:0); `clock_for` / `stopwatch` read CUDA events on a GPU (the host only queues kernels there) and the host
  clock on CPU: the one clock of sharded steps, layer timings and pipeline actions.
- `memory_report()` gives the free bytes a plan is checked against before anything is built
  (nbdist.checks.fits); `named_out_of_memory`
  turns an allocation that fails during a step into one line naming the rank, the phase and the bytes, and frees
  what the step held so the engine stays usable.
"""
from __future__ import annotations

import contextlib
import gc
import re
import time
from collections.abc import Iterator

import torch
from torch import nn

from nbdist.errors import DistUsageError
from nbdist.runtime.ranks.rank import this_rank
from nbdist.units import format_bytes


def here() -> torch.device:
    """This rank's device: what boot bound and `%dist_status` shows."""
    return torch.device(this_rank().device)


def place(model: nn.Module) -> nn.Module:
    """`model` with its parameters and buffers on this rank's device (in place; a no-op where they are). A model
    left on torch's meta device has no values to move: refused in one line."""
    device = here()
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise DistUsageError("the model is on the meta device (no values): build it with real tensors, or call "
                             "model.to_empty(device=...) and initialise it in your model function")
    return model.to(device)


def to_here(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` on this rank's device."""
    device = here()
    return tuple(t.to(device) for t in tensors)


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the queued work of `device` (default: this rank's); nothing to wait for on CPU."""
    device = here() if device is None else device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    """GPU: a mark is a CUDA event on the compute stream, placed on the host clock through an anchor (an event
    recorded, with the compute stream idle, at the host time `call_began` ran); `seconds` is valid once `settle` has
    run. Settling waits for the last event recorded, never the whole device (`torch.cuda.synchronize` would wait for
    NCCL's streams too, where a message posted for a later call may still wait for its peer)."""

    deferred = True

    def __init__(self, device: torch.device):
        self.device = device
        self.anchor = None
        self.last = None  # the latest event recorded: settling waits for it, and so for everything before it

    def call_began(self) -> None:
        """The anchor: the compute stream is idle (earlier work settled), so an event recorded now completes at
        about this host time."""
        torch.cuda.current_stream(self.device).synchronize()
        self.anchor = (time.perf_counter(), self._record())

    def mark(self):
        return self.anchor, self._record()

    def settle(self) -> None:
        """Wait for the work on the compute stream up to its last event."""
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


def clock_for(device: torch.device) -> HostClock | CudaClock:
    """The device's own clock: marks on the host on CPU, CUDA events on a GPU (the host only queues kernels)."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


def stopwatch(device: torch.device | None = None) -> HostClock | CudaClock:
    """A started clock of `device` (default: this rank's): mark(), settle(), then seconds(mark), a host time."""
    clock = clock_for(here() if device is None else device)
    clock.call_began()
    return clock


def timed(fn, device: torch.device | None = None) -> float:
    """Seconds `fn()` takes on `device` (default: this rank's), its queued GPU work included."""
    watch = stopwatch(device)
    start = watch.mark()
    fn()
    end = watch.mark()
    watch.settle()
    return watch.seconds(end) - watch.seconds(start)


def tensor_devices(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """Every device the model's parameters, buffers and gradients and the optimizer's state lie on (a DTensor's own
    shard counts): one entry, the rank's device, when the rule holds. Optimizer entries named "step" are skipped:
    torch keeps Adam's step counter on CPU by design (unless capturable or fused)."""
    found = set()
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for k, v in state.items()
                    if k != "step" and isinstance(v, torch.Tensor)]
    for t in tensors:
        found.add(str(getattr(t, "_local_tensor", t).device))
    return sorted(found)


# -- memory -----------------------------------------------------------------------------------------------------------


def free_bytes(device: torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes where this rank's tensors go: the GPU's, as CUDA reports them, or on CPU the host's
    available and physical memory (which the engines of that host share: the kernel divides)."""
    device = here() if device is None else device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def memory_report() -> dict:
    """This rank's device and its free and total bytes (what a plan is checked against before it is built)."""
    free, total = free_bytes()
    info = this_rank()
    return {"rank": info.rank, "device": info.device, "free": free, "total": total}


_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch.cuda's before 2.5
# the size in CUDA's message ("Tried to allocate 20.00 MiB") and the CPU allocator's ("you tried to allocate N bytes")
_TRIED = re.compile(r"tried to allocate\s+([\d.]+)\s*(bytes|[KMGT]iB|B)?", re.IGNORECASE)
_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def allocation_failed(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: CUDA's OutOfMemoryError, or the CPU allocator's refusal
    (a RuntimeError saying it could not allocate)."""
    if isinstance(error, _OUT_OF_MEMORY):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("DefaultCPUAllocator" in text or "can't allocate memory" in text)


def out_of_memory_line(error: str, rank: int, device: str, phase: str, free: int | None) -> str:
    """One line for an allocation that failed: the rank, its device, the phase and the bytes asked for and free."""
    found = _TRIED.search(error)
    asked = ""
    if found:
        asked = " of " + format_bytes(float(found.group(1)) * _UNITS.get((found.group(2) or "").lower(), 1))
    left = "" if free is None else f"; {format_bytes(free)} free"
    return (f"rank {rank} ({device}) ran out of memory during {phase}: an allocation{asked} failed{left}; the step was "
            f"abandoned and its tensors freed (the engines stay usable): use a smaller batch, more micro-batches, a "
            f"higher ZeRO stage or more engines")


@contextlib.contextmanager
def named_out_of_memory(phase: str, release=None) -> Iterator[None]:
    """Run a step's `phase` ("forward of micro-batch 2", ...); an allocation that fails inside it becomes one
    DistUsageError line (out_of_memory_line), after `release()` (the caller drops what the step held: gradients,
    activations) and the device's cache are freed, so the next cell runs on an engine with its memory back."""
    text = None
    try:
        yield
    except Exception as error:
        if not allocation_failed(error):
            raise
        text = str(error)
    if text is None:
        return
    # out of the except block: the failed allocation's traceback (which holds the step's tensors) is gone
    info = this_rank()
    if release is not None:
        release()
    gc.collect()
    device = torch.device(info.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    raise DistUsageError(out_of_memory_line(text, info.rank, info.device, phase, free_bytes(device)[0]))
