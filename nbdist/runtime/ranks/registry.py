"""The one home of what features keep on a rank (this code runs ON the engines).

Pipelines' stage executors, meshes, process groups, MPI communicators, traced algorithms' groups: everything a
feature keeps on a rank between the notebook's calls is stored here under (kind, name), and nowhere else. So one
place can list what a rank holds and how much memory it takes (`%dist_status`), and one rule explains what a
restart does: the engines are new processes, this registry starts empty, and a later use of an old object says so
in one line instead of failing somewhere deep.

An entry may describe itself: `memory_bytes()` (tensors it holds) and `describe()` (one line for the table).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@dataclass
class Entry:
    kind: str  # "pipeline", "mesh", "group", ...
    name: str
    value: Any
    created: float


_ENTRIES: dict[tuple[str, str], Entry] = {}
RANK = "rank"  # the rank's own start-up facts (cluster/launching/ranks/boot.py): kept here like the rest, not listed as a holding


class Gone(RuntimeError):
    """An object the notebook refers to is not on this rank (the engines were restarted since it was made)."""


def put(kind: str, name: str, value: T) -> T:
    """Keep `value` under (kind, name), replacing what was there."""
    _ENTRIES[(kind, name)] = Entry(kind, name, value, time.time())
    return value


def get(kind: str, name: str) -> Any:
    """The value kept under (kind, name); one clear line when it is not here."""
    try:
        return _ENTRIES[(kind, name)].value
    except KeyError:
        raise Gone(
            f"{kind} {name!r} is not on this rank: the engines were restarted since it was made (make it again)"
        ) from None


def find(kind: str, name: str) -> Any | None:
    entry = _ENTRIES.get((kind, name))
    return None if entry is None else entry.value


def get_or_make(kind: str, name: str, make: Callable[[], T]) -> T:
    """The value under (kind, name), made by `make()` the first time (e.g. a process group, made once)."""
    entry = _ENTRIES.get((kind, name))
    return entry.value if entry is not None else put(kind, name, make())


def drop(kind: str, name: str) -> None:
    """Forget (kind, name); its tensors are freed when nothing else holds them."""
    entry = _ENTRIES.pop((kind, name), None)
    close = getattr(entry.value, "close", None) if entry is not None else None
    if callable(close):
        close()


def names(kind: str) -> list[str]:
    return [name for (k, name) in _ENTRIES if k == kind]


def holdings() -> list[dict]:
    """One row per entry: kind, name, bytes of tensors held, a one-line description."""
    rows = []
    for entry in _ENTRIES.values():
        if entry.kind == RANK:
            continue
        memory = getattr(entry.value, "memory_bytes", None)
        describe = getattr(entry.value, "describe", None)
        rows.append({
            "kind": entry.kind,
            "name": entry.name,
            "bytes": int(memory()) if callable(memory) else 0,
            "what": describe() if callable(describe) else type(entry.value).__name__,
        })
    return rows
