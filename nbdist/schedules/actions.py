"""One action of a pipeline schedule: which stage, what kind of work, which micro-batch.

The text form is torch.distributed.pipelining's: `0F0` (stage 0, forward, micro-batch 0), `1B3`, `2I1`, `2W1`,
`0SEND_F1` (stage 0 sends micro-batch 1's activation onward), `1RECV_F1` (stage 1 receives it), `1SEND_B1`,
`0RECV_B1`. A send or receive names the stage of the rank that does it, as in torch, so schedules go both ways.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from nbdist.errors import DistUsageError

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE + COMMS

_WORDS = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "input-gradient backward (I)",
          BACKWARD_WEIGHT: "weight-gradient backward (W)"}

_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Action(NamedTuple):
    """stage: global stage index (0 .. stages*chunks-1); kind: one of KINDS; microbatch: 0 .. m-1.

    A named tuple: immutable, ordered by its fields, and hashed and compared in C. A cluster-scale play (Megatron's
    Table 1: 600,000 actions) hashes actions millions of times, and a frozen dataclass's Python-level hash, equality
    and construction were most of its time."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def is_comm(self) -> bool:
        return self.kind in COMMS

    @property
    def activations_held(self) -> int:
        """+1 for a forward (it keeps its activation), -1 for the action that frees it: B, or W when the
        backward is split (W still needs the stage's inputs), 0 otherwise."""
        return 1 if self.kind == FORWARD else -1 if self.kind in (BACKWARD, BACKWARD_WEIGHT) else 0

    @property
    def message(self) -> str:
        """What a send or receive carries, in words: 'the activation of micro-batch 3' or 'the gradient of ...'."""
        carried = "activation" if self.kind in (SEND_F, RECV_F) else "gradient"
        return f"the {carried} of micro-batch {self.microbatch}"

    def describe(self) -> str:
        """The action in words, for hover texts: 'forward of micro-batch 3 on stage 1', 'send of the activation
        of micro-batch 3 to stage 2'."""
        if self.is_comm:
            verb, way = ("send", "to") if self.kind in (SEND_F, SEND_B) else ("receive", "from")
            return f"{verb} of {self.message} {way} stage {self.peer_stage()}"
        return f"{_WORDS[self.kind]} of micro-batch {self.microbatch} on stage {self.stage}"

    def peer_stage(self) -> int:
        """The stage at the other end of a send or receive."""
        if self.kind in (SEND_F, RECV_B):
            return self.stage + 1
        if self.kind in (RECV_F, SEND_B):
            return self.stage - 1
        raise ValueError(f"{self} is not a send or receive")

    def matching(self) -> "Action":
        """The action on the peer that pairs with this send/receive (SEND_F 0->1 pairs with RECV_F on stage 1)."""
        pair = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}[self.kind]
        return Action(self.peer_stage(), pair, self.microbatch)

    @staticmethod
    def parse(text: "str | Action") -> "Action":
        if isinstance(text, Action):
            return text
        match = _PATTERN.match(str(text).strip())
        if not match:
            raise DistUsageError(
                f"cannot read action {text!r}: expected stage, kind, micro-batch like '0F0', '1B3', '0SEND_F1'"
            )
        stage, kind, microbatch = match.groups()
        return Action(int(stage), kind, int(microbatch))
