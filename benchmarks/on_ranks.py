"""What the benchmarks run on the engines (imported there: nbdist gives the engines the kernel's import path, which
holds the running script's folder, benchmarks/).

Every function here runs on one rank. What a benchmark keeps between calls (torch's pipeline stages, the DDP
models) lives in nbdist's engine registry under the kind "benchmark", like any nbdist feature's rank state:
`%dist_status` lists it and a restart clears it.
"""
from __future__ import annotations

import time

import cloudpickle
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from nbdist.cluster.meshes.ranks import rank_mesh
from nbdist.pipeline_parallel.ranks import pairs, pipeline
from nbdist.pipeline_parallel.ranks.transport import make_transport
from nbdist.runtime.ranks import registry

KIND = "benchmark"
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


# -- nbdist ---------------------------------------------------------------------------------------------------------


def nbdist_steps(args: tuple, k: int) -> dict:
    """k full-speed steps of an nbdist pipeline back to back, each exactly as Pipeline.step runs it
    (nbdist.pipeline_parallel.ranks.pipeline.step with the arguments Pipeline.step_args gives; every step starts with the
    pipeline's barrier). This rank's start and end (perf_counter, after a barrier) and each step's report."""
    dist.barrier()
    start = time.perf_counter()
    reports = [pipeline.step(*args) for _ in range(k)]
    return {"start": start, "end": time.perf_counter(), "reports": reports}


def _pair_groups(me, transport: str) -> dict | None:
    """The torch transport sends over one process group per pipeline (pipeline_parallel/ranks/pairs.py), made once
    per mesh like a pipeline's (collective: every rank of the world runs pingpong)."""
    if transport != "torch":
        return None
    name = f"bench-p2p-{me.mesh.name}"
    if registry.find(pairs.KIND, name) is None:
        pairs.connect(name, me.mesh)
    return registry.find(pairs.KIND, name)


def pingpong(mesh: str, transport: str, shape: tuple, count: int, tags: tuple) -> list[float]:
    """Round trips (seconds) of one tensor between pipeline ranks 0 and 1 of `mesh` through nbdist's transport,
    timed on rank 0 (the others return [])."""
    me = rank_mesh.here(mesh)
    t = make_transport(transport, me, torch.device("cpu"), _pair_groups(me, transport))
    rank = me.coord("pp")
    buf = torch.ones(shape)
    dist.barrier()
    out = []
    for _ in range(count):
        started = time.perf_counter()
        if rank == 0:
            t.isend(buf, 1, tags[0]).wait()
            t.irecv(buf, 1, tags[1]).wait()
        elif rank == 1:
            t.irecv(buf, 0, tags[0]).wait()
            t.isend(buf, 0, tags[1]).wait()
        out.append(time.perf_counter() - started)
    return out if rank == 0 else []


# -- the anchor: torch.distributed.pipelining -----------------------------------------------------------------------


class TorchStage:
    """This rank's torch `PipelineStage` and schedule (ScheduleGPipe / Schedule1F1B) over the same layers nbdist's
    split gives it, built from the same model function."""

    def __init__(self, build: bytes, ranges: list, schedule: str, microbatches: int, loss_fn: bytes):
        self.rank, self.p = dist.get_rank(), len(ranges)
        self.first_layer, end = ranges[self.rank]
        self.module = torch.nn.Sequential(*list(cloudpickle.loads(build)())[self.first_layer:end])
        stage = PipelineStage(self.module, self.rank, self.p, device=torch.device("cpu"))
        self.schedule = TORCH_SCHEDULES[schedule](stage, n_microbatches=microbatches,
                                                  loss_fn=cloudpickle.loads(loss_fn))

    def step(self, x, y) -> float | None:
        """One step, gradients cleared first (as nbdist's begin does); the loss on the last rank."""
        self.module.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(x, return_outputs=False)
        elif self.rank == self.p - 1:
            losses = []
            self.schedule.step(target=y, losses=losses, return_outputs=False)
            return float(torch.stack(losses).mean())
        else:
            self.schedule.step(return_outputs=False)
        return None

    def describe(self) -> str:
        return f"torch {type(self.schedule).__name__}, stage {self.rank} of {self.p} (benchmark anchor)"

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


