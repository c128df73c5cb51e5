"""A torch.distributed backend over mpi4py for CPU engines (runs ON the engines).

    from nbdist.backend.ranks import mpi_backend
    mpi_backend.register()                              # once per process; returns the name, "mpi4py"
    group = dist.new_group([0, 1], backend="mpi4py")    # or dist.init_process_group("mpi4py", ...)
    dist.all_reduce(t, group=group)                     # MPICH's shared memory, not gloo's TCP loopback

Why "mpi4py" and not "mpi": torch already owns the name "mpi" (`Backend.MPI`, its own ProcessGroupMPI, present
only in builds from source). `register_backend("mpi", ...)` leaves `Backend.MPI` as it is and
`_new_process_group_helper` tests for "mpi" before it looks at plugins, so groups named "mpi" would still go to
the missing ProcessGroupMPI ("Distributed package doesn't have MPI built in"). A name of its own avoids that.

How it plugs in: torch cannot construct its C++ `Backend` from Python, but it can subclass `ProcessGroup` (a
pybind trampoline): `MpiProcessGroup` is one, and torch uses what the creator returns as the group itself
(`_new_process_group_helper`: "a subclass of ProcessGroup ... return this process group immediately"). Python
callers (`dist.all_reduce` -> `group.allreduce([t], opts)`) reach its methods directly; C++ callers (DDP's
reducer, `_broadcast_coalesced`) through the trampoline. It is registered with `devices=["cpu"]`, so that
torch's device-to-backend map sends cpu tensors to it. Such a group has no C++ backend behind it; asked for its
backend on a device (`group._get_backend(device)`, which torch asks of every new group on a GPU engine, where the
default group is bound to cuda:N), it answers itself (MpiProcessGroup._get_backend). DDP, FSDP2 (`fully_shard`),
DeviceMesh, DTensor and `batch_isend_irecv` work on it (tried on torch 2.13; new_group on a GPU engine on 2.11).

Which ranks a group has: the creator is registered with `extended_api=True`, so torch hands it a
`_DistributedBackendOptions` with `global_ranks_in_group` (empty for the default group: the whole world),
`group_rank`, `group_size`, `timeout` and `group_id` (the group's name). Global ranks are torch's; nbdist's
engines initialise torch.distributed with torch rank = MPI rank, so they name MPI ranks, and the group's world is
`MPI.COMM_WORLD.Create_group` of those ranks in that order (collective over the members only, as torch calls the
creator on members only), made once per group. Sub-groups (`dist.new_group(ranks)`, a DeviceMesh's dimensions)
are MPI sub-communicators this way.

Speed: a call posts non-blocking MPI operations on buffers made straight from the tensor's address and polls them
(waiting.py); no future or thread exists unless `get_future()` is called, and calls without `async_op` complete
before returning. The waited-for all_reduce SUM of a contiguous tensor (dist.all_reduce(t), the common case) has
a path of its own (_sum_now): the fewest checks, its agreement kept packed between calls, the MPI buffer made once
per tensor memory (mpi_data.summable), a short spin on both requests before the full poll. A small call's time
goes to raw MPI, to torch's own `dist.all_reduce` into a Python group (the floor of any backend written in Python),
to the agreement beside the data (a second collective) and to this path's own Python (bench_mpi_backend.py prints
the breakdown; figures: benchmarks/README.md). After the agreement came back every rank is known to be in the
call, so the rest is transfer and is polled without naps (waiting.TRANSFER_SECONDS): MPICH moves shared-memory data
only inside a test.

Data: tensors travel as their bytes (any dtype, bf16 included, no copy when contiguous); reductions use the MPI
datatype of the dtype, except float16 and bfloat16, which MPI cannot reduce: those are reduced through a float32
copy (exact for the min and max, and sums of float32 round once instead of once per step). Non-contiguous tensors
are copied into contiguous ones and back. AVG is a SUM divided by the group's size (integer tensors refuse AVG).
Only CPU tensors: the MPI it runs on is not CUDA-aware, so a CUDA (or "meta") tensor is refused in one line where
the operation enters (mpi_data.on_cpu), before its pointer reaches MPI.
"""
from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist

