"""The live views' figures read as a person reads them, checked on their data (no browser): binary units with
binary labels, no e-notation, a step's time rather than a sum of steps, one colour per step term, an empty panel
that says why. The browser trials (tests/test_browser.py) check the same figures drawn in JupyterLab."""
from __future__ import annotations

import re

from nbdist.planner import hardware, predict
from nbdist.planner.widget import MODELS, ClusterPlannerView
from nbdist.units import binary_ticks, format_bytes, format_seconds
from nbdist.viz.cluster_plan import frontier_figure, memory_bar_figure, time_breakdown_figure
from nbdist.viz.training import NO_SAMPLE, training_figure

E_NOTATION = re.compile(r"\d[eE][+-]\d")
MODEL = "GPT 145.6 B (80 layers, 12288)"


def test_format_bytes_keeps_its_outputs_and_never_writes_e_notation():
    assert [format_bytes(b) for b in (1024, 4194304, 1000, 1536)] == ["1 KiB", "4 MiB", "1000 B", "1.5 KiB"]
    assert format_bytes(1034000) == f"{1034000 / 1024:,.0f} KiB"  # was "1.01e+03 KiB"
    assert format_bytes(1020 * 2**30) == "1,020 GiB"


def test_format_seconds_picks_the_unit_a_person_reads():
    assert format_seconds(6.036e4) == f"{6.036e4 / 3600:.3g} h"  # was "6.036e+04 s"
    assert format_seconds(0.05) == "50 ms" and format_seconds(9.47) == "9.47 s"


def test_binary_ticks_put_the_capacity_on_a_labelled_tick():
    values, labels = binary_ticks(80 * 2**30 * 1.05)
    assert dict(zip(labels, values))["80 GiB"] == 80 * 2**30
    assert all(label.endswith(("B", "KiB", "MiB", "GiB")) for label in labels)


def test_cluster_figures_use_binary_labels_and_no_e_notation():
    p = predict(MODELS[MODEL], hardware("a100-80gb"), gpus=1536, tp=8, pp=8, global_batch=2304)
    memory = memory_bar_figure(p.breakdown["memory"], p.hardware.memory_bytes)
    assert "80 GiB" in memory.layout.xaxis.ticktext and memory.layout.xaxis.title.text is None
    timing = time_breakdown_figure({"matmul": 6.036e4, "optimizer": 30.0})
    texts = [timing.layout.title.text, *timing.layout.xaxis.ticktext, *(t.hovertext[0] for t in timing.data)]
    assert not [t for t in texts if E_NOTATION.search(t)], texts
    points = [{"memory": m * 2**30, "tokens_per_second": m * 1e3, "fits": m < 80, "plan": str(m)}
              for m in (60, 70, 80, 90)]
    ticks = frontier_figure(points, 80 * 2**30).layout.xaxis.ticktext
    assert ticks and all(t.endswith("GiB") for t in ticks), ticks  # not "60G70G80G90G"


def test_each_step_term_keeps_its_colour_when_another_term_appears():
    without = time_breakdown_figure({"matmul": 1.0, "optimizer": 0.1})
    with_more = time_breakdown_figure({"matmul": 1.0, "recomputation": 0.3, "optimizer": 0.1})
    colour = {fig_trace.name: fig_trace.marker.color for fig_trace in without.data}
    assert all(colour[t.name] == t.marker.color for t in with_more.data if t.name in colour)


def test_a_refusal_names_the_model_gpu_and_zero_it_refuses():
    view = ClusterPlannerView(tp=5, dp=24)  # 96 heads: tp 5 is refused
    assert view.refusal is not None
    assert view._static_text() == f"refused: {MODEL} on a100-80gb, ZeRO 0: {view.refusal}"


def _records(steps: int, step_s: float) -> list[dict]:
    split = {"compute_s": step_s / 2, "comm_s": step_s / 4, "idle_s": step_s / 4}
    return [{"step": i, "loss": 1.0, "samples": 32, "seconds": step_s, "ranks": {0: split, 1: split}}
            for i in range(steps)]


