"""The plan explorer (plan.widget(), nbdist/sharding/explorer.py) on real clusters: what it draws is the plan's own
prediction, always.

The claims: moving a control makes a new plan, and the memory bars drawn are that plan's predicted_memory() for each
rank's pipeline stage; an impossible choice shows the plan's refusal line instead of the figures and disables Apply;
stages cut by parameters, by memory or by time are the min-max cut of those per-layer sizes (checked against every
possible cut), and a cut by hand is the one typed; profiling fills every layer's times and the predicted step; Apply
builds the plan, and its step trains. The figure functions (viz/plan.py) draw given data exactly. Executed headless
and exported to HTML, the notebook shows the view's static copy, drawn offline, in its final state.
"""
from __future__ import annotations

import html
import itertools
import math
import re
import textwrap

import pytest
import torch

import nbdist
from nbdist import data, models
from nbdist.cluster.meshes.mesh import make_mesh
from nbdist.errors import DistUsageError
from nbdist.sharding.explorer import PlanExplorer
from nbdist.sharding.memory import RankMemory
from nbdist.sharding.shape import micro_batch_size
from nbdist.units import format_bytes
from nbdist.viz.plan import LAYER_COLUMNS, MEMORY_PARTS, layers_html, memory_figure, placement_figure

CONFIG = dict(vocab=256, seq=16, layers=4, hidden=32, heads=4)
PARTS = list(MEMORY_PARTS)  # params, grads, optimizer, activations


def model_fn():
    from nbdist import models

    return models.gpt(**CONFIG, seed=0)


def sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.1)


# -- reading the view back ------------------------------------------------------------------------------------------


def drawn_memory(view) -> dict[str, dict[str, int]]:
    """The memory bars as the widget holds them (the figure's JSON): rank label -> part -> bytes."""
    traces = view.memory.figure["data"]
    assert [t["name"] for t in traces] == [MEMORY_PARTS[p][0] for p in PARTS]
    return {label: {part: traces[i]["y"][j] for i, part in enumerate(PARTS)}
            for j, label in enumerate(traces[0]["x"])}


def predicted_memory(plan) -> dict[str, dict[str, int]]:
    """Each rank's bytes as the plan predicts them: its pipeline stage's entry of predicted_memory()."""
    memory = plan.predicted_memory()
    mesh = make_mesh(plan.cluster.world_size, pp=plan.pp, dp=plan.dp, tp=plan.tp)
    return {f"rank {r}": {p: getattr(memory[mesh.coords(r)["pp"]], p) for p in PARTS}
            for r in range(plan.cluster.world_size)}


def stage_sums(plan, sizes: list[float]) -> list[float]:
    return [sum(sizes[a:b]) for a, b in plan.boundaries]


def best_max_stage(sizes: list[float], pieces: int) -> float:
    """The reference for a balanced cut: the smallest largest-stage sum over EVERY cut into non-empty stages."""
    n = len(sizes)
    return min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations(range(1, n), pieces - 1))


def assert_shows(view) -> None:
    """A possible plan: no refusal, the figures drawn from it, Apply enabled."""
    assert view.refusal is None and view.refusal_line.value == ""
    assert not view.apply_button.disabled
    assert view.memory.layout.display is None and view.memory.figure["data"]
    assert drawn_memory(view) == predicted_memory(view.plan)


# -- the figure functions, from given data --------------------------------------------------------------------------


def test_memory_figure_stacks_the_four_parts_of_each_rank():
    rows = [{"rank": 0, "pp": 0, "memory": RankMemory(100, 100, 200, 3000)},
            {"rank": 1, "pp": 1, "memory": {"params": 50, "grads": 50, "optimizer": 0, "activations": 7000}}]
    fig = memory_figure(rows)
    assert fig.layout.barmode == "stack"
    assert [t.type for t in fig.data] == ["bar"] * 4
    assert [t.name for t in fig.data] == ["parameters", "gradients", "optimizer state", "activations"]
    assert all(list(t.x) == ["rank 0", "rank 1"] for t in fig.data)
    assert [list(t.y) for t in fig.data] == [[100, 50], [100, 50], [200, 0], [3000, 7000]]
    assert f"at most {format_bytes(7100)} (rank 1)" in fig.layout.title.text
    assert fig.data[3].hovertext[1] == f"rank 1 · activations: {format_bytes(7000)}<br>pp 1"