from nbdist.backend.ranks import mpi_data as data
from nbdist.backend.ranks import roll_call
from nbdist.backend.ranks.mpi_agree import ANY, Agreement, Planned, SumAgreement, one_dtype, reduction_code
from nbdist.backend.ranks.mpi_moving import MovingData
from nbdist.backend.ranks.mpi_work import MpiWork, complete_now, done
from nbdist.backend.ranks.waiting import abandoned, quickly_complete, test_all
from nbdist.backend.replies import Renewed
from nbdist.debugging.ranks import recorder
from nbdist.debugging.ranks.recorder import DONE
from nbdist.debugging.ranks.recorder import clock as _clock
from nbdist.debugging.ranks.recorder import ends as _ends
from nbdist.debugging.ranks.recorder import since as _since
from nbdist.errors import DistUsageError

NAME = "mpi4py"
_SUM, _STRIDED = dist.ReduceOp.SUM, torch.strided
_groups: list[weakref.ref] = []  # every MpiProcessGroup of this process, in creation order (for renew)


def register() -> str:
    """Make the backend "mpi4py" known to torch.distributed (idempotent); returns its name."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    return NAME


def renew() -> Renewed:
    """Give every mpi4py group of this rank a fresh MPI communicator. Call on EVERY rank after a rank failed while
    the engines survived: making a communicator is collective over the group's members, and every rank goes through
    its groups in the order they were made, which is the same everywhere (torch makes groups in the same order on
    every rank). Every group is renewed, not only those that gave up an operation: a message one rank sent and the
    failed rank never received would otherwise wait in the old communicator for a later receive.

    Returns the groups' ranks and how many of them had given up an operation on this rank: the notebook says
    "renewed" to the user only where an operation was actually abandoned somewhere."""
    renewed, broken = [], 0
    for ref in _groups:
        group = ref()
        if group is not None:
            broken += group.renew()
            renewed.append(group.global_ranks)
    return Renewed(renewed, broken)


def _create(options, backend_options=None) -> MpiProcessGroup:
    """torch's creator hook (extended API): the group of `options.global_ranks_in_group` (all ranks if empty)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group) or list(range(world.size))
    torch_rank = dist.get_rank() if dist.is_initialized() else options.group_rank  # default group: not yet
    if torch_rank != world.rank or (not options.global_ranks_in_group and options.group_size != world.size):
        raise DistUsageError(
            f"the {NAME} backend needs torch rank = MPI rank (as nbdist's engines start): torch rank {torch_rank} "
            f"of {options.group_size} runs on MPI rank {world.rank} of {world.size}")
    comm = _communicator(ranks)
    if comm.rank != options.group_rank:
        raise DistUsageError(f"{NAME}: rank {world.rank} is rank {comm.rank} of the MPI group of ranks {ranks} "
                             f"but torch made it rank {options.group_rank}")
    group = MpiProcessGroup(comm, ranks, options.timeout, str(options.group_id))
    _groups.append(weakref.ref(group))
    return group


