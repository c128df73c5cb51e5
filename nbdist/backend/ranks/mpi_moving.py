"""The mpi4py process group's operations that move data rather than reduce it (runs ON the engines): broadcast,
the all-gathers, gather, scatter, the all-to-alls, send and receive. A mixin of MpiProcessGroup
(mpi_backend.py), which gives `_usable` (the communicator, checks), `_start` (agreement and data posted together)
and `_n` (the group's size); see mpi_backend.py's docstring for how data travels.
"""
from __future__ import annotations

from nbdist.backend.ranks import mpi_data as data
from nbdist.backend.ranks.mpi_agree import ANY, Planned, one_dtype
from nbdist.backend.ranks.mpi_work import MpiWork
from nbdist.debugging.ranks import recorder


class MovingData:
    """Broadcast, gathers, scatters, all-to-alls and point-to-point for MpiProcessGroup."""

    def broadcast(self, tensors, opts=None) -> MpiWork:
        comm = self._usable("broadcast", tensors)
        (tensor,) = data.single(tensors, "broadcast")
        out = data.Output(tensor, copy_in=comm.rank == opts.rootRank)
        post = lambda: [comm.Ibcast(data.raw(out.work), opts.rootRank)]  # noqa: E731
        return self._start(comm, Planned("broadcast", tensor.numel(), tensor.dtype, opts.rootRank, post, tensors,
                                         out.finish, (out.work,)), opts)

    def allgather(self, output_tensors, input_tensors, opts=None) -> MpiWork:
        comm = self._usable("all_gather", output_tensors, input_tensors)
        (outputs,), (tensor,) = data.single(output_tensors, "all_gather"), data.single(input_tensors, "all_gather")
        data.same_count(outputs, self._n, "all_gather")
        return self._start(comm, self._allgather_parts(comm, outputs, tensor, output_tensors), opts)

    def _allgather_parts(self, comm, outputs, tensor, output_tensors, call: str = "all_gather") -> Planned:
        send = data.contiguous(tensor)
        gathered = data.Pieces(outputs)
        post = lambda: [comm.Iallgatherv(data.raw(send), gathered.spec())]  # noqa: E731
        return Planned(call, tensor.numel(), tensor.dtype, ANY, post, output_tensors, gathered.finish,
                       (send, gathered.flat), expected=[o.numel() for o in outputs])

    def _allgather_parts_into_tensor(self, output, input) -> Planned:
        comm = self._usable("all_gather_into_tensor", output, input)
        data.sizes_match(output.numel(), input.numel() * self._n, "all_gather_into_tensor")
        out = data.Output(output, copy_in=True)
        send = data.gather_source(data.contiguous(input), out.work, comm.rank)  # FSDP2 gathers in place
        post = lambda: [comm.Iallgather(data.IN_PLACE if send is None else data.raw(send),  # noqa: E731
                                        data.raw(out.work))]
        return Planned("all_gather_into_tensor", input.numel(), input.dtype, ANY, post, [output], out.finish,
                       (send, out.work))

    def _allgather_base(self, output, input, opts=None) -> MpiWork:
        return self._start(self._comm, self._allgather_parts_into_tensor(output, input), opts)

    all_gather_single = _allgather_base  # torch 2.13's name for the same call

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> MpiWork:
        parts = [self._allgather_parts_into_tensor(o, i) for o, i in zip(outputs, inputs)]
        return self._start(self._comm, Planned.joined(parts, call="all_gather_into_tensor"), opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> MpiWork:
        """all_gather of several tensors at once (torch's list form): one all_gather per input tensor, agreed on
        as one call."""
        comm = self._usable("all_gather_coalesced", output_lists, input_list)
        data.same_count(output_lists, self._n, "all_gather_coalesced")
        parts = [self._allgather_parts(comm, [outputs[i] for outputs in output_lists], tensor, [],
                                       "all_gather_coalesced") for i, tensor in enumerate(input_list)]
        return self._start(comm, Planned.joined(parts, [t for outputs in output_lists for t in outputs],
                                                "all_gather_coalesced"), opts)

    def gather(self, output_tensors, input_tensors, opts=None) -> MpiWork:
        comm = self._usable("gather", output_tensors, input_tensors)
        (tensor,) = data.single(input_tensors, "gather")
        send, root = data.contiguous(tensor), opts.rootRank
        if comm.rank != root:
            post = lambda: [comm.Igatherv(data.raw(send), None, root)]  # noqa: E731
            return self._start(comm, Planned("gather", tensor.numel(), tensor.dtype, root, post, [], None, (send,),
                                             same_count=False), opts)
        (outputs,) = data.single(output_tensors, "gather")
        data.same_count(outputs, self._n, "gather")
        gathered = data.Pieces(outputs)
        post = lambda: [comm.Igatherv(data.raw(send), gathered.spec(), root)]  # noqa: E731
        return self._start(comm, Planned("gather", tensor.numel(), tensor.dtype, root, post, output_tensors,
                                         gathered.finish, (send, gathered.flat), same_count=False), opts)

    def scatter(self, output_tensors, input_tensors, opts=None) -> MpiWork:
        comm = self._usable("scatter", output_tensors, input_tensors)
        (tensor,) = data.single(output_tensors, "scatter")
        out, root = data.Output(tensor, copy_in=False), opts.rootRank
        spec, flat = None, None
        if comm.rank == root:
            (inputs,) = data.single(input_tensors, "scatter")
            data.same_count(inputs, self._n, "scatter")
            flat = data.concatenated(inputs)
            spec = data.pieces_spec(flat, inputs)
        post = lambda: [comm.Iscatterv(spec, data.raw(out.work), root)]  # noqa: E731
        return self._start(comm, Planned("scatter", tensor.numel(), tensor.dtype, root, post, output_tensors,
                                         out.finish, (out.work, flat), same_count=False), opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None) -> MpiWork:
        comm = self._usable("all_to_all_single", output, input)
        send, out = data.contiguous(input), data.Output(output, copy_in=False)
        send_spec = data.split_spec(send, input_split_sizes, self._n, "all_to_all_single")
        recv_spec = data.split_spec(out.work, output_split_sizes, self._n, "all_to_all_single")
        post = lambda: [comm.Ialltoallv(send_spec, recv_spec)]  # noqa: E731
        return self._start(comm, Planned("all_to_all_single", input.numel(), input.dtype, ANY, post, [output],
                                         out.finish, (send, out.work), same_count=False), opts)

    def alltoall(self, output_tensors, input_tensors, opts=None) -> MpiWork:
        comm = self._usable("all_to_all", output_tensors, input_tensors)
        data.same_count(input_tensors, self._n, "all_to_all")
        data.same_count(output_tensors, self._n, "all_to_all")
        flat, gathered = data.concatenated(input_tensors), data.Pieces(output_tensors)
        post = lambda: [comm.Ialltoallv(data.pieces_spec(flat, input_tensors), gathered.spec())]  # noqa: E731
        return self._start(comm, Planned("all_to_all", flat.numel(), one_dtype(input_tensors), ANY, post,
                                         output_tensors, gathered.finish, (flat, gathered.flat), same_count=False),
                           opts)

    def send(self, tensors, dst: int, tag: int) -> MpiWork:
        comm = self._usable("send", tensors)
        (tensor,) = data.single(tensors, "send")
        send = data.contiguous(tensor)
        peer = self.global_ranks[dst]
        slot = recorder.begin(self.recorded_as, None, "send", peer, tensor.numel(), tensor.dtype)
        return MpiWork(self, f"send to rank {peer}", [comm.Isend(data.raw(send), dst, tag)], tensors, None, (send,),
                       slot=slot)

    def recv(self, tensors, src: int, tag: int) -> MpiWork:
        return self._receive(tensors, src, tag)

    def recv_anysource(self, tensors, tag: int) -> MpiWork:
        """A receive from whichever rank sends first; the work's `_source_rank()` says which (a group rank, as
        torch's `dist.recv(t)` without `src` expects)."""
        from mpi4py import MPI

        return self._receive(tensors, MPI.ANY_SOURCE, tag)

    def _receive(self, tensors, src: int, tag: int) -> MpiWork:
        comm = self._usable("recv", tensors)
        (tensor,) = data.single(tensors, "recv")
        out = data.Output(tensor, copy_in=False)
        request = data.SourcedRequest(comm.Irecv(data.raw(out.work), src, tag))
        peer = None if src < 0 else self.global_ranks[src]
        sender = "any rank" if peer is None else f"rank {peer}"
        slot = recorder.begin(self.recorded_as, None, "recv", peer, tensor.numel(), tensor.dtype)
        return MpiWork(self, f"recv from {sender}", [request], tensors, out.finish, (out.work,), slot=slot)
