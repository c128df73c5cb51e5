"""The plan explorer (`plan.widget()`): a sharding plan's settings as controls, its predictions redrawn as they
move. (The cluster-scale planner is nbdist/planner/; this explores one plan on the running cluster.)

Every control change asks the plan for a new one (`Plan.changed`), and every number drawn comes from that plan:
per rank its predicted memory (Plan.ranks / predicted_memory), where each rank sits (the mesh), the model's layers
(Plan.layers), and once the layers are timed on an engine ("Profile on the engines": Plan.profile) the predicted
step (Plan.predicted_step: its simulated pipeline drawn with the one timeline drawing, viz/timeline.py). Nothing
here prices anything. A plan `changed` refuses (dp·pp·tp not the world size, tp not dividing the heads, more
stages than layers, ...) is shown as the refusal's one line in place of the figures, and Apply is disabled. A
plan that needs the engines to redraw (its step time, Profile, Apply) while the cluster is stopped (the lab's last
cell stops it) shows that in one line too, its memory and placement still drawn, Profile and Apply disabled: the
view never freezes on an error that only the kernel's log would see.

New plans are changed from the last profiled plan (`origin`, at first the plan given): Plan.changed keeps layer
times where tp is the same as its own, so moving tp away and back finds the times again.

Pipeline stages are cut by hand (a text box of layers per stage) or balanced by a per-layer size with
nbdist.pipeline_parallel.stages.layer_counts (the min-max cut nbdist.pipeline uses): parameters, profiled time,
or memory. The memory size is the layer's own bytes: its parameters (fp32, its tensor-parallel
slice) and what one micro-batch saves in it for backward; it chooses where to cut, the prediction of the cut is
the plan's.

Displayed, the view is the widget and, as its own output, a static copy (figures, numbers, the layers table) that
an exported notebook shows without widgets and without a network, refreshed on every redraw (see
pipeline_parallel/view.py, whose copy this one follows).
"""
from __future__ import annotations

import html
import re
from typing import Callable

import ipywidgets as widgets

from nbdist.errors import DistError, DistUsageError
from nbdist.pipeline_parallel.stages import layer_counts
from nbdist.sharding.profile import LayerProfile
from nbdist.sharding.shape import micro_batch_size
from nbdist.sharding.step_time import StepTime
from nbdist.units import format_bytes
from nbdist.viz.display import figure_html
from nbdist.viz.plan import layers_html, memory_figure, placement_figure
from nbdist.viz.timeline import makespan_text, timeline_figure
from nbdist.widgets.controls import Controls
from nbdist.widgets.figure import PlotlyFigure
from nbdist.widgets.static_copy import HIDE_STATIC_COPY, STATIC_COPY, WithStaticCopy

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1")
ZERO_CHOICES = (("0: none", 0), ("1: optimizer state", 1), ("2: + gradients", 2), ("3: + parameters", 3))
OPTIMIZERS = ("adam", "sgd-momentum", "sgd")
BALANCES = (("by parameters", "parameters"), ("by time (profile first)", "time"), ("by memory", "memory"),
            ("by hand", "hand"))
PARAM_BYTES = 4  # fp32, as the plan predicts
CONTROLS = ("dp", "pp", "tp", "zero", "optimizer", "microbatches", "batch", "schedule", "chunks", "balance_by",
            "counts")
STOPPED = ("the cluster is stopped: start it again (cluster.start()) to redraw the step time, profile or apply; "
           "memory and placement need no engines")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layer_sizes(layers: list[LayerProfile], by: str, tp: int, micro_batch: int) -> list[float]:
    """Per layer, what a balanced cut evens out: parameters, profiled seconds (forward + backward), or the layer's
    own bytes (its parameters' tp slice, fp32, plus one micro-batch's saved activations)."""
    if by == "parameters":
        return [layer.params for layer in layers]
    if by == "time":
        if any(layer.forward_s is None for layer in layers):
            raise DistUsageError("balancing by time needs the layers' times: press \"Profile on the engines\" first")
        return [layer.forward_s + layer.backward_s for layer in layers]
    return [sum(t.numel(tp) for t in layer.tensors) * PARAM_BYTES + layer.saved_bytes(tp) * micro_batch
            for layer in layers]


