"""The timed loops of `nbdist.collectives.benchmark` (runs ON the engines): one collective, one way ("torch" or
"mpi"), one size, checked, warmed up, calibrated and timed on this rank.

The notebook side (nbdist/collectives/sweep.py) validates the request, sends `measure` to every rank and turns
the per-rank reports into rows; the conventions (nccl-tests' sizes, times and bandwidths) are described there.
Every rank makes the same calls in the same order, whatever its data: a collective called on some ranks only would
wait forever. The groups of the first ranks are made once and kept in the engine registry
(nbdist/cluster/meshes/ranks/groups.py).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from nbdist.cluster.meshes.ranks import groups
from nbdist.collectives.ops import ELEMENT_BYTES, GLOO_REDUCE_SCATTER_NOTE, ROOT
from nbdist.collectives.replies import MpiWorld, Timed
from nbdist.runtime.ranks.compat import all_gather_single, reduce_scatter_single
from nbdist.runtime.ranks.devices import backend_for

MAX_ITERS = 1_000_000
CALIBRATE_SECONDS = 0.005  # a calibration loop shorter than this is too close to the clock to trust


def mpi_world() -> MpiWorld:
    """Whether this engine can use MPI for the benchmark: its MPI rank and size beside torch.distributed's."""
    if not dist.is_initialized():
        return MpiWorld(problem="torch.distributed is not initialised on this engine")
    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        from mpi4py import MPI
    except ImportError as e:
        return MpiWorld(rank, size, problem=f"mpi4py cannot be imported on the engines ({e})")
    return MpiWorld(rank, size, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())


def measure(op: str, via: str, size: int, iters: int | None, warmup: int, check: bool, target_seconds: float,
            members: int | None = None) -> Timed | None:
    """Check (optional), warm up, calibrate and time `op` through `via` on S = `size` bytes among ranks
    0..members-1 (default: all); seconds per op. Call on every rank; None on a rank outside them."""
    members = members or dist.get_world_size()
    group = groups.first_ranks(members)  # collective over the world the first time: members or not
    if dist.get_rank() >= members:
        return None
    comm = groups.mpi_comm(range(members)) if via == "mpi" else None  # the members' own, made once
    return _time(Collective(op, via, size, members, dist.get_rank(), group, comm), iters, warmup, check,
                 target_seconds)


def _time(bench: "Collective", iters: int | None, warmup: int, check: bool, target_seconds: float) -> Timed:
    """This rank's report for one collective: checked (optional), warmed up, calibrated, timed."""
    try:  # a backend without this op says so on the first call, on every rank alike
        wrong = _first_call(bench, check)
    except RuntimeError as e:
        if "support" not in str(e):
            raise
        return Timed(bench.rank, bench.backend, f"{bench.backend}: {str(e).splitlines()[0]}", unsupported=True)
    bench.zero()
    for _ in range(warmup):
        bench.call()
    count = iters or _calibrate(bench, target_seconds)
    bench.barrier()
    seconds = bench.timed(count) / count
    return Timed(bench.rank, bench.backend, bench.note, seconds, count, wrong)


def _first_call(bench: "Collective", check: bool) -> str | None:
    """With check, run the op once on rank-dependent values: None if the result is exactly right, else what is
    wrong. Without, just call it once."""
    if check:
        bench.fill()
    bench.call()
    return bench.verify() if check else None


def _calibrate(bench: "Collective", target_seconds: float) -> int:
    """Iterations for a loop of about target_seconds, the same on every rank: loops of k = 1, 10, 100, ... until
    one lasts long enough to measure (slowest rank's time), then scale."""
    k = 1
    while True:
        bench.barrier()
        elapsed = bench.agree_max(bench.timed(k))
        if elapsed >= min(CALIBRATE_SECONDS, target_seconds / 2) or k >= MAX_ITERS:
            return max(1, min(MAX_ITERS, round(target_seconds * k / elapsed)))
        k = min(MAX_ITERS, k * 10)


def _fill_values(count: int, rank: int, start: int = 0):
    """Rank-dependent, position-dependent float32 integers: (i mod 251) + 256(rank + 1) for i from start.
    Sums over up to a few hundred ranks stay exact in float32 (below 2**24)."""
    i = torch.arange(start, start + count, dtype=torch.int64)
    return ((i % 251) + 256 * (rank + 1)).to(torch.float32)


