"""The live view of a pipeline step: the measured Gantt growing as actions run, the ideal schedule beneath it.

The measured chart shows the work: while a Stepper steps, the pauses between calls (a person reading between two
clicks) are taken out of the time axis (stepping.work_timeline), and the chart says how much and where. A toggle
puts it on the tick axis instead, every action at its tick. The ideal is the same schedule simulated with the
median durations measured over the last few steps (schedules.simulate.measured_durations), so the gap between the
two pictures is what communication and imbalance cost, not one cold action. Below them: the bubble of the work
done, the ideal's, the tick, per-rank busy and idle shares, and the activations each rank holds.

Displayed, the view is two outputs: the widget, and a static HTML copy of its figures and numbers (with plotly.js
embedded once per notebook, viz.display). nbconvert shows a widget's view when the notebook's widget state is saved
(it is, when executed headless), so the copy must be an output of its own to reach an HTML export; it is updated
(display_id) when a step completes, and hidden wherever the widget renders in a live JupyterLab.
"""
from __future__ import annotations

import html
import time

import ipywidgets as widgets
from IPython import get_ipython

from nbdist.debugging.bubbles import median_compute, stepping_cost
from nbdist.pipeline_parallel.stepping import tick_timeline
from nbdist.schedules.simulate import Timeline, measured_durations
from nbdist.viz.display import figure_html
from nbdist.viz.timeline import makespan_text, timeline_figure
from nbdist.widgets.figure import PlotlyFigure
from nbdist.widgets.static_copy import HIDE_STATIC_COPY, STATIC_COPY, WithStaticCopy

DRAW_EVERY = 0.5  # seconds between redraws while steps run back to back (live updates: twice a second)
RANKS_TABLE_STYLE = "<style>.nbdist-ranks td, .nbdist-ranks th {padding: 2px 12px; text-align: right}</style>"