def test_training_split_is_one_step_in_ms_not_a_sum_of_steps():
    fig = training_figure(_records(30, 0.05))
    bars = [t for t in fig.data if t.name in ("compute", "communication", "idle")]
    assert abs(sum(bar.y[0] for bar in bars) - 50.0) < 1e-9  # 0.05 s per step: 50 ms; was 20 x 0.05 = 1.0 s


def test_training_memory_axis_is_binary_and_empty_utilisation_says_why():
    telemetry = {0: {"cpu_percent": 90.0, "rss_bytes": 288_465_000}, 1: {"cpu_percent": 80.0, "rss_bytes": 3e8}}
    fig = training_figure(_records(3, 0.05), telemetry)
    assert all(label.endswith(("B", "MiB")) for label in fig.layout.yaxis5.ticktext), fig.layout.yaxis5.ticktext
    empty = training_figure(_records(3, 0.05), {})
    assert NO_SAMPLE in [a.text for a in empty.layout.annotations] and empty.layout.xaxis4.visible is False


def test_training_utilisation_axis_starts_at_zero_and_the_legend_sits_under_the_rank_labels():
    telemetry = {0: {"cpu_percent": 0.0, "rss_bytes": 3e8}, 1: {"cpu_percent": 0.0, "rss_bytes": 3e8}}
    fig = training_figure(_records(3, 0.05), telemetry)
    assert fig.layout.yaxis4.rangemode == "tozero"  # all-zero samples drew a -1..1 "%" axis
    legend = fig.layout.legend  # the figure's foot, not 10 % of the plot below it (over the bars' rank labels)
    assert legend.yref == "container" and legend.y == 0 and legend.yanchor == "bottom"


def test_a_sample_right_after_another_repeats_its_cpu_share_instead_of_reading_zero():
    import time

    import torch

    from nbdist.training.ranks.telemetry import MIN_CPU_INTERVAL, Sampler

    sampler = Sampler(torch.device("cpu"))
    busy_until = time.monotonic() + MIN_CPU_INTERVAL + 0.05
    while time.monotonic() < busy_until:
        pass
    first = sampler.sample()["cpu_percent"]
    again = sampler.sample()["cpu_percent"]  # a stop's forced publication, right after a periodic one
    assert first > 10 and again == first, (first, again)


def test_show_fits_the_width_it_is_given_and_wraps_side_by_side_titles():
    import json

    from plotly.subplots import make_subplots

    from nbdist.viz.display import NARROW_PLOT_PX, TITLE_CHAR_PX, fitted

    titles = ("training loss", "samples / s", "activations saved (MiB) per precision")
    fig = make_subplots(rows=1, cols=3, subplot_titles=titles)
    fig.update_layout(width=900, title="a figure laid out for 900 px, with a title longer than a narrow figure")
    figure = fitted(json.loads(fig.to_json()))
    assert "width" not in figure["layout"] and figure["layout"]["autosize"] is True  # cut at 1000 px before
    notes = figure["layout"]["annotations"]
    assert [n["text"].replace("<br>", " ") for n in notes] == list(titles)  # the same words
    share = fig.layout.xaxis.domain[1] - fig.layout.xaxis.domain[0]
    longest = max(len(line) for n in notes for line in n["text"].split("<br>"))
    assert longest * TITLE_CHAR_PX <= share * NARROW_PLOT_PX, [n["text"] for n in notes]
    assert notes[0]["text"] == "training loss"  # a short title stays on one line
    assert all(len(line) <= 60 for line in figure["layout"]["title"]["text"].split("<br>")), figure["layout"]["title"]
    lines = max(n["text"].count("<br>") for n in notes)
    assert lines and figure["layout"]["margin"]["t"] >= 100 + 20 * lines  # wrapped upwards, under the title
