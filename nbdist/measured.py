"""What a lab prints beside a measurement it reads: the machine's load while it ran, and repeats as a median with
their spread, so a sentence that interprets a timing is computed from the run and says the conditions it held in.

A class runs the labs on a shared machine: the same cell measured quiet and beside two busy processes can flip a
comparison. So a lab that compares timings takes repeats (`Repeats`), says its verdict only when the medians are
further apart than the spreads (`Repeats.clearly_below`), and prints `machine_load()` beside it. Kernel side,
plain Python (os.getloadavg; psutil where it is installed for the cores this process may use).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from nbdist.errors import DistUsageError
from nbdist.units import amount


@dataclass(frozen=True)
class Load:
    """The run queue over the last minute (os.getloadavg) on the cores this process may use. The cluster's own
    busy ranks count in it too: a lab with 4 busy engines on 2 cores reads about 2 per core with nothing else."""

    average: float
    cores: int

    @property
    def per_core(self) -> float:
        return self.average / self.cores

    @property
    def word(self) -> str:
        """quiet (under half the cores busy), busy (up to one runnable process per core), loaded (processes wait
        for a core: timings stretch and their order can flip)."""
        return "quiet" if self.per_core < 0.5 else "busy" if self.per_core <= 1.0 else "loaded"

    def __str__(self) -> str:
        return (f"machine: load {self.average:.1f} on {self.cores} core{'s' if self.cores != 1 else ''} over the "
                f"last minute ({self.word})")


def machine_load() -> Load:
    """The load now, as `str(machine_load())` prints it beside a verdict."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return Load(os.getloadavg()[0], max(cores, 1))


@dataclass(frozen=True)
class CoreShare:
    """The share of a core each rank got with every rank computing at once (its CPU seconds over wall seconds;
    the slowest rank's), measured when a plan was profiled, with the load then: what a step's prediction assumes
    the ranks get. A prediction scales the layers' core seconds by it, so it holds while the load stays near the
    one it was measured under, and says how far the load is now (str)."""

    share: float
    ranks: int  # the ranks on this host, which compete for its cores with each other and with other work
    load: Load

    @property
    def others(self) -> float:
        """Runnable processes besides the ranks, in cores' worth: what the ranks' share says competes with them
        (the cores over the share, less the ranks)."""
        return max(0.0, self.load.cores / self.share - self.ranks) if self.ranks else 0.0

    @property
    def slowdown(self) -> float:
        """Wall seconds per core second of a rank's compute with every rank busy."""
        return 1.0 / self.share

    @property
    def others_fraction(self) -> float:
        """The part of the competition for the cores that stays when the ranks idle (other work)."""
        return self.others / (self.others + self.ranks) if self.ranks else 0.0

    def __str__(self) -> str:
        now = machine_load()
        return (f"assumes each of {self.ranks} ranks gets {self.share:.2f} of a core with every rank busy, as "
                f"measured at profile time under load {self.load.average:.1f} on {self.load.cores} cores; "
                f"now {now.average:.1f}")

    __repr__ = __str__


@dataclass(frozen=True)
class Repeats:
    """One quantity measured several times: its median and its spread (lowest and highest)."""

    values: tuple[float, ...]
    unit: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise DistUsageError("Repeats needs at least one measured value, got none")

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def clearly_below(self, other: "Repeats") -> bool:
        """True when every repeat here is below every repeat of `other`: the order holds in each pair, not only
        in the medians (with 3 repeats each, a chance ordering comes out so 1 time in 20)."""
        return self.high < other.low

    def __str__(self) -> str:
        unit = _spelled(self.unit)
        if len(self.values) == 1:
            return f"{amount(self.median)}{unit} (one run)"
        return (f"{amount(self.median)}{unit} (median of {len(self.values)}, "
                f"{amount(self.low)}-{amount(self.high)})")


def _spelled(unit: str) -> str:
    """A unit as it follows a number: '471 µs', '4.8x', '44%', a bare count."""
    return unit if unit in ("x", "%") else f" {unit}" if unit else ""


def order(a: Repeats, b: Repeats, name_a: str, name_b: str, lower: str = "faster") -> str:
    """The verdict a lab prints when it compares two timed things: which is `lower` ("faster") when the repeats
    say so clearly, or that they overlap, with both medians and spreads."""
    if a.clearly_below(b):
        said = f"{name_a} was {lower} than {name_b} in every repeat"
    elif b.clearly_below(a):
        said = f"{name_b} was {lower} than {name_a} in every repeat"
    else:
        said = f"{name_a} and {name_b} overlap: neither was {lower} in every repeat"
    return f"{said}: {name_a} {a}, {name_b} {b}"


def compared(a: Repeats, b: Repeats, name_a: str, name_b: str, lower: str = "faster") -> str:
    """order(), and by how much the medians differ: the verdict of a lab that says what one way adds to another
    ("the backend added 372 µs over MPI at 1 KiB"), with the repeats it was read from."""
    low, high = sorted(((a, name_a), (b, name_b)), key=lambda pair: pair[0].median)
    unit = _spelled(a.unit)
    times = f"{high[0].median / low[0].median:.3g}x" if low[0].median > 0 else "no ratio: a median of 0"
    return (f"{order(a, b, name_a, name_b, lower)}; {high[1]}'s median is {amount(high[0].median - low[0].median)}"
            f"{unit} above {low[1]}'s ({times})")


def ratios(a: Repeats, b: Repeats) -> Repeats:
    """a / b repeat by repeat (the i-th of each were measured side by side, at the same moment of a noisy
    machine): the ratio's own median and spread, to compare with another ratio by `order`."""
    if len(a.values) != len(b.values) or not all(b.values):
        raise DistUsageError(f"ratios needs as many repeats on each side and no 0 to divide by: got "
                             f"{a.values} and {b.values}")
    return Repeats(tuple(x / y for x, y in zip(a.values, b.values)), "x")


def ranking(values: dict[str, float], unit: str, higher: str = "highest") -> str:
    """Named single measurements from the `higher` end down, e.g. throughputs of one run each: what the run
    ordered, without claiming more than that one run."""
    if not values:
        raise DistUsageError("ranking needs at least one named value, got none")
    unit = _spelled(unit)
    ranked = sorted(values.items(), key=lambda item: item[1], reverse=higher == "highest")
    lowest_word = "lowest" if higher == "highest" else "highest"
    return (f"from {higher} to {lowest_word}: " + "; ".join(f"{name} {amount(value)}{unit}" for name, value in ranked))


def this_run(*verdicts: str) -> str:
    """The lines a lab prints for what its run showed: each verdict after 'this run: ', then the load it ran
    under, so a reader (and tests/test_labs_under_load.py) sees every reading beside its conditions."""
    return "\n".join(f"this run: {verdict}" for verdict in verdicts) + f"\n{machine_load()}"