def _communicator(ranks: list[int]):
    """A new communicator of these MPI ranks in this order (collective over them only)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    members = world.group.Incl(ranks)
    try:
        return world.Create_group(members)
    finally:
        members.Free()


class MpiProcessGroup(MovingData, dist.ProcessGroup):
    """A torch process group whose operations are non-blocking MPI operations on its own communicator. Each
    method takes torch's arguments (lists and option objects, as gloo's do) and returns an MpiWork."""

    def __init__(self, comm, global_ranks: list[int], timeout: datetime.timedelta, name: str):
        super().__init__(comm.rank, comm.size)
        self._comm, self.global_ranks, self._name = comm, global_ranks, name
        self.timeout_seconds = timeout.total_seconds()
        self._broken: str | None = None  # why its ranks are out of step, once an operation was abandoned
        self.generation = 0  # how many times renew() replaced its communicator
        self._n = comm.size
        self.calls = 0  # collectives started on this group: the roll call's sequence numbers
        self._where = f" on the group of ranks {global_ranks}"
        self.recorded_as = (name, tuple(global_ranks), 0)  # how the flight recorder names it: name, ranks, generation
        self._agreement_buffers = Agreement.new_buffers(comm.size)  # for calls done before the next begins
        self._sums = SumAgreement(comm.size)  # the hot path's own: its last agreement stays packed for the next
        roll_call.known(self)

    # -- what torch asks of a process group ------------------------------------------------------------------

    def renew(self) -> bool:
        """A fresh MPI communicator for this group, its agreement state and call numbering started afresh (see the
        module's renew(), which calls it on every rank, for every group, in the same order). Whether the group had
        given up an operation on this rank."""
        was_broken = self._broken is not None
        abandoned.append(((), (self._comm,)))  # not freed: a request abandoned on it may still be pending
        self._comm, self._broken = _communicator(self.global_ranks), None
        self._agreement_buffers = Agreement.new_buffers(self._n)  # an abandoned all-gather may write the old ones
        self._sums = SumAgreement(self._n)
        self.generation += 1  # works still pending on the old communicator no longer mark the group
        recorder.close_run()  # its open run counts calls of the old numbering
        self.calls = 0  # numbered afresh on every rank: a rank that gave up earlier than others made fewer
        self.recorded_as = (*self.recorded_as[:2], self.generation)  # its call #1 from before the renewal is not
        # this one (the notebook's hang view compares generations, debugging/hang.py)
        return was_broken

    def getBackendName(self) -> str:
        return NAME

    supports_splitting = False  # a new group makes its own communicator (MPI_Comm_create_group), never a split

    def _get_backend(self, device: torch.device) -> MpiProcessGroup:
        """This group is its own backend, whatever the device. torch asks for it by device: a group made on a GPU
        engine inherits the default group's `bound_device_id` (cuda:N), and `_new_process_group_helper` then asks
        `pg._get_backend(cuda:N).supports_splitting` to connect it early; the C++ ProcessGroup, which has no backend
        registered for this Python group, would answer "No backend type associated with device type cuda" and
        `new_group(backend="mpi4py")` would fail there. CUDA tensors are still refused, at each operation
        (mpi_data.on_cpu)."""
        return self

    @property
    def group_name(self) -> str:
        return self._name  # ProcessGroup's own getter asks a C++ backend, which this group has none of

    @property
    def group_desc(self) -> str:
        return f"{NAME} ranks {self.global_ranks}"

    def __repr__(self) -> str:
        return f"MpiProcessGroup(ranks={self.global_ranks}, rank={self._comm.rank})"

    # -- bookkeeping for works ----------------------------------------------------------------------------------

    def _start(self, comm, plan: Planned, opts=None) -> MpiWork:
        """Post the call's agreement (mpi_agree.py) and, right behind it, its data; whoever waits looks at the
        agreement first. Posted together, both are in flight at once instead of one after the other; MPI never
        writes past a buffer's count, so a disagreement costs no memory, only the data's result, which is then
        refused. A caller that waits anyway (`opts.asyncOp` false: torch's dist.* without async_op) gets it done
        before returning."""
        seconds = self.seconds(opts)
        self.calls += 1
        op = f"{plan.call} #{self.calls}"  # named so in errors and in the roll call: "all_reduce #12"
        waits = opts is not None and not opts.asyncOp  # the common case: done before returning
        slot = recorder.begin(self.recorded_as, self.calls, plan.call, None, plan.count, plan.dtype)
        try:
            agreement = Agreement(comm, plan.call, plan.count, plan.dtype, plan.detail, plan.same_count,
                                  plan.outputs, self._agreement_buffers if waits else None)
            requests = plan.post()
            if not waits:
                return MpiWork(self, op, requests, plan.outputs_list, plan.finish, plan.buffers, seconds,
                               agreement=(agreement, plan), slot=slot)
            complete_now(self, op, [agreement.request], None, plan.buffers, seconds, also=requests)
            self.refuse_disagreement(agreement, plan, requests)
            work = complete_now(self, op, requests, plan.finish, plan.buffers, seconds, transfer=True)
        except BaseException:
            recorder.failed(slot)
            raise
        recorder.end(slot)
        return work

    def _sum_now(self, comm, tensor, spec: list, opts) -> MpiWork:
        """The hot path, a waited-for all_reduce SUM of a contiguous CPU tensor: what _start does, without the
        objects (Planned, Agreement, the call's name, its timeout) it makes for every other call; they are made only
        when the call is slow or the ranks disagree. Between ready ranks a small sum completes within a few tests,
        so a short spin here ends most calls; a longer wait goes through complete_now (interruptible, timed).
        `spec`: the tensor as an MPI buffer (mpi_data.summable)."""
        self.calls += 1
        sums, numel, dtype = self._sums, tensor.numel(), tensor.dtype
        agreed = sums.post(comm, numel, dtype)
        request = comm.Iallreduce(data.IN_PLACE, spec, data.MPI_SUM)
        if recorder.on and recorder.run_key is not sums.packed:  # the flight recorder: one entry per run of
            recorder.start_run(self, sums.packed, "all_reduce", numel, dtype)  # these sums (recorder.py, "Runs")
        try:
            quick = quickly_complete(agreed, request)
        except BaseException:  # interrupted: both are given up (what MPI may still write kept alive), out of step
            self.abandon("all_reduce", [agreed, request], (tensor, *sums.buffers))
            recorder.run_failed(recorder.waiting(), self, "all_reduce", numel, dtype)
            raise
        if quick and sums.agreed():
            return done()
        slot = None
        if recorder.on and recorder.open_run is not None:  # recorder.waiting() written out: the run in flight
            slot = recorder.open_run[0]  # since now (every call takes this path where ranks outnumber cores)
            _since[slot] = _clock()
            _ends[slot] = None
        try:
            self._sum_slowly(comm, tensor, numel, agreed, request, quick, opts)
        except BaseException:
            recorder.run_failed(slot, self, "all_reduce", numel, dtype)
            raise
        if slot is not None:
            _ends[slot] = DONE
        return done()

    def _sum_slowly(self, comm, tensor, numel: int, agreed, request, quick: bool, opts) -> None:
        """The rest of _sum_now when its spin did not end the call, or the ranks disagree: wait for the agreement
        first (ranks that disagree may never complete the data), look at it, then wait for the data."""
        sums, op, seconds = self._sums, f"all_reduce #{self.calls}", self.seconds(opts)
        if not quick:
            complete_now(self, op, [agreed], None, (tensor, *sums.buffers), seconds, also=[request])
        if not sums.agreed():
            agreement = Agreement(comm, "all_reduce", numel, tensor.dtype, buffers=sums.buffers, request=agreed)
            plan = Planned("all_reduce", numel, tensor.dtype, ANY, None, [tensor])
            self.refuse_disagreement(agreement, plan, [request])
        if not quick:
            complete_now(self, op, [request], None, (tensor,), seconds, transfer=True)

    def where(self, op: str) -> str:
        """Where a rank waiting in `op` is, as the roll call says it: "all_reduce #12 on the group of ranks [..]"."""
        return op + self._where

    def refuse_disagreement(self, agreement: Agreement, plan: Planned, requests: list) -> None:
        """Raise the one line every rank raises when the ranks brought different calls, counts or dtypes, or (where
        each rank brings its own share) shares that do not fit the outputs every rank expects. The data's
        requests, posted behind the agreement, are given up unless they completed (then the group is still in
        step): MPI may never complete a collective its ranks disagree on."""
        said = agreement.disagreement(self.global_ranks)
        if said:
            said = f"the ranks of the group {self.global_ranks} disagree on a collective: {said}"
        elif plan.expected is not None and agreement.counts() != plan.expected:
            said = (f"{plan.call} on the group of ranks {self.global_ranks}: the ranks bring {agreement.counts()} "
                    f"elements but the outputs hold {plan.expected}")
        if said is None:
            return
        if not test_all(requests):
            self.abandon(plan.call, requests, plan.buffers)
        raise DistUsageError(f"{NAME}: {said}; its result was dropped")

    def seconds(self, opts=None) -> float:
        """How long an operation may wait: its own timeout where the call gave one (torch leaves it unset, -1 ms,
        otherwise), else the group's."""
        given = getattr(opts, "timeout", None)
        seconds = given.total_seconds() if given is not None else 0.0
        return seconds if seconds > 0 else self.timeout_seconds

    def _usable(self, op: str, *tensors):
        """The communicator, unless an abandoned operation left this group's ranks out of step or a tensor of the
        operation (`tensors`: its tensor arguments as torch passes them) is not in CPU memory. Every operation
        starts here, so this is the one place that refuses CUDA tensors (mpi_data.on_cpu)."""
        if self._broken is not None:
            raise DistUsageError(f"{NAME} {op}: {self._broken}")
        data.on_cpu(op, tensors)
        return self._comm

    def abandon(self, op: str, requests: list, buffers: tuple, generation: int | None = None) -> None:
        """An operation was interrupted or timed out: keep its buffers alive and mark the group out of step
        (unless the operation ran on a communicator that renew() has replaced since)."""
        abandoned.append((requests, buffers))
        if generation is not None and generation != self.generation:
            return
        self._broken = (f"the group of ranks {self.global_ranks} gave up a {op} on rank {self._global_rank()} "
                        f"(interrupted or timed out), so its ranks are out of step; run "
                        f"nbdist.backend.ranks.mpi_backend.renew() on every rank, or restart the engines")

    def timeout_error(self, op: str, seconds: float | None = None) -> Exception:
        """The line for an operation that outlasted its timeout; for a collective, with what the roll call found:
        which members wait in it too, which wait elsewhere (and where), which did not answer."""
        error = getattr(dist, "DistBackendError", RuntimeError)
        seconds = self.timeout_seconds if seconds is None else seconds
        found = ""
        if "#" in op:  # a collective: every member should be in it
            answers = roll_call.ask(self, self.global_ranks, self._global_rank(), self.where(op))
            found = roll_call.sentence(self.where(op), answers)
        why = found or "a rank of the group did not take part"
        return error(f"{NAME} {op} on the group of ranks {self.global_ranks} timed out after {seconds:g} s on rank "
                     f"{self._global_rank()}: {why} (the call's or the group's timeout sets how long to wait)")

    def _global_rank(self) -> int:
        return self.global_ranks[self._comm.rank]

    # -- reductions ----------------------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None) -> MpiWork:
        if opts is not None and len(tensors) == 1 and not opts.asyncOp and self._broken is None:
            tensor = tensors[0]  # the common case, dist.all_reduce(t): checked here in the fewest steps
            if tensor.is_cpu and tensor.layout is _STRIDED and tensor.is_contiguous() and opts.reduceOp == _SUM:
                spec = data.summable(tensor)
                if spec is not None:
                    return self._sum_now(self._comm, tensor, spec, opts)
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        if len(tensors) == 1 and tensors[0].layout == torch.sparse_coo:  # summed as gloo sums them
            from nbdist.backend.ranks import mpi_sparse

            self._usable("all_reduce")
            return mpi_sparse.all_reduce(self, self._comm, tensors[0], op, self.seconds(opts))
        comm = self._usable("all_reduce", tensors)
        (tensor,) = data.single(tensors, "all_reduce")
        if op == dist.ReduceOp.SUM and data.direct(tensor):
            post = lambda: [comm.Iallreduce(data.IN_PLACE, data.typed(tensor), data.MPI_SUM)]  # noqa: E731
            return self._start(comm, Planned("all_reduce", tensor.numel(), tensor.dtype, reduction_code(op), post,
                                             tensors), opts)
        stage = data.Reduction(tensor, op, self._n, "all_reduce", copy_in=True)
        post = lambda: [comm.Iallreduce(data.IN_PLACE, data.typed(stage.work), stage.mpi_op)]  # noqa: E731
        return self._start(comm, Planned("all_reduce", tensor.numel(), tensor.dtype, reduction_code(op), post,
                                         tensors, stage.finish, (stage.work,)), opts)

    def allreduce_coalesced(self, tensors, opts=None) -> MpiWork:
        comm = self._usable("all_reduce_coalesced", tensors)
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        stages = [data.Reduction(t, op, self._n, "all_reduce_coalesced", copy_in=True) for t in tensors]
        post = lambda: [comm.Iallreduce(data.IN_PLACE, data.typed(s.work), s.mpi_op) for s in stages]  # noqa: E731
        return self._start(comm, Planned("all_reduce_coalesced", sum(t.numel() for t in tensors), one_dtype(tensors),
                                         reduction_code(op), post, tensors, data.all_of(s.finish for s in stages),
                                         tuple(s.work for s in stages)), opts)

    def reduce(self, tensors, opts=None) -> MpiWork:
        comm = self._usable("reduce", tensors)
        (tensor,) = data.single(tensors, "reduce")
        root, me = opts.rootRank, comm.rank
        stage = data.Reduction(tensor, opts.reduceOp, self._n, "reduce", copy_in=True)

        def post() -> list:
            if me == root:
                return [comm.Ireduce(data.IN_PLACE, data.typed(stage.work), stage.mpi_op, root)]
            return [comm.Ireduce(data.typed(stage.work), None, stage.mpi_op, root)]
        return self._start(comm, Planned("reduce", tensor.numel(), tensor.dtype,
                                         reduction_code(opts.reduceOp) + 64 * root, post, tensors,
                                         stage.finish if me == root else None, (stage.work,)), opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None) -> MpiWork:
        comm = self._usable("reduce_scatter", output_tensors, input_tensors)
        (output,), (inputs,) = data.single(output_tensors, "reduce_scatter"), data.single(input_tensors,
                                                                                        "reduce_scatter")
        data.same_count(inputs, self._n, "reduce_scatter")
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        stage = data.Reduction(output, op, self._n, "reduce_scatter", copy_in=False)
        send = data.flat_for_reduction(inputs, stage.work.dtype)
        post = lambda: [comm.Ireduce_scatter(data.typed(send), data.typed(stage.work),  # noqa: E731
                                             [t.numel() for t in inputs], stage.mpi_op)]
        return self._start(comm, Planned("reduce_scatter", send.numel(), output.dtype, reduction_code(op), post,
                                         output_tensors, stage.finish, (send, stage.work)), opts)

    def _reduce_scatter_parts(self, output, input, opts) -> Planned:
        comm = self._usable("reduce_scatter_tensor", output, input)
        data.sizes_match(input.numel(), output.numel() * self._n, "reduce_scatter_tensor")
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        stage = data.Reduction(output, op, self._n, "reduce_scatter_tensor", copy_in=False)
        send = data.flat_for_reduction([input], stage.work.dtype)
        post = lambda: [comm.Ireduce_scatter_block(data.typed(send, output.numel()),  # noqa: E731
                                                   data.typed(stage.work), stage.mpi_op)]
        return Planned("reduce_scatter_tensor", input.numel(), input.dtype, reduction_code(op), post, [output],
                       stage.finish, (send, stage.work))

    def _reduce_scatter_base(self, output, input, opts=None) -> MpiWork:
        return self._start(self._comm, self._reduce_scatter_parts(output, input, opts), opts)

    reduce_scatter_single = _reduce_scatter_base  # torch 2.13's names for the same calls

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> MpiWork:
        parts = [self._reduce_scatter_parts(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._start(self._comm, Planned.joined(parts, call="reduce_scatter_tensor"), opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None) -> MpiWork:
        comm = self._usable("barrier")
        post = lambda: [comm.Ibarrier()]  # noqa: E731
        return self._start(comm, Planned("barrier", 0, None, ANY, post, []), opts)