@pytest.mark.parametrize("dims", [dict(pp=2, dp=2, tp=1), dict(pp=1, dp=2, tp=2), dict(pp=2, dp=1, tp=2)])
def test_placement_figure_writes_what_each_rank_holds_in_its_own_cell(dims):
    mesh = make_mesh(4, **dims)
    notes = {r: [f"holds {r * 11}", "second line"] for r in range(4)}
    fig = placement_figure(mesh, notes)
    (heatmap,) = fig.data
    cells = [(row, col, text) for row, texts in enumerate(heatmap.text) for col, text in enumerate(texts)]
    assert len(cells) == 4
    for row, col, text in cells:
        rank = int(re.match(r"rank (\d+)<br>", text).group(1))
        coords = mesh.coords(rank)
        assert row == coords["pp"]  # a row per pipeline stage, as viz/mesh.py draws it
        assert text.endswith(f"<br>holds {rank * 11}<br>second line")
        assert heatmap.hovertext[row][col].endswith(f"; holds {rank * 11}; second line")
        assert heatmap.z[row][col] == coords["dp"]  # coloured by replica
    assert sorted(int(re.match(r"rank (\d+)", t).group(1)) for _, _, t in cells) == [0, 1, 2, 3]
    # one colour, one meaning: the explorer draws this beside the memory chart, whose colours are its parts'
    replicas = {colour.upper() for _, colour in heatmap.colorscale}
    assert not replicas & {colour.upper() for _, colour in MEMORY_PARTS.values()}, heatmap.colorscale


def test_layers_table_prints_every_column_and_a_dash_before_the_profile():
    rows = [{"layer": "0", "kind": "Embedding", "stage": None, "pp rank": None, "parameters": 8704,
             "activations / sample": 1536, "forward ms": None, "backward ms": None},
            {"layer": "1", "kind": "Block", "stage": 1, "pp rank": 0, "parameters": 12704,
             "activations / sample": 33280.0, "forward ms": 0.12345, "backward ms": 2.0}]
    table = layers_html(rows)
    assert table.count("<th>") == len(LAYER_COLUMNS) and table.count("<tr>") == 3
    assert ("<td>0</td><td>Embedding</td><td>—</td><td>—</td><td>8,704</td><td>1.5 KiB</td><td>—</td><td>—</td>"
            in table)
    assert ("<td>1</td><td>Block</td><td>1</td><td>0</td><td>12,704</td><td>32.5 KiB</td><td>0.123</td>"
            "<td>2.000</td>" in table)


# -- the view on a real 2-engine cluster ----------------------------------------------------------------------------


def test_a_control_moved_is_a_new_plan_and_the_bars_are_its_prediction(cluster):
    view = PlanExplorer(nbdist.shard(model_fn, dp=2, cluster=cluster))
    assert_shows(view)
    before = drawn_memory(view)
    view.zero.value = 3
    assert (view.plan.dp, view.plan.zero) == (2, 3)
    assert_shows(view)
    assert drawn_memory(view) != before  # ZeRO-3 shards what each rank holds
    view.optimizer.value = "sgd"
    assert view.plan.optimizer_kind == "sgd"
    assert_shows(view)
    assert all(parts["optimizer"] == 0 for parts in drawn_memory(view).values())
    view.choose(dp=1, pp=2, zero=0, microbatches=2)
    assert (view.plan.dp, view.plan.pp, view.plan.schedule.name) == (1, 2, "1f1b")
    assert_shows(view)
    placement = view.placement.figure["data"][0]["text"]  # one row per stage, its layers written in its cell
    assert [row[0].split("<br>")[2] for row in placement] == [f"layers {a}..{b - 1}" for a, b in view.plan.boundaries]
    assert "nbdist-static-copy" in view.static_html() and view.plan.describe() in view.static_html()


