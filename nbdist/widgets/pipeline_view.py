"""The live view of a pipeline step: measured Gantt growing as actions run, the ideal schedule beneath it.

The ideal is the same schedule simulated with the durations just measured (mean forward and backward per stage),
so the gap between the two pictures is what communication and imbalance cost. Below them: per-rank busy and idle
shares, the bubble measured against the ideal, and the activations each rank holds. A Stepper's view adds Step /
Run / Reset buttons.

Displayed, the view sends JupyterLab the widget and, in the same output, a static HTML copy of its figures: a
notebook executed headless (nbconvert) or opened where widgets do not render still shows the pictures. The static
copy is refreshed when a step completes.
"""
from __future__ import annotations

import html
import json
import time

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython import get_ipython
from IPython.display import display

from nbdist.schedules.simulate import Timeline, measured_durations
from nbdist.viz.timeline import timeline_figure

DRAW_EVERY = 0.5  # seconds between redraws while steps run back to back (live updates: twice a second)


class PipelineView:
    def __init__(self, pipe, stepper=None):
        self.pipe, self.stepper = pipe, stepper
        # Output widgets holding plain plotly figures: a FigureWidget would save ~5 MB of plotly.js in every
        # executed notebook's widget state; a figure in an Output widget saves only its JSON.
        self.measured = widgets.Output()
        self.ideal = widgets.Output()
        self._figures: tuple[go.Figure, ...] = ()
        self.stats = widgets.HTML()
        self._handle = None
        self._static = ""
        self._static_stale = False
        self._flush_registered = False
        self._last_draw = 0.0
        self._pending: tuple = ({}, None)
        children = [self.measured, self.ideal, self.stats]
        if stepper is not None:
            children.insert(0, self._controls())
        self.widget = widgets.VBox(children)
        self._draw()

    # -- controls ------------------------------------------------------------------------------------------------

    def _controls(self) -> widgets.HBox:
        step = widgets.Button(description="Step", tooltip="run the next tick on every rank")
        run = widgets.Button(description="Run", tooltip="run to the end of the step")
        reset = widgets.Button(description="Reset", tooltip="start the step again")
        step.on_click(lambda _: self.stepper.next())
        run.on_click(lambda _: self.stepper.run())
        reset.on_click(lambda _: self.stepper.reset())
        return widgets.HBox([step, run, reset])

    # -- drawing --------------------------------------------------------------------------------------------------

    def refresh(self, spans_by_rank: dict, final: bool = True, tick_state=None, throttle: bool = False) -> None:
        """Show the spans measured so far (rank -> [(action, start, end, wait)]).

        throttle: draw at most every DRAW_EVERY seconds (a loop of short steps must not spend its time drawing);
        whatever was skipped is drawn when the cell finishes. final: the step is complete, so the static copy is
        refreshed too (once, when the cell finishes).
        """
        self._pending = (spans_by_rank, tick_state)
        if not throttle or time.monotonic() - self._last_draw >= DRAW_EVERY:
            self._draw()
        if final or throttle:
            self._flush_when_cell_ends(static=final)

    def _draw(self) -> None:
        spans_by_rank, tick_state = self._pending
        self._last_draw = time.monotonic()
        measured = Timeline.from_spans(spans_by_rank or {r: [] for r in self.pipe.ranks}, name="measured")
        highlight = measured.end if tick_state is not None and spans_by_rank else None
        ideal = self._ideal(measured)
        self._figures = (
            timeline_figure(measured, title=self._measured_title(measured, tick_state), highlight_time=highlight),
            timeline_figure(ideal, title=f"ideal ({self._ideal_basis(measured)}): bubble {ideal.bubble_fraction:.1%}"),
        )
        for output, figure in zip((self.measured, self.ideal), self._figures):
            _replace(output, figure)
        self.stats.value = _stats_table(measured, ideal, tick_state)

    def _flush_when_cell_ends(self, static: bool) -> None:
        """Draw what is pending (and refresh the static copy) once the running cell is done."""
        self._static_stale = self._static_stale or static
        shell = get_ipython()
        if shell is None:
            self._flush()
        elif not self._flush_registered:
            shell.events.register("post_execute", self._flush)
            self._flush_registered = True

    def _flush(self) -> None:
        shell = get_ipython()
        if shell is not None and self._flush_registered:
            shell.events.unregister("post_execute", self._flush)
            self._flush_registered = False
        self._draw()
        if self._static_stale:
            self._static_stale = False
            self._static = self._static_html()
            if self._handle is not None:
                self._handle.update(self._bundle(), raw=True)

    def _measured_title(self, measured: Timeline, tick_state) -> str:
        where = f"tick {tick_state.tick} of {tick_state.total_ticks}, " if tick_state is not None else ""
        if not measured.spans or measured.makespan == 0:
            return f"measured: {where}nothing has run yet"
        return f"measured: {where}{measured.makespan * 1e3:.1f} ms, bubble {measured.bubble_fraction:.1%}"

    def _ideal_basis(self, measured: Timeline) -> str:
        return "simulated with the measured durations and latency" if self._measured(measured) else "F = 1, B = 2"

    def _measured(self, measured: Timeline) -> dict | None:
        schedule = self.pipe.schedule
        return measured_durations(measured, schedule.stages, schedule.chunks) if measured.spans else None

    def _ideal(self, measured: Timeline) -> Timeline:
        durations = self._measured(measured)
        timeline = self.pipe.schedule.simulate(**(durations or {"forward": 1.0, "backward": 2.0}))
        timeline.unit = "s" if durations else ""
        return timeline

    # -- display --------------------------------------------------------------------------------------------------

    def _static_html(self) -> str:
        figures = "".join(fig.to_html(include_plotlyjs="cdn", full_html=False) for fig in self._figures)
        return figures + self.stats.value

    def _bundle(self) -> dict:
        bundle = dict(self.widget._repr_mimebundle_() or {})
        bundle["text/html"] = self._static
        bundle["text/plain"] = repr(self)
        return bundle

    def show(self) -> "PipelineView":
        self._static = self._static_html()
        self._handle = display(self._bundle(), raw=True, display_id=True)
        return self

    def _ipython_display_(self) -> None:
        self.show()

    def __repr__(self) -> str:
        return f"<PipelineView of {self.pipe!r}>"


