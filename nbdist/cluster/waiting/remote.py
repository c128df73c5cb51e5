"""Waiting for work on the ranks: live, rank-labelled output, and no rank left stuck.

An exception on one rank often leaves the others waiting forever in a collective (gloo and NCCL waits cannot be
interrupted by SIGINT). So while we wait we watch each rank: once one has failed, the others get a short grace
period; whoever is still running then is interrupted (SIGINT: a local signal on the kernel's host, sent down the
rank's lifeline on any other host), and if that does not free it the engines are restarted. The same happens on a
timeout and on the kernel's interrupt. The user is told exactly what was done.

What reaches the cell is bounded: a shown rank's stdout or stderr beyond OUTPUT_CAP characters in one call is
kept whole in a file of the cluster's folder instead, and one line says how much was left out and where it is.
Ranks that failed the same way are said once (tracebacks.grouped); `last_tracebacks()` keeps every frame of the
last failure for `%dist_traceback`.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from nbdist.cluster.waiting.deaths import unreachable_line
from nbdist.cluster.waiting.tracebacks import (
    exited,
    failure_phrase,
    grouped,
    ranks_label,
    remote_traceback,
    whole_traceback,
)
from nbdist.errors import DistError, DistInterrupt
from nbdist.units import format_bytes

if TYPE_CHECKING:
    from nbdist.cluster.waiting.recovery import WaitedOn

ERROR_GRACE_SECONDS = 1.0  # after one rank fails, how long the others may take to finish (or fail) by themselves
INTERRUPT_WAIT_SECONDS = 3.0  # how long an interrupted rank may take to stop before we restart the engines (1.5 s was
# seen too short once on 2 cores under a load of 8+ busy processes: a rank polling MPI was restarted, not freed)
SHOW_MODES = ("rank0", "all", "none")
DIED = "an engine process died (which ends the whole MPI job)"
OUTPUT_CAP = 2**20  # characters of one rank's stdout (or stderr) one call shows in the cell; the rest goes to a file
OUTPUT_WAIT_SECONDS = 60.0  # how long a finished call's output may take to arrive: it comes after the reply, and
# 100 MB printed at once took 3 s per rank on 2 cores (waiting 1 s, the cell showed nothing of it); no wait once an
# engine died
_last_failure: list[tuple[int, str]] = []  # (rank, whole traceback) of the last failure, for %dist_traceback


def last_tracebacks() -> dict[int, str]:
    """Every frame of each rank's traceback in the last failure (what `%dist_traceback` shows), by rank."""
    return dict(_last_failure)


def write_grouped(by_rank: Iterable[tuple[int, str]], out) -> None:
    """Each text once, labelled on every line with the ranks that said it ("[ranks 0-3] ...")."""
    for ranks, text in grouped(by_rank):
        out.write(_prefixed(text.rstrip("\n") + "\n", f"[{ranks_label(ranks)}]"))
    out.flush()


def label(rank: int) -> str:
    return f"[rank {rank}]"


def _prefixed(text: str, prefix: str) -> str:
    return "".join(f"{prefix} {line}" for line in text.splitlines(True))