def heads_of_three():
    from nbdist import models

    return models.gpt(vocab=256, seq=16, layers=4, hidden=30, heads=3, seed=0)


@pytest.mark.parametrize("model, choice, line", [
    (model_fn, dict(dp=1), "dp × pp × tp = 1 × 1 × 1 = 1, but the cluster has 2 ranks: the product must be the world "
                           "size"),
    (heads_of_three, dict(dp=1, tp=2), "tp=2 does not divide the model's 3 heads"),
    (model_fn, dict(dp=1, pp=2, microbatches=2, schedule="interleaved-1f1b", chunks=4),
     "the model has 6 layers, fewer than pp × chunks = 8 stages"),
    (model_fn, dict(dp=1, pp=2, microbatches=2, zero=2), "zero=2 shards over data-parallel replicas, but this "
                                                          "pipeline has none (dp = 1)"),
    (model_fn, dict(dp=1, pp=2, microbatches=1), "1f1b needs microbatches >= stages (1 < 2)"),
    (model_fn, dict(batch=7), "a batch of 7 does not split into dp=2 equal shares"),
], ids=["world size", "tp and heads", "stages and layers", "zero-2 without replicas", "schedule", "batch"])
def test_an_impossible_choice_shows_the_refusal_and_disables_apply(cluster, model, choice, line):
    view = PlanExplorer(nbdist.shard(model, dp=2, cluster=cluster))
    possible = view.plan
    view.choose(**choice)
    assert line in view.refusal and "\n" not in view.refusal
    with pytest.raises(DistUsageError) as refused:  # the plan's own line is what the widget shows
        possible.changed(**choice)
    assert str(refused.value) == view.refusal
    assert html.escape(view.refusal) in view.refusal_line.value
    assert view.apply_button.disabled
    assert all(f.layout.display == "none" and f.figure == {} for f in (view.memory, view.placement, view.timeline))
    assert "nbdist-figure" not in view.static_html() and html.escape(view.refusal) in view.static_html()
    with pytest.raises(DistUsageError, match="this plan cannot be applied"):
        view.apply()
    assert view.plan is possible  # the last possible plan stays the view's plan
    view.choose(**{k: getattr(possible, k) for k in ("dp", "pp", "tp", "zero", "microbatches", "batch")},
                schedule="1f1b")
    assert_shows(view)


def test_stages_balanced_by_parameters_or_memory_and_cut_by_hand(cluster):
    view = PlanExplorer(nbdist.shard(model_fn, pp=2, microbatches=2, cluster=cluster))
    layers = view.plan.layers
    params = [layer.params for layer in layers]
    assert view.balance_by.value == "parameters" and view.counts.disabled
    assert max(stage_sums(view.plan, params)) == best_max_stage(params, 2)
    assert view.counts.value == ", ".join(str(b - a) for a, b in view.plan.boundaries)

    view.balance_by.value = "memory"  # the layer's own bytes: its parameters (fp32) and one micro-batch's saved bytes
    micro = micro_batch_size(view.plan.batch, 1, 2)
    own = [layer.params * 4 + layer.saved_bytes(1) * micro for layer in layers]
    assert view.refusal is None and max(stage_sums(view.plan, own)) == pytest.approx(best_max_stage(own, 2))
    assert_shows(view)

    view.balance_by.value = "parameters"
    view.schedule.value = "interleaved-1f1b"  # two chunks per rank: four stages, balanced the same way
    assert view.chunks.value == 2 and view.plan.schedule.chunks == 2 and len(view.plan.boundaries) == 4
    assert max(stage_sums(view.plan, params)) == best_max_stage(params, 4)
    assert_shows(view)
    view.schedule.value = "1f1b"
    assert view.chunks.value == 1 and len(view.plan.boundaries) == 2

    view.balance_by.value = "time"
    assert view.refusal == "balancing by time needs the layers' times: press \"Profile on the engines\" first"
    assert view.apply_button.disabled

    view.choose(balance_by="hand", counts="2, 4")
    assert view.plan.boundaries == [(0, 2), (2, 6)] and not view.counts.disabled
    assert_shows(view)
    view.counts.value = "2, x"
    assert view.refusal.startswith("layers per stage: write whole numbers separated by commas")
    view.counts.value = "1, 2"
    assert view.refusal == "balance [1, 2] sums to 3, but the model has 6 layers"
    view.counts.value = "5 1"
    assert view.refusal is None and view.plan.boundaries == [(0, 5), (5, 6)]
    assert_shows(view)
    view.choose(dp=2, pp=1)  # one stage: the box is empty, its placeholder says why
    assert view.counts.disabled and view.counts.value == "" and view.refusal is None
    view.choose(dp=1, pp=2)  # back by hand: the widget's own filler was refused ("write whole numbers")
    assert view.refusal is None and not view.apply_button.disabled, view.refusal
    assert max(stage_sums(view.plan, params)) == best_max_stage(params, 2)  # the cut by parameters to start from
    assert view.counts.value == ", ".join(str(b - a) for a, b in view.plan.boundaries)


