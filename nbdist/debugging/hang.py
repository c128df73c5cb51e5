"""Why a cell hangs: every rank's report (its flight recorder's tail and main stack) read side by side.

Each rank answers from a thread of its own (cluster/waiting/ranks/inspector.py), so a rank stuck in a collective, a receive
or a loop of the user's still says where it is. Read together, the reports name what one rank alone cannot: which
ranks wait in which call (the call's number on its group: "all_reduce #42"), which member of that group never
reached it and what that member does instead, and where ranks that met in the same call brought different calls,
sizes or dtypes. One table (a row per rank) and one sentence:

    ranks 0, 1, 3 wait in all_reduce #42 on the group of ranks [0, 1, 2, 3]; rank 2 never reached it: it waits in
    recv from rank 1 on the pipeline (pipeline tick 7: R1 s1), called from train.py:88 in step

Plain data in, plain data out (no cluster, no drawing): Cluster.why() gathers the reports, the magic shows them.
"""
from __future__ import annotations

import html
import os
import sysconfig
from dataclasses import dataclass, field

from nbdist.units import format_bytes

WAITS, RUNS, IDLE, SILENT = "waits", "runs", "idle", "no answer"
# Frames whose file is one of these is the machinery of waiting (the innermost frames of a rank that waits).
_WAIT_FILES = ("nbdist/backend/ranks/waiting.py", "nbdist/backend/ranks/mpi_work.py",
               "nbdist/pipeline_parallel/ranks/transport.py", "torch/distributed/distributed_c10d.py",
               "torch/distributed/c10d_logger.py")
# Frames of the engine's own loop: a stack made of these alone is an engine waiting for the next cell (between
# cells the loop also ticks MPI's progress: idle_progress.py, which a view caught in it must not call running code).
_ENGINE_FILES = ("ipyparallel/", "ipykernel/", "IPython/", "tornado/", "zmq/", "asyncio/", "selectors.py",
                 "threading.py", "runpy.py", "nbdist/cluster/launching/ranks/main.py", "nbdist/cluster/hosts/lifeline.py",
                 "nbdist/backend/ranks/idle_progress.py", "traitlets/", "jupyter_client/", "<frozen ")
_STDLIB = sysconfig.get_paths().get("stdlib", "////")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace(os.sep, "/") + "/"  # .../nbdist/


@dataclass
class RankState:
    """What one rank does, as its report says."""

    rank: int
    state: str  # WAITS, RUNS, IDLE or SILENT
    host: str = ""
    call: dict | None = None  # the recorded call it waits in (WAITS), else None
    waited: float | None = None  # seconds in that call so far
    torch_call: str | None = None  # waiting in a torch.distributed call the recorder does not see (gloo, NCCL)
    where: str = ""  # the innermost frame of the user's code, "file:line in function"
    doing: str | None = None  # what a walker said it does (the pipeline's tick and action)
    last: dict | None = None  # its last completed call
    stack: list = field(default_factory=list)  # [file, line, function, source] outermost first

    def in_call(self) -> str:
        """"all_reduce #42 on the group of ranks [0, 1]", "recv from rank 1 on the pipeline", or ""."""
        if self.call is not None:
            return describe_call(self.call)
        return f"{self.torch_call} (torch.distributed)" if self.torch_call else ""