@dataclass
class OutputRelay:
    """Copies each shown rank's stdout, stderr and displays into the notebook as they arrive, labelled by rank, up to
    `cap` characters per rank and stream; `keep(rank, stream, text)` writes a stream that went past it to a file
    and returns its path (None if it could not)."""

    ranks: Sequence[int]
    shown: set[int]
    keep: Callable[[int, str, str], str | None] | None = None
    cap: int = OUTPUT_CAP
    _sent: dict = field(default_factory=dict)
    _partial: dict = field(default_factory=dict)
    _written: dict = field(default_factory=dict)  # (rank, stream) -> characters written into the cell
    _cut: set = field(default_factory=set)  # (rank, stream) that reached the cap
    _said: set = field(default_factory=set)  # (rank, stream) whose cut was said

    def relay(self, metadata: Sequence[dict], final: bool = False) -> None:
        for rank, md in zip(self.ranks, metadata):
            if rank not in self.shown:
                continue
            self._relay_stream(rank, md, "stdout", sys.stdout, final)
            self._relay_stream(rank, md, "stderr", sys.stderr, final)
            self._relay_displays(rank, md)

    def _relay_stream(self, rank: int, md: dict, name: str, out, final: bool) -> None:
        key = (rank, name)
        text = md.get(name) or ""
        start = self._sent.get(key, 0)
        if len(text) <= start and not final:
            return
        self._sent[key] = len(text)
        if key not in self._cut:
            self._write(key, self._partial.get(key, "") + text[start:], out, final)
        if key in self._cut and final and key not in self._said:
            self._said.add(key)
            self._say_cut(key, text, out)

    def _write(self, key: tuple[int, str], pending: str, out, final: bool) -> None:
        """Whole lines of `pending` into the cell (all of it when final), up to the cap."""
        room = self.cap - self._written.get(key, 0)
        if len(pending) > room:
            complete, rest = pending[:room], ""
            self._cut.add(key)
        else:
            complete, _, rest = pending.rpartition("\n")
            if final and rest:
                complete, rest = pending, ""
            elif complete:
                complete += "\n"
        self._partial[key] = rest
        if complete:
            out.write(_prefixed(complete if complete.endswith("\n") else complete + "\n", label(key[0])))
            out.flush()
            self._written[key] = self._written.get(key, 0) + len(complete)

    def _say_cut(self, key: tuple[int, str], text: str, out) -> None:
        rank, name = key
        where = self.keep(rank, name, text) if self.keep is not None else None
        total = len(text.encode(errors="replace"))
        shown = len(text[: self._written.get(key, 0)].encode(errors="replace"))
        rest = f"all {format_bytes(total)} of it is in {where}" if where else "the rest could not be kept"
        out.write(f"{label(rank)} {name} cut after {format_bytes(shown)}: {format_bytes(total - shown)} more not "
                  f"shown; {rest}\n")
        out.flush()

    def _relay_displays(self, rank: int, md: dict) -> None:
        outputs = md.get("outputs") or []
        start = self._sent.get((rank, "outputs"), 0)
        if len(outputs) > start:
            from IPython.display import publish_display_data

            for content in outputs[start:]:
                publish_display_data(content["data"], content.get("metadata") or {})
            self._sent[(rank, "outputs")] = len(outputs)


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """While nbdist frees or restarts the ranks, a second press of the stop button must not leave the cluster
    half-restarted (nor print nbdist's internals): SIGINT is ignored until that is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


@dataclass
class Waiter:
    """Waits for one multi-rank AsyncResult, asking the cluster (`on`: one small interface, recovery.WaitedOn) who
    died, how to interrupt a rank, how to bring the ranks back in step, and to restart when nothing else frees them."""

    ar: object
    ranks: Sequence[int]
    on: WaitedOn
    timeout: float | None = None
    relay: OutputRelay | None = None
    progress: Callable[[object], None] | None = None  # called with the AsyncResult while waiting (live views)
    progress_every: float = 0.5
    _restarted: bool = False
    _viewed: bool = False  # the hang view was shown: where each rank was is said, not its interrupt's traceback
    _signalled: set = field(default_factory=set)  # the ranks nbdist interrupted: their KeyboardInterrupt is nbdist's

    def wait(self) -> list:
        """Block until every rank is done; return per-rank results (rank order) or raise DistError."""
        started = time.monotonic()
        first_failure_at = None
        reason, action = None, None
        last_progress = started
        if self.progress is not None:  # at once: a live view may be opened by it, as soon as the work is sent
            self.progress(self.ar)
        try:
            while not self.ar.ready():
                self.ar.wait(0.05)
                self._relay()
                if self.progress is not None and time.monotonic() - last_progress >= self.progress_every:
                    last_progress = time.monotonic()
                    self.progress(self.ar)
                if first_failure_at is None and self._failed_ranks():
                    first_failure_at = time.monotonic()
                died = self._death() or self._silent()
                if died:
                    reason, action = died, self._after_death()
                    break
                if first_failure_at is not None and time.monotonic() - first_failure_at > ERROR_GRACE_SECONDS:
                    action = self._free_stuck()
                    break
                if self.timeout is not None and time.monotonic() - started > self.timeout and not self.ar.ready():
                    reason = self._why(f"timed out after {self.timeout:g} s")
                    action = self._free_stuck()
                    break
        except KeyboardInterrupt:
            with _interrupts_deferred():
                reason = self._why("interrupted")
            self._raise_failures(reason, self._back_in_step(self._free_stuck()), DistInterrupt)
        if action is None and any(_engine_died(e) for e in self._failed_ranks().values()):
            # every rank's result came back (as EngineError) before the launcher noticed the job had ended
            reason, action = self._death() or DIED, self._after_death()
        self._finish_output()
        if self.progress is not None and action is None:  # the ranks' last publication, now that every output
            self.progress(self.ar)  # is in: a run shorter than progress_every is otherwise never seen live
        if self._failed_ranks():
            action = self._back_in_step(action)
        self._raise_failures(reason, action)
        return [child.result() for _, child in self._children()]

    def _why(self, reason: str) -> str:
        """Before stuck ranks are freed, ask what they wait in (the hang view, shown in the cell); its sentence
        joins `reason`. Nothing is asked when no rank is still running or nothing can ask."""
        if not self._pending_ranks():
            return reason
        try:
            view = self.on.why()
        except Exception as e:  # the view must never hide the failure it explains
            return f"{reason} (the hang view failed: {type(e).__name__}: {e})"
        self._relay()
        _show(replace(view, sentence=""))  # the table; the sentence is said once, in the error's line
        self._viewed = True
        return f"{reason}: {view.sentence}" if view.sentence else reason

    def _death(self) -> str | None:
        """A line naming the rank that died, as soon as its process is gone (the launcher notices seconds later)."""
        return self.on.death() or (None if self.on.alive() else DIED)

    def _silent(self) -> str | None:
        """Ranks the controller lost (no heartbeat: ipyparallel reports them as EngineError) that no death watch
        explained: named with their hosts. On another host that is a host that died or cannot be reached."""
        lost = sorted(r for r, e in self._failed_ranks().items() if _engine_died(e))
        if not lost:
            return None
        pids = self.on.pids()
        return unreachable_line({r: pids[r][0] for r in lost})

    def _after_death(self) -> str:
        said = self.on.after_death()
        if said is None:
            return self._restart()
        self._restarted = True  # nothing is left to bring back in step
        return said

    # -- per-rank state -------------------------------------------------------------------------------------

    def _children(self):
        return list(zip(self.ranks, self.ar._children))

    def _pending_ranks(self) -> list[int]:
        return [rank for rank, child in self._children() if not child.done()]

    def _failed_ranks(self) -> dict[int, BaseException]:
        failed = {}
        for rank, child in self._children():
            if child.done():
                result = child.exception() or child.result()
                if isinstance(result, BaseException):
                    failed[rank] = result
        return failed

    # -- freeing ranks ----------------------------------------------------------------------------------------

    def _free_stuck(self) -> str | None:
        """Interrupt the ranks still running; restart the engines if that does not stop them. Says what it did."""
        stuck = self._pending_ranks()
        if not stuck:
            return None
        with _interrupts_deferred():
            return self._interrupt_or_restart(stuck)

    def _interrupt_or_restart(self, stuck: list[int]) -> str:
        self._interrupt(stuck)
        deadline = time.monotonic() + INTERRUPT_WAIT_SECONDS
        while self._pending_ranks() and time.monotonic() < deadline:
            self.ar.wait(0.02)
        still = self._pending_ranks()
        if not still:
            return f"nbdist interrupted rank(s) {_ranks_text(stuck)}, which then stopped"
        return (
            f"rank(s) {_ranks_text(still)} kept running (stuck in a collective?) and did not stop on interrupt, "
            + self._restart()
        )

    def _back_in_step(self, action: str | None) -> str | None:
        """After a failure the engines survived: the cluster brings them back in step; its words join the line."""
        if self._restarted:
            return action
        return "; ".join(part for part in (action, self.on.back_in_step()) if part) or None

    def _restart(self) -> str:
        self._finish_output()
        self._restarted = True
        with _interrupts_deferred():
            self.on.restart()
        return "so nbdist restarted the engines: fresh processes and process group, engine variables lost"

    def _interrupt(self, ranks: Sequence[int]) -> None:
        """SIGINT to each rank, on this host or another (through its lifeline: Cluster.signal_rank)."""
        for rank in ranks:
            self._signalled.add(rank)
            self.on.signal_rank(rank, signal.SIGINT)

    # -- results ----------------------------------------------------------------------------------------------

    def _relay(self, final: bool = False) -> None:
        if self.relay is not None:
            self.relay.relay(self.ar._metadata, final=final)

    def _finish_output(self) -> None:
        """Every rank's output in, then the last of it shown: a call's output arrives after its reply (all of a
        large print at once, seconds later), so it is waited for, up to OUTPUT_WAIT_SECONDS, while the engines
        live; what came by then is shown, and a line says if some did not."""
        if not self.ar.ready():
            self._relay(final=True)
            return
        deadline = time.monotonic() + OUTPUT_WAIT_SECONDS
        try:
            while not self.ar.wait_for_output(timeout=0.1):
                self._relay()
                if self._death() or self._silent():
                    break
                if time.monotonic() > deadline:
                    sys.stderr.write(f"nbdist: some of the ranks' output had not arrived {OUTPUT_WAIT_SECONDS:g} s "
                                     "after the call ended; what came is shown\n")
                    break
        except Exception:
            pass
        self._relay(final=True)

    def _raise_failures(self, reason: str | None, action: str | None, kind: type = DistError) -> None:
        """Print each failed rank's traceback (always, whatever --output says) and raise one summary line."""
        failed = self._failed_ranks()
        if not failed and reason is None and action is None:
            return
        self._finish_output()
        if failed:
            _last_failure[:] = [(rank, whole_traceback(error)) for rank, error in failed.items()]
        # nbdist's interrupt (or the user's): a KeyboardInterrupt the cell raised itself is its own failure
        interrupted = [r for r, e in failed.items()
                       if _interrupted(e) and (r in self._signalled or kind is DistInterrupt)]
        # ranks the controller lost (ipyparallel's "Engine 2 died while running task ...", with its own frames):
        # the reason line names them, with their host
        lost = {r for r, e in failed.items() if reason is not None and _engine_died(e)}
        causes = {r: e for r, e in failed.items() if r not in interrupted and r not in lost}  # the rest: nbdist's
        if not causes and not self._viewed and not lost:  # interrupt; where each rank was: its traceback says it
            causes = failed
        shown = ((r, remote_traceback(e)) for r, e in causes.items() if not exited(e))  # sys.exit: the line says it
        write_grouped(shown, sys.stderr)
        said = grouped((r, failure_phrase(e)) for r, e in failed.items() if r not in interrupted and r not in lost)
        raised = [f"{ranks_label(ranks)} {phrase}" for ranks, phrase in said]
        parts = [p for p in (reason, "; ".join(raised)) if p]
        if action:
            parts.append(action)
        elif interrupted:
            parts.append(f"rank(s) {_ranks_text(interrupted)} interrupted")
        raise kind("; ".join(parts))


def _show(view) -> None:
    """The hang view in the cell: its table (HTML in a notebook, text elsewhere)."""
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            display(view)
            return
    except ImportError:
        pass
    sys.stderr.write(str(view) + "\n")
    sys.stderr.flush()


def _engine_died(error: BaseException) -> bool:
    return getattr(error, "ename", type(error).__name__) == "EngineError"


def _interrupted(error: BaseException) -> bool:
    return getattr(error, "ename", type(error).__name__) == "KeyboardInterrupt"


def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