def test_profile_fills_every_layers_times_and_the_predicted_step(cluster):
    view = PlanExplorer(nbdist.shard(model_fn, pp=2, microbatches=2, cluster=cluster))
    assert view.step is None and view.timeline.layout.display == "none"
    assert view.layers.value.count("<td>—</td>") == 2 * len(view.plan.layers)  # no forward, no backward yet
    view.profile_button.click()
    plan = view.plan
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in plan.layers)
    assert "<td>—</td>" not in view.layers.value
    size = micro_batch_size(plan.batch, plan.dp, plan.microbatches)
    for layer in plan.layers:  # the table's milliseconds per micro-batch are the profile's seconds per sample
        assert f"<td>{layer.forward_s * size * 1e3:.3f}</td><td>{layer.backward_s * size * 1e3:.3f}</td>" \
               in view.layers.value
    step = plan.predicted_step()
    shown = re.search(r'data-total-s="([^"]+)" data-bubble="([^"]+)"', view.status.value)
    assert float(shown.group(1)) == pytest.approx(step.total_s, rel=1e-5)
    assert float(shown.group(2)) == pytest.approx(step.bubble_fraction, abs=1e-4)
    timeline = view.timeline.figure
    assert view.timeline.layout.display is None and timeline["layout"]["xaxis"]["title"]["text"] == "time (ms)"
    assert {bar for trace in timeline["data"] for bar in trace["y"]} == {"rank 0", "rank 1"}

    view.balance_by.value = "time"  # now possible: the min-max cut of forward + backward
    seconds = [layer.forward_s + layer.backward_s for layer in view.plan.layers]
    assert view.refusal is None
    assert max(stage_sums(view.plan, seconds)) == pytest.approx(best_max_stage(seconds, 2))
    view.choose(dp=2, pp=1, microbatches=1)  # other plans keep the times (same tp)
    assert view.step is not None and view.plan.layers[0].forward_s == plan.layers[0].forward_s

    # an unchanged plan predicts the same step at every redraw: another optimizer's overheads are measured once,
    # not the layers again (a redraw re-profiled, and one plan read 51.0, 44.8 and 54.0 ms)
    view.choose(optimizer="sgd")
    first = view.step.total_s
    assert view.plan.layers[0].forward_s == plan.layers[0].forward_s
    view.choose(microbatches=2)
    view.choose(microbatches=1)
    assert view.step.total_s == first and view.plan.layers[0].forward_s == plan.layers[0].forward_s
    view.profile_button.click()  # measured afresh: the view says how far that moved the same plan's prediction
    moved = re.search(r"predicted step moved ([+-][0-9.]+)%", view.status.value)
    assert moved, view.status.value
    assert float(moved.group(1)) == pytest.approx(100 * (view.step.total_s - first) / first, abs=0.051)