def _torch_device(group) -> torch.device:
    """Where "torch" measures: on this rank's GPU when the group sends CUDA tensors through nccl (GPU engines:
    "cpu:gloo,cuda:nccl", or "nccl"), else on CPU."""
    if backend_for(dist.get_backend(group), "cuda") == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Collective:
    """One op, one via, one size, on this rank: buffers, the call, its expected result."""

    def __init__(self, op: str, via: str, size: int, n: int, rank: int, group=None, comm=None):
        self.op, self.via, self.n, self.rank = op, via, n, rank
        self.group, self.comm = group, comm  # torch group (None: the default one), MPI communicator (via="mpi")
        self.count = size // ELEMENT_BYTES
        self.chunk = self.count // n
        self.device = _torch_device(group) if via == "torch" else torch.device("cpu")
        self.backend = backend_for(dist.get_backend(group), self.device.type) if via == "torch" else _mpi_library()
        self.note = GLOO_REDUCE_SCATTER_NOTE if (via, self.backend, op) == ("torch", "gloo", "reduce_scatter") else ""
        send, recv = {"all_reduce": (self.count, 0), "broadcast": (self.count, 0),
                      "all_gather": (self.chunk, self.count), "reduce_scatter": (self.count, self.chunk),
                      "all_to_all": (self.count, self.count)}[op]
        self.send = torch.zeros(send, device=self.device)
        self.recv = torch.zeros(recv, device=self.device) if recv else self.send  # in place when no output
        self.call = self._torch_call() if via == "torch" else self._mpi_call()

    # -- the call

    def _torch_call(self):
        send, recv, group = self.send, self.recv, self.group
        return {
            "all_reduce": lambda: dist.all_reduce(send, group=group),
            "all_gather": lambda: all_gather_single(recv, send, group=group),
            "reduce_scatter": lambda: reduce_scatter_single(recv, send, group=group),
            "broadcast": lambda: dist.broadcast(send, src=ROOT, group=group),  # ROOT = 0 is in every group here
            "all_to_all": lambda: dist.all_to_all_single(recv, send, group=group),
        }[self.op]

    def _mpi_call(self):
        from mpi4py import MPI

        comm = self.comm
        send, recv = self.send.numpy(), self.recv.numpy()  # views of the tensors' memory, not copies
        return {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM),
            "all_gather": lambda: comm.Allgather(send, recv),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(send, root=ROOT),
            "all_to_all": lambda: comm.Alltoall(send, recv),
        }[self.op]

    # -- timing

    def barrier(self) -> None:
        """The barrier of the way being measured (gloo's or MPI's), then the GPU idle, so that all start together."""
        if self.via == "torch":
            dist.barrier(group=self.group)
        else:
            self.comm.Barrier()
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, k: int) -> float:
        """Seconds for k back-to-back calls on this rank (waiting for the GPU at the end, as nccl-tests does)."""
        call = self.call
        started = time.perf_counter()
        for _ in range(k):
            call()
        self._sync()
        return time.perf_counter() - started

    def agree_max(self, value: float) -> float:
        """The largest of every rank's value (torch.distributed: present on every engine, whatever the via)."""
        device = "cpu" if backend_for(dist.get_backend(self.group), "cpu") else _torch_device(self.group)
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    # -- checking

    def zero(self) -> None:
        """Timing runs on zeros: an all-reduce repeated in place on them stays zero (no overflow to inf)."""
        self.send.zero_()
        self.recv.zero_()

    def fill(self) -> None:
        """Inputs for the check; outputs set to -1, so that an output left unwritten shows."""
        if self.op == "broadcast" and self.rank != ROOT:
            self.send.fill_(-1)
        else:
            self.send.copy_(_fill_values(self.send.numel(), self.rank))
        if self.recv is not self.send:
            self.recv.fill_(-1)

    def expected(self):
        """What every rank must hold after one call on `fill`'s values."""
        n, chunk = self.n, self.chunk
        if self.op == "all_reduce":
            return sum(_fill_values(self.count, r) for r in range(n))
        if self.op == "broadcast":
            return _fill_values(self.count, ROOT)
        if self.op == "all_gather":
            return torch.cat([_fill_values(chunk, r) for r in range(n)])
        if self.op == "reduce_scatter":
            return sum(_fill_values(chunk, r, start=self.rank * chunk) for r in range(n))
        return torch.cat([_fill_values(chunk, r, start=self.rank * chunk) for r in range(n)])  # all_to_all

    def verify(self) -> str | None:
        got, want = self.recv.cpu(), self.expected()
        if got.shape == want.shape and bool((got == want).all()):
            return None
        wrong = (got != want).nonzero()
        if got.shape != want.shape or wrong.numel() == 0:
            return f"output has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        i = int(wrong[0])
        return f"element {i} of {got.numel()} is {got[i].item():g}, expected {want[i].item():g} ({wrong.numel()} wrong)"


def _mpi_library() -> str:
    """'MPICH 5.0.2', 'Open MPI v5.0.3', ...: the MPI shown in the via column."""
    from mpi4py import MPI

    first = (MPI.Get_library_version().strip().splitlines() or ["MPI"])[0]
    if "Version:" in first:  # MPICH and its derivatives: "MPICH Version:      5.0.2"
        name, _, version = first.partition("Version:")
        return f"{name.strip()} {version.strip()}"
    return first.split(",")[0].strip() or "MPI"  # Open MPI: "Open MPI v5.0.3, package: ..."
