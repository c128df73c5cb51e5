"""Axes in people's units for every figure: bytes on binary ticks with binary labels, seconds labelled with their
unit. The tick rules are nbdist.units'; here they become plotly axis settings, so no figure writes them out again."""
from __future__ import annotations

from nbdist.units import binary_log_ticks, binary_ticks, second_ticks


def _ticks(values: list[float], labels: list[str]) -> dict:
    return {"tickmode": "array", "tickvals": values, "ticktext": labels}


def byte_axis(top: float) -> dict:
    """A bytes axis from 0 to `top` ('256 KiB', '80 GiB', not plotly's decimal '262k' or '86G')."""
    return _ticks(*binary_ticks(top))


def byte_log_axis(low: float, high: float) -> dict:
    """A log axis of bytes from `low` to `high`, ticked at powers of two."""
    return _ticks(*binary_log_ticks(low, high))


def seconds_axis(total: float) -> dict:
    """A seconds axis from 0 to `total`, each tick with its unit ('500 ms', '1.5 h')."""
    return _ticks(*second_ticks(total))