def torch_setup(key: str, build: bytes, ranges: list, schedule: str, microbatches: int, loss_fn: bytes) -> str:
    return registry.put(KIND, key, TorchStage(build, ranges, schedule, microbatches, loss_fn)).describe()


def torch_step(key: str, x, y) -> float | None:
    return registry.get(KIND, key).step(x, y)


def torch_steps(key: str, x, y, k: int) -> dict:
    """k torch steps back to back after a barrier; this rank's start and end (perf_counter)."""
    stage = registry.get(KIND, key)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(k):
        stage.step(x, y)
    return {"start": start, "end": time.perf_counter()}


def torch_grads(key: str) -> dict:
    """This rank's gradients after the last step, and the index of its first layer in the unsplit model."""
    stage = registry.get(KIND, key)
    return {"first_layer": stage.first_layer,
            "grads": {k: p.grad.detach().clone() for k, p in stage.module.named_parameters()}}


def drop(key: str) -> None:
    registry.drop(KIND, key)


# -- data parallel: DDP with nbdist's MPI hook against DDP's own all-reduce over gloo -------------------------------

DDP_SIDES = ("mpi", "gloo", "local", "ddp")


class DdpSides:
    """Four copies of one model on this rank (built by the same function, so equal), each with its SGD optimizer
    and this rank's shard of one global batch:
      mpi    DistributedDataParallel with its defaults + nbdist's MPI hook (`register_hook(model, "mpi")`);
      gloo   the same DDP with no hook: DDP's built-in all-reduce over gloo (the anchor);
      local  the bare model, no DDP: the compute alone;
      ddp    `nbdist.data_parallel.ranks.ddp.ddp(model)` as a notebook gets it (MPI hook, gradient_as_bucket_view=True)."""

    def __init__(self, build: bytes, x, y, lr: float):
        from torch.nn.parallel import DistributedDataParallel

        from nbdist.data_parallel.ranks.ddp import ddp
        from nbdist.data_parallel.ranks.hooks import register_hook

        make = cloudpickle.loads(build)
        self.shard = x, y
        self.models, self.optimizers = {}, {}
        for side in DDP_SIDES:
            module = make()
            if side == "local":
                model = module
            else:
                model = ddp(module) if side == "ddp" else DistributedDataParallel(module)
            self.models[side] = model
            self.optimizers[side] = torch.optim.SGD(model.parameters(), lr=lr)
        self.hook_state = register_hook(self.models["mpi"], "mpi")

    def steps(self, side: str, k: int) -> dict:
        """k training steps of one side after an MPI barrier; this rank's start and end (perf_counter)."""
        from mpi4py import MPI

        model, optimizer = self.models[side], self.optimizers[side]
        x, y = self.shard
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        for _ in range(k):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        return {"start": start, "end": time.perf_counter(), "loss": loss.item()}

    def compare(self) -> dict:
        """Largest parameter difference of the MPI and ddp() sides from the gloo side (equal steps from equal
        starts), and the MPI side's bucket sizes (bytes)."""
        diff = 0.0
        for side in ("mpi", "ddp"):
            pairs = zip(self.models[side].parameters(), self.models["gloo"].parameters())
            diff = max(diff, *(float((a - b).detach().abs().max()) for a, b in pairs))
        return {"max_param_diff": diff, "bucket_bytes": list(self.hook_state.bucket_bytes)}

    def describe(self) -> str:
        return "DDP sides mpi / gloo / local / ddp() (benchmark)"

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for m in self.models.values() for p in m.parameters())


def ddp_setup(key: str, build: bytes, x, y, lr: float) -> int:
    """Build the four sides from this rank's shard; returns torch's threads on this rank."""
    registry.put(KIND, key, DdpSides(build, x, y, lr))
    return torch.get_num_threads()


def ddp_steps(key: str, side: str, k: int) -> dict:
    return registry.get(KIND, key).steps(side, k)


def ddp_compare(key: str) -> dict:
    return registry.get(KIND, key).compare()


