"""Waiting for work on the ranks: live, rank-labelled output, and no rank left stuck.

An exception on one rank often leaves the others waiting forever in a collective (gloo and NCCL waits cannot be
interrupted by SIGINT). So while we wait we watch each rank: once one has failed, the others get a short grace
period; whoever is still running then is interrupted (SIGINT), and if that does not free it the engines are
restarted. The same happens on a timeout and on the kernel's interrupt. The user is told exactly what was done.
"""
from __future__ import annotations

import linecache
import os
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from nbdist.errors import DistError, DistInterrupt, debugging

ERROR_GRACE_SECONDS = 1.0  # after one rank fails, how long the others may take to finish (or fail) by themselves
INTERRUPT_WAIT_SECONDS = 1.5  # how long an interrupted rank may take to stop before we restart the engines
SHOW_MODES = ("rank0", "all", "none")


def label(rank: int) -> str:
    return f"[rank {rank}]"


def _prefixed(text: str, prefix: str) -> str:
    return "".join(f"{prefix} {line}" for line in text.splitlines(True))


@dataclass
class OutputRelay:
    """Copies each shown rank's stdout, stderr and displays into the notebook as they arrive, labelled by rank."""

    ranks: Sequence[int]
    shown: set[int]
    _sent: dict = field(default_factory=dict)
    _partial: dict = field(default_factory=dict)

    def relay(self, metadata: Sequence[dict], final: bool = False) -> None:
        for rank, md in zip(self.ranks, metadata):
            if rank not in self.shown:
                continue
            self._relay_stream(rank, md, "stdout", sys.stdout, final)
            self._relay_stream(rank, md, "stderr", sys.stderr, final)
            self._relay_displays(rank, md)

    def _relay_stream(self, rank: int, md: dict, name: str, out, final: bool) -> None:
        text = md.get(name) or ""
        start = self._sent.get((rank, name), 0)
        if len(text) <= start and not final:
            return
        pending = self._partial.get((rank, name), "") + text[start:]
        self._sent[(rank, name)] = len(text)
        complete, _, rest = pending.rpartition("\n")
        if final and rest:
            complete, rest = pending, ""
        elif complete:
            complete += "\n"
        self._partial[(rank, name)] = rest
        if complete:
            out.write(_prefixed(complete if complete.endswith("\n") else complete + "\n", label(rank)))
            out.flush()

    def _relay_displays(self, rank: int, md: dict) -> None:
        outputs = md.get("outputs") or []
        start = self._sent.get((rank, "outputs"), 0)
        if len(outputs) > start:
            from IPython.display import publish_display_data

            for content in outputs[start:]:
                publish_display_data(content["data"], content.get("metadata") or {})
            self._sent[(rank, "outputs")] = len(outputs)


def remote_summary(error: BaseException) -> str:
    """'ValueError: boom' for an engine's exception (ipyparallel wraps it as a RemoteError)."""
    ename = getattr(error, "ename", type(error).__name__)
    evalue = getattr(error, "evalue", str(error))
    return f"{ename}: {evalue}" if evalue else ename


def remote_traceback(error: BaseException) -> str:
    """A rank's traceback as the user needs it: their frames, not ipyparallel's nor nbdist's (NBDIST_DEBUG=1: all)."""
    text = getattr(error, "traceback", None) or remote_summary(error)
    return text if debugging() else "\n".join(user_frames(text.splitlines()))


ANSI = re.compile(r"\x1b\[[0-9;]*m")
FRAME_HEADER = re.compile(r"^(?:File (?P<path>.+?):(?P<line>\d+)\b(?:, in (?P<name>[^(\s]+))?|Cell In\[|Input In \[)")
SENT_BY_VALUE = "<dynamic-code>"  # cloudpickle's file name for the code of a function it sent by value
_sent_functions: dict[str, str] = {}  # qualified name -> the kernel file (cell) it was defined in


