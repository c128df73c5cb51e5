"""A sharding plan as pictures: each rank's predicted memory, where each rank sits, and the model's layers.

Drawn from plain data only (the rows `Plan.ranks()` gives, a Mesh, dicts of numbers), so the plan explorer, a
static copy in an exported notebook and a test all draw the same thing from the same numbers. The numbers are
never computed here: they come from nbdist/sharding/memory.py and step_time.py through the plan.

Memory is one stacked bar per rank, in bytes (axis and hover: binary units, as every nbdist table prints them), with the
four parts the ZeRO paper names: parameters, gradients, optimizer state, activations. The placement figure is the
mesh's picture (viz/mesh.py: a row per pipeline stage, a cell per rank, coloured by replica) with what each rank
holds written in its cell.
"""
from __future__ import annotations

import html
from itertools import product
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go

from nbdist.units import format_bytes
from nbdist.viz.axes import byte_axis
from nbdist.viz.mesh import mesh_figure

# part of a rank's memory -> (legend label, colour); the keys are RankMemory's fields
MEMORY_PARTS: dict[str, tuple[str, str]] = {
    "params": ("parameters", "#4C78A8"),
    "grads": ("gradients", "#F58518"),
    "optimizer": ("optimizer state", "#54A24B"),
    "activations": ("activations", "#B279A2"),
}
LAYER_COLUMNS = ("layer", "kind", "stage", "pp rank", "parameters", "activations / sample", "forward ms",
                 "backward ms")


def memory_part(memory: Any, part: str) -> int:
    """A part of one rank's memory, from a RankMemory (attributes) or a dict with the same keys."""
    return memory[part] if isinstance(memory, Mapping) else getattr(memory, part)


def memory_figure(rows: Sequence[Mapping], title: str | None = None) -> go.Figure:
    """One stacked bar per rank: `rows` as Plan.ranks() gives them ('rank', 'memory', and optionally the 'pp', 'dp',
    'tp' coordinates for the hover). One trace per part, so the legend toggles a part on every rank at once."""
    labels = [f"rank {row['rank']}" for row in rows]
    traces = []
    for part, (label, colour) in MEMORY_PARTS.items():
        values = [memory_part(row["memory"], part) for row in rows]
        hover = [f"{name} · {label}: {format_bytes(v)}{_coords(row)}" for name, v, row in zip(labels, values, rows)]
        traces.append(go.Bar(name=label, x=labels, y=values, marker={"color": colour}, hovertext=hover,
                             hoverinfo="text"))
    totals = [sum(memory_part(row["memory"], part) for part in MEMORY_PARTS) for row in rows]
    fig = go.Figure(traces)
    if title is None and totals:
        peak = max(range(len(totals)), key=totals.__getitem__)
        title = f"predicted memory per rank: at most {format_bytes(totals[peak])} ({labels[peak]})"
    fig.update_layout(
        title=title, barmode="stack", height=360, margin={"l": 70, "r": 20, "t": 60, "b": 40},
        legend={"orientation": "h", "yanchor": "top", "y": -0.12, "x": 0},  # under the ranks, not over the bars
        yaxis={"title": "peak memory (predicted)", "rangemode": "tozero", **byte_axis(max(totals, default=0))},
        xaxis={"type": "category"},
    )
    return fig


def _coords(row: Mapping) -> str:
    coords = [f"{k} {row[k]}" for k in ("pp", "dp", "tp") if k in row]
    return f"<br>{', '.join(coords)}" if coords else ""


def placement_figure(mesh, notes: Mapping[int, Sequence[str]], title: str | None = None) -> go.Figure:
    """The mesh's picture (viz/mesh.py) with `notes[rank]` (lines: its layers, its tensor slice, ...) added to
    each rank's cell and hover."""
    fig = mesh_figure(mesh, title=title)
    heatmap = fig.data[0]
    rows_dim = "pp" if "pp" in mesh.names else None
    others = [(name, size) for name, size in mesh.dims if name != rows_dim]
    columns = list(product(*(range(size) for _, size in others)))  # the columns in mesh_figure's order
    text, hover = [list(r) for r in heatmap.text], [list(r) for r in heatmap.hovertext]
    for row in range(len(text)):
        for col, values in enumerate(columns):
            coords = dict(zip((name for name, _ in others), values)) | ({rows_dim: row} if rows_dim else {})
            lines = list(notes.get(mesh.rank_at(**coords), ()))
            text[row][col] += "".join(f"<br>{line}" for line in lines)
            hover[row][col] += "".join(f"; {line}" for line in lines)
    heatmap.update(text=text, hovertext=hover)
    extra = max((len(lines) for lines in notes.values()), default=0)
    fig.update_layout(height=max(200, (90 + 18 * extra) * len(text) + 120))
    return fig


def layers_html(rows: Sequence[Mapping]) -> str:
    """The model's layers as an HTML table, one row per dict with LAYER_COLUMNS' keys ('stage' and 'pp rank' None
    without pipeline stages; the times None before the profile). Bytes print in binary units, parameters with
    thousands separators, milliseconds with three decimals."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in LAYER_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c, row.get(c)))}</td>" for c in LAYER_COLUMNS)
                   + "</tr>" for row in rows)
    style = ("<style>.nbdist-plan-layers td, .nbdist-plan-layers th {padding: 2px 10px; text-align: right}"
             "</style>")
    return f'{style}<table class="nbdist-plan-layers"><tr>{head}</tr>{body}</table>'


def _cell(column: str, value) -> str:
    if value is None:
        return "—"
    if column == "parameters":
        return f"{value:,}"
    if column == "activations / sample":
        return format_bytes(value)
    if column.endswith(" ms"):
        return f"{value:.3f}"
    return str(value)