class _Bucket:
    """What a DDP hook reads of a gradient bucket: its flat buffer."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self.tensor


def allreduce_latency(sizes: list[int], count: int, repeats: int) -> dict:
    """Seconds per all-reduce of a float32 bucket of each size (bytes): gloo (`dist.all_reduce`, as DDP's built-in
    calls it) and nbdist's MPI hook called on a stand-in bucket; interleaved, an MPI barrier before each call,
    the first two of each side untimed."""
    from mpi4py import MPI

    from nbdist.data_parallel.ranks.hooks import mpi_allreduce_hook

    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        calls = {"gloo": lambda: dist.all_reduce(t), "mpi": lambda: mpi_allreduce_hook(None, _Bucket(t)).wait()}
        samples: dict[str, list[float]] = {"gloo": [], "mpi": []}
        for rep in range(repeats * count + 2):
            for side in ("gloo", "mpi") if rep % 2 else ("mpi", "gloo"):
                MPI.COMM_WORLD.Barrier()
                started = time.perf_counter()
                calls[side]()
                if rep >= 2:
                    samples[side].append(time.perf_counter() - started)
        out[str(nbytes)] = samples
    return out


# -- collectives: what one writes by hand to time an all-reduce ------------------------------------------------------


def plain_all_reduce(nbytes: int, k: int, warmup: int) -> float:
    """A float32 buffer of `nbytes`, `warmup` untimed all-reduces, a barrier, k all-reduces timed: seconds each."""
    x = torch.ones(nbytes // 4)
    for _ in range(warmup):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(k):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / k


# -- tensor parallel: one MLP split over every rank (DTensor), on whatever backend the cluster started with ---------


class TensorParallelMlp:
    """The model `build` makes, its Linear layers alternately column- and row-parallel over all ranks
    (`parallelize_module`), SGD, and one batch every rank sees whole (tensor parallelism splits the weights)."""

    def __init__(self, build: bytes, x, y, lr: float, communicate: bool = True):
        """`communicate=False`: the mesh's group is one whose collectives do nothing (no_communication_mesh), so a
        step costs what torch's own path and the compute cost, as if a backend took no time at all."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = cloudpickle.loads(build)()
        linears = [name for name, m in model.named_children() if isinstance(m, torch.nn.Linear)]
        plan = {name: ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i, name in enumerate(linears)}
        mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if communicate else no_communication_mesh()
        self.model = parallelize_module(model, mesh, plan)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.batch = x, y

    def steps(self, k: int) -> dict:
        """k training steps after a barrier; this rank's start and end (perf_counter) and the last loss."""
        x, y = self.batch
        dist.barrier()
        start = time.perf_counter()
        for _ in range(k):
            self.optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
        return {"start": start, "end": time.perf_counter(), "loss": loss.item()}

    def describe(self) -> str:
        return "a tensor-parallel MLP (benchmark)"

    def memory_bytes(self) -> int:
        return sum(p.to_local().numel() * p.element_size() for p in self.model.parameters())


def tp_setup(key: str, build: bytes, x, y, lr: float, communicate: bool = True) -> str:
    registry.put(KIND, key, TensorParallelMlp(build, x, y, lr, communicate))
    return str(dist.get_backend()) if communicate else "no communication"


def tp_steps(key: str, k: int) -> dict:
    return registry.get(KIND, key).steps(k)


# -- what one small all-reduce costs, piece by piece (bench_mpi_backend.py) ------------------------------------------


NOTHING = "nbdist_bench_nothing"  # the backend whose groups are _NothingGroups


class _NothingGroup(dist.ProcessGroup):
    """A process group whose collectives do nothing (their outputs are left as they are): what torch's own path
    costs around any backend written in Python (`dist.all_reduce`; DTensor's functional collectives), the floor
    under nbdist's MPI backend."""

    def __init__(self, rank: int, size: int, name: str = "nothing"):
        from nbdist.backend.ranks.mpi_work import done

        super().__init__(rank, size)
        self._done = done()  # the completed Work the MPI backend's waited-for calls return
        self._name = name

    def getBackendName(self) -> str:
        return "nothing"

    def _get_backend(self, device):
        return self

    @property
    def group_name(self) -> str:
        return self._name

    def _nothing(self, *args, **kwargs):
        return self._done

    allreduce = allreduce_coalesced = broadcast = barrier = allgather = _allgather_base = _nothing
    allgather_into_tensor_coalesced = reduce_scatter = _reduce_scatter_base = _nothing
    reduce_scatter_tensor_coalesced = alltoall_base = scatter = gather = _nothing