def remember_source(fn) -> None:
    """Note where a function that is sent to the ranks by value (cloudpickle) was defined, so that a traceback
    through it shows its source: cloudpickle replaces the file name with "<dynamic-code>"."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        _sent_functions[fn.__qualname__] = code.co_filename


NBDIST_DIR = os.path.dirname(os.path.abspath(__file__))
HIDDEN_PARTS = (f"{os.sep}ipyparallel{os.sep}", f"site-packages{os.sep}nbdist{os.sep}")
NO_SOURCE = "Could not get source"


def user_frames(lines: list[str]) -> list[str]:
    """Drop the frames of an IPython-formatted traceback that belong to ipyparallel or nbdist.

    A frame is its header line ("File path:line, in f(...)" or "Cell In[n], line k") and the lines up to the next
    blank one. The `<string>` frame right after a hidden one is ipyparallel's `exec` of the call, hidden too.
    Frames of functions defined in a notebook cell get their source from the kernel, where that cell lives."""
    kept: list[str] = []
    hide_string_frame = any_frame = False
    for block in _blocks(lines):
        match = FRAME_HEADER.match(ANSI.sub("", block[0]))
        if match is None:
            kept += block
            continue
        path = match.group("path") or ""
        hidden = _hidden(path) or (path == "<string>" and hide_string_frame)
        hide_string_frame = hidden
        if not hidden:
            if path == SENT_BY_VALUE and (match.group("name") or "") in _sent_functions:
                path = _sent_functions[match.group("name")]
                block = [block[0].replace(SENT_BY_VALUE, path, 1)] + block[1:]
            kept += _with_kernel_source(block, path, int(match.group("line") or 0))
            any_frame = True
    return kept if any_frame else [line for line in kept if not _header_line(ANSI.sub("", line))]


def _header_line(plain: str) -> bool:
    """The '-----' rule and the 'Traceback (most recent call last)' title: noise when no frame is left."""
    return plain.strip("-").strip() == "" or "Traceback (most recent call last)" in plain


def _blocks(lines: list[str]) -> Iterator[list[str]]:
    """Split traceback lines into frames (header up to and including the next blank line) and single lines."""
    frame: list[str] | None = None
    for line in lines:
        plain = ANSI.sub("", line)
        if frame is not None and not FRAME_HEADER.match(plain):
            frame.append(line)
            if not plain.strip():
                yield frame
                frame = None
            continue
        if frame is not None:
            yield frame
        frame = [line] if FRAME_HEADER.match(plain) else None
        if frame is None:
            yield [line]
    if frame is not None:
        yield frame


def _hidden(path: str) -> bool:
    return path.startswith(NBDIST_DIR + os.sep) or any(part in path for part in HIDDEN_PARTS)


def _with_kernel_source(block: list[str], path: str, line: int) -> list[str]:
    """An engine cannot read the source of a function defined in a notebook cell; the kernel can (linecache)."""
    body = [ANSI.sub("", text) for text in block[1:] if text.strip()]
    if body and not any(NO_SOURCE in text for text in body):
        return block
    source = linecache.getlines(path)
    if not source or line > len(source):
        return block
    shown = range(max(1, line - 2), min(len(source), line + 2) + 1)
    body = [_numbered(n, source[n - 1].rstrip("\n"), current=n == line) for n in shown]
    return [block[0]] + body + [""]


def _numbered(number: int, text: str, current: bool) -> str:
    """IPython's layout: '      4 code', and '----> 5 code' for the line that raised."""
    digits = str(number)
    prefix = "-" * max(1, 5 - len(digits)) + "> " + digits if current else digits.rjust(7)
    return f"{prefix} {text}"


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
    """Waits for one multi-rank AsyncResult. `restart` is called when stuck ranks cannot be freed otherwise."""

    ar: object
    ranks: Sequence[int]
    pids: dict[int, tuple[str, int]]  # rank -> (host, pid)
    restart: Callable[[], None]
    engines_alive: Callable[[], bool]
    timeout: float | None = None
    relay: OutputRelay | None = None
    progress: Callable[[object], None] | None = None  # called with the AsyncResult while waiting (live views)
    progress_every: float = 0.5

    def wait(self) -> list:
        """Block until every rank is done; return per-rank results (rank order) or raise DistError."""
        started = time.monotonic()
        first_failure_at = None
        reason, action = None, None
        last_progress = started
        try:
            while not self.ar.ready():
                self.ar.wait(0.05)
                self._relay()
                if self.progress is not None and time.monotonic() - last_progress >= self.progress_every:
                    last_progress = time.monotonic()
                    self.progress(self.ar)
                if first_failure_at is None and self._failed_ranks():
                    first_failure_at = time.monotonic()
                if not self.engines_alive():
                    reason, action = "an engine process died (which ends the whole MPI job)", self._restart()
                    break
                if first_failure_at is not None and time.monotonic() - first_failure_at > ERROR_GRACE_SECONDS:
                    action = self._free_stuck()
                    break
                if self.timeout is not None and time.monotonic() - started > self.timeout:
                    reason, action = f"timed out after {self.timeout:g} s", self._free_stuck()
                    break
        except KeyboardInterrupt:
            self._raise_failures("interrupted", self._free_stuck(), DistInterrupt)
        if action is None and any(_engine_died(e) for e in self._failed_ranks().values()):
            # every rank's result came back (as EngineError) before the launcher noticed the job had ended
            reason, action = "an engine process died (which ends the whole MPI job)", self._restart()
        self._finish_output()
        self._raise_failures(reason, action)
        return [child.result() for _, child in self._children()]

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

    def _restart(self) -> str:
        self._finish_output()
        with _interrupts_deferred():
            self.restart()
        return "so nbdist restarted the engines: fresh processes and process group, engine variables lost"

    def _interrupt(self, ranks: Sequence[int]) -> None:
        here = socket.gethostname()
        for rank in ranks:
            host, pid = self.pids[rank]
            if host == here:
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass

    # -- results ----------------------------------------------------------------------------------------------

    def _relay(self, final: bool = False) -> None:
        if self.relay is not None:
            self.relay.relay(self.ar._metadata, final=final)

    def _finish_output(self) -> None:
        try:
            self.ar.wait_for_output(timeout=1.0) if self.ar.ready() else None
        except Exception:
            pass
        self._relay(final=True)

    def _raise_failures(self, reason: str | None, action: str | None, kind: type = DistError) -> None:
        """Print each failed rank's traceback (always, whatever --output says) and raise one summary line."""
        failed = self._failed_ranks()
        if not failed and reason is None and action is None:
            return
        self._finish_output()
        for rank, error in failed.items():
            sys.stderr.write(_prefixed(remote_traceback(error).rstrip("\n") + "\n", label(rank)))
        sys.stderr.flush()
        raised = [f"rank {r} raised {remote_summary(e)}" for r, e in failed.items() if not _interrupted(e)]
        interrupted = [r for r, e in failed.items() if _interrupted(e)]
        parts = [p for p in (reason, "; ".join(raised)) if p]
        if action:
            parts.append(action)
        elif interrupted:
            parts.append(f"rank(s) {_ranks_text(interrupted)} interrupted")
        raise kind("; ".join(parts))


def _engine_died(error: BaseException) -> bool:
    return getattr(error, "ename", type(error).__name__) == "EngineError"


def _interrupted(error: BaseException) -> bool:
    return getattr(error, "ename", type(error).__name__) == "KeyboardInterrupt"


def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