@dataclass(repr=False)
class HangView:
    """Every rank's state, the sentence that explains them, and mismatches between ranks that met in one call."""

    ranks: dict[int, RankState]
    sentence: str
    mismatches: list[str] = field(default_factory=list)

    def rows(self) -> list[dict]:
        """One row per rank, for a table."""
        return [{"rank": s.rank, "host": s.host, "state": s.state, "call": s.in_call(),
                 "bytes": "" if s.call is None or s.call.get("bytes") is None else format_bytes(s.call["bytes"]),
                 "waiting": "" if s.waited is None else f"{s.waited:.1f} s", "where": s.where,
                 "doing": s.doing or "", "last done": "" if s.last is None else describe_call(s.last)}
                for s in self.ranks.values()]

    def stacks(self, ranks: list[int] | None = None) -> str:
        """The ranks' Python stacks (the user's and nbdist's frames, innermost last), ranks with the same stack
        said once; default: the ranks that run code outside any communication call (a loop that never ends)."""
        chosen = [s for s in self.ranks.values() if (s.state == RUNS if ranks is None else s.rank in ranks)]
        by_stack: dict[str, list[int]] = {}
        for s in chosen:
            by_stack.setdefault(stack_text(s.stack), []).append(s.rank)
        return "\n".join(f"{_ranks(rs)}, innermost last:\n{text}" for text, rs in by_stack.items() if text)

    def __repr__(self) -> str:  # what a notebook shows as text (exports, terminals)
        return str(self)

    def __str__(self) -> str:
        rows = self.rows()
        columns = _columns(rows)
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
        lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
        lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
        return "\n".join([*lines, *filter(None, [self.sentence, *self.mismatches, self.stacks()])])

    def _repr_html_(self) -> str:
        rows = self.rows()
        columns = _columns(rows)
        head = "".join(f"<th style='text-align:left'>{c}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(r[c]))}</td>"
                                        for c in columns) + "</tr>" for r in rows)
        said = "".join(f"<p>{html.escape(line)}</p>" for line in [self.sentence, *self.mismatches] if line)
        stacks = self.stacks()
        shown = f"<pre>{html.escape(stacks)}</pre>" if stacks else ""
        return f"<table><tr>{head}</tr>{body}</table>{said}{shown}"


def _columns(rows: list[dict]) -> list[str]:
    """The table's columns that say something for at least one rank."""
    return [c for c in rows[0] if c == "rank" or any(r[c] != "" for r in rows)] if rows else []


def stack_text(stack: list) -> str:
    """A stack's frames of the user's code and nbdist's, one line each: "  file:line in function: source"."""
    kept = [f for f in stack if not _is_library(_normal(f[0])) and not any(e in _normal(f[0]) for e in _ENGINE_FILES)]
    return "\n".join(f"  {_short(path)}:{line} in {function}" + (f": {source}" if source else "")
                     for path, line, function, source in kept)


def describe_call(call: dict) -> str:
    """A recorded call in words: "all_reduce #42 on the group of ranks [0, 1]", "recv from rank 1 on the pipeline"."""
    name = call["call"]
    if call.get("seq") is not None:
        name += f" #{call['seq']}"
    if call.get("peer") is not None:
        name += f" {'to' if call['call'] == 'send' else 'from'} rank {call['peer']}"
    elif call["call"] == "recv":
        name += " from any rank"
    return name + _on_group(call)


def _on_group(call: dict) -> str:
    """" on group dp (ranks [0, 2])" for a named group (a mesh's dimension, the pipeline), else " on the group of
    ranks [0, 1]"."""
    name, ranks = call.get("group"), call.get("ranks")
    if ranks is None:
        return ""
    if name and not str(name).isdigit():
        return f" on group {name} (ranks {ranks})"
    return f" on the group of ranks {ranks}"


# -- one rank -------------------------------------------------------------------------------------------------------


def rank_state(rank: int, report: dict | None) -> RankState:
    """Read one rank's report."""
    if report is None:
        return RankState(rank, SILENT)
    stack, calls = report.get("stack") or [], report.get("calls") or []
    by_torch = report.get("torch_calls") or []  # gloo's and NCCL's calls, from torch's recorder: made, never "ended"
    state = RankState(rank, RUNS, host=report.get("host", ""), where=user_frame(stack), doing=report.get("doing"),
                      stack=stack)
    waited_in = None
    if _waiting(stack):
        state.state = WAITS
        open_calls = [c for c in calls if not c.get("done") and not c.get("failed")]
        if open_calls:
            waited_in = open_calls[-1]
        else:
            state.torch_call = _torch_call(stack)
            waited_in = by_torch[-1] if by_torch and state.torch_call else None
        if waited_in is not None:
            state.call = waited_in
            state.waited = max(0.0, report.get("now", 0.0) - waited_in["start"])
    elif _engine_only(stack):
        state.state = IDLE
    done = [c for c in calls if c.get("done")] + [c for c in by_torch if c is not waited_in]
    state.last = max(done, key=lambda c: c["start"]) if done else None
    return state


