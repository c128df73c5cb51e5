"""All-reduce built by hand from point-to-point messages: ring, binomial tree and recursive doubling (runs ON the
engines).

The three functions run on every rank of a process group, like `dist.all_reduce` (sum, in place):

    ring_all_reduce(t)                  reduce-scatter then all-gather of n chunks: 2(n-1) steps of S/n bytes
    tree_all_reduce(t)                  binomial tree reduce to rank 0, then broadcast: 2 ceil(log2 n) steps of S
    recursive_doubling_all_reduce(t)    exchange with rank XOR 2^k: log2 n steps of S (floor(log2 n) + 2 when n
                                        is not a power of two: a fold-in and a fold-out step more)

A step is one round of messages; all of a rank's sends and receives of a step are posted together
(`batch_isend_irecv`), so no ordering can deadlock and the same code runs on gloo and on nccl. With `record=[]`
each rank appends one entry per step: who sent which chunk where, and which ranks' contributions each of its
chunks now holds. Those holdings travel with the data (a small mask message beside each chunk), so the record is
what the ranks really exchanged, not what we expected them to.

`trace_rank` is the engine side of the notebook's `nbdist.collectives.trace` (nbdist/collectives/trace.py): the
algorithm and the library on the same random tensor, and this rank's record. The step and byte counts, the phase
names and the chunk sizes come from the one table, nbdist.cost.collectives (plain data, read on both sides).

On nccl, a group's first batch of point-to-point messages must involve all of its ranks (torch's rule for
`batch_isend_irecv`), which the tree's first round does not for n = 3: run one collective on a fresh group first
(`trace_rank` does: it runs `dist.all_reduce` before the algorithm).

Sums of floating and integer tensors are supported; bool and complex tensors raise DistUsageError (a sum of bools
is no bool; complex is not needed here, so not tested). A group of one rank is a valid no-op: no steps.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from nbdist.cluster.meshes.ranks import groups
from nbdist.cost.collectives import REDUCING_PHASES
from nbdist.errors import DistUsageError

DATA_TAG, MASK_TAG = 0, 1


# -- one rank's all-reduce in progress ---------------------------------------------------------------------------


class _Run:
    """One rank's view of an all-reduce: its chunks (views into the tensor; one per rank when `chunked`, else the
    whole tensor), its rank in the group, and (when recording) which ranks' contributions each chunk holds.
    `step` is the only place that communicates."""

    def __init__(self, tensor: torch.Tensor, group, record: list | None, chunked: bool):
        _check_tensor(tensor)
        self.tensor, self.group, self.record = tensor, group, record
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise DistUsageError(f"rank {dist.get_rank()} is not in the group it was asked to all-reduce over")
        self.work = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.chunks = list(self.work.view(-1).tensor_split(self.size if chunked else 1))
        self.holds = [{self.rank} for _ in self.chunks] if record is not None else None
        self.steps = 0

    def step(self, phase: str, send: list[tuple[int, int]] = (), recv: list[tuple[int, int]] = ()) -> None:
        """One round: send chunk c to peer for each (peer, c) in `send`, receive chunk c from peer for each in
        `recv`, then add (reducing phases) or copy (the others) what arrived. Peers are ranks in the group."""
        adding = phase in REDUCING_PHASES
        buffers = [torch.empty_like(self.chunks[c]) if adding else self.chunks[c] for _, c in recv]
        ops = [self._op(dist.isend, self.chunks[c], peer, DATA_TAG) for peer, c in send]
        ops += [self._op(dist.irecv, buffer, peer, DATA_TAG) for (peer, _), buffer in zip(recv, buffers)]
        masks = self._mask_ops(send, recv, ops) if self.holds is not None else []
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if adding:
            for (_, c), buffer in zip(recv, buffers):
                self.chunks[c] += buffer
        self.steps += 1
        if self.holds is not None:
            self._note(phase, send, recv, masks, adding)

    def finish(self) -> torch.Tensor:
        if self.work is not self.tensor:
            self.tensor.copy_(self.work)
        return self.tensor

    def _op(self, fn: Callable, tensor: torch.Tensor, peer: int, tag: int) -> dist.P2POp:
        # P2POp takes the peer's global rank whatever the group (torch >= 2.6 also accepts group_peer)
        global_peer = peer if self.group is None else dist.get_global_rank(self.group, peer)
        return dist.P2POp(fn, tensor, global_peer, self.group, tag)

    # -- recording: holdings travel as a 0/1 mask of n ranks beside each chunk --------------------------------

    def _mask_ops(self, send, recv, ops: list) -> list[torch.Tensor]:
        device = self.chunks[0].device
        for peer, c in send:
            mask = torch.zeros(self.size, dtype=torch.uint8, device=device)
            mask[sorted(self.holds[c])] = 1
            ops.append(self._op(dist.isend, mask, peer, MASK_TAG))
        masks = [torch.empty(self.size, dtype=torch.uint8, device=device) for _ in recv]
        ops += [self._op(dist.irecv, mask, peer, MASK_TAG) for (peer, _), mask in zip(recv, masks)]
        return masks

    def _note(self, phase: str, send, recv, masks: list[torch.Tensor], adding: bool) -> None:
        for (peer, c), mask in zip(recv, masks):
            incoming = set(mask.nonzero().flatten().tolist())
            if adding and incoming & self.holds[c]:
                raise RuntimeError(
                    f"rank {self.rank}, step {self.steps}: chunk {c} from rank {peer} would count rank(s) "
                    f"{sorted(incoming & self.holds[c])} twice"
                )
            self.holds[c] = self.holds[c] | incoming if adding else incoming
        self.record.append({
            "step": self.steps,
            "phase": phase,
            "sends": [(self.rank, peer, c) for peer, c in send],
            "holds": [sorted(h) for h in self.holds],
        })


def _check_tensor(tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise DistUsageError(f"all-reduce needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise DistUsageError(f"all-reduce sums floating or integer tensors, not {tensor.dtype}")


# -- the three algorithms ----------------------------------------------------------------------------------------


def ring_all_reduce(tensor: torch.Tensor, group=None, record: list | None = None) -> torch.Tensor:
    """Sum `tensor` over the group in place, around a ring. Bandwidth-optimal: each rank sends 2(n-1)/n of it.

    The flattened tensor is cut into n nearly equal chunks. Reduce-scatter: at step s rank r sends chunk r-s to
    its right neighbour and adds chunk r-s-1 from its left; after n-1 steps rank r holds the full sum of chunk
    r+1. All-gather: the full chunks go round the ring the same way, n-1 more steps, copied instead of added.
    """
    run = _Run(tensor, group, record, chunked=True)
    n, r = run.size, run.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        run.step("reduce-scatter", send=[(right, (r - s) % n)], recv=[(left, (r - s - 1) % n)])
    for s in range(n - 1):
        run.step("all-gather", send=[(right, (r - s + 1) % n)], recv=[(left, (r - s) % n)])
    return run.finish()


def tree_all_reduce(tensor: torch.Tensor, group=None, record: list | None = None) -> torch.Tensor:
    """Sum `tensor` over the group in place: binomial-tree reduce to rank 0, then broadcast down the same tree.

    Round k of the reduce: every rank r with r mod 2^(k+1) = 2^k sends its partial sum to r - 2^k and is done.
    Latency-friendly (2 ceil(log2 n) steps) but every message is the whole tensor, and half the ranks idle each
    round. Any n works: a rank whose partner would be >= n simply waits out that round.
    """
    run = _Run(tensor, group, record, chunked=False)
    n, r = run.size, run.rank
    rounds = (n - 1).bit_length()  # ceil(log2 n)
    for k in range(rounds):
        span = 1 << k
        if r % (2 * span) == span:
            run.step("reduce", send=[(r - span, 0)])
        elif r % (2 * span) == 0 and r + span < n:
            run.step("reduce", recv=[(r + span, 0)])
        else:
            run.step("reduce")
    for k in reversed(range(rounds)):
        span = 1 << k
        if r % (2 * span) == 0 and r + span < n:
            run.step("broadcast", send=[(r + span, 0)])
        elif r % (2 * span) == span:
            run.step("broadcast", recv=[(r - span, 0)])
        else:
            run.step("broadcast")
    return run.finish()


def recursive_doubling_all_reduce(tensor: torch.Tensor, group=None, record: list | None = None) -> torch.Tensor:
    """Sum `tensor` over the group in place: at round k every rank swaps its partial sum with rank XOR 2^k.

    After log2 n rounds everyone has everything: the fewest steps, but every message is the whole tensor. With
    n not a power of two, p = the largest power of two below n: ranks p..n-1 first fold their tensor into ranks
    0..n-p-1 ("fold-in"), ranks 0..p-1 run recursive doubling, and the result is sent back ("fold-out").
    """
    run = _Run(tensor, group, record, chunked=False)
    n, r = run.size, run.rank
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if extra:
        _fold(run, "fold-in", r, p, extra, to_low=True)
    for k in range(p.bit_length() - 1):
        partner = r ^ (1 << k)
        if r < p:
            run.step("exchange", send=[(partner, 0)], recv=[(partner, 0)])
        else:
            run.step("exchange")
    if extra:
        _fold(run, "fold-out", r, p, extra, to_low=False)
    return run.finish()


def _fold(run: _Run, phase: str, r: int, p: int, extra: int, to_low: bool) -> None:
    """Rank p+i and rank i (i < extra) pair up: the high one sends to the low one (in) or receives from it (out)."""
    if r >= p:
        run.step(phase, **{"send" if to_low else "recv": [(r - p, 0)]})
    elif r < extra:
        run.step(phase, **{"recv" if to_low else "send": [(r + p, 0)]})
    else:
        run.step(phase)


ALGORITHMS: dict[str, Callable] = {
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "recursive-doubling": recursive_doubling_all_reduce,
}


def trace_rank(algorithm: str, n: int, size: int, seed: int) -> dict | None:
    """Engine side of `trace`: `algorithm` (a name of the cost table) and `dist.all_reduce` on the same random
    float32 tensor of `size` elements among ranks 0..n-1, and this rank's record. Call on every rank (the group of
    ranks 0..n-1 is made once, collectively); None on a rank outside the group."""
    from nbdist.cluster.launching.ranks.boot import boot

    group = groups.first_ranks(n)
    if dist.get_rank() >= n:
        return None
    rank = dist.get_rank(group)
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)
    ours = torch.randn(size, generator=generator).to(boot().device)
    expected = ours.clone()
    dist.all_reduce(expected, group=group)
    record: list = []
    ALGORITHMS[algorithm](ours, group, record)
    return {
        "record": record,
        "max_diff": (ours - expected).abs().max().item() if size else 0.0,
        "scale": expected.abs().max().item() if size else 0.0,
    }
