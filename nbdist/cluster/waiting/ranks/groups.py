"""Can this rank be brought back in step with the others? Asked after a rank failed, before nbdist's MPI groups are
renewed (this code runs ON the engines, and involves no other rank).

Why: renewing is collective (every rank makes each group's new communicator, in the order the groups were made). A
rank whose code called torch.distributed.destroy_process_group() holds no group any more, so the others waited in
their renewal for it: 60 s, then the next cell stuck behind them. Asked first, each rank answers alone, at once.
"""
from __future__ import annotations


def has_process_group() -> bool:
    """Whether this rank still has torch.distributed's default process group (nbdist's boot made it)."""
    import torch.distributed as dist

    return dist.is_initialized()
