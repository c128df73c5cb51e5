"""A pipeline schedule as plain data: for each rank, the ordered list of its actions.

Generation (generators.py), simulation (simulate.py), execution (nbdist.pipeline_parallel) and drawing
(nbdist.viz) all read this one structure. Stages are placed round-robin ("looped"): stage s lives on rank
s % ranks, so with v chunks rank r holds stages r, r + p, r + 2p, ...
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.errors import DistUsageError
from nbdist.schedules.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
)


@dataclass
class Schedule:
    """name; ranks p; microbatches m; chunks v (model chunks per rank); program: rank -> [Action, ...]."""

    name: str
    ranks: int
    microbatches: int
    chunks: int = 1
    program: dict[int, list[Action]] = field(default_factory=dict)

    @property
    def stages(self) -> int:
        """Number of model pieces: p * v."""
        return self.ranks * self.chunks

    @property
    def actions(self) -> dict[int, list[str]]:
        """rank -> action strings in torch.distributed.pipelining's form ('0F0', '1SEND_F2', ...)."""
        return {rank: [str(a) for a in acts] for rank, acts in self.program.items()}

    @property
    def splits_backward(self) -> bool:
        """True when backward is split into input-gradient I and weight-gradient W actions."""
        return any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for acts in self.program.values() for a in acts)

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.stages, self.ranks))

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.program[rank] if a.is_compute]

    def simulate(self, forward: float = 1.0, backward: float = 2.0, weight: float | None = None, comm: float = 0.0):
        """Timeline of this schedule with the given per-micro-batch durations (see simulate.simulate)."""
        from nbdist.schedules.simulate import simulate

        return simulate(self, forward=forward, backward=backward, weight=weight, comm=comm)

    def figure(self, **durations):
        """Plotly Gantt of the simulated timeline."""
        return self.simulate(**durations).figure()

    def __repr__(self) -> str:
        return f"<Schedule {self.name}: {self.ranks} ranks, {self.microbatches} micro-batches, {self.chunks} chunk(s)>"

    @classmethod
    def from_actions(cls, actions: dict, name: str = "custom", chunks: int | None = None) -> "Schedule":
        """A schedule from per-rank action strings (user-written, or torch's `pipeline_order`).

        Lists without sends and receives get them added; None entries (torch's idle slots) are skipped. The
        schedule is checked: every stage on the right rank, every send matched, no deadlock.
        """
        program = {
            int(r): [Action.parse(a) for a in acts if a is not None and str(a).strip()] for r, acts in actions.items()
        }
        ranks = len(program)
        if sorted(program) != list(range(ranks)):
            raise DistUsageError(f"ranks must be numbered 0..{ranks - 1}, got {sorted(program)}")
        all_actions = [a for acts in program.values() for a in acts]
        if not all_actions:
            raise DistUsageError("the schedule has no actions")
        stages = max(a.stage for a in all_actions) + 1
        chunks = chunks or -(-stages // ranks)
        microbatches = max(a.microbatch for a in all_actions) + 1
        schedule = cls(name, ranks, microbatches, chunks, program)
        for rank, acts in program.items():
            for a in acts:
                if schedule.rank_of(a.stage) != rank:
                    raise DistUsageError(f"action {a} is on rank {rank}, but stage {a.stage} lives on rank "
                                         f"{schedule.rank_of(a.stage)} (stage s lives on rank s % {ranks})")
        if not any(a.is_comm for a in all_actions):
            schedule.program = add_comms(schedule)
        from nbdist.schedules.simulate import check

        check(schedule)
        return schedule


def add_comms(schedule: Schedule) -> dict[int, list[Action]]:
    """Insert sends and receives around the compute actions, as late (receives) and early (sends) as possible.

    A forward on stage s > 0 first receives its input from stage s-1; a forward on a stage that is not the last
    sends its output to stage s+1 right after. Backward (B or I) mirrors this with gradients. Adjacent stages on
    the same rank (one rank, several chunks) pass tensors locally, without a message.
    """
    last = schedule.stages - 1
    program = {}
    for rank, acts in schedule.program.items():
        out: list[Action] = []
        for a in acts:
            if not a.is_compute:
                continue
            remote_prev = a.stage > 0 and schedule.rank_of(a.stage - 1) != rank
            remote_next = a.stage < last and schedule.rank_of(a.stage + 1) != rank
            if a.kind == FORWARD:
                out += [Action(a.stage, RECV_F, a.microbatch)] if remote_prev else []
                out.append(a)
                out += [Action(a.stage, SEND_F, a.microbatch)] if remote_next else []
            elif a.kind in (BACKWARD, BACKWARD_INPUT):
                out += [Action(a.stage, RECV_B, a.microbatch)] if remote_next else []
                out.append(a)
                out += [Action(a.stage, SEND_B, a.microbatch)] if remote_prev else []
            else:
                out.append(a)
        program[rank] = out
    return program