def test_apply_builds_the_plan_and_its_step_trains(cluster):
    view = PlanExplorer(nbdist.shard(model_fn, pp=2, microbatches=2, cluster=cluster), optimizer_fn=sgd)
    view.choose(balance_by="hand", counts="2, 4")
    x, y = data.token_batch(data.byte_corpus(1 << 16), 0, 8, CONFIG["seq"], seed=0)
    view.apply_button.click()
    first = view.applied
    try:
        assert first.balance == [2, 4] and first.schedule.name == "1f1b"
        assert view.applied_plan is view.plan and "applied: " + view.plan.describe() in view.status.value
        losses = [first.step(x, y, models.lm_loss) for _ in range(2)]
        assert all(math.isfinite(loss) for loss in losses) and losses[1] < losses[0]  # SGD on the same batch
        view.choose(dp=2, pp=1, microbatches=1)
        second = view.apply()
        assert second is view.applied and second.plan.dp == 2
        assert "the model applied before was closed" in view.status.value
        loss = second.step(x, y, models.lm_loss)
        assert math.isfinite(loss) and loss == pytest.approx(losses[0], rel=1e-4)  # the same model from one seed
    finally:
        view.applied.close()


# -- dp x pp x tp on 4 engines --------------------------------------------------------------------------------------


def test_every_rank_of_a_stage_gets_its_stages_prediction_on_four_engines(cluster4):
    view = PlanExplorer(nbdist.shard(model_fn, dp=4, cluster=cluster4))
    assert list(view.dp.options) == [1, 2, 4]
    view.choose(dp=2, pp=2, microbatches=2)
    assert_shows(view)
    drawn, memory = drawn_memory(view), view.plan.predicted_memory()
    assert drawn["rank 0"] == drawn["rank 1"] != drawn["rank 2"] == drawn["rank 3"]  # ranks 0, 1: stage 0
    assert drawn["rank 2"]["activations"] == memory[1].activations
    view.choose(dp=1, tp=2)
    assert_shows(view)
    cells = [text for row in view.placement.figure["data"][0]["text"] for text in row]
    assert sorted(re.search(r"tensor slice (\d) of 2", t).group(1) for t in cells) == ["1", "1", "2", "2"]


# -- headless: the notebook executed and exported shows the static copy, drawn offline ------------------------------

NOTEBOOK = [
    "import nbdist\ncluster = nbdist.start(2)",
    textwrap.dedent("""
        def model_fn():
            from nbdist import models
            return models.gpt(vocab=256, seq=16, layers=4, hidden=32, heads=4, seed=0)
        plan = nbdist.shard(model_fn, dp=2)
        view = plan.widget()
        view"""),
    "view.choose(dp=1, pp=2, microbatches=2)\nview.profile()\nprint(view.plan.describe())",
    "cluster.stop()",
]


def test_the_exported_notebook_shows_the_final_plan_offline(tmp_path):
    from browser import Browser, is_drawn, measure_plots, require_browser, wait_for
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter
    from test_notebooks import expected_figures

    require_browser()
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK])
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    final = nb.cells[2].outputs[0]["text"].strip()
    assert final.startswith("plan dp=1 pp=2 tp=1 zero=0 microbatches=2 schedule=1f1b")
    static = [o for o in nb.cells[1].outputs if "nbdist-static-copy" in o.get("data", {}).get("text/html", "")]
    assert len(static) == 1 and final in static[0]["data"]["text/html"]  # updated in place by the later cell
    assert 'class="nbdist-plan-step"' in static[0]["data"]["text/html"]
    assert expected_figures(nb) == 3  # memory, placement, predicted pipeline: the widget's, and so the copy's
    page_file = tmp_path / "plan_explorer.html"
    page_file.write_text(HTMLExporter(template_name="lab").from_notebook_node(nb)[0], encoding="utf-8")
    chromium = Browser()
    try:
        page = chromium.new_page(offline=True)
        page.goto(page_file.as_uri(), wait_until="load")
        plots = wait_for(lambda: [p for p in measure_plots(page) if is_drawn(p)], 20)
        assert len(plots) == len(measure_plots(page)) == 3, page.console_errors[:5]
        assert page.locator(".nbdist-static-copy .nbdist-plan-layers tr").count() == 1 + 6
    finally:
        chromium.close()
