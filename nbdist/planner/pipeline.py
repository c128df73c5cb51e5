"""The pipeline part of a step, from nbdist's own schedule simulator (nbdist.schedules): makespan, each rank's busy
time, the activations each rank holds at its peak.

Every micro-batch is played: at cluster scale that is many actions (Megatron-LM's 1 T-parameter run has p = 64
stages, m = 512 micro-batches and v = 2 chunks: 65,000 compute actions, seconds to simulate), which is why a
search simulates only its best candidates (frontier.py). Playing fewer micro-batches and extending the steady
state is exact only for even stages: with the first and last stages heavier (embedding, logits) the pipeline
settles into its steady state slowly (figures: benchmarks/README.md), so nothing is extrapolated. The peak of
held activations depends on the order alone, not on the durations: it stops growing once the warm-up is over, so
it is read from the schedule's order with at most 3p micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nbdist.schedules import Schedule, Timeline
from nbdist.schedules.generators import GENERATORS, check_parameters
from nbdist.schedules.schedule import add_comms
from nbdist.schedules.simulate import durations, play_order, replay


@dataclass(frozen=True)
class PipelineRun:
    """One step's pipeline: `makespan` (s), per rank its compute time (`busy`), and the simulated `timeline`."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    makespan: float
    busy: tuple[float, ...]
    timeline: Timeline

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all pipeline ranks' time: 1 - Σ busy / (p · makespan)."""
        return max(0.0, 1 - sum(self.busy) / (self.stages * self.makespan)) if self.makespan else 0.0


def run(schedule: str, p: int, m: int, v: int, forward: tuple[float, ...], backward: tuple[float, ...],
        comm: float) -> PipelineRun:
    """Simulate `schedule` with per-stage forward and backward seconds of one micro-batch (p·v entries: each model
    chunk's own time) and `comm` seconds per message between stages."""
    return _run(schedule, p, m, v, tuple(forward), tuple(backward), float(comm))


@lru_cache(maxsize=256)
def _run(schedule: str, p: int, m: int, v: int, forward: tuple, backward: tuple, comm: float) -> PipelineRun:
    busy = tuple(m * sum(forward[k] + backward[k] for k in range(r, p * v, p)) for r in range(p))
    timeline = _simulate(schedule, p, m, v, forward, backward, comm)
    return PipelineRun(schedule, p, m, v, timeline.makespan, busy, timeline)


def _simulate(schedule: str, p: int, m: int, v: int, forward: tuple, backward: tuple, comm: float) -> Timeline:
    played, needs, order = _played(schedule, p, m, v)
    # the simulator divides a rank's time by its chunks: give it each chunk's time × v
    times = durations(played, forward=[f * v for f in forward], backward=[b * v for b in backward])
    timeline = replay(played, needs, order, times, comm)
    timeline.name, timeline.unit = f"{schedule} (predicted)", "s"
    return timeline


@lru_cache(maxsize=16)
def _played(name: str, p: int, m: int, v: int) -> tuple[Schedule, dict, list]:
    """The schedule with its play order (simulate.play_order): a search, a sweep or a table (Megatron-LM's Table 1
    under two efficiencies) simulates one schedule under many durations, and the order is most of a play's work."""
    schedule = _schedule(name, p, m, v)
    return (schedule, *play_order(schedule))


def _schedule(name: str, p: int, m: int, v: int) -> Schedule:
    """The named schedule with its messages, as nbdist.schedules.build makes it but without build's deadlock
    check: it replays the whole schedule, as long again as the simulation, and the generators' schedules are
    proven deadlock-free by tests/test_schedules.py for every p, m, v."""
    check_parameters(name, p, m, v)
    schedule = Schedule(name, p, m, v, GENERATORS[name](p, m, v))
    schedule.program = add_comms(schedule)
    return schedule


@lru_cache(maxsize=1024)
def peak_held(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """Per rank, the most micro-batch chunks whose activations it holds at once (1F1B: p - r; interleaved more),
    read from the schedule's order of forwards and backwards."""
    check_parameters(schedule, p, m, v)
    program = GENERATORS[schedule](p, min(m, 3 * p), v)
    peaks = []
    for rank in range(p):
        held = peak = 0
        for action in program[rank]:
            held += action.activations_held
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)
