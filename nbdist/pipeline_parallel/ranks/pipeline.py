"""A pipeline's entry points on the ranks (this code runs ON the engines): what the notebook's Pipeline calls.

`setup(spec)` builds this rank's executor from its StageSpec and keeps it in the engine registry under the
pipeline's name; `begin` / `advance` / `step` run a step (whole, or tick by tick for a Stepper); `parameters`
gathers weights or gradients; `close` frees it all. Every call of a step starts with a barrier of all the ranks
of the pipeline's mesh (every replica), and reports when this rank left it: the notebook lines the ranks up by
that and takes the pauses between a Stepper's calls out of the timeline (pipeline_parallel/stepping.py).
"""
from __future__ import annotations

import copy
import functools
import time

import torch
from torch import nn

from nbdist.cluster.meshes.ranks import rank_mesh
from nbdist.data_parallel.ranks import data_parallel, zero, zero_optimizer
from nbdist.models.gathered import whole
from nbdist.models.structure import repeated_blocks
from nbdist.pipeline_parallel.ranks import pairs
from nbdist.pipeline_parallel.ranks.executor import StageExecutor
from nbdist.pipeline_parallel.ranks.transport import make_transport
from nbdist.pipeline_parallel.spec import StageSpec
from nbdist.runtime.ranks import placement, registry
from nbdist.schedules.actions import Action
from nbdist.schedules.nccl import rank_walks
from nbdist.schedules.schedule import Schedule
from nbdist.tensor_parallel.ranks import tensor_parallel
from nbdist.wire import restore

KIND = "pipeline"
WAKE_SECONDS = 0.005  # a stepping call first keeps its core busy this long: see _wake


def setup(spec: StageSpec) -> str:
    """Build this rank's executor. With a model function, this rank builds the model itself and keeps only its
    layers (nothing large crosses the network)."""
    from nbdist.cluster.launching.ranks.boot import boot

    device = torch.device(boot().device)
    mesh = rank_mesh.here(spec.mesh)
    sharded = spec.zero >= 2  # FSDP2 reduce-scatters the gradients itself
    average = _dp_average(mesh, spec.replicas, spec.transport) if spec.replicas > 1 and not sharded else None
    _warm_up()
    transport = make_transport(spec.transport, mesh, device, registry.find(pairs.KIND, spec.name))
    walks = _walks(spec, mesh) if spec.transport == "torch" else None
    modules = _modules(spec)
    if spec.sync_batchnorm and spec.replicas > 1:  # statistics over every replica's share (data_parallel/ranks)
        from nbdist.data_parallel.ranks import sync_batchnorm

        modules = {s: sync_batchnorm.convert(m, mesh.group("dp")) for s, m in modules.items()}
    if spec.tp_plan:  # each stage's Linear pairs split over the mesh's tp group (tensor_parallel/ranks/tensor_parallel.py)
        for stage, module in modules.items():
            tensor_parallel.apply(module, mesh.device_mesh["tp"], spec.tp_plan[stage])
    if sharded:  # each stage's gradients (ZeRO-2) and weights (ZeRO-3) over its replicas: FSDP2, as shard() does
        for module in modules.values():
            blocks = None if not spec.pruned else tuple(f"model.{b}" for b in repeated_blocks(module.model))
            zero.shard(module, mesh.device_mesh["dp"], spec.zero, blocks)
    make = restore(spec.optimizer)
    if make is not None and spec.zero == 1:  # each stage's replicas share its optimizer state (ZeRO-1)
        make = functools.partial(zero_optimizer.optimizer, make=make, stage=1, dp_group=mesh.group("dp"))
    executor = StageExecutor(spec, modules, device, transport, average, make, walks)
    executor.tie_sum, executor.tie_comms = _tied_sum(spec, mesh, modules)
    registry.put(KIND, spec.name, executor)
    return device.type


def begin(name: str, shapes: dict, inputs, targets, loss_fn) -> None:
    registry.get(KIND, name).begin(shapes, inputs, targets, restore(loss_fn))