class PipelineView(WithStaticCopy):
    def __init__(self, pipe, stepper=None):
        self.pipe, self.stepper = pipe, stepper
        self.measured, self.ideal, self.stats = PlotlyFigure(), PlotlyFigure(), widgets.HTML()
        self.axis = widgets.ToggleButtons(options=["time", "ticks"], value="time",
                                          tooltips=["measured time, pauses between clicks removed",
                                                    "every action at its tick: the Stepper's clock"])
        self.axis.observe(lambda _: self._draw(), names="value")
        self._buttons: list[widgets.Button] = []
        self._figures: tuple = ()
        self._stats = ""
        self._static_handle = None
        self._static_stale = False
        self._flush_registered = False
        self._last_draw = 0.0
        self._pending: tuple[Timeline | None, object] = (None, None)
        controls = self._controls() if stepper is not None else []
        self.widget = widgets.VBox([widgets.HBox(controls + [self.axis]), self.measured, self.ideal, self.stats])
        self._draw()

    # -- controls ------------------------------------------------------------------------------------------------

    def _controls(self) -> list[widgets.Button]:
        step = widgets.Button(description="Step", tooltip="run the next tick on every rank")
        run = widgets.Button(description="Run", tooltip="run to the end of the step")
        reset = widgets.Button(description="Reset", tooltip="start the step again")
        step.on_click(lambda _: self.stepper.next())
        run.on_click(lambda _: self.stepper.run())
        reset.on_click(lambda _: self.stepper.reset())
        self._buttons = [step, run]
        return [step, run, reset]

    # -- drawing --------------------------------------------------------------------------------------------------

    def refresh(self, timeline: Timeline | None, final: bool = True, tick_state=None, throttle: bool = False) -> None:
        """Show `timeline` (the step measured so far; for a Stepper its work timeline) at `tick_state`.

        throttle: draw at most every DRAW_EVERY seconds (a loop of short steps must not spend its time drawing);
        whatever was skipped, and the static copy, is drawn when the cell finishes. final: the numbers are those of
        a finished call (a step, or a Stepper's call), so the static copy is refreshed too.
        """
        self._pending = (timeline, tick_state)
        if not throttle or time.monotonic() - self._last_draw >= DRAW_EVERY:
            self._draw()
        if throttle:
            self._flush_when_cell_ends()
        elif final:
            self._update_static()

    def _draw(self) -> None:
        timeline, tick_state = self._pending
        self._last_draw = time.monotonic()
        measured = timeline if timeline is not None else self._nothing_yet()
        ideal, basis = self._ideal(measured, tick_state)
        self._figures = (
            self._measured_figure(measured, tick_state),
            timeline_figure(ideal, title=f"ideal: {makespan_text(ideal)}, bubble {_pct(ideal.bubble_fraction)}",
                            subtitle=f"the schedule simulated with {basis}"),
        )
        self.measured.show(self._figures[0])
        self.ideal.show(self._figures[1])
        full_speed = next((t for t in reversed(self.pipe.recent) if not t.cuts), None)
        self._stats = stats_html(measured, ideal, tick_state, full_speed)
        self.stats.value = HIDE_STATIC_COPY + self._stats
        for button in self._buttons:
            button.disabled = self.stepper is not None and self.stepper.done

    def _nothing_yet(self) -> Timeline:
        several = len(self.pipe.pipelines) > 1
        return Timeline({r: [] for r in self.pipe.ranks}, name="measured",
                        pipelines=self.pipe.pipelines if several else [],
                        pipeline_names=self.pipe.pipeline_names() if several else [])

    def _measured_figure(self, measured: Timeline, tick_state):
        where = f"tick {tick_state.tick} of {tick_state.total_ticks}, " if tick_state is not None else ""
        if self.axis.value == "ticks":
            ticks = tick_timeline(self.pipe.schedule, self.pipe.ticks, tick_state.tick if tick_state else None)
            total = tick_state.total_ticks if tick_state else round(ticks.end)
            figure = timeline_figure(ticks, title=f"ticks: {where or f'{total} ticks, '}each action at its tick",
                                     subtitle="one action per rank per tick: the Stepper's clock, not time")
            figure.update_xaxes(range=[0, total], autorange=False)
            return figure
        if not measured.spans or measured.makespan == 0:
            return timeline_figure(measured, title=f"measured: {where}nothing has run yet")
        work = "measured work" if tick_state is not None else "measured"
        title = f"{work}: {where}{makespan_text(measured)}, bubble {_pct(measured.bubble_fraction)}"
        highlight = measured.end if tick_state is not None else None
        return timeline_figure(measured, title=title, highlight_time=highlight)

    def _ideal(self, measured: Timeline, tick_state) -> tuple[Timeline, str]:
        """The schedule simulated with median measured durations; F = 1, B = 2 until something was measured."""
        in_progress = measured if any(measured.spans.values()) else None
        sources = self.pipe.duration_sources(in_progress)
        schedule = self.pipe.schedule
        durations = measured_durations(sources, schedule.stages, schedule.chunks) if sources else None
        if durations is None:
            timeline = schedule.simulate(forward=1.0, backward=2.0)
            return timeline, "F = 1, B = 2 units (no step measured yet)"
        timeline = schedule.simulate(**durations)
        timeline.unit = "s"
        steps = f"the last {len(sources)} steps'" if len(sources) > 1 else "this step's"
        latency = f"{durations['comm'] * 1e3:.3f} ms"
        return timeline, f"median durations per stage and kind over {steps} micro-batches, {latency} per message"

    def _flush_when_cell_ends(self) -> None:
        """Draw what is pending and refresh the static copy once the running cell is done."""
        self._static_stale = True
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
            self._update_static()

    # -- display --------------------------------------------------------------------------------------------------

    def static_html(self) -> str:
        """The figures and numbers as HTML that needs no widgets and no network (plotly.js: viz.display)."""
        figures = "".join(figure_html(figure, loader=False) for figure in self._figures)
        return f'<div class="{STATIC_COPY}">{figures}{self._stats}</div>'

    def _update_static(self) -> None:
        self._static_stale = False
        super()._update_static()

    def __repr__(self) -> str:
        return f"<PipelineView of {self.pipe!r}>"


