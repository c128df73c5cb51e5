"""Shipping the user's functions to the engines: the kernel makes them `portable`, a rank `restore`s them.

A model builder, a loss or a data set function written in a notebook cell must run on ranks that never saw that
cell. cloudpickle sends it by value, with what it references. The kernel remembers where each shipped function was
defined (`defined_in`), so a traceback through it on a rank shows its source (cluster/waiting/tracebacks.py) instead of
cloudpickle's "<dynamic-code>". Both halves import this module: it needs cloudpickle only, on first use.
"""
from __future__ import annotations

from typing import Any, Callable

SENT_BY_VALUE = "<dynamic-code>"  # cloudpickle's file name for the code of a function it sent by value
_sent_functions: dict[str, str] = {}  # qualified name -> the kernel file (cell) it was defined in


def portable(fn: Callable | None) -> bytes | None:
    """A user function as self-contained bytes (cloudpickle, by value with what it references), so a model
    builder or loss written in a notebook cell runs on the engines even if they never imported torch."""
    import cloudpickle

    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    if code is not None:
        _sent_functions[fn.__qualname__] = code.co_filename
    return cloudpickle.dumps(fn)


def restore(payload: Any) -> Any:
    """On a rank: the bytes `portable` made back into the user's function (anything else is passed through)."""
    import cloudpickle

    return cloudpickle.loads(payload) if isinstance(payload, bytes) else payload


def defined_in(qualified_name: str) -> str | None:
    """The kernel file (notebook cell) a function shipped by `portable` was defined in, if it was."""
    return _sent_functions.get(qualified_name)