def _replace(output: widgets.Output, figure: go.Figure) -> None:
    """Show `figure` in `output` instead of what was there (JupyterLab renders plotly's mimetype).

    The output's state is set directly rather than through `with output: clear_output(wait=True); display(...)`:
    that route makes nbclient (headless runs) capture into its mimic of the widget and, here, never finish the cell.
    """
    data = {"application/vnd.plotly.v1+json": json.loads(figure.to_json()), "text/plain": str(figure.layout.title.text)}
    output.outputs = ({"output_type": "display_data", "data": data, "metadata": {}},)


def _stats_table(measured: Timeline, ideal: Timeline, tick_state) -> str:
    rows = []
    ranks = sorted(ideal.spans)
    busy = measured.busy_fraction if measured.makespan > 0 else {}
    for rank in ranks:
        share = busy.get(rank)
        held = tick_state.activations.get(rank) if tick_state is not None else None
        rows.append(
            f"<tr><td>rank {rank}</td><td>{_pct(share)}</td><td>{_pct(None if share is None else 1 - share)}</td>"
            f"<td>{'' if held is None else held}</td><td>{ideal.peak_activations.get(rank, '')}</td></tr>"
        )
    bubble = _pct(measured.bubble_fraction if measured.makespan > 0 else None)
    in_flight = ", ".join(tick_state.in_flight) if tick_state is not None and tick_state.in_flight else "nothing"
    return (
        f"<p><b>bubble</b> measured {bubble}, ideal {ideal.bubble_fraction:.1%}"
        + (f"; <b>in flight</b>: {html.escape(in_flight)}" if tick_state is not None else "")
        + "</p><table><tr><th>rank</th><th>busy</th><th>idle</th><th>activations held now</th>"
        "<th>peak activations (ideal)</th></tr>" + "".join(rows) + "</table>"
    )


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"
