"""What `Cluster.run`, `run_each` and `execute` are given, checked in the kernel before anything reaches a rank:
each problem is one DistUsageError line naming it."""
from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence

from nbdist.checks import is_whole
from nbdist.errors import DistUsageError


def chosen_ranks(ranks: Sequence[int] | int | str | None, world_size: int) -> list[int]:
    """None, 'all', a spec ('0,2-3'), one rank or a list of ranks -> the ranks, each once and in 0..world_size-1."""
    if ranks is None or ranks == "all":
        return list(range(world_size))
    if isinstance(ranks, str):
        chosen = parse_rank_spec(ranks, world_size)
    elif is_whole(ranks):
        chosen = [ranks]
    elif isinstance(ranks, (list, tuple, range)):
        chosen = list(ranks)
    else:
        raise DistUsageError(f"ranks must be 'all', a spec like '0,2-3', a rank or a list of ranks, got {ranks!r}")
    bad = [r for r in chosen if not is_whole(r) or not 0 <= r < world_size]
    if bad or not chosen:
        raise DistUsageError(f"ranks {ranks!r} are not in 0..{world_size - 1}")
    if len(set(chosen)) < len(chosen):
        raise DistUsageError(f"ranks {ranks!r} name a rank twice")
    return chosen


def parse_rank_spec(spec: str, world_size: int) -> list[int]:
    """'all', '0', '0,2', '1-3' or '0,2-3' -> sorted rank list."""
    spec = spec.strip()
    if spec == "all":
        return list(range(world_size))
    ranks: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            ranks.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise DistUsageError(f"--ranks {spec!r}: expected 'all', '0', '0,2' or '1-3'") from None
    return sorted(ranks)


def needs_function(fn: Any, what: str) -> None:
    if not callable(fn):
        raise DistUsageError(f"{what} needs a function to call on the ranks, got {fn!r}")


def sendable_to_each(fn: Callable, args_by_rank: dict[int, Sequence]) -> None:
    """Refuse, before anything is sent, a call whose arguments for some rank cannot be pickled: sent rank by
    rank, the ranks before it would already run (and wait in their collectives for the one that never starts).
    The first rank's arguments are left to the send itself, which says the same line."""
    from ipyparallel.serialize import pack_apply_message

    for args in list(args_by_rank.values())[1:]:
        sent(fn, lambda: pack_apply_message(fn, args, {}))


def sent(fn: Callable, send: Callable[[], Any]) -> Any:
    """Send a call to the engines: what cannot be pickled (a lock, an open file, a generator...) is one line, said
    before any rank runs anything."""
    try:
        return send()
    except (TypeError, AttributeError, pickle.PicklingError, RecursionError) as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise DistUsageError(f"{name} or its arguments cannot be sent to the ranks ({type(e).__name__}: {e}); "
                             "make what it needs inside the function") from e
