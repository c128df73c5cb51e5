"""All-reduce built by hand from point-to-point messages: ring, binomial tree and recursive doubling.

The three functions run ON the engines, on every rank of a process group, like `dist.all_reduce` (sum, in place):

    ring_all_reduce(t)                  reduce-scatter then all-gather of n chunks: 2(n-1) steps of S/n bytes
    tree_all_reduce(t)                  binomial tree reduce to rank 0, then broadcast: 2 ceil(log2 n) steps of S
    recursive_doubling_all_reduce(t)    exchange with rank XOR 2^k: log2 n steps of S (floor(log2 n) + 2 when n
                                        is not a power of two: a fold-in and a fold-out step more)

A step is one round of messages; all of a rank's sends and receives of a step are posted together
(`batch_isend_irecv`), so no ordering can deadlock and the same code runs on gloo and on nccl. With `record=[]`
each rank appends one entry per step: who sent which chunk where, and which ranks' contributions each of its
chunks now holds. Those holdings travel with the data (a small mask message beside each chunk), so the record is
what the ranks really exchanged, not what we expected them to.

In the notebook, `trace("ring")` runs an algorithm on the cluster, checks it against `dist.all_reduce`, gathers
every rank's record and draws it step by step (`trace(...).figure()`); `message_counts` gives the step and byte
counts the alpha-beta model charges, from the one cost table (nbdist.collectives.costs).

On nccl, a group's first batch of point-to-point messages must involve all of its ranks (torch's rule for
`batch_isend_irecv`), which the tree's first round does not for n = 3: run one collective on a fresh group first
(`trace` does: it runs `dist.all_reduce` before the algorithm).

Sums of floating and integer tensors are supported; bool and complex tensors raise DistUsageError (a sum of bools
is no bool; complex is not needed here, so not tested). A group of one rank is a valid no-op: no steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from nbdist.collectives import costs
from nbdist.collectives.costs import MessageCount, message_counts  # noqa: F401 (the counts live in the table)
from nbdist.errors import DistError, DistUsageError

# phases whose received chunks are added; in the others ("all-gather", "broadcast", "fold-out") they replace ours
REDUCING_PHASES = ("reduce-scatter", "reduce", "exchange", "fold-in")
DATA_TAG, MASK_TAG = 0, 1
RELATIVE_TOLERANCE = 1e-5  # of the largest |sum| (at least 1): the library adds in another order, last bits differ


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


# -- tracing: run on the cluster, check against the library, gather the records (kernel side) -------------------

_GROUPS: dict[int, object] = {}  # engine side: world size -> process group of ranks 0..n-1 (created once)


def _group(n: int):
    """The group of ranks 0..n-1: the default group when that is everyone. Every rank must call this (new_group
    is collective), so the cache grows the same way on all of them."""
    if n == dist.get_world_size():
        return None
    if n not in _GROUPS:
        _GROUPS[n] = dist.new_group(list(range(n)))
    return _GROUPS[n]


def _trace_rank(algorithm: str, n: int, size: int, seed: int) -> dict | None:
    """Engine side of `trace`: the algorithm and the library on the same random tensor, and this rank's record."""
    from nbdist.engine.boot import boot

    group = _group(n)
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


