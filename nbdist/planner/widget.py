"""The cluster planner (`nbdist.planner.widget()`): a model and a cluster picked, a plan's t, p, d, v, b, ZeRO stage
and recomputation on sliders; the per-GPU memory bar and the step-time breakdown redrawn as they move.

Every number drawn comes from `nbdist.planner.predict` (nothing here prices anything). A plan `predict` refuses
(tp not dividing the heads, more stages than layers, a batch that does not split, ...) shows its one line in
place of the figures; a plan that does not fit in memory still shows its bars, with the reason in red beside
them. Displayed, the view is the widget and, as its own output, a static copy (numbers and figures) that an
exported notebook shows without widgets and without a network (widgets/static_copy.py).
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from nbdist.errors import DistUsageError
from nbdist.planner import PROFILES, Prediction, gpt, hardware, predict
from nbdist.planner.model import GPT, RECOMPUTE, llama
from nbdist.units import format_bytes, format_count, format_duration
from nbdist.viz.cluster_plan import memory_bar_figure, time_breakdown_figure
from nbdist.viz.display import figure_html
from nbdist.widgets.controls import Controls
from nbdist.widgets.figure import PlotlyFigure
from nbdist.widgets.static_copy import HIDE_STATIC_COPY, STATIC_COPY, WithStaticCopy

MODELS: dict[str, GPT] = {  # Megatron-LM's Table 1 sizes (arXiv 2104.04473), GPT-3 175B (arXiv 2005.14165), Llama 3
    "GPT 1.7 B (24 layers, 2304)": gpt(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200),
    "GPT 18.4 B (40 layers, 6144)": gpt(layers=40, hidden=6144, heads=48, seq=2048, vocab=51200),
    "GPT 145.6 B (80 layers, 12288)": gpt(layers=80, hidden=12288, heads=96, seq=2048, vocab=51200),
    "GPT-3 175 B (96 layers, 12288)": gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
    "GPT 529.6 B (105 layers, 20480)": gpt(layers=105, hidden=20480, heads=128, seq=2048, vocab=51200),
    "GPT 1 T (128 layers, 25600)": gpt(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200),
    "Llama 3 8 B (32 layers, 4096, GQA 8)": llama(32, 4096, 32, 8, 14336),
    "Llama 3 70 B (80 layers, 8192, GQA 8)": llama(80, 8192, 64, 8, 28672),
}
SLIDER_WIDTH, SLIDER_MIN = "320px", "260px"  # a slider keeps its label, track and value readable
CONTROLS = ("model", "hardware", "tp", "cp", "pp", "dp", "chunks", "microbatch", "global_batch", "zero", "recompute",
            "sequence_parallel", "flash_attention")


class ClusterPlannerView(Controls, WithStaticCopy):
    """`view.prediction`: the plan the controls describe (None while a refusal shows); `view.refusal`: the
    refusal's line or None; `view.reason`: why a predicted plan does not fit, or None."""

    CONTROLS = CONTROLS
    NAME = "the cluster planner"

    def __init__(self, model: str | GPT = "GPT 145.6 B (80 layers, 12288)", hw: str = "a100-80gb", tp: int = 8,
                 pp: int = 8, dp: int = 24, chunks: int = 2, microbatch: int = 1, global_batch: int = 2304,
                 zero: int = 0, recompute: str = "full", sequence_parallel: bool = False,
                 flash_attention: bool = False, cp: int = 1):
        self.models = dict(MODELS)
        if isinstance(model, GPT):
            self.models[model.name or "your model"] = model
            model = model.name or "your model"
        self.prediction: Prediction | None = None
        self.refusal: str | None = None
        self._figures: list = []
        self._make_controls(model, hw, tp, pp, dp, chunks, microbatch, global_batch, zero, recompute,
                            sequence_parallel, flash_attention, cp)
        self.memory, self.time = PlotlyFigure(), PlotlyFigure()
        self.status, self.refusal_line = widgets.HTML(), widgets.HTML()
        self.widget = widgets.VBox([*self._rows(), self.status, self.refusal_line, self.memory, self.time])
        self._replan()

    # -- controls ------------------------------------------------------------------------------------------------

    def _make_controls(self, model, hw, tp, pp, dp, chunks, microbatch, global_batch, zero, recompute, sp, flash,
                       cp):
        wide = {"description_width": "initial"}
        self.model = widgets.Dropdown(options=list(self.models), value=model, description="model", style=wide)
        self.hardware = widgets.Dropdown(options=[*PROFILES, "local"], value=hw, description="GPU", style=wide)
        self.tp = widgets.IntSlider(value=tp, min=1, max=16, description="t (tensor)", style=wide)
        self.cp = widgets.IntSlider(value=cp, min=1, max=32, description="c (context)", style=wide)
        self.pp = widgets.IntSlider(value=pp, min=1, max=128, description="p (pipeline)", style=wide)
        self.dp = widgets.IntSlider(value=dp, min=1, max=1024, description="d (data)", style=wide)
        self.chunks = widgets.IntSlider(value=chunks, min=1, max=8, description="v (chunks)", style=wide)
        self.microbatch = widgets.IntSlider(value=microbatch, min=1, max=16, description="b (micro-batch)",
                                            style=wide)
        self.global_batch = widgets.IntText(value=global_batch, description="global batch B", style=wide,
                                            layout=widgets.Layout(width="220px"))
        self.zero = widgets.Dropdown(options=[0, 1, 2, 3], value=zero, description="ZeRO", style=wide,
                                     layout=widgets.Layout(width="130px"))
        self.recompute = widgets.Dropdown(options=list(RECOMPUTE), value=recompute, description="recompute",
                                          style=wide, layout=widgets.Layout(width="200px"))
        self.sequence_parallel = widgets.Checkbox(value=sp, description="sequence parallel")
        self.flash_attention = widgets.Checkbox(value=flash, description="FlashAttention")
        for name in CONTROLS:
            getattr(self, name).observe(self._on_change, names="value")

    def _rows(self) -> list[widgets.HBox]:
        """Rows that wrap: in a narrow notebook (JupyterLab at 1000 px with the file browser open) a control that
        does not fit moves to the next line instead of being cut off, and no slider shrinks below SLIDER_MIN."""
        for slider in (self.tp, self.pp, self.dp, self.cp, self.chunks, self.microbatch):
            slider.layout = widgets.Layout(width=SLIDER_WIDTH, min_width=SLIDER_MIN)
        for control in (self.model, self.hardware, self.global_batch, self.zero, self.recompute,
                        self.sequence_parallel, self.flash_attention):
            control.layout.flex = "0 0 auto"  # its own width, never squeezed
        rows = ([self.model, self.hardware, self.global_batch], [self.tp, self.pp, self.dp],
                [self.cp, self.chunks, self.microbatch],
                [self.zero, self.recompute, self.sequence_parallel, self.flash_attention])
        return [widgets.HBox(row, layout=widgets.Layout(flex_flow="row wrap", width="100%")) for row in rows]

    def _on_change(self, _change) -> None:
        if not self._quiet:
            self._replan()

    # -- planning and drawing ------------------------------------------------------------------------------------

    @property
    def gpus(self) -> int:
        return self.tp.value * self.cp.value * self.pp.value * self.dp.value

    def _replan(self) -> None:
        try:
            self.prediction = predict(
                self.models[self.model.value], hardware(self.hardware.value), gpus=self.gpus, tp=self.tp.value,
                pp=self.pp.value, global_batch=self.global_batch.value, microbatch=self.microbatch.value,
                chunks=self.chunks.value, zero=self.zero.value, recompute=self.recompute.value,
                sequence_parallel=self.sequence_parallel.value, flash_attention=self.flash_attention.value,
                cp=self.cp.value)
        except DistUsageError as e:
            self.prediction, self.refusal = None, str(e)
        else:
            self.refusal = None
        self._draw()

    @property
    def reason(self) -> str | None:
        return self.prediction.reason if self.prediction is not None else None

    def _draw(self) -> None:
        p = self.prediction
        problem = self.refusal or self.reason
        self.refusal_line.value = (f'<p class="nbdist-refusal" style="color:#B00020">'
                                   f"{html.escape(self.setting())}: {html.escape(problem)}</p>" if problem else "")
        self._figures = [] if p is None else [
            memory_bar_figure(p.breakdown["memory"], p.hardware.memory_bytes),
            time_breakdown_figure(p.breakdown["time"], title=f"step {format_duration(p.step_seconds)}, bubble "
                                                             f"{p.pipeline.bubble_fraction:.1%}")]
        for view, figure in zip((self.memory, self.time), self._figures or [None, None]):
            view.layout.display = "none" if figure is None else None
            if figure is None:
                view.figure = {}
            else:
                view.show(figure)
        self.status.value = HIDE_STATIC_COPY + self._status_html()
        self._update_static()

    def setting(self) -> str:
        """What a refusal refuses, beyond the plan's numbers: the model, the GPU and the ZeRO stage (an exported
        refusal line must say them: the controls are not in the export)."""
        return f"{self.model.value} on {self.hardware.value}, ZeRO {self.zero.value}"

    def _status_html(self) -> str:
        p = self.prediction
        context = f" × c {self.cp.value}" if self.cp.value > 1 else ""
        head = (f"{format_count(self.gpus, 'GPU')} = t {self.tp.value}{context} × p {self.pp.value} × "
                f"d {self.dp.value}")
        if p is None:
            return f'<div class="nbdist-cluster-planner"><b>{head}</b>: refused</div>'
        return (f'<div class="nbdist-cluster-planner" data-step-s="{p.step_seconds:.6g}" '
                f'data-memory="{p.memory_per_gpu:.6g}"><b>{head}</b>: step {format_duration(p.step_seconds)}, '
                f"{p.tokens_per_second:,.0f} tokens/s, {p.tflops_per_gpu:,.1f} TFLOP/s per GPU, MFU {p.mfu:.1%}, "
                f"{format_bytes(p.memory_per_gpu)} per GPU ({'fits' if p.fits else 'does not fit'})</div>")

    # -- display -------------------------------------------------------------------------------------------------

    def static_html(self) -> str:
        figures = "".join(figure_html(figure, loader=False) for figure in self._figures)
        return f'<div class="{STATIC_COPY}">{self._status_html()}{self.refusal_line.value}{figures}</div>'

    def _static_text(self) -> str:
        return f"refused: {self.setting()}: {self.refusal}" if self.refusal else str(self.prediction)

    def __repr__(self) -> str:
        what = self.refusal or (self.prediction.describe() if self.prediction else "")
        return f"<ClusterPlannerView {what}>"
