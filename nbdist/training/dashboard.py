"""The Trainer's live dashboard (kernel side): a progress bar and one figure (viz/training.py) redrawn from what
the ranks publish while they train, at least once a second; headless, the final figure as a static copy and a
text summary."""
from __future__ import annotations

import json
import time

import ipywidgets as widgets

from nbdist.viz.display import figure_html
from nbdist.widgets.figure import PlotlyFigure
from nbdist.widgets.static_copy import HIDE_STATIC_COPY, STATIC_COPY, WithStaticCopy

REDRAW_SECONDS = 0.5
_TEMPLATES: dict[tuple, dict] = {}  # figure shape (viz/training.shape_of) -> its plotly JSON, built once


class Dashboard(WithStaticCopy):
    def __init__(self, trainer, steps: int):
        from nbdist.training.history import History

        self.trainer, self.first, self.steps = trainer, trainer.step, steps
        self.live = History()
        self.live.by_step = dict(trainer.history.by_step)
        self.telemetry: dict[int, dict] = {}
        self.bar = widgets.IntProgress(min=0, max=steps, value=0, description="training")
        self.label = widgets.HTML(HIDE_STATIC_COPY)  # the live widget hides its static copy (below it)
        self.plot = PlotlyFigure()
        self.steps_explained = trainer.pipeline_steps  # pipeline plans: each step's bubbles, drawn below
        self.bubble_plot = PlotlyFigure() if self.steps_explained is not None else None
        self.bubbles_shown: int | None = None  # the step the bubble figure shows
        self.widget = widgets.VBox([widgets.HBox([self.bar, self.label]), self.plot,
                                    *([self.bubble_plot] if self.bubble_plot is not None else [])])
        self.last_draw = 0.0
        self.redraws = 0

    @classmethod
    def open(cls, trainer, steps: int, shown: bool = True) -> "Dashboard":
        """A dashboard, shown in the notebook when `shown` (training/live.py says where it can be); else one that
        draws without being shown (what a benchmark of its cost needs)."""
        view = cls(trainer, steps)
        return view.show() if shown else view

    def progress(self, ar) -> None:
        """Called by the cluster's wait about twice a second: merge what the ranks published, redraw."""
        for published in ar.data:
            if isinstance(published, dict) and published.get("trainer") == self.trainer.id:
                self.live.add(published["records"])
                sample = {k: v for k, v in published.items() if k.endswith(("_percent", "_bytes")) and v is not None}
                if sample:  # a publication without a sample keeps the rank's latest one
                    self.telemetry[published["rank"]] = sample
                if self.steps_explained is not None:
                    self.steps_explained.add(published["rank"], published.get("pipeline_step"))
        if time.monotonic() - self.last_draw >= REDRAW_SECONDS:
            self._draw()

    def _draw(self) -> None:
        self.last_draw = time.monotonic()
        self.redraws += 1
        done = self.live.step - self.first
        self.bar.value = max(0, min(done, self.steps))
        rows = [r for r in self.live.records if r["loss"] is not None]
        if rows:
            rate = self.live.throughput(last=20)
            tokens = rows[-1].get("tokens", 0) / rows[-1]["samples"]
            self.label.value = HIDE_STATIC_COPY + (
                f"step {rows[-1]['step']} &nbsp; loss {rows[-1]['loss']:.4f} &nbsp; {rate:.1f} samples/s"
                + (f" &nbsp; {rate * tokens:,.0f} tokens/s" if tokens else ""))
        self.plot.figure = self.figure_json()
        if self.redraws == 2:  # the page has had half a second to make the view's model: it hears a push now
            self.plot.push_plotly()
        self._draw_bubbles()

    def _draw_bubbles(self) -> None:
        """The newest pipeline step every rank has reported, its idle time by cause (once per new step)."""
        step = self.steps_explained.newest() if self.steps_explained is not None else None
        if step is None or step == self.bubbles_shown:
            return
        self.bubbles_shown = step
        self.bubble_plot.show(self.bubble_figure(step))

    def bubble_figure(self, step: int | None = None):
        """The bubble breakdown of a pipeline step as a plotly Figure (debugging/bubbles.py)."""
        step = self.steps_explained.newest() if step is None else step
        breakdown = self.steps_explained.breakdown(step)
        return breakdown.figure(title=f"Idle time by cause, training step {step} ({breakdown.step * 1e3:.1f} ms)")

    def figure_json(self) -> dict:
        """The figure as plotly JSON: the traces and layout of a figure of this shape (built once per kernel and
        kept: building one is slow; figures: benchmarks/README.md) with this run's values and title."""
        from nbdist.viz.training import shape_of, trace_values, utilisation_axes, utilisation_note  # at first draw

        shape = shape_of(self.live.records, self.telemetry)
        template = _TEMPLATES.get(shape)
        if template is None:
            template = _TEMPLATES[shape] = json.loads(self.figure().to_json())
        data = [{**trace, **values} for trace, values in
                zip(template["data"], trace_values(self.live.records, self.telemetry))]
        layout = template["layout"]
        notes = [a for a in layout.get("annotations", []) if a.get("name") != "no-telemetry"]
        axes = {name: {**layout.get(name, {}), **patch} for name, patch in utilisation_axes(self.telemetry).items()}
        return {"data": data, "layout": {
            **layout, **axes, "annotations": notes + utilisation_note(self.telemetry),
            "title": {**layout.get("title", {}), "text": self._title(), "subtitle": {"text": self.trainer.describe()}}}}

    def figure(self):
        """The figure as a plotly Figure (what a test or a person may inspect)."""
        from nbdist.viz.training import training_figure

        return training_figure(self.live.records, self.telemetry, title=self._title(), subtitle=self.trainer.describe())

    def _title(self) -> str:
        """The trainer and the newest step the figure draws: the same step the progress line names (the trainer's
        own count lags while a fit runs, and counts steps done, one more than the last step's number). Short: the
        plan goes in the subtitle, so the title fits a narrow figure."""
        rows = [r for r in self.live.records if r["loss"] is not None]
        return f"Trainer {self.trainer.id}: step {rows[-1]['step']}" if rows else f"Trainer {self.trainer.id}"


    def close(self, history, summary: bool = True) -> None:
        """The run's end: draw the whole history, update the static copy, print the text summary (not from a
        background run: its print would land in whichever cell runs then)."""
        self.live.by_step = dict(history.by_step)
        self.live.step = history.step
        self._draw()
        self._update_static()
        if summary:
            print(history.summary())

    def static_html(self) -> str:
        bubbles = self.bubble_plot.figure if self.bubbles_shown is not None else None
        figures = figure_html(self.figure_json(), loader=False)
        figures += figure_html(bubbles, loader=False) if bubbles else ""
        return f'<div class="{STATIC_COPY}">{figures}</div>'

    def _static_bundle(self) -> dict:
        """The figure's static copy; before the first redraw in a kernel that has drawn no training figure yet (plotly
        and the figure's template are slow to load and build the first time; figures: benchmarks/README.md), an
        empty one: the fit is sent to the ranks before that work, and the fit's end replaces the copy with the whole
        figure (what an export keeps)."""
        if self.redraws or _TEMPLATES:
            return super()._static_bundle()
        empty = figure_html({"data": [], "layout": {}}, loader=False)
        return {"text/html": f'<div class="{STATIC_COPY}">{empty}</div>', "text/plain": self._static_text()}

    def _static_text(self) -> str:
        return self.trainer.history.summary()