def parse_counts(text: str) -> list[int]:
    """'2, 4' -> [2, 4]: layers per stage as typed; their sum and number are the plan's to check."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise DistUsageError(f"layers per stage: write whole numbers separated by commas (e.g. 3, 3), got {text!r}")
    return [int(p) for p in parts]


class PlanExplorer(Controls, WithStaticCopy):
    """plan.widget(): controls for the plan's settings, its predictions, Profile and Apply.

    `view.plan` is the plan the controls describe (the last possible one while a refusal shows), `view.refusal`
    the refusal's line or None, `view.applied` the model Apply built (`optimizer_fn` is given to Plan.apply)."""

    CONTROLS = CONTROLS
    NAME = "the plan explorer"

    def __init__(self, plan, optimizer_fn: Callable | None = None):
        self.origin = self.plan = plan
        self.optimizer_fn = optimizer_fn
        self.refusal: str | None = None
        self.problem: str | None = None  # why the engines could not answer (the cluster stopped, a rank failed)
        self.applied = None
        self.applied_plan = None
        self.step: StepTime | None = None
        self._overheads: dict[tuple, object] = {}  # a plan's shape -> the library overheads measured for it once
        self._before_profile: tuple[str, float] | None = None  # (plan, predicted step) before the last Profile
        self._note = ""
        self._figures: list = []
        self._static_handle = None
        self._make_controls(plan)
        # side by side where the row is wide enough for both, else one under the other (each figure fits its box)
        self.memory = PlotlyFigure(layout=widgets.Layout(flex="1 1 420px", min_width="320px"))
        self.placement = PlotlyFigure(layout=widgets.Layout(flex="1 1 480px", min_width="320px"))
        self.timeline = PlotlyFigure(layout=widgets.Layout(width="100%"))
        self.status, self.refusal_line, self.layers = widgets.HTML(), widgets.HTML(), widgets.HTML()
        self.widget = widgets.VBox([
            *self._control_rows(), self.status, self.refusal_line,
            widgets.HBox([self.memory, self.placement], layout=widgets.Layout(flex_flow="row wrap", width="100%")),
            self.timeline, self.layers])
        self._draw()

    # -- controls ------------------------------------------------------------------------------------------------

    def _make_controls(self, plan) -> None:
        world, wide = divisors(plan.cluster.world_size), {"description_width": "initial"}
        small = widgets.Layout(width="150px")
        schedule = plan.schedule if isinstance(plan.schedule, str) else plan.schedule.name
        self.dp = widgets.Dropdown(options=world, value=plan.dp, description="dp", layout=small)
        self.pp = widgets.Dropdown(options=world, value=plan.pp, description="pp", layout=small)
        self.tp = widgets.Dropdown(options=world, value=plan.tp, description="tp", layout=small)
        self.zero = widgets.Dropdown(options=ZERO_CHOICES, value=plan.zero, description="ZeRO", style=wide)
        self.optimizer = widgets.Dropdown(options=list(dict.fromkeys([*OPTIMIZERS, plan.optimizer_kind])),
                                          value=plan.optimizer_kind, description="optimizer", style=wide)
        self.microbatches = widgets.IntText(value=plan.microbatches, description="micro-batches", style=wide,
                                            layout=widgets.Layout(width="180px"))
        self.batch = widgets.IntText(value=plan.batch, description="global batch", style=wide,
                                     layout=widgets.Layout(width="180px"))
        self.schedule = widgets.Dropdown(options=list(dict.fromkeys([*SCHEDULES, schedule])), value=schedule,
                                         description="schedule", style=wide)
        self.chunks = widgets.IntText(value=plan.chunks, description="chunks", layout=small)
        self.balance_by = widgets.Dropdown(options=BALANCES, value="hand" if plan.balance else "parameters",
                                           description="stages", style=wide)
        self.counts = widgets.Text(value=_counts_text(plan), description="layers per stage", style=wide,
                                   continuous_update=False, placeholder="e.g. 3, 3")
        for control in self._controls():
            control.observe(self._on_change, names="value")
        self.profile_button = widgets.Button(description="Profile on the engines", icon="clock-o",
                                             layout=widgets.Layout(width="auto"),
                                             tooltip="time every layer's forward and backward on rank 0")
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="check",
                                           tooltip="build this plan on the cluster (view.applied)")
        self.profile_button.on_click(lambda _: self._safely(self.profile))
        self.apply_button.on_click(lambda _: self._safely(self.apply))

    def _controls(self) -> list[widgets.ValueWidget]:
        return [getattr(self, name) for name in CONTROLS]

    def _control_rows(self) -> list[widgets.HBox]:
        return [widgets.HBox([self.dp, self.pp, self.tp, self.zero, self.optimizer]),
                widgets.HBox([self.microbatches, self.batch, self.schedule, self.chunks]),
                widgets.HBox([self.balance_by, self.counts]),
                widgets.HBox([self.profile_button, self.apply_button])]

    def _chosen(self, values: dict) -> None:
        if "schedule" in values and "chunks" not in values:
            self._chunks_for_schedule()

    def _on_change(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] is self.schedule:
            with self.quietly():
                self._chunks_for_schedule()
        self._safely(self._replan)  # a control's handler: its failure is shown in the view, not in the kernel's log

    def _chunks_for_schedule(self) -> None:
        """Interleaving needs two chunks or more per rank, the other schedules one: the chunks follow the choice."""
        self.chunks.value = max(2, self.chunks.value) if self.schedule.value == "interleaved-1f1b" else 1

    def _settings(self) -> dict:
        """The controls as Plan.changed's settings; the stage cut worked out here (by hand or balanced)."""
        pp = self.pp.value
        settings = dict(dp=self.dp.value, pp=pp, tp=self.tp.value, zero=self.zero.value,
                        optimizer=self.optimizer.value, microbatches=self.microbatches.value, batch=self.batch.value,
                        schedule=self.schedule.value, chunks=self.chunks.value if pp > 1 else 1, balance=None)
        if pp > 1:
            settings["balance"] = self._balance(settings)
        return settings

    def _balance(self, s: dict) -> list[int] | None:
        if self.balance_by.value == "hand" and self.counts.value.strip():
            return parse_counts(self.counts.value)
        if s["pp"] * s["chunks"] > len(self.origin.layers):
            return None  # no cut exists: the plan refuses it, in its own words
        micro = micro_batch_size(s["batch"], s["dp"], s["microbatches"])
        by = "parameters" if self.balance_by.value == "hand" else self.balance_by.value
        counts = layer_counts(layer_sizes(self.origin.layers, by, s["tp"], micro), s["pp"] * s["chunks"])
        if self.balance_by.value == "hand":  # an empty box (pp was 1): start the hand cut from the balanced one
            with self.quietly():
                self.counts.value = ", ".join(map(str, counts))
        return counts

    # -- planning -------------------------------------------------------------------------------------------------

    def _replan(self) -> None:
        try:
            plan = self.origin.changed(**self._settings())
        except DistUsageError as e:
            self.refusal = str(e)
        else:
            self.plan, self.refusal = plan, None
        self._draw()

    def profile(self) -> "PlanExplorer":
        """Time the layers on rank 0 (Plan.profile); later plans reuse the times (see the module docstring)."""
        self._note = ""
        self._before_profile = (self.plan.describe(), self.step.total_s) if self.step is not None else None
        self._overheads = {}  # measured afresh with the layers: every later plan predicts from this profile
        self.origin = self.plan.profile()
        self._replan()
        return self

    def apply(self):
        """Build the plan on the cluster (Plan.apply with this view's optimizer_fn), kept as `view.applied`; a
        model this view applied before is closed first, so the engines hold one."""
        if self.refusal is not None:
            raise DistUsageError(f"this plan cannot be applied: {self.refusal}")
        closed = ""
        if self.applied is not None:
            self.applied.close()
            closed = " (the model applied before was closed)"
        self.applied, self.applied_plan = None, None  # a failed build leaves no closed model as view.applied
        self.applied = self.plan.apply(self.optimizer_fn)
        self.applied_plan = self.plan
        self._note = f"applied: {self.plan.describe()} — the model is view.applied{closed}"
        self._draw()
        return self.applied

    def _safely(self, action: Callable) -> None:
        """A button's action: its one-line failure is shown in the view (a callback's exception would go to the
        log, where no one looks)."""
        buttons = (self.profile_button, self.apply_button)
        for b in buttons:
            b.disabled = True
        try:
            action()
        except (DistUsageError, DistError) as e:
            self._note = _engines_problem(self.plan, e)
        except Exception as e:  # noqa: BLE001 - a callback's error would otherwise reach only the kernel's log
            self._note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            self._draw()

    # -- drawing --------------------------------------------------------------------------------------------------

    def _draw(self) -> None:
        plan, refused = self.plan, self.refusal is not None
        self.chunks.disabled = self.schedule.disabled = self.balance_by.disabled = self.pp.value == 1
        self.counts.disabled = self.pp.value == 1 or self.balance_by.value != "hand"
        self.counts.placeholder = "all layers on every rank" if self.pp.value == 1 else "e.g. 3, 3"
        if self.counts.disabled and not refused:
            with self.quietly():
                self.counts.value = _counts_text(plan)
        self.step, self.problem = None, None
        if not refused:
            self.step, self.problem = self._step_or_problem(plan)
        running = plan.cluster.running
        if not running and not refused:
            self.problem = self.problem or STOPPED
        if not running and self._note.startswith("applied:"):
            self._note = ""  # the applied model went with the cluster
        self.apply_button.disabled = refused or not running
        self.profile_button.disabled = not running
        line = self.refusal or self.problem
        self.refusal_line.value = (f'<p class="nbdist-refusal" style="color:#B00020">{html.escape(line)}</p>'
                                   if line else "")
        self._figures = [] if refused else self._plan_figures(plan)
        for view, figure in zip((self.memory, self.placement, self.timeline), [*self._figures, None, None, None]):
            view.layout.display = "none" if figure is None else None
            if figure is None:
                view.figure = {}  # a hidden figure holds nothing: the saved widget state shows what the copy shows
            else:
                view.show(figure)
        self.layers.value = layers_html(_layer_rows(plan))
        self.status.value = HIDE_STATIC_COPY + self._status_html()
        self._update_static()

    def _plan_figures(self, plan) -> list:
        rows = plan.ranks()
        mesh = plan.layout.mesh()
        placement = placement_figure(mesh, {r["rank"]: _holds(plan, r) for r in rows},
                                     title=f"ranks: pp={plan.pp} × dp={plan.dp} × tp={plan.tp}, colour: replica")
        placement.update_layout(width=None)  # as wide as its share of the row
        figures = [memory_figure(rows), placement]
        if self.step is not None:
            timeline = self.step.pipeline
            figures.append(timeline_figure(
                timeline, title=f"predicted pipeline: {makespan_text(timeline)}, bubble "
                                f"{timeline.bubble_fraction:.1%}",
                subtitle="the schedule simulated with the profiled layer times, stretched where ranks share cores"))
        return figures

    def _status_html(self) -> str:
        plan = self.plan
        lines = [f'<b class="nbdist-plan-describe">{html.escape(plan.describe())}</b>'
                 + (" <i>(the last possible plan)</i>" if self.refusal else "")]
        if self.step is not None:
            s = self.step
            lines.append(
                f'<span class="nbdist-plan-step" data-total-s="{s.total_s:.6g}" data-bubble="{s.bubble_fraction:.4f}">'
                f"predicted step {_ms(s.total_s)}: pipeline {_ms(s.makespan_s)} (bubble {s.bubble_fraction:.1%}) + "
                f"data-parallel sync {_ms(max(s.dp_sync_s))}</span>")
        elif self.problem is not None:
            lines.append("step time: not predicted (see the line below)")
        elif self.refusal is None:
            lines.append("step time: not predicted yet: press <i>Profile on the engines</i> (times every layer on "
                         "rank 0)")
        before = self._before_profile
        if before is not None and self.step is not None and before[0] == plan.describe():
            lines.append(f'<span class="nbdist-plan-noise">{html.escape(noise_note(before[1], self.step.total_s))}'
                         "</span>")
        if self._note:
            lines.append(f'<span class="nbdist-plan-note">{html.escape(self._note)}</span>')
        return '<div class="nbdist-plan-explorer">' + "<br>".join(lines) + "</div>"

    def _predicted_step(self, plan) -> StepTime | None:
        """The plan's predicted step once its layers are timed (never profiles: that is the button's to do). The
        layer times are the last profile's, and the libraries' overheads of a plan's shape are measured once and
        kept: an unchanged plan predicts the same step at every redraw (measuring again on each one moved it by 10
        to 20 %, more than the differences between optimizers or ZeRO stages that the view is there to show)."""
        if any(layer.forward_s is None for layer in plan.layers):
            return None
        if plan.overheads is None:  # a new (tp, ZeRO, optimizer, mesh): its overheads only, not the layers again
            key = (plan.dp, plan.pp, plan.tp, plan.zero, plan.optimizer_kind,
                   micro_batch_size(plan.batch, plan.dp, plan.microbatches))
            if key not in self._overheads:
                plan.links = plan._measure_links()  # the overheads are net of the links' prices
                self._overheads[key] = plan._measure_overheads()
            plan.overheads = self._overheads[key]
        return plan.predicted_step()  # its pipeline Timeline is in seconds: the drawing shows ms

    def _step_or_problem(self, plan) -> tuple[StepTime | None, str | None]:
        """(the predicted step, None), or (None, why the engines could not give it): a plan changed from a profiled
        one may need the engines again (a new tp times its overheads), and a stopped cluster must say so."""
        try:
            return self._predicted_step(plan), None
        except (DistUsageError, DistError) as e:
            return None, _engines_problem(plan, e)

    # -- display --------------------------------------------------------------------------------------------------

    def static_html(self) -> str:
        """The numbers, the refusal or the figures, and the layers, as HTML that needs no widgets and no network."""
        figures = "".join(figure_html(figure, loader=False) for figure in self._figures)
        return (f'<div class="{STATIC_COPY}">{self._status_html()}{self.refusal_line.value}{figures}'
                f"{self.layers.value}</div>")

    def _static_text(self) -> str:
        return f"refused: {self.refusal}" if self.refusal else "\n".join(self.plan.table())

    def __repr__(self) -> str:
        return f"<PlanExplorer of {self.plan.describe()}>"




