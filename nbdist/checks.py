"""Checks of user input shared by every feature: each failure is one DistUsageError line naming the argument."""
from __future__ import annotations

import inspect
from typing import Any

from nbdist.errors import DistUsageError


def is_whole(value: Any) -> bool:
    """A whole number given as an int (True and False are ints to Python, but never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def whole_number(value: Any, what: str, minimum: int = 1) -> int:
    """`value` if it is a whole number >= minimum, else one line saying what `what` must be."""
    if not is_whole(value):
        raise DistUsageError(f"{what} must be a whole number, got {value!r}")
    if value < minimum:
        raise DistUsageError(f"{what} must be at least {minimum}, got {value}")
    return value


def positive_seconds(value: Any, what: str) -> float:
    """A positive number of seconds (int or float, not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DistUsageError(f"{what} must be a number of seconds, got {value!r}")
    if not value > 0:
        raise DistUsageError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def one_of(value: Any, choices: tuple[str, ...] | list[str], what: str) -> str:
    """`value` if it is one of `choices`, else one line listing them."""
    if value not in choices:
        raise DistUsageError(f"unknown {what} {value!r}: choose {', '.join(map(str, choices))}")
    return value


def known_options(given, known, what: str) -> None:
    """One line naming the options `what` does not take (and the ones it does)."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        takes = ", ".join(repr(k) for k in known) or "no options"
        raise DistUsageError(f"{what} takes {takes}; got {', '.join(repr(u) for u in unknown)}")


def fits(needed: int, free: int, total: int, rank: int, device: str, what: str) -> None:
    """Refuse, in one line with both figures, what needs more bytes than are free where it would go (rank `rank`'s
    `device`): said before anything is allocated, rather than as an out-of-memory error in the middle of a step."""
    from nbdist.units import format_bytes

    if needed > free:
        raise DistUsageError(
            f"rank {rank} ({device}): {what} needs {format_bytes(needed)} but {format_bytes(free)} of "
            f"{format_bytes(total)} is free there; use more engines, a higher ZeRO stage, tensor or pipeline "
            f"parallelism, or a smaller batch")


CALLS = {  # how the loop calls each function the user gives
    "model_fn": (), "data_fn": (), "eval_data_fn": (), "loss_fn": ("output", "target"),
    "optimizer_fn": ("params",), "lr_schedule": ("step",),
}


def check_functions(**functions) -> None:
    """Each given function is callable with the arguments the loop passes it (None: not given)."""
    for label, fn in functions.items():
        if fn is None and label in ("eval_data_fn", "lr_schedule", "loss_fn"):  # loss_fn None: the output's own
            continue
        if not callable(fn):
            raise DistUsageError(f"{label} must be a function, got {type(fn).__name__}")
        arguments = CALLS[label]
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without one: the call will tell
            continue
        try:
            signature.bind(*arguments)
        except TypeError:
            raise DistUsageError(f"{label} is called as {label}({', '.join(arguments)}), but it takes "
                                 f"{signature}") from None
