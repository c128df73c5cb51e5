"""MPI keeps moving between cells (nbdist/backend/ranks/idle_progress.py), on a real 4-engine MPI cluster.

The claim: a rank that comes late to many collectives posted at once (ZeRO's parameter broadcasts) completes them
even though its peers completed theirs and went idle. Without the idle ticks it waited for good in about half such
cells (seen in CI: notebook 32 stuck 600 s in `broadcast #81`), because part of what the peers sent was still in
their own postponed queues, which only their MPI calls move.

The engine functions import what they use inside and raise AssertionError by hand (see test_mpi_backend.py).
"""
from __future__ import annotations

import time

BROADCASTS = 50
ROUNDS = 8


def late_rank_zero(round_: int) -> float:
    """Every rank posts BROADCASTS broadcasts at once (sizes 64 B to 256 KiB, roots in turn), rank 0 after a
    delay, then waits for them in order, as ZeroRedundancyOptimizer._sync_params does; returns seconds waited."""
    import time

    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        time.sleep(0.05 + 0.05 * (round_ % 3))
    sizes = [(16, 64, 4096, 16384, 65536)[(i * 7 + round_) % 5] for i in range(BROADCASTS)]
    tensors = [torch.full((n,), float(rank)) for n in sizes]
    started = time.perf_counter()
    works = [dist.broadcast(t, src=i * size // BROADCASTS, async_op=True) for i, t in enumerate(tensors)]
    for work in works:
        work.wait()
    for i, t in enumerate(tensors):
        if not bool((t == i * size // BROADCASTS).all()):
            raise AssertionError(f"broadcast {i} on rank {rank} holds {t[0].item()}")
    return time.perf_counter() - started


def ticks() -> tuple[int, float]:
    from nbdist.backend.ranks import idle_progress

    if idle_progress._ticker is None:
        raise AssertionError("no idle ticker on this engine")
    return idle_progress._ticker.ticks, idle_progress._ticker.gap


def test_a_late_rank_completes_what_its_idle_peers_posted(cluster4):
    for round_ in range(ROUNDS):
        waited = cluster4.run(late_rank_zero, round_, timeout=30)
        if max(waited) > 5:  # a few ms each; ~0.06 s at worst when a peer's ticks have slowed to their longest gap
            raise AssertionError(f"round {round_}: rank 0 waited {waited[0]:.2f} s for what its peers had sent")


def test_an_idle_engine_ticks_slowly(cluster4):
    before = cluster4.run(ticks)
    time.sleep(1.0)
    after = cluster4.run(ticks)
    for (b, _), (a, gap) in zip(before, after):
        # after a cell: ticks at 2, 4, ... ms, then one per 50 ms: about 20 in that second, never hundreds
        assert 10 <= a - b <= 40, (b, a)
        assert gap > 0.002
