"""Who is where when a collective times out: the ranks of the group asked over a side channel (runs ON the engines).

A timed-out collective used to say "a rank of the group did not take part". MPI cannot tell which: a collective
has no list of who arrived. But every wait of nbdist's MPI traffic is a Python loop (waiting.poll), so a rank
that waits can also answer a question: while its wait is long (past the spinning phase), it looks every few
milliseconds for a roll call on a communicator of its own (a duplicate of the world, made at boot) and answers
with where it waits ("all_reduce #12 on the group of ranks [0, 1, 2, 3]") and how many calls it made on the asking
rank's group. A rank that times out asks every other member, listens for a second (answering others' questions
meanwhile: they may be timing out too), and names in its error who is in the same call, who is elsewhere in
MPI (and where), and who did not answer (computing, stuck outside MPI, or gone), e.g.
"ranks 0, 1, 3 wait in it too; rank 2 is not in it: it waits in recv from rank 1 (on the group of ranks [1, 2])".

Opened by boot (every rank, collectively); where it is not (a process group made outside nbdist's engines), a
timeout says what it said before.
"""
from __future__ import annotations

import time
import weakref

QUERY, REPLY = 31500, 31501  # tags on the roll call's own communicator
ANSWER_EVERY = 0.005  # seconds between looks for a roll call while a wait is long
LISTEN_SECONDS = 1.0  # how long a timed-out rank waits for the answers

_comm = None
_sent: list = []  # answers in flight (their requests), dropped once complete
waiting_in: str | None = None  # where this rank waits now, for whoever asks
_groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # group name -> the group (its `calls` count
# is read when asked); weak, as mpi_backend's own list: a group torch dropped is not kept alive here


def open_channel(world) -> None:
    """Make the roll call's communicator (a collective over `world`: every rank, once)."""
    global _comm
    if _comm is None:
        _comm = world.Dup()


def known(group) -> None:
    """A process group whose calls a roll call may ask about."""
    _groups[group.group_name] = group


def answer_pending() -> None:
    """Answer every roll call that has arrived (called from long waits)."""
    if _comm is None:
        return
    from mpi4py import MPI

    status = MPI.Status()
    while _comm.Iprobe(source=MPI.ANY_SOURCE, tag=QUERY, status=status):
        source = status.Get_source()
        group_name = _comm.recv(source=source, tag=QUERY)
        group = _groups.get(group_name)
        answer = (waiting_in, None if group is None else group.calls)
        _sent.append(_comm.isend(answer, dest=source, tag=REPLY))
    _sent[:] = [request for request in _sent if not request.Test()]


def ask(group, members: list[int], me: int, here: str) -> dict[int, tuple | None]:
    """Ask each other member (global ranks) where it waits; {rank: (where, calls on `group`) or None}. Meanwhile
    this rank says it is still `here` (the others, timing out too, may be asking it)."""
    if _comm is None:
        return {}
    global waiting_in
    previous, waiting_in = waiting_in, here
    try:
        return _ask(group, members, me)
    finally:
        waiting_in = previous


def _ask(group, members: list[int], me: int) -> dict[int, tuple | None]:
    from mpi4py import MPI

    others = [r for r in members if r != me]
    requests = [_comm.isend(group.group_name, dest=r, tag=QUERY) for r in others]
    answers: dict[int, tuple | None] = {r: None for r in others}
    status = MPI.Status()
    deadline = time.monotonic() + LISTEN_SECONDS
    while time.monotonic() < deadline and any(a is None for a in answers.values()):
        answer_pending()
        while _comm.Iprobe(source=MPI.ANY_SOURCE, tag=REPLY, status=status):
            source = status.Get_source()
            answers[source] = _comm.recv(source=source, tag=REPLY)
        time.sleep(ANSWER_EVERY / 5)
    _sent.extend(requests)  # a query nobody took stays posted; MPI frees it with the communicator
    return answers


def sentence(here: str, answers: dict[int, tuple | None]) -> str:
    """Who waits where this rank waits (`here`, as MpiProcessGroup.where says it), who elsewhere and where, who did
    not answer."""
    if not answers:
        return ""
    same, elsewhere, silent = [], [], []
    for rank, answer in sorted(answers.items()):
        if answer is None:
            silent.append(rank)
        elif answer[0] == here:
            same.append(rank)
        else:
            where, calls = answer
            made = f"made {calls} call{'s' * (calls != 1)} on this group" if calls is not None else ""
            if where:
                elsewhere.append(f"rank {rank} waits in {where}" + (f" ({made})" if made else ""))
            else:
                elsewhere.append(f"rank {rank} waits in no MPI call" + (f" ({made})" if made else ""))
    parts = []
    if same:
        parts.append(f"{_ranks(same)} wait{'s' * (len(same) == 1)} in it too")
    parts += elsewhere
    if silent:
        parts.append(f"{_ranks(silent)} did not answer (computing, stuck outside MPI, or gone)")
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