def advance(name: str, until_tick: int | None, publish_every: float | None = None, last: bool = False) -> dict:
    """Run to the tick boundary (None: to the end); report the spans so far and, once the rank's list is done,
    finish the step (gradients averaged over the replicas, optimizer). `last`: the Stepper's last call of the step.

    Every call, on every rank of the mesh (also one whose list is done), starts with a barrier: the notebook's
    requests reach the ranks one after another, and without it that skew would count as bubble. (It costs tens of
    microseconds on one host.) Stepping (until_tick given) on MPI, the other ranks may post the receives of our last
    sends only at a later tick, so we do not wait for those sends here: `pause` keeps them moving. On the torch
    transport every send's receive is posted within the call that sends it (rounds: schedules/nccl.py), so a rank
    completes its sends before it finishes, and its gradients' average never shares the GPU with them (two NCCL
    communicators in flight at once may deadlock).
    """
    from nbdist.cluster.launching.ranks.boot import boot

    executor = registry.get(KIND, name)
    state = executor.state
    executor.stop_draining()
    stepping = until_tick is not None
    if stepping:
        _wake(WAKE_SECONDS)
    rank_mesh.here(executor.spec.mesh).everyone.Barrier()
    state.calls.append(time.perf_counter())
    rank = boot().rank
    if state.report is None:
        executor.advance(until_tick, _publisher(rank, boot().host, publish_every))
    if stepping:
        executor.pause()
    # a tied tensor's gradients are summed between the stages holding it, which finish at different ticks: a
    # stepped step sums them (and steps the optimizer) only in its last call, which every rank reaches whole
    deferred = stepping and not last and executor.tie_sum is not None
    if executor.done and not deferred:
        if state.report is None:
            complete = not stepping or executor.posts_rounds
            state.report = {**executor.finish(wait_for_sends=complete), "rank": rank, "host": boot().host,
                            "done": True}
        return {**state.report, "calls": list(state.calls)}
    spans = [s.as_tuple() for s in state.spans]
    return {"rank": rank, "host": boot().host, "loss": None, "spans": spans, "calls": list(state.calls),
            "done": False}


def step(name: str, shapes: dict, inputs, targets, loss_fn, publish_every: float | None = None,
         memory: bool = False) -> dict:
    """A whole step at full speed: one call, so one barrier before the first action and none between ticks.
    `memory`: also report the bytes this rank holds (runtime/ranks/memory.py), activations at their peak."""
    if not memory:
        begin(name, shapes, inputs, targets, loss_fn)
        return advance(name, None, publish_every)
    from nbdist.runtime.ranks.memory import ActivationMeter, GatheredParams

    executor = registry.get(KIND, name)
    stages = list(executor.modules.values())  # each stage's layers sampled as they start (ZeRO-2/3)
    gathered = GatheredParams(nn.ModuleList(stages), [layer for stage in stages for layer in stage.children()])
    with ActivationMeter() as meter:
        begin(name, shapes, inputs, targets, loss_fn)
        report = advance(name, None, publish_every)
    held = executor.held_bytes()
    held["params"] = max(held["params"], gathered.close())
    return {**report, "memory": {**held, "activations": meter.peak_bytes}}


def parameters(name: str, grads: bool) -> dict | None:
    """stage -> {local key: tensor} of this rank's parameters and buffers (or the parameters' gradients), on CPU.
    Tensor-parallel slices and ZeRO-2/3 shards are gathered whole (collective over the tp or dp group: every slice,
    and under ZeRO-2/3 every replica, calls this); the first slice returns them, the others None."""
    executor = registry.get(KIND, name)
    out = {}
    for stage, module in executor.modules.items():
        if grads:
            out[stage] = {k: whole(p.grad) for k, p in module.named_parameters()}
        else:
            out[stage] = {k: whole(v) for k, v in module.state_dict().items()}
    tp_slice = rank_mesh.here(executor.spec.mesh).coords.get("tp", 0)
    return out if tp_slice == 0 else None


def close(name: str) -> None:
    executor = registry.find(KIND, name)
    for comm in getattr(executor, "tie_comms", ()):  # collective: every rank of the pipeline closes it
        comm.Free()
    registry.drop(KIND, name)
    groups = registry.find(pairs.KIND, name)
    if groups is not None:
        pairs.release(groups)
        registry.drop(pairs.KIND, name)


# -- helpers --------------------------------------------------------------------------------------------------------


def _walks(spec: StageSpec, mesh) -> dict:
    """The torch transport's rounds need the whole schedule (a receive is posted in the round its sender sends it),
    and a spec holds this rank's list only: the pipeline's ranks share theirs (collective over the pp group; every
    rank runs setup) and each computes its walks from the same schedule (schedules/nccl.py: rank_walks)."""
    programs = mesh.comm("pp").allgather(spec.program)
    schedule = Schedule(spec.name, len(programs), spec.microbatches, spec.stages // len(programs),
                        {r: [Action.parse(a) for a in acts] for r, acts in enumerate(programs)})
    walks = rank_walks(schedule, spec.pipeline_rank)
    if tuple(walks["step"][1]) != tuple(spec.ticks):
        raise RuntimeError(f"pipeline rank {spec.pipeline_rank}: the ticks made here differ from the notebook's")
    return walks


def _modules(spec: StageSpec) -> dict[int, nn.Module]:
    """This rank's stage modules: slices of a Sequential, or pruned copies of any other model (split.py)."""
    if spec.pruned:
        from nbdist.pipeline_parallel.split import PrunedStage

        model = restore(spec.model)() if isinstance(spec.model, bytes) else spec.model
        stages = sorted(spec.layers)
        return {stage: PrunedStage(model if i == len(stages) - 1 else copy.deepcopy(model), spec.units, a, b)
                for i, (stage, (a, b)) in enumerate((s, spec.layers[s]) for s in stages)}
    if isinstance(spec.model, bytes):
        layers = list(restore(spec.model)())
        return {stage: nn.Sequential(*layers[a:b]) for stage, (a, b) in spec.layers.items()}
    return dict(spec.model)


