"""A rank's traceback as the user needs it: their own frames, not those of the libraries under them.

ipyparallel sends back an engine's IPython-formatted traceback. Most of its frames are the machinery that ran the
user's code (ipyparallel's apply, nbdist's engine entry points) or the libraries it called (torch's modules, the
standard library); the story a person debugging *their* code needs is their frames and the error. `user_frames`
keeps those, and gives functions defined in a notebook cell (sent by value, whose source the rank does not have)
their source back from the kernel; a line under the traceback says which libraries' frames were hidden.
`%dist_traceback` shows the last failure's tracebacks whole; NBDIST_DEBUG=1 keeps everything, always.

Several ranks failing the same way (the same folded traceback) are said once, naming the ranks (`grouped`).

What a rank raised is said in the error's one line, cut to ERROR_CHARS (a 1 MiB message made a 1 MiB line), and
the traceback's lines to LINE_CHARS, each cut saying how much was left out; `%dist_traceback` keeps it all. A cell
that called sys.exit() is said as that (IPython's SystemExit text names no rank and suggests %tb).
"""
from __future__ import annotations

import importlib.util
import linecache
import os
import re
from collections import Counter
from typing import Iterable, Iterator, Sequence

from nbdist.errors import debugging
from nbdist.wire import SENT_BY_VALUE, defined_in


ERROR_CHARS = 500  # of what a rank raised, in the error's line (a long torch message fits; a flood does not)
LINE_CHARS = 2000  # of each line of a rank's traceback shown in the cell


def remote_summary(error: BaseException) -> str:
    """'ValueError: boom' for an engine's exception (ipyparallel wraps it as a RemoteError), cut to ERROR_CHARS."""
    return cut(_whole_summary(error), ERROR_CHARS)


def _whole_summary(error: BaseException) -> str:
    ename = getattr(error, "ename", type(error).__name__)
    evalue = getattr(error, "evalue", str(error))
    return f"{ename}: {evalue}" if evalue else ename


def exited(error: BaseException) -> bool:
    """The rank's code called sys.exit() (or raised SystemExit)."""
    return getattr(error, "ename", type(error).__name__) == "SystemExit"


def failure_phrase(error: BaseException) -> str:
    """What a rank did, after its label in the error's line: 'raised ValueError: boom', or for sys.exit() what that
    does on a rank (its cell stops; the engine, its variables and the MPI job live on)."""
    if not exited(error):
        return f"raised {remote_summary(error)}"
    code = getattr(error, "evalue", "") or ""
    return cut(f"called sys.exit({code}), which ends the cell there, not the rank: the engines and their variables "
               "are kept (%dist_stop ends them)", ERROR_CHARS)


def cut(text: str, limit: int) -> str:
    """`text` up to `limit` characters, and how many more there were."""
    if len(text) <= limit:
        return text
    reset = "\x1b[0m" if "\x1b[" in text[:limit] else ""  # a colour begun in what is shown ends there
    return f"{text[:limit]}{reset}... ({len(text) - limit:,} more characters not shown: %dist_traceback shows them)"


def whole_traceback(error: BaseException) -> str:
    """A rank's traceback with every frame, as the engine sent it."""
    return getattr(error, "traceback", None) or _whole_summary(error)


def remote_traceback(error: BaseException) -> str:
    """A rank's traceback as the user needs it: their frames, then a line naming the libraries whose frames were
    hidden (NBDIST_DEBUG=1: everything)."""
    text = whole_traceback(error)
    if debugging():
        return text
    hidden: Counter = Counter()
    kept = [cut(line, LINE_CHARS) for line in user_frames(text.splitlines(), hidden)]
    return "\n".join(kept + ([hidden_note(hidden)] if hidden else []))


def hidden_note(hidden: Counter) -> str:
    frames = sum(hidden.values())
    names = ", ".join(name for name, _ in hidden.most_common())
    return f"({frames} frame{'s' if frames > 1 else ''} of {names} hidden: %dist_traceback shows every frame)"


ANSI = re.compile(r"\x1b\[[0-9;]*m")
FRAME_HEADER = re.compile(r"^(?:File (?P<path>.+?):(?P<line>\d+)\b(?:, in (?P<name>[^(\s]+))?|Cell In\[|Input In \[)")
NBDIST_DIR = os.path.dirname(os.path.abspath(importlib.util.find_spec("nbdist").origin))  # the package's folder
# An installed library's file (site-packages/NAME/...), or the standard library's (lib/python3.X/NAME...)
LIBRARY = re.compile(r"[\\/]lib(?:64)?[\\/]python3[\d.]*[\\/](?:(?P<installed>(?:site|dist)-packages)[\\/])?"
                     r"(?P<name>[^\\/.]+)")
# What runs every call (and nbdist's own errors are one line by design): not worth a mention when hidden
PLUMBING = {"nbdist", "ipyparallel", "IPython", "ipykernel", "python"}
NO_SOURCE = "Could not get source"


def library_of(path: str) -> str | None:
    """The library a frame's file belongs to ("torch", "nbdist", "python" for the standard library), or None for
    the user's own code (a notebook cell, a module of theirs). IPython writes a path in the home folder as "~/..."
    (nbdist checked out in the user's home: its frames were shown as the user's)."""
    path = os.path.expanduser(path)
    if path.startswith(NBDIST_DIR + os.sep):
        return "nbdist"
    if path.startswith("<frozen "):
        return "python"
    found = LIBRARY.search(path)
    if found is None:
        return None
    return found.group("name") if found.group("installed") else "python"


def user_frames(lines: list[str], hidden: Counter | None = None) -> list[str]:
    """Drop the frames of an IPython-formatted traceback that belong to libraries (nbdist, ipyparallel, torch, the
    standard library...); `hidden` counts them by library, the machinery of every call (nbdist, ipyparallel,
    IPython, the standard library's) left out.

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
        library = library_of(path)
        hidden_here = library is not None or (path == "<string>" and hide_string_frame)
        hide_string_frame = hidden_here
        if hidden_here and hidden is not None and library not in PLUMBING | {None}:
            hidden[library] += 1
        if not hidden_here:
            if path == SENT_BY_VALUE and defined_in(match.group("name") or "") is not None:
                path = defined_in(match.group("name"))
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


def ranks_label(ranks: Sequence[int]) -> str:
    """'rank 1', 'ranks 0, 2', 'ranks 0-3' (runs of three or more as a range)."""
    ranks = sorted(ranks)
    parts, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            run = ranks[start:i]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(r) for r in run]
            start = i
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(parts)}"


def grouped(by_rank: Iterable[tuple[int, str]]) -> list[tuple[list[int], str]]:
    """Ranks that said the same text, together: [(ranks, text)], in the order of each text's first rank."""
    groups: dict[str, list[int]] = {}
    for rank, text in by_rank:
        groups.setdefault(text, []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]
