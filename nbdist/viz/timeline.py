"""A pipeline timeline as a plotly Gantt: one row per rank, one bar per action, the idle stretches between them.

One horizontal-bar trace per kind of bar (not per bar), each bar placed by `base` = start and `x` = duration:
a figure of hundreds of actions stays a handful of traces, fast to draw and to send to the browser. The same
function draws a simulated timeline, a measured one and one on the tick axis; only the axis unit differs
(measured seconds are shown in ms).

Every bar's hover says what it is: the rank, the action in words, its duration and start. An idle stretch says
what the rank waits for: the message and the rank it comes from, or the other ranks at the end of the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from nbdist.schedules.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_B, RECV_F

COMM, WAIT, IDLE = "comm", "wait", "idle"
# kind -> (legend label, colour)
STYLES: dict[str, tuple[str, str]] = {
    FORWARD: ("forward F", "#4C78A8"),
    BACKWARD: ("backward B", "#54A24B"),
    BACKWARD_INPUT: ("input grad I", "#F58518"),
    BACKWARD_WEIGHT: ("weight grad W", "#B279A2"),
    COMM: ("send / receive", "#9ECAE9"),
    WAIT: ("waiting for a message", "#BDBDBD"),
    IDLE: ("idle", "#E6E6E6"),
}
SMALLEST_SHOWN = 0.002  # idle stretches and sends shorter than this share of the makespan are not drawn (< 1 px)


def timeline_figure(timeline, title: str | None = None, highlight_time: float | None = None,
                    subtitle: str | None = None) -> go.Figure:
    """Gantt of `timeline` (nbdist.schedules.Timeline), rank 0 on top; `highlight_time` draws a vertical line.

    A timeline with `cuts` (a stepped step, its pauses taken out) gets a dotted line at each cut and a subtitle
    saying how much was removed.
    """
    axis = _Axis.of(timeline)
    rows = {kind: _empty_row() for kind in STYLES}
    peers = _peers_by_rank(timeline)
    smallest = SMALLEST_SHOWN * timeline.makespan
    for rank, spans in timeline.spans.items():
        for kind, start, end, hover, text in _bars(rank, spans, timeline, peers[rank], smallest, axis):
            _add(rows[kind], _rank_label(timeline, rank), axis.scale * start, axis.scale * (end - start), hover,
                 text)
    fig = go.Figure([_trace(kind, row) for kind, row in rows.items() if row["x"]])
    _layout(fig, timeline, axis, title, subtitle)
    for at, _ in timeline.cuts:
        fig.add_vline(x=axis.scale * at, line_width=1, line_dash="dot", line_color="#7F7F7F")
    if highlight_time is not None:
        fig.add_vline(x=axis.scale * highlight_time, line_width=2, line_dash="dash", line_color="#D62728")
    return fig


# -- units ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Axis:
    """How a timeline's unit is shown: measured seconds as ms, simulated units as they are, ticks as ticks."""

    unit: str
    scale: float
    title: str

    @staticmethod
    def of(timeline) -> "_Axis":
        if timeline.unit == "s":
            return _Axis("s", 1e3, "time (ms)")
        if timeline.unit == "tick":
            return _Axis("tick", 1.0, "tick")
        return _Axis(timeline.unit, 1.0, f"time ({timeline.unit or 'simulated units'})")

    def length(self, value: float) -> str:
        """A duration in words: '3.1 ms', '2 units', '4 ticks'."""
        if self.unit == "s":
            ms = value * 1e3
            return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3f} ms"
        if self.unit == "tick":
            return f"{value:.0f} tick" + ("" if round(value) == 1 else "s")
        return f"{value:.4g} {self.unit or ('unit' if value == 1 else 'units')}"

    def at(self, value: float) -> str:
        """A point on the axis: 'starts at 3.1 ms', 'starts at tick 4', 'starts at 2 units'."""
        return f"starts at tick {value:.0f}" if self.unit == "tick" else f"starts at {self.length(value)}"


def makespan_text(timeline) -> str:
    """'makespan 534.1 ms', 'makespan 11 units', 'makespan 20 ticks': the title's numbers, with their unit."""
    return f"makespan {_Axis.of(timeline).length(timeline.makespan)}"


# -- bars ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Peers:
    """Who ran which action in one pipeline (several pipelines run the same actions under data parallelism), so a
    message's sender is named by the rank that sent it, or, before it ran, by where the schedule places it."""

    ran: dict
    ranks: tuple[int, ...]  # the pipeline's ranks in pipeline-rank order

    def rank_of(self, action) -> int:
        peer = action.matching()
        return self.ran.get(peer, self.ranks[peer.stage % len(self.ranks)])


def _peers_by_rank(timeline) -> dict[int, _Peers]:
    out = {}
    for ranks in timeline.pipelines or [sorted(timeline.spans)]:
        ran = {span.action: rank for rank in ranks for span in timeline.spans.get(rank, [])}
        out.update({rank: _Peers(ran, tuple(ranks)) for rank in ranks})
    return out