def _frames(stack: list, files: tuple[str, ...]) -> list[bool]:
    return [any(f in _normal(frame[0]) for f in files) for frame in stack]


def _normal(path: str) -> str:
    return path.replace(os.sep, "/")


def _waiting(stack: list) -> bool:
    """The innermost frames are the machinery of a communication wait."""
    inner = stack[-4:]
    return any(_frames(inner, _WAIT_FILES))


def _torch_call(stack: list) -> str | None:
    """The torch.distributed function a rank waits in, from its stack (calls no recorder sees)."""
    names = [frame[2] for frame in stack if "torch/distributed/distributed_c10d.py" in _normal(frame[0])]
    return names[0] if names else None


def _engine_only(stack: list) -> bool:
    return bool(stack) and all(_frames(stack, _ENGINE_FILES))


def user_frame(stack: list) -> str:
    """The innermost frame of the user's own code ("file:line in function"), else the innermost of nbdist's."""
    for wanted in (_is_users, _is_nbdist):
        for path, line, function, _ in reversed(stack):
            if wanted(_normal(path)) and not any(e in _normal(path) for e in _ENGINE_FILES):
                return f"{_short(path)}:{line} in {function}"
    return ""


def _is_users(path: str) -> bool:
    return not (_is_library(path) or _is_nbdist(path) or any(f in path for f in _ENGINE_FILES))


def _is_library(path: str) -> bool:
    return "site-packages/" in path or "dist-packages/" in path or path.startswith(_normal(_STDLIB))


def _is_nbdist(path: str) -> bool:
    """nbdist's own files: under this package's folder (the ranks run the same installation), or an installed
    copy's."""
    return path.startswith(_PACKAGE) or "-packages/nbdist/" in path


def _short(path: str) -> str:
    """A cell's or a file's name as a reader knows it: "cell In[3]" (the rank's inspector names cells so), the
    file's name, nbdist's path from the package."""
    if path.startswith("cell "):
        return path
    path = _normal(path)
    if _is_nbdist(path):
        return "nbdist/" + path.rsplit("/nbdist/", 1)[1]
    return path.rsplit("/", 1)[-1]


# -- the ranks together ---------------------------------------------------------------------------------------------


def explain(reports: dict[int, dict | None]) -> HangView:
    """Every rank's state from its report (None: it did not answer), and the sentence that says why they wait."""
    states = {rank: rank_state(rank, reports[rank]) for rank in sorted(reports)}
    mismatches = _mismatches(states)
    return HangView(states, _sentence(states), mismatches)


def _collective_waits(states: dict[int, RankState]) -> dict[tuple, list[int]]:
    """(group's ranks, seq, generation) -> the ranks that wait in that collective."""
    met: dict[tuple, list[int]] = {}
    for s in states.values():
        if s.state == WAITS and s.call is not None and s.call.get("seq") is not None and s.call.get("ranks"):
            met.setdefault((tuple(s.call["ranks"]), s.call["seq"], s.call.get("generation", 0)), []).append(s.rank)
    return met


def _sentence(states: dict[int, RankState]) -> str:
    met = _collective_waits(states)
    if met:
        (ranks, seq, _), waiting = max(met.items(), key=lambda item: (len(item[1]), -min(item[1])))
        call = states[waiting[0]].call
        said = f"{_ranks(waiting)} wait{'s' * (len(waiting) == 1)} in {describe_call(call)}"
        missing = [r for r in ranks if r not in waiting]
        done = [r for r in missing if _completed(states.get(r), call)]
        parts = [said] + [_missing(states.get(r), r, call) for r in missing if r not in done]
        if done:  # they sent their part; what has not arrived waits for their next MPI call
            idle = all(states[r].state == IDLE for r in done)
            cells = f" and finished {_their(done)} cell{'s' * (len(done) > 1)}" if idle else ""
            parts.append(f"{_ranks(done)} completed it{cells}")
        return "; ".join(parts)
    p2p = [s for s in states.values() if s.state == WAITS and s.call is not None]
    if p2p:
        return "; ".join(_p2p(states, s) for s in p2p)
    if all(s.state == IDLE for s in states.values()):
        return "no rank is running a cell: every engine waits for the next one"
    said: dict[str, list[int]] = {}  # what a rank does -> the ranks that do it
    for s in states.values():
        said.setdefault(_elsewhere(s, with_rank=False), []).append(s.rank)
    return "; ".join(f"{_ranks(ranks)} {_verb(text.removeprefix('it '), len(ranks))}" for text, ranks in said.items())