def no_communication_mesh():
    """A 1-D DeviceMesh over every rank whose group is a _NothingGroup (registered as a backend of its own, as
    nbdist's MPI backend is, so that DTensor's functional collectives find it by name)."""
    from torch.distributed.device_mesh import DeviceMesh

    if NOTHING.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NOTHING, lambda options, _=None: _NothingGroup(
            options.group_rank, options.group_size, str(options.group_id)), extended_api=True, devices=["cpu"])
    return DeviceMesh.from_group(dist.new_group(backend=NOTHING), "cpu")


def small_call_costs(nbytes: int, k: int) -> dict:
    """Microseconds per call, k calls back to back from a barrier, of a float32 all-reduce of `nbytes` on the whole
    world: raw mpi4py blocking and non-blocking, the non-blocking pair a call of the MPI backend posts (its
    agreement beside its data), torch's dist.all_reduce into a group that does nothing, and the MPI backend. Where
    ranks outnumber cores, the hand-written polls yield after each test, as the backend's do (without, 4 ranks on
    2 cores take ~16 ms a call)."""
    import os

    import numpy as np
    from mpi4py import MPI

    from nbdist.backend.ranks.waiting import OVERSUBSCRIBED

    between_tests = os.sched_yield if OVERSUBSCRIBED else (lambda: None)  # as the backend's own poll does
    comm, n = MPI.COMM_WORLD, dist.get_world_size()
    tensor = torch.zeros(nbytes // 4)
    array, mine, everyone = tensor.numpy(), np.zeros(6, np.int64), np.zeros((n, 6), np.int64)
    nothing = _NothingGroup(dist.get_rank(), n)

    def nonblocking() -> None:
        request = comm.Iallreduce(MPI.IN_PLACE, array)
        while not request.Test():
            between_tests()

    def pair() -> None:
        agreement, request = comm.Iallgather(mine, everyone), comm.Iallreduce(MPI.IN_PLACE, array)
        while not (agreement.Test() and request.Test()):
            between_tests()

    calls = {"raw mpi4py Allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, array),
             "raw mpi4py Iallreduce + Test": nonblocking,
             "raw mpi4py Iallgather (agreement) + Iallreduce + Test": pair,
             "dist.all_reduce into a group that does nothing": lambda: dist.all_reduce(tensor, group=nothing),
             "dist.all_reduce on the MPI backend": lambda: dist.all_reduce(tensor)}
    out = {}
    for name, call in calls.items():
        for _ in range(max(10, k // 20)):
            call()
        comm.Barrier()
        started = time.perf_counter()
        for _ in range(k):
            call()
        out[name] = (time.perf_counter() - started) / k * 1e6
    return out


# -- the flight recorder: on or off ---------------------------------------------------------------------------------


def set_recording(on: bool) -> bool:
    """Turn this rank's flight recorder on or off (nbdist/debugging/ranks/recorder.py); returns what it was."""
    from nbdist.debugging.ranks import recorder

    was = recorder.on
    recorder.recording(on)
    return was


def recorder_pairs(pairs: int, calls: int, size: int) -> list[tuple[float, float]] | None:
    """Blocks of `calls` back-to-back all-reduces of `size` bytes through torch.distributed (the collectives
    benchmark's own timed loop, nbdist/collectives/ranks/collective_timing.py), alternating the flight recorder on
    and off block by block, `pairs` times (who goes first alternating): both sides of a pair run within
    milliseconds of each other, so they share whatever the machine is doing then. Seconds per call of each block,
    (on, off), the slowest rank's; None on ranks other than 0."""
    from nbdist.collectives.ranks.collective_timing import Collective
    from nbdist.debugging.ranks import recorder

    bench = Collective("all_reduce", "torch", size, dist.get_world_size(), dist.get_rank())
    for _ in range(calls):  # warm-up
        bench.call()
    was, seconds = recorder.on, []
    try:
        for pair in range(pairs):
            block = {}
            for recording in (True, False) if pair % 2 == 0 else (False, True):
                recorder.recording(recording)
                bench.barrier()
                block[recording] = bench.agree_max(bench.timed(calls) / calls)
            seconds.append((block[True], block[False]))
    finally:
        recorder.recording(was)
    return seconds if dist.get_rank() == 0 else None


# -- the anchors for a user's model: torch's own DDP, FSDP2 and pipelining ---------------------------------------------


class TorchDataParallel:
    """torch's DistributedDataParallel, or FSDP2 (`fully_shard` on each decoder layer, then the root: the units
    torchtitan and nbdist's ZeRO-3 make), of a Hugging Face model on the default process group, Adam, reading the
    Trainer's batches: global batch k in nbdist.data's order (DistributedSampler's), this rank's share of it."""

    def __init__(self, build: bytes, data_fn: bytes, kind: str, batch: int):
        from torch.nn.parallel import DistributedDataParallel

        from nbdist.runtime.ranks.compat import fully_shard

        self.rank, self.world, self.batch = dist.get_rank(), dist.get_world_size(), batch
        model = cloudpickle.loads(build)()
        if kind == "ddp":
            self.model = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (self.world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.dataset = cloudpickle.loads(data_fn)()
        self.step_number = 0

    def steps(self, k: int) -> dict:
        from nbdist import data

        dist.barrier()
        start = time.perf_counter()
        for _ in range(k):
            indices = data.batch_indices(len(self.dataset), self.step_number, self.batch, 0)
            share = data.collate(self.dataset, data.replica_share(indices, self.world, self.rank))
            loss = self.model(**share).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step_number += 1
        return {"start": start, "end": time.perf_counter()}

    def describe(self) -> str:
        return f"torch {type(self.model).__name__} of a user's model (benchmark anchor)"

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def data_parallel_setup(key: str, build: bytes, data_fn: bytes, kind: str, batch: int) -> str:
    return registry.put(KIND, key, TorchDataParallel(build, data_fn, kind, batch)).describe()


def data_parallel_steps(key: str, k: int) -> dict:
    return registry.get(KIND, key).steps(k)


class _TorchPrunedStage(torch.nn.Module):
    """nbdist's pruned stage of a user's model (pipeline_parallel/split.py) as torch's PipelineStage calls a stage:
    the previous stage's output as its argument (none on the first), the micro-batch's inputs as keywords, the
    logits out of the last."""

    def __init__(self, stage, first: bool, last: bool):
        super().__init__()
        self.stage, self.first, self.last = stage, first, last

    def forward(self, *args, **inputs):
        out = self.stage(None if self.first else args[0], inputs)
        return out.logits if self.last else out


class TorchPrunedPipeline:
    """torch's PipelineStage and Schedule1F1B over the same stages nbdist's pipeline builds for this rank (a pruned
    copy of the model, cut at the same units): the anchor of a user's model's pipeline."""

    def __init__(self, build: bytes, units: list, ranges: list, microbatches: int, loss_fn: bytes):
        from nbdist.pipeline_parallel.split import PrunedStage

        self.rank, self.p = dist.get_rank(), len(ranges)
        a, b = ranges[self.rank]
        pruned = PrunedStage(cloudpickle.loads(build)(), units, a, b)
        self.module = _TorchPrunedStage(pruned, self.rank == 0, self.rank == self.p - 1)
        stage = PipelineStage(self.module, self.rank, self.p, device=torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=cloudpickle.loads(loss_fn))

    def steps(self, inputs: dict, labels, k: int) -> dict:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(k):
            self.module.zero_grad(set_to_none=True)
            if self.rank == self.p - 1:
                self.schedule.step(target=labels, losses=[], return_outputs=False, **inputs)
            else:
                self.schedule.step(return_outputs=False, **inputs)
        return {"start": start, "end": time.perf_counter()}

    def describe(self) -> str:
        return f"torch Schedule1F1B over nbdist's pruned stage {self.rank} of {self.p} (benchmark anchor)"

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


def pruned_pipeline_setup(key: str, build: bytes, units: list, ranges: list, microbatches: int,
                          loss_fn: bytes) -> str:
    return registry.put(KIND, key, TorchPrunedPipeline(build, units, ranges, microbatches, loss_fn)).describe()


def pruned_pipeline_steps(key: str, inputs: dict, labels, k: int) -> dict:
    return registry.get(KIND, key).steps(inputs, labels, k)