@dataclass
class Trace:
    """One all-reduce, step by step. `steps[k]`: {"step", "phase", "sends": [(src, dst, chunk)], "holds": per rank,
    per chunk, the sorted ranks whose contributions it holds after the step}."""

    algorithm: str
    world_size: int
    size: int  # float32 elements per rank
    chunk_sizes: list[int]  # elements of each chunk (one chunk, the whole tensor, for tree and recursive doubling)
    steps: list[dict]
    matches_library: bool
    max_diff: float  # largest |ours - dist.all_reduce| over ranks and elements

    def figure(self):
        """A plotly figure with one frame per step and a slider (nbdist.viz.collective_steps)."""
        from nbdist.viz.collective_steps import collective_steps_figure

        return collective_steps_figure(self)

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each rank sent in total (float32), from the record; the largest is `message_counts(...)
        .busiest_rank_bytes`."""
        sent = [0] * self.world_size
        for step in self.steps:
            for src, _, chunk in step["sends"]:
                sent[src] += 4 * self.chunk_sizes[chunk]
        return sent

    @property
    def critical_path_bytes(self) -> int:
        """The sum over steps of each step's largest message (float32 bytes), from the record: what the alpha-beta
        model charges beta for (`message_counts(...).critical_path_bytes`)."""
        return sum(max((4 * self.chunk_sizes[chunk] for _, _, chunk in step["sends"]), default=0)
                   for step in self.steps)

    def __repr__(self) -> str:
        verdict = "matches" if self.matches_library else "DIFFERS FROM"
        steps = f"{len(self.steps)} step" + ("" if len(self.steps) == 1 else "s")
        return (
            f"<{self.algorithm} all-reduce on {self.world_size} ranks, {self.size} floats: {steps}, "
            f"{verdict} dist.all_reduce (max diff {self.max_diff:.2g})>"
        )


def trace(algorithm: str, world_size: int | None = None, size: int = 1024, cluster=None, *, seed: int = 0,
          timeout: float | None = 120.0) -> Trace:
    """Run `algorithm` ("ring", "tree", "recursive-doubling", or the alias "recursive_doubling") on ranks
    0..world_size-1 of the cluster (default: all) on random float32 tensors of `size` elements, check it equals
    `dist.all_reduce` of the same tensors (DistError if not), and return every rank's record merged step by step.
    `.figure()` draws it."""
    from nbdist.cluster import current

    algorithm = costs.canonical(algorithm)  # one spelling, one alias, checked in one place
    cluster = cluster or current()
    n = cluster.world_size if world_size is None else world_size
    if not isinstance(n, int) or not 2 <= n <= cluster.world_size:
        raise DistUsageError(f"world_size must be 2..{cluster.world_size} (the cluster's ranks), got {world_size!r}"
                             " - one rank has nothing to reduce")
    if not isinstance(size, int) or size < 1:
        raise DistUsageError(f"size must be a positive number of elements, got {size!r}")
    results = cluster.run(_trace_rank, algorithm, n, size, seed, timeout=timeout)[:n]
    max_diff = max(r["max_diff"] for r in results)
    scale = max(r["scale"] for r in results)
    if not max_diff <= RELATIVE_TOLERANCE * max(scale, 1.0):
        raise DistError(f"{algorithm} all-reduce differs from dist.all_reduce by up to {max_diff:.3g} "
                        f"(largest |sum| {scale:.3g}) on {n} ranks, {size} elements")
    steps = _merge([r["record"] for r in results], algorithm)
    chunks = n if algorithm == "ring" else 1
    sizes = [len(c) for c in torch.empty(size).tensor_split(chunks)]
    return Trace(algorithm, n, size, sizes, steps, True, max_diff)


def _merge(records: list[list[dict]], algorithm: str) -> list[dict]:
    """Per-rank records -> per-step entries with everyone's sends and holdings; checks the ranks agree and that
    every chunk ends fully reduced everywhere (the record's own proof of the result)."""
    n = len(records)
    phases = [[entry["phase"] for entry in record] for record in records]
    if any(p != phases[0] for p in phases):
        raise DistError(f"{algorithm}: the ranks recorded different steps: {phases}")
    steps = [
        {
            "step": k + 1,
            "phase": phase,
            "sends": sorted(send for record in records for send in record[k]["sends"]),
            "holds": [record[k]["holds"] for record in records],
        }
        for k, phase in enumerate(phases[0])
    ]
    everyone = list(range(n))
    missing = [(r, c) for r, holds in enumerate(steps[-1]["holds"]) for c, h in enumerate(holds) if h != everyone]
    if missing:
        raise DistError(f"{algorithm}: after the last step (rank, chunk) {missing} lack some ranks' contributions")
    return steps