def _verb(clause: str, ranks: int) -> str:
    """A clause said of one rank ("runs ...", "waits in ...") said of several ("run ...", "wait in ...")."""
    verb, _, rest = clause.partition(" ")
    plural = {"runs": "run", "waits": "wait"}.get(verb, verb) if ranks > 1 else verb
    return f"{plural} {rest}"


def _completed(state: RankState | None, call: dict) -> bool:
    """Whether a rank not waiting in a collective has completed it (or a later call on the same group)."""
    last = state.last if state is not None and state.state in (IDLE, RUNS) else None
    return bool(last) and _same_group(last, call) and last.get("seq") is not None and last["seq"] >= call["seq"]


def _same_group(one: dict, other: dict) -> bool:
    """Two recorded calls on the same group and the same communicator: a group renewed after a freed hang numbers
    its calls from #1 again, and its call #1 before the renewal is not the call #1 after it."""
    return tuple(one.get("ranks") or ()) == tuple(other.get("ranks") or ()) and \
        one.get("generation", 0) == other.get("generation", 0)


def _their(ranks: list[int]) -> str:
    return "its" if len(ranks) == 1 else "their"


def _missing(state: RankState | None, rank: int, call: dict) -> str:
    """Why a member of a collective's group is not in it."""
    if state is None:
        return f"rank {rank} was not asked"
    if state.state == WAITS and state.call is not None and _same_group(state.call, call) and \
            state.call.get("seq") is not None:
        ahead = state.call["seq"] - call["seq"]
        return f"rank {rank} waits in {describe_call(state.call)} ({abs(ahead)} call{'s' * (abs(ahead) != 1)} " \
               f"{'ahead' if ahead > 0 else 'behind'} on that group)"
    return f"rank {rank} never reached it: " + _elsewhere(state, with_rank=False)


def _elsewhere(state: RankState, with_rank: bool = True) -> str:
    """What a rank does instead, as a clause: "it waits in recv from rank 1 ... called from ...", "it runs ..."."""
    who = f"rank {state.rank}" if with_rank else "it"
    doing = f" ({state.doing})" if state.doing else ""
    called = f", called from {state.where}" if state.where else ""
    if state.state == SILENT:
        return f"{who} did not answer (stuck in code that holds Python's lock, or gone)"
    if state.state == IDLE:
        last = f" (its last call: {describe_call(state.last)})" if state.last else ""
        return f"{who} finished its cell{last}"
    if state.state == WAITS:
        return f"{who} waits in {state.in_call() or 'a communication call'}{doing}{called}"
    return f"{who} runs {state.where or 'code'}{doing}, outside any communication call"


def _p2p(states: dict[int, RankState], s: RankState) -> str:
    """A rank waiting on one peer: what that peer does."""
    peer = s.call.get("peer")
    said = f"rank {s.rank} waits in {describe_call(s.call)}" + (f" ({s.doing})" if s.doing else "")
    if peer is None or peer not in states:
        return said
    other = states[peer]
    if other.state == WAITS and other.call is not None and other.call.get("peer") == s.rank and \
            other.call["call"] == s.call["call"]:
        return said + f", and rank {peer} waits in {other.call['call']} from it too: neither sends (a deadlock)"
    return said + "; " + _elsewhere(other)


def _mismatches(states: dict[int, RankState]) -> list[str]:
    """Ranks that met in the same collective (group and number) with a different call, size or dtype."""
    out = []
    for (ranks, seq, _), waiting in _collective_waits(states).items():
        brought = {r: (states[r].call["call"], states[r].call.get("numel"), states[r].call.get("dtype"))
                   for r in waiting}
        if len(set(brought.values())) > 1:
            said = ", ".join(f"rank {r} {c} of {n} {d}" for r, (c, n, d) in brought.items())
            out.append(f"the ranks disagree on call #{seq} of the group of ranks {list(ranks)}: {said}")
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
