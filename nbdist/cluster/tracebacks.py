"""A rank's traceback as the user needs it: their own frames, not ipyparallel's nor nbdist's.

ipyparallel sends back an engine's IPython-formatted traceback. Most of its frames are the machinery that ran the
user's code (ipyparallel's apply, nbdist's engine entry points); the story a person debugging *their* code needs is
their frames and the error. `user_frames` keeps those, and gives functions defined in a notebook cell (sent by
value, whose source the rank does not have) their source back from the kernel. NBDIST_DEBUG=1 keeps everything.
"""
from __future__ import annotations

import linecache
import os
import re
from typing import Iterator

from nbdist.errors import debugging
from nbdist.wire import SENT_BY_VALUE, defined_in


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
NBDIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, above cluster/
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