def stats_html(measured: Timeline, ideal: Timeline, tick_state, full_speed: Timeline | None = None) -> str:
    """The numbers under the charts. Class names and data attributes are a contract (browser tests read them):
    nbdist-bubble (the measured work's bubble; data-bubble="" before anything ran), nbdist-ideal-bubble, nbdist-tick,
    nbdist-stepping-cost (a stepped step: the points of its bubble that stepping itself causes). `full_speed`: the
    pipeline's last step run at full speed, compared with a stepped one."""
    ran = bool(measured.spans) and measured.makespan > 0
    bubble = (f'<span class="nbdist-bubble" data-bubble="{measured.bubble_fraction:.4f}">'
              f"{_pct(measured.bubble_fraction)}</span>" if ran else
              '<span class="nbdist-bubble" data-bubble="">nothing has run yet</span>')
    ideal_bubble = (f'<span class="nbdist-ideal-bubble" data-bubble="{ideal.bubble_fraction:.4f}">'
                    f"{_pct(ideal.bubble_fraction)}</span>")
    parts = [f"<b>bubble</b> ({'measured work' if tick_state is not None else 'measured'}): {bubble}",
             f"<b>ideal</b>: {ideal_bubble}"]
    if measured.cuts:
        parts.append(f"pauses between clicks removed: {measured.paused:.1f} s")
        if ran:
            parts.append(_stepping_html(measured, full_speed))
    if tick_state is not None:
        parts.append(f'<b>tick</b> <span class="nbdist-tick" data-tick="{tick_state.tick}" '
                     f'data-total="{tick_state.total_ticks}">{tick_state.tick} of {tick_state.total_ticks}</span>')
        parts.append(f"<b>in flight</b>: {html.escape(', '.join(tick_state.in_flight) or 'nothing')}")
    return (f'<p class="nbdist-stats">{" · ".join(parts)}</p>' + RANKS_TABLE_STYLE +
            '<table class="nbdist-ranks"><tr><th>rank</th><th>busy</th><th>idle</th><th>activations held now</th>'
            "<th>peak activations (ideal)</th></tr>" + "".join(_rank_rows(measured, ideal, tick_state)) + "</table>")


def _stepping_html(stepped: Timeline, full_speed: Timeline | None) -> str:
    """What stepping itself costs a stepped step: the points of its bubble in the gaps at the tick calls (a rank
    done with its tick waits for the next call, which starts with a barrier), and, beside the last full-speed step,
    how much slower its actions ran (each call starts cold)."""
    stepping = stepping_cost(stepped)
    points = stepping / (stepped.ranks * stepped.makespan)
    said = (f'<b>stepping\'s own cost</b>: <span class="nbdist-stepping-cost" data-points="{points:.4f}">'
            f"{100 * points:.0f} points</span> of the bubble, in the gaps at each tick's call")
    if full_speed is not None and full_speed.makespan > 0:
        full_compute = median_compute(full_speed)
        slower = median_compute(stepped) / full_compute if full_compute else 0.0
        said += (f"; at full speed the last step's bubble was {_pct(full_speed.bubble_fraction)}"
                 + (f", its actions {slower:.1f}x faster (a tick's call starts cold)" if slower > 1.05 else ""))
    return said


def _rank_rows(measured: Timeline, ideal: Timeline, tick_state) -> list[str]:
    """One row per measured rank; the activations it holds and the ideal's peak are its pipeline rank's (with data
    parallelism every replica's pipeline rank r runs the same actions)."""
    busy = measured.busy_fraction if measured.makespan > 0 else {}
    pipeline_rank = {rank: i for ranks in measured.pipelines for i, rank in enumerate(ranks)}
    rows = []
    for rank in sorted(measured.spans) or sorted(ideal.spans):
        share, p = busy.get(rank), pipeline_rank.get(rank, rank)
        held = tick_state.activations.get(p) if tick_state is not None else None
        rows.append(
            f"<tr><td>rank {rank}</td><td>{_pct(share, 0)}</td><td>{_pct(None if share is None else 1 - share, 0)}"
            f"</td><td>{'' if held is None else held}</td><td>{ideal.peak_activations.get(p, '')}</td></tr>"
        )
    return rows


def _pct(value: float | None, digits: int = 1) -> str:
    """'23.5 %'; '' for no value (nothing measured yet)."""
    return "" if value is None else f"{100 * value:.{digits}f} %"
