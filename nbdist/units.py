"""Sizes and durations as people read them: one formatting rule for every table, figure and benchmark (a leaf:
imports nothing).

Binary units (KiB = 1024 bytes), as message sizes in collective benchmarks are powers of two, and the same units on
figure axes (`binary_ticks`), so that a line drawn at 80 GiB sits on the axis' "80 GiB" and not at "86G". Numbers
never print in e-notation: a person reads "1,010 KiB" and "16.8 h", not "1.01e+03 KiB" and "6.036e+04 s".
"""
from __future__ import annotations

import math

BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def amount(value: float) -> str:
    """3 significant digits below 100, whole numbers with thousands separators from 100 on (no e-notation, negative
    amounts too)."""
    if value == int(value) or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def format_bytes(size: float) -> str:
    """1024 -> '1 KiB', 4194304 -> '4 MiB', 1000 -> '1000 B', 1536 -> '1.5 KiB', 1034000 -> '1,010 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{amount(size / scale)} {unit}"
    return f"{size:.0f} B"


def format_seconds(seconds: float) -> str:
    """A duration in the unit that reads best: '850 µs', '12.3 ms', '4.56 s', '12.5 min', '16.8 h', '2.5 days'."""
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60), ("s", 1), ("ms", 1e-3)):
        if abs(seconds) >= scale:
            return f"{amount(seconds / scale)} {unit}"
    return f"{amount(seconds * 1e6)} µs"


def binary_ticks(top: float, most: int = 6) -> tuple[list[float], list[str]]:
    """Tick positions (bytes) and their labels for an axis from 0 to `top` bytes: at most `most` + 1 ticks, a round
    step (1, 2 or 5 x 10^k) in the largest binary unit `top` reaches, labelled by format_bytes."""
    if top <= 0:
        return [0.0], ["0 B"]
    unit = next(scale for _, scale in BINARY_UNITS if top >= scale)
    span = top / unit
    step = max(_round_step(span / most), 1 / 1024 if unit > 1 else 1)
    values = [i * step * unit for i in range(int(span / step + 1e-9) + 1)]
    return values, ["0 B" if v == 0 else format_bytes(v) for v in values]


def second_ticks(total: float, most: int = 6) -> tuple[list[float], list[str]]:
    """Ticks from 0 to `total` seconds at a round step, each labelled with its unit ('2 s', '500 ms', '1.5 h')."""
    if total <= 0:
        return [0.0], ["0 s"]
    step = _round_step(total / most)
    values = [i * step for i in range(int(total / step + 1e-9) + 1)]
    return values, ["0 s" if v == 0 else format_seconds(v) for v in values]


def _round_step(raw: float) -> float:
    """The smallest round step (1, 2 or 5 x 10^k) of at least `raw`: ticks a person reads at a glance."""
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def binary_log_ticks(low: float, high: float) -> tuple[list[float], list[str]]:
    """Ticks for a log axis of bytes from `low` to `high`: the powers of two between them, labelled by
    format_bytes ('8 GiB', '16 GiB', ...), thinned to at most 8 so that labels never run together."""
    if low <= 0 or high <= low:
        return [], []
    powers = list(range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1))
    stride = max(1, math.ceil(len(powers) / 8))
    values = [2.0**p for p in powers[::stride]]
    return values, [format_bytes(v) for v in values]


def format_count(count: float, noun: str, plural: str | None = None) -> str:
    """A count with its noun, grammatical and grouped: (1, 'GPU') -> '1 GPU', (2097152, 'GPU') -> '2,097,152 GPUs';
    whole counts only print whole ('1,536 GPUs', never '1536.0')."""
    amount = f"{count:,.0f}" if count == int(count) else f"{count:,.3g}"
    return f"{amount} {noun if count == 1 else plural or noun + 's'}"


def format_parameters(parameters: float) -> str:
    """A model's size said as a count, not a byte size: 1.746e11 -> '174.6 billion parameters', 1.008e12 ->
    '1.01 trillion parameters' (a bare '1008.0 B' reads like bytes)."""
    for word, scale in (("trillion", 1e12), ("billion", 1e9), ("million", 1e6)):
        if parameters >= scale:
            value = parameters / scale
            return f"{value:.3g} {word} parameters" if value < 100 else f"{value:,.1f} {word} parameters"
    return format_count(parameters, "parameter")


def format_duration(seconds: float) -> str:
    """A duration from a minute up in whole units a person reads at once: 100 -> '1 min 40 s', 3725 -> '1 h 2 min',
    1110 -> '18 min 30 s'; below a minute, format_seconds ('4.56 s', '12.3 ms')."""
    if abs(seconds) < 60:
        return format_seconds(seconds)
    if abs(seconds) < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    if abs(seconds) < 86400:
        hours, rest = divmod(round(seconds / 60), 60)
        return f"{hours} h {rest} min" if rest else f"{hours} h"
    days, rest = divmod(round(seconds / 3600), 24)
    return f"{days} days {rest} h" if rest else f"{days} days"


_DURATION_STEPS = (60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)  # whole minutes and hours


def duration_ticks(total: float, most: int = 6) -> tuple[list[float], list[str]]:
    """Ticks from 0 to `total` seconds: below two minutes as second_ticks; above, at whole minutes or hours (1, 2,
    5, 10, 15, 30 min, 1, 2, 3, 6, 12 h, 1 day), labelled by format_duration ('1 min 30 s' never, '2 min', '1 h')."""
    if total <= 120:
        return second_ticks(total, most)
    step = next((s for s in _DURATION_STEPS if s * most >= total), 86400 * _round_step(total / most / 86400))
    values = [i * step for i in range(int(total / step + 1e-9) + 1)]
    return values, ["0 s" if v == 0 else format_duration(v) for v in values]