def _bars(rank: int, spans, timeline, peers: _Peers, smallest: float, axis: _Axis):
    """(kind, start, end, hover, text) of one rank's bars: its idle stretches, compute, sends and receives."""
    cursor = timeline.start
    who = f"rank {rank}"
    for span in spans:
        idle_end = span.start + span.wait
        gap = idle_end - cursor
        if gap > 0 and (gap > smallest or span.wait > 0):
            kind, reason = _idle_reason(span, peers)
            if kind == IDLE and any(cursor < at <= idle_end for at, _ in timeline.cuts):
                reason = "waiting for the other ranks to end the call (stepping stops every rank at a tick)"
            length = axis.length(gap)
            yield kind, cursor, idle_end, f"{who} · idle {length}: {reason}<br>{axis.at(cursor)}", ""
        work = span.end - idle_end
        if span.action.is_compute:
            text = str(span.action.microbatch)
            yield span.action.kind, idle_end, span.end, _hover(who, span, axis, work), text
        elif work > smallest and work > 0:
            peer = f" (rank {peers.rank_of(span.action)})"
            yield COMM, idle_end, span.end, _hover(who, span, axis, work, peer), ""
        cursor = max(cursor, span.end)
    if spans and timeline.end - cursor > smallest:
        length = axis.length(timeline.end - cursor)
        hover = f"{who} · idle {length}: waiting for the other ranks to finish<br>{axis.at(cursor)}"
        yield IDLE, cursor, timeline.end, hover, ""


def _idle_reason(span, peers: _Peers) -> tuple[str, str]:
    """Why a rank idles before `span`: the message a receive waits for, or the action it has not started."""
    action = span.action
    if action.kind in (RECV_F, RECV_B):
        sender = peers.rank_of(action)
        return WAIT, f"waiting for {action.message} from rank {sender} ({action.matching()})"
    if span.wait > 0:
        return WAIT, f"waiting for a message before {action} ({action.describe()})"
    return IDLE, f"before its next action, {action} ({action.describe()})"


def _hover(who: str, span, axis: _Axis, work: float, extra: str = "") -> str:
    """'rank 1 · forward of micro-batch 3 on stage 1<br>0.5 ms, starts at 3.1 ms (1F3)'."""
    when = f"{axis.length(work)}, {axis.at(span.end - work)}"
    return f"{who} · {span.action.describe()}{extra}<br>{when} ({span.action})"


def _empty_row() -> dict[str, list]:
    return {"x": [], "base": [], "y": [], "text": [], "hover": []}


def _add(row: dict[str, list], label: str, base: float, width: float, hover: str, text: str) -> None:
    row["x"].append(width)
    row["base"].append(base)
    row["y"].append(label)
    row["text"].append(text)
    row["hover"].append(hover)


def _trace(kind: str, row: dict[str, list]) -> go.Bar:
    label, colour = STYLES[kind]
    idle = kind in (WAIT, IDLE)
    return go.Bar(
        name=label,
        orientation="h",
        x=row["x"],
        base=row["base"],
        y=row["y"],
        text=row["text"],
        textposition="inside",
        insidetextanchor="middle",
        hovertext=row["hover"],
        hoverinfo="text",
        marker={"color": colour, "line": {"color": "white", "width": 1},
                **({"pattern": {"shape": "/", "fgcolor": "#BDBDBD", "size": 6}} if kind == IDLE else {})},
        opacity=0.7 if idle else 1.0,
    )


def _rank_label(timeline, rank: int) -> str:
    """'rank 2', or with several pipelines 'rank 2 (replica 1)' (data parallelism), or the pipeline's own name
    ('rank 2 (dp 0, tp 1)') when the timeline carries names."""
    if len(timeline.pipelines) > 1:
        index = next(i for i, ranks in enumerate(timeline.pipelines) if rank in ranks)
        names = getattr(timeline, "pipeline_names", None)
        return f"rank {rank} ({names[index] if names else f'replica {index}'})"
    return f"rank {rank}"


def _layout(fig: go.Figure, timeline, axis: _Axis, title: str | None, subtitle: str | None) -> None:
    if title is None:
        name = timeline.name or "timeline"
        title = f"{name}: {makespan_text(timeline)}, bubble {timeline.bubble_fraction:.1%}"
    notes = [subtitle] if subtitle else []
    if timeline.cuts:
        notes.append(f"pauses between clicks removed: {timeline.paused:.1f} s (dotted lines)")
    ranks = [_rank_label(timeline, r) for r in sorted(timeline.spans)]
    x_end = timeline.end if timeline.spans and timeline.makespan > 0 else 1.0
    fig.update_layout(
        title={"text": title, "subtitle": {"text": " · ".join(notes)}, "yref": "container", "y": 1.0,
               "yanchor": "top", "pad": {"t": 12}},
        barmode="overlay",
        bargap=0.25,
        height=(175 if notes else 145) + 45 * len(ranks),
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
        margin={"l": 70, "r": 20, "t": 115 if notes else 85, "b": 50},
        uniformtext={"minsize": 8, "mode": "hide"},
        xaxis={"title": axis.title, "rangemode": "tozero", **({} if timeline.spans and timeline.makespan > 0 else
                                                              {"range": [0, axis.scale * x_end]})},
        # a category axis with every rank listed and a fixed range: rank labels show even before anything ran
        yaxis={"type": "category", "categoryorder": "array", "categoryarray": ranks,
               "range": [len(ranks) - 0.5, -0.5], "autorange": False},
    )
