"""Sizes as people read them: one formatting rule for every table, figure and benchmark (a leaf: imports nothing).

Binary units (KiB = 1024 bytes), as message sizes in collective benchmarks are powers of two.
"""
from __future__ import annotations


def format_bytes(size: float) -> str:
    """1024 -> '1 KiB', 4194304 -> '4 MiB', 1000 -> '1000 B', 1536 -> '1.5 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{size:.0f} B"