def _engines_problem(plan, error: Exception) -> str:
    """The one line the view shows when the engines could not answer: a stopped cluster said as such, else the
    error itself."""
    return STOPPED if not plan.cluster.running else f"{type(error).__name__}: {error}"


def noise_note(before_s: float, after_s: float) -> str:
    """What profiling the same plan again did to its prediction: the size of the profile's own noise, which a
    difference between two plans must exceed to mean anything."""
    change = (after_s - before_s) / before_s
    return (f"profiled again: this plan's predicted step moved {change:+.1%} ({_ms(before_s)} -> {_ms(after_s)}), the "
            "profile's own noise: two plans that differ by less than that are not told apart")


def _counts_text(plan) -> str:
    if plan.boundaries is None:
        return ""  # the box's placeholder says "all layers on every rank"; a typed cut starts from an empty box
    return ", ".join(str(b - a) for a, b in plan.boundaries)


def _holds(plan, row: dict) -> list[str]:
    """A rank's cell in the placement figure: its layers, its tensor slice, its predicted memory."""
    lines = [f"layers {row['layers']}"]
    if plan.tp > 1:
        lines.append(f"tensor slice {row['tp'] + 1} of {plan.tp}")
    return lines + [format_bytes(row["memory"].total)]


def _layer_rows(plan) -> list[dict]:
    """One row per layer for viz.plan.layers_html: its profile at this plan's tp, its stage, its times per
    micro-batch (the profile's seconds per sample x the plan's micro-batch size)."""
    size = micro_batch_size(plan.batch, plan.dp, plan.microbatches)
    stage_of = {i: s for s, (a, b) in enumerate(plan.boundaries or []) for i in range(a, b)}
    rows = []
    for i, layer in enumerate(plan.layers):
        stage = stage_of.get(i)
        rows.append({
            "layer": layer.name, "kind": layer.kind, "stage": stage,
            "pp rank": None if stage is None else stage % plan.pp, "parameters": layer.params,
            "activations / sample": layer.saved_bytes(plan.tp),
            "forward ms": None if layer.forward_s is None else layer.forward_s * size * 1e3,
            "backward ms": None if layer.backward_s is None else layer.backward_s * size * 1e3,
        })
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
