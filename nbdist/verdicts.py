"""The labs' verdicts on a learner's predictions (predict, then run, then explain): the one line a lab prints after
it measures what the learner predicted. (Predictions of cost are elsewhere: nbdist/sharding/ for a plan,
nbdist/planner/ at cluster scale.)

A lab asks for a prediction in its own cell (`my_prediction = ...`) before the cell that measures it; this module
turns the pair into one sentence a learner reads: how far off the guess was and in which direction, or, for a
choice, whether it was the one measured. A cell left at `...` (Ellipsis) or None is told so, not scored, so a
student version run top to bottom never breaks on a prediction not yet written. Kernel side, plain Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nbdist.errors import DistUsageError


@dataclass(frozen=True, repr=False)
class Verdict:
    """A prediction next to its measurement: `close` when within `tolerance` (a number) or equal (a choice)."""

    what: str
    predicted: object
    measured: object
    close: bool | None
    line: str

    def __str__(self) -> str:
        return self.line

    def __repr__(self) -> str:  # a cell's plain-text output (an export, a terminal) shows the one line too
        return self.line

    def _repr_markdown_(self) -> str:
        return self.line


def compare(what: str, predicted, measured, unit: str = "", tolerance: float = 0.25) -> Verdict:
    """`predicted` against `measured` for `what`: numbers within `tolerance` (a fraction of the measured value) are
    close; strings (a choice) are close when equal, ignoring case and surrounding spaces."""
    if not isinstance(what, str) or not what:
        raise DistUsageError(f"what must name the quantity predicted, got {what!r}")
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < math.inf):
        raise DistUsageError(f"tolerance must be a positive fraction such as 0.25, got {tolerance!r}")
    if predicted is ... or predicted is None:
        return Verdict(what, predicted, measured, None,
                       f"{what}: no prediction written (set it in the cell above), measured {_show(measured, unit)}")
    if isinstance(measured, str) or isinstance(predicted, str):
        close = str(predicted).strip().lower() == str(measured).strip().lower()
        word = "right" if close else "not what happened"
        return Verdict(what, predicted, measured, close,
                       f"{what}: you chose {predicted!r}, measured {measured!r}: {word}")
    return _compare_numbers(what, float(predicted), float(measured), unit, tolerance)


def _compare_numbers(what: str, predicted: float, measured: float, unit: str, tolerance: float) -> Verdict:
    if not (math.isfinite(predicted) and math.isfinite(measured)):
        raise DistUsageError(f"{what}: a prediction and a measurement must be finite numbers, got "
                             f"{predicted!r} and {measured!r}")
    if measured == 0 or predicted / measured <= 0:  # no ratio to read: zero, or the other side of zero
        close = predicted == measured
        gap = predicted - measured
        how = "exact" if close else f"{_show(abs(gap), unit)} {'high' if gap > 0 else 'low'}"
    else:
        error = predicted / measured - 1
        close = abs(error) <= tolerance
        how = f"{abs(error):.0%} {'high' if error > 0 else 'low'}" if error else "exact"
        if abs(error) >= 1:
            ratio = predicted / measured
            how = f"×{ratio:.2f} of it" if ratio < 10 else f"×{ratio:,.0f} of it"
    verdict = "close" if close else "far"
    return Verdict(what, predicted, measured, close,
                   f"{what}: you predicted {_show(predicted, unit)}, measured {_show(measured, unit)}: {how} "
                   f"({verdict}; within {tolerance:.0%} counts as close)")


def _show(value, unit: str) -> str:
    """A number as people read it: 3 significant digits, thousands separated, never an exponent under 1e6."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = f"{value:,.3g}" if abs(value) < 1e6 else f"{value:,.0f}"
        if "e" in text and abs(value) >= 1e-3:
            text = f"{value:,.1f}"
    else:
        text = repr(value)
    if value == 1 and unit.isalpha() and len(unit) > 3 and unit.endswith("s"):  # "1 call", "1 step"; "1 ms"
        unit = unit[:-1]
    return f"{text} {unit}".rstrip()