def _tied_sum(spec: StageSpec, mesh, modules: dict[int, nn.Module]) -> tuple:
    """A function that sums the gradients of each tied tensor over the copies the pipeline's stages hold (GPT-2's
    embedding on the first stage and its head on the last: Megatron's embedding group), so every copy takes the
    gradient one process's single tensor gets and the same optimizer step; None when no tied tensor spans two
    stages. Set up collectively over the pp group (every rank of it runs setup). With it, the MPI communicators it
    made (close frees them)."""
    if not spec.pruned or not spec.tied:
        return None, []
    copies: list[list[nn.Parameter]] = []  # per tied group, this rank's distinct copies
    for group in spec.tied:
        found: dict[int, nn.Parameter] = {}
        for module in modules.values():
            for name, p in module.named_parameters(remove_duplicate=False):
                if name.removeprefix("model.") in group:
                    found.setdefault(id(p), p)
        copies.append(list(found.values()))
    held = mesh.comm("pp").allgather([(len(c), c[0].numel() if c else 0) for c in copies])
    spans = [i for i in range(len(spec.tied)) if sum(h[i][0] for h in held) > 1]
    sizes = {i: max(h[i][1] for h in held) for i in spans}
    if not spans:
        return None, []
    comms: dict = {}
    if spec.transport == "mpi":
        from mpi4py import MPI

        comms = {i: mesh.comm("pp").Split(0 if copies[i] else MPI.UNDEFINED) for i in spans}

        def all_reduce(i: int, flat: torch.Tensor) -> None:
            comms[i].Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
    else:  # torch transport: the whole pp group, zeros where a rank holds no copy
        import torch.distributed as dist

        def all_reduce(i: int, flat: torch.Tensor) -> None:
            dist.all_reduce(flat, group=mesh.group("pp"))

    def tie_sum() -> None:
        for i in spans:
            mine = [p for p in copies[i] if p.grad is not None]
            if not copies[i]:
                if spec.transport != "mpi":  # the whole pp group takes part
                    all_reduce(i, torch.zeros(sizes[i], device=placement.here()))
                continue
            total = sum(p.grad for p in mine) if mine else torch.zeros_like(copies[i][0])
            total = total.contiguous()
            all_reduce(i, total.view(-1))
            for p in copies[i]:
                p.grad = total.clone()

    return tie_sum, [c for c in comms.values() if c != _null_comm()]


def _null_comm():
    from mpi4py import MPI

    return MPI.COMM_NULL


def _dp_average(mesh, replicas: int, transport: str):
    """A function averaging a list of gradient tensors over this rank's dp group in place: one all-reduce of one
    flat buffer (MPI on CPU, torch.distributed otherwise), then divided by the number of replicas."""
    if transport == "mpi":
        from mpi4py import MPI

        def all_reduce(flat: torch.Tensor) -> None:
            mesh.comm("dp").Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
    else:
        import torch.distributed as dist

        def all_reduce(flat: torch.Tensor) -> None:
            dist.all_reduce(flat, group=mesh.group("dp"))

    return lambda grads: data_parallel.average_grads(grads, replicas, all_reduce)


def _warm_up() -> None:
    """The first backward given an output gradient makes torch import sympy (once per process, and slow): pay
    that here, not inside the first measured backward, where it would look like a far slower stage (figures:
    benchmarks/README.md). A tiny graph of our own: the user's modules (and their buffers or random state) are not
    touched."""
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    torch.autograd.backward(y, torch.ones_like(y))


def _wake(seconds: float) -> None:
    """Keep this core busy for `seconds` before a stepping call's barrier.

    Between two clicks a rank sleeps for seconds; the first actions after such a pause run slower than the same
    actions moments later (the core and the process wake up), which a person stepping through the schedule would
    read as bubble. Keeping the core busy first brings the stepped bubble close to the full-speed one, for a few
    milliseconds a click (figures: benchmarks/README.md)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _publisher(rank: int, host: str, every: float | None):
    """A function the executor calls after each action: publishes the spans so far (ipyparallel's datapub) at
    most every `every` seconds, for a live view; None when no view watches."""
    if every is None:
        return None
    from ipyparallel.datapub import publish_data

    last = [time.perf_counter()]

    def publish(state) -> None:
        if state.spans and state.spans[-1].end - last[0] > every:  # on a GPU spans appear when a call ends
            last[0] = state.spans[-1].end
            publish_data({"rank": rank, "host": host, "spans": [s.as_tuple() for s in state.spans],
                          "calls": list(state.calls)})

    return publish
