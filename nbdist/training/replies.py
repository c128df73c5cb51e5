"""What the Trainer's rank functions (training/ranks/) answer the kernel: plain data, made on the ranks and unpickled
in the kernel, so this module imports neither torch nor anything of the ranks'.

A problem with the user's inputs that every rank finds alike is a field of the reply (`problem`, `failure`), one
line the kernel says as it is, not a raised error: a raised error would be shown as each rank's failure, with its
traceback. The records of steps stay dicts (`Fitted.records`): they are rows, merged by step (history.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prepared:
    """inputs.prepare: this rank seeded, and the optimizer function tried on a stand-in parameter."""

    problem: str | None  # what is wrong with optimizer_fn (inputs.optimizer_problem), or None
    optimizer: str | None = None  # the class it makes (what the replica modes' warnings name); None: not known


@dataclass(frozen=True)
class Sample:
    """data_source.sample: the data set's first samples as the loop batches them, or why it cannot be read."""

    example: tuple | None  # (inputs, targets or None): what the kernel profiles a model with and sizes messages by
    problem: str | None = None  # the data set is not one the loop can read, or cannot make the global batch


@dataclass(frozen=True)
class SetUp:
    """training.setup: this rank's side of a Trainer, registered; or why its inputs do not fit (nothing kept)."""

    rank: int
    length: int | None = None  # samples in the data set (None: an iterable data set, or a problem)
    problem: str | None = None  # the data sets, the replica's model and optimizer, or a sample do not fit
    stepped: int = 0  # the model's trainable parameters on this rank that the optimizer steps
    unstepped: tuple[str, ...] = ()  # and the names of those it does not (inputs.optimizer_coverage)


@dataclass(frozen=True)
class Failure:
    """A rank's first step of a trainer failed on the inputs: the line, and the traceback NBDIST_DEBUG=1 prints."""

    line: str
    traceback: str = ""


@dataclass(frozen=True)
class NonFinite:
    """The first step of a fit whose loss some rank found not finite, as this rank saw it."""

    first: int  # the step
    count: int  # the non-finite steps agreed on from there on
    mine: float | None  # this rank's loss at `first` (None: finite here, or none computed)
    weights_finite: bool  # every parameter this rank holds is finite now
    lag: int  # how many steps late the replicas learn each other's losses (Synchronizer.lag)


@dataclass(frozen=True)
class Fitted:
    """training.fit (and training.records, after a stop): this rank's records of the steps it ran, and how the fit
    ended on it."""

    rank: int
    records: list[dict]  # one per step: loss, lr, times (RankTrainer.records)
    step: int  # steps done
    pipeline_step: dict | None = None  # the newest pipeline step's spans, for the bubble breakdown
    stopped: bool = False  # asked to stop, at a step boundary
    failure: Failure | None = None
    nonfinite: NonFinite | None = None  # None: every loss finite, or on_nonfinite="ignore"


@dataclass(frozen=True)
class Loaded:
    """training.load: the checkpoint's step once loaded, or what made it unreadable (one line)."""

    step: int | None
    problem: str | None = None
