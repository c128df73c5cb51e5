"""The cluster-scale planner (nbdist.planner) against references: parameter counts of published models, Megatron-LM's
FLOPs formula (and a published run's TFLOP/s from its iteration time), the ZeRO paper's memory example, the
pipeline bubble's closed forms from nbdist's own simulator, Megatron-LM's Table 1 reproduced from its
configurations; bad plans refused in one line; the search returns only plans that fit; the widget redraws what
predict says and shows why a plan is impossible; "local" measured on real engines.
"""
from __future__ import annotations

import math

import pytest

from nbdist import planner
from nbdist.errors import DistUsageError
from nbdist.planner import memory, pipeline, published
from nbdist.planner.shapes import groups, shape
from nbdist.planner.widget import ClusterPlannerView

A100 = planner.hardware("a100-80gb")
GB = 1e9


def table1_model(heads, hidden, layers):
    return planner.gpt(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)


# -- parameters and FLOPs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, expected", [
    (dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257), 124_439_808),     # GPT-2 small (tied head)
    (dict(layers=48, hidden=1600, heads=25, seq=1024, vocab=50257), 1_557_611_200),  # GPT-2 XL
])
def test_parameter_counts_of_gpt2_sizes(sizes, expected):
    assert planner.gpt(**sizes).parameters == expected


def test_gpt3_175b_and_megatron_closed_form():
    gpt3 = planner.gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=50257)
    assert abs(gpt3.parameters / 175e9 - 1) < 0.01
    # Megatron-LM's P = 12lh²(1 + 13/(12h) + (V+s)/(12lh)) is the exact count without the final LayerNorm (2h)
    assert gpt3.parameters - 2 * 12288 == pytest.approx(gpt3.megatron_parameters(), rel=1e-12)


def test_table1_parameter_counts_are_the_papers():
    got = [round(run.model.parameters / 1e9, 1) for run in published.TABLE1]
    assert got == [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]


def test_flops_per_iteration_is_megatrons_formula():
    model = table1_model(96, 12288, 80)
    l, h, s, v, b = 80, 12288, 2048, 51200, 2304
    by_hand = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert model.flops_per_iteration(b, "full") == pytest.approx(by_hand, rel=1e-12)
    # without recomputation the blocks lose their second forward (72 instead of 96) but the logits, never
    # recomputed, stay at 3 passes of 2·B·s·h·V (Megatron's 72-version scales them too)
    by_hand = 72 * b * s * l * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v
    assert model.flops_per_iteration(b, "none") == pytest.approx(by_hand, rel=1e-12)


def test_flops_formula_gives_mt_nlgs_published_tflops_from_its_iteration_times():
    """MT-NLG 530B reports 60.1, 50.2, 44.4 s per iteration on 280, 350, 420 nodes and 126, 121, 113 TFLOP/s."""
    model = published.MT_NLG[0].model
    for nodes, seconds, tflops in ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)):
        got = model.flops_per_iteration(1920, "full") / (nodes * 8 * seconds) / 1e12
        assert abs(got - tflops) < 1.0


# -- memory ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(zero, gigabytes):
    """7.5 B parameters, 64 GPUs, mixed-precision Adam (K = 12): 120 / 31.4 / 16.6 / 1.9 GB (ZeRO, figure 1)."""
    states = memory.model_states(7.5e9, 64, zero, "bf16")
    assert round(sum(states.values()) / GB, 1) == pytest.approx(gigabytes, abs=0.051)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_predicted_model_states_follow_zero_for_the_whole_model(zero):
    model = table1_model(32, 4096, 36)  # 7.5 B
    p = planner.predict(model, A100, gpus=64, global_batch=64, zero=zero, recompute="full")
    psi, n = model.parameters, 64
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[zero]
    got = p.breakdown["memory"]
    assert got["weights"] + got["gradients"] + got["optimizer"] == pytest.approx(paper, rel=1e-12)
    assert got["gathered layers"] == (0 if zero < 3 else 2 * model.layer_split_parameters() * 2)


def test_activations_follow_korthikanti():
    """Per layer, 2-byte activations: sbh(34 + 5as/h) unsplit, sbh(10 + 24/t + 5as/(ht)) with tp,
    sbh(34/t + 5as/(ht)) with sequence parallelism, 2sbh with full recomputation."""
    m = table1_model(96, 12288, 80)
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert m.activation_bytes_per_layer(b, 1, "none", False) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert m.activation_bytes_per_layer(b, t, "none", False) == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert m.activation_bytes_per_layer(b, t, "none", True) == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))
    assert m.activation_bytes_per_layer(b, t, "selective", False) == pytest.approx(s * b * h * (10 + 24 / t))
    assert m.activation_bytes_per_layer(b, t, "full", False) == pytest.approx(2 * s * b * h)


def test_fused_attention_keeps_no_scores_only_their_log_sum_exp():
    """FlashAttention stores no a·s² scores: GPT-3 175 B, b = 4, no recomputation, no tensor parallelism, per layer
    sbh·34 bytes plus one fp32 log-sum-exp per row and head (4·a·s·b), against sbh(34 + 5as/h) unfused; the
    prediction follows the layout's flash_attention (on by default)."""
    m = table1_model(96, 12288, 96)
    s, b, h, a = 2048, 4, 12288, 96
    fused = s * b * h * 34 + 4 * a * s * b
    assert m.activation_bytes_per_layer(b, 1, "none", False, flash_attention=True) == pytest.approx(fused)
    assert m.activation_bytes_per_layer(b, 1, "none", False) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert m.activation_bytes_per_layer(b, 1, "selective", False, flash_attention=True) == pytest.approx(
        s * b * h * 34)  # the attention core recomputed: not even its statistics are kept
    per_rank = {flash: planner.predict(m, A100, gpus=8, tp=1, pp=1, global_batch=32, microbatch=4,
                                       flash_attention=flash).breakdown["memory"]["activations"]
                for flash in (True, False)}
    assert per_rank[False] - per_rank[True] == pytest.approx(96 * (s * b * h * 5 * a * s / h - 4 * a * s * b))


def test_first_pipeline_rank_holds_p_microbatches_of_activations():
    """1F1B: rank 0 holds p micro-batches in flight, so its layers' activations times p (plus the layer being
    recomputed)."""
    model = table1_model(96, 12288, 80)
    p = planner.predict(model, A100, gpus=1536, tp=8, pp=8, global_batch=2304, recompute="full")
    per_layer = model.activation_bytes_per_layer(1, 8, "full", False)
    working = model.working_bytes_per_layer(1, 8, False, flash_attention=True)  # the layout's default
    assert p.memory_rank == 0
    assert p.breakdown["memory"]["activations"] == pytest.approx(8 * 10 * per_layer + working)


# -- the pipeline bubble from the simulator ----------------------------------------------------------------------------


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 64), (4, 100)])
def test_1f1b_bubble_is_the_closed_form(p, m):
    run = pipeline.run("1f1b", p, m, 1, (1.0,) * p, (2.0,) * p, 0.0)
    assert run.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (8, 64, 2), (4, 16, 4), (2, 40, 3)])
def test_interleaved_bubble_is_divided_by_v(p, m, v):
    """Megatron-LM: the bubble time (p-1)·(f+b) shrinks to (p-1)·(f+b)/v, so its share is (p-1)/(v·m + p-1)."""
    run = pipeline.run("interleaved-1f1b", p, m, v, (1.0 / v,) * (p * v), (2.0 / v,) * (p * v), 0.0)
    assert run.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)


@pytest.mark.parametrize("schedule, p, v", [("1f1b", 4, 1), ("interleaved-1f1b", 4, 2), ("interleaved-1f1b", 3, 3)])
def test_peak_activations_read_from_a_short_schedule_are_the_whole_steps(schedule, p, v):
    """The peak is read from at most 3p micro-batches; it equals the peak of the whole step's timeline."""
    m = 16 * p
    timeline = pipeline._simulate(schedule, p, m, v, (1.0,) * (p * v), (2.0,) * (p * v), 0.0)
    assert pipeline.peak_held(schedule, p, m, v) == tuple(timeline.peak_activations[r] for r in range(p))
    if schedule == "1f1b":
        assert pipeline.peak_held(schedule, p, m, v) == tuple(p - r for r in range(p))


# -- placement -------------------------------------------------------------------------------------------------------


def test_groups_use_the_links_they_span():
    model = table1_model(96, 12288, 80)
    placed = groups(shape(model, 1536, 8, 8, 2304), A100)
    assert placed["tp"].hosts == 1 and placed["tp"].bandwidth == 300e9        # NVLink within the DGX
    assert placed["dp"].per_host == 1 and placed["dp"].bandwidth == 25e9     # one HDR port per member
    assert placed["pp"].hosts == 2
    uneven = groups(shape(model, 1536, 6, 8, 2304), A100)                    # tp=6 on hosts of 8
    assert uneven["tp"].hosts == 2


# -- refusals --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan, words", [
    (dict(gpus=1536, tp=5, pp=8, global_batch=2304), "tp=5 does not divide heads=96"),
    (dict(gpus=1620, tp=2, pp=81, global_batch=2304), "pp=81 > layers=80"),
    (dict(gpus=1536, tp=8, pp=8, global_batch=2300), "global batch 2300 is not divisible by dp × microbatch"),
    (dict(gpus=1536, tp=8, pp=8, global_batch=2304, microbatch=5), "not divisible by dp × microbatch = 24 × 5"),
    (dict(gpus=1000, tp=8, pp=8, global_batch=2304), "gpus (1000) must be a multiple of tp × pp"),
    (dict(gpus=1536, tp=8, pp=8, global_batch=2304, zero=4), "ZeRO stage"),
    (dict(gpus=1536, tp=8, pp=8, global_batch=2304, recompute="some"), "unknown recompute 'some'"),
])
def test_bad_plans_are_refused_in_one_line(plan, words):
    with pytest.raises(DistUsageError) as error:
        planner.predict(table1_model(96, 12288, 80), A100, **plan)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_plan_that_does_not_fit_says_why():
    p = planner.predict(table1_model(96, 12288, 80), A100, gpus=1536, tp=8, pp=8, global_batch=2304, microbatch=4)
    assert not p.fits
    assert "activations" in p.reason and "80 GiB" in p.reason


# -- search ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_search_returns_only_plans_that_fit_best_first():
    model = table1_model(48, 6144, 40)  # 18.4 B
    result = planner.search(model, A100, gpus=256, global_batch=1024, top=8)
    assert len(result) == 8
    assert all(p.fits for p in result)
    speeds = [p.tokens_per_second for p in result]
    assert speeds == sorted(speeds, reverse=True)
    assert any(not c.fits for c in result.candidates)  # plans that do not fit were considered and left out
    assert result.best.shape.describe() in result.why()
    # every plan returned is what predict says for its shape
    again = planner.predict(model, A100, gpus=256, tp=result.best.shape.tp, pp=result.best.shape.pp,
                            global_batch=1024, microbatch=result.best.shape.microbatch,
                            chunks=result.best.shape.chunks, zero=result.best.shape.zero,
                            recompute=result.best.shape.recompute,
                            sequence_parallel=result.best.shape.sequence_parallel)
    assert again.step_seconds == pytest.approx(result.best.step_seconds, rel=1e-12)


def test_search_with_nothing_that_fits_says_so():
    result = planner.search(table1_model(160, 25600, 128), A100, gpus=8, global_batch=8)
    assert len(result) == 0
    with pytest.raises(DistUsageError, match="no plan of"):
        result.best


# -- Megatron-LM's Table 1, reproduced --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table1():
    return published.reproduce(published.TABLE1, A100)


@pytest.mark.slow
def test_table1_every_row_within_15_percent_and_fits(table1):
    for row in table1:
        assert abs(row["ratio"] - 1) <= 0.15, row
        assert row["fits"], row
        assert row["memory"] <= 80 * 2**30


@pytest.mark.slow
def test_table1_trend_is_right(table1):
    """Which runs are faster: the prediction orders at least 90 % of the pairs the paper separates by > 2 TFLOP/s."""
    agreement = published.order_agreement([r["predicted"] for r in table1], [r["published"] for r in table1])
    assert agreement >= 0.9


@pytest.mark.slow
def test_mt_nlg_is_missed_by_what_the_planner_does_not_model():
    """MT-NLG 530B (DeepSpeed + Megatron, 2022) reached 113-126 TFLOP/s where Megatron-LM's Table 1 reached 163 for
    the same model on the same GPUs. The planner models Megatron-LM's software: it predicts 30-40 % above MT-NLG's
    figures (a miss, reported as such), but orders the three scales right."""
    rows = published.reproduce(published.MT_NLG, A100)
    assert all(1.25 < row["ratio"] < 1.45 for row in rows)
    assert published.order_agreement([r["predicted"] for r in rows], [r["published"] for r in rows]) == 1.0


# -- Megatron-LM's Table 2: ZeRO-3 without model parallelism against PTD-P, reproduced ------------------------------


@pytest.fixture(scope="module")
def table2():
    return published.reproduce(published.TABLE2, A100)


@pytest.mark.slow
def test_table2_every_row_within_15_percent_and_fits(table2):
    """ZeRO-3 144 / 88 / 44 and PTD-P 153 / 149 / 141 TFLOP/s per GPU on 384 / 768 / 1,536 GPUs, each predicted
    from its configuration within 15 %: no constant is fitted to them (cost/zero3.py cites each one)."""
    assert len(table2) == 6
    for row in table2:
        assert abs(row["ratio"] - 1) <= 0.15, (row["run"], row["predicted"], row["published"])
        assert row["fits"], row


@pytest.mark.slow
def test_table2_zero3_collapses_because_its_collectives_take_the_step(table2):
    """ZeRO-3 falls by more than half from 384 to 1,536 GPUs while PTD-P loses under a tenth, as published; the
    share of ZeRO-3's step in its collectives grows with the GPUs (compute per GPU shrinks, the calls' ring
    latency and copies per member grow) and is most of the step at 1,536."""
    zero3 = [r for r in table2 if r["prediction"].shape.zero == 3]
    ptdp = [r for r in table2 if r["prediction"].shape.zero == 0]
    assert zero3[-1]["predicted"] < 0.5 * zero3[0]["predicted"]
    assert ptdp[-1]["predicted"] > 0.9 * ptdp[0]["predicted"]
    shares = [r["prediction"].breakdown["time"]["ZeRO collectives (exposed)"] / r["prediction"].step_seconds
              for r in zero3]
    assert shares == sorted(shares) and shares[-1] > 0.5


def test_zero3_pays_a_rings_latency_per_call():
    """Gathering tensor by tensor instead of block by block adds, per pass, (calls - 1) ring latencies of (n - 1)
    steps each, plus the list form's per-member copies and its bytes copied back (cost/zero3.py)."""
    model = published.TABLE2_ZERO3[0].model
    plans = {calls: planner.predict(model, A100, gpus=64, global_batch=64, zero=3, overlap=False,
                                    flash_attention=False, zero3_calls=calls) for calls in ("layer", "parameter")}
    forward = {calls: p.costs.chunks[0].zero_forward for calls, p in plans.items()}
    dp = plans["layer"].costs.placement["dp"]
    latency = 63 * dp.link.latency
    psi = model.layers * model.layer_parameters() + model.embedding_parameters() + model.norm_parameters
    copies = model.layers * model.block_tensors * 64 * 2 * 2e-6 + 2 * 2 * psi / A100.streaming_bandwidth()
    extra = (model.layers * model.block_tensors - model.layers) * latency + copies
    assert forward["parameter"] - forward["layer"] == pytest.approx(extra, rel=1e-6)


# -- Korthikanti et al. 2022 (sequence parallelism, selective recomputation), reproduced ----------------------------


def test_korthikanti_configurations_give_the_papers_utilisation():
    """The transcription of Tables 3 and 5 checked against the paper's own MFU column: Megatron's formula over
    312 TFLOP/s per GPU turns each configuration and iteration time into 41.5, 51.4, 56.0 and 56.3 %."""
    selective = [run for run in published.KORTHIKANTI_RUNS if run.sequence_parallel]
    assert [run.published_mfu() for run in selective] == pytest.approx([0.415, 0.514, 0.560, 0.563], abs=0.003)


@pytest.mark.slow
def test_korthikanti_every_run_within_15_percent_on_both_sides():
    rows = published.reproduce(published.KORTHIKANTI_RUNS, A100)
    for row in rows:
        assert abs(row["mfu"] / row["published mfu"] - 1) <= 0.15, row
        assert row["fits"], row
    ratios = [row["ratio"] for row in rows]
    assert min(ratios) < 1 < max(ratios)  # no one-sided error: no missing term hidden in a constant
    by_size = {}
    for row in rows:  # sequence parallelism + selective recomputation is faster for every size, as published
        by_size.setdefault(row["parameters"], {})[row["prediction"].shape.recompute] = row["prediction"].step_seconds
    assert all(times["selective"] < times["full"] for times in by_size.values())


# -- the widget --------------------------------------------------------------------------------------------------------


def drawn(view, figure: str) -> dict[str, float]:
    return {trace["name"]: trace["x"][0] for trace in getattr(view, figure).figure["data"]}


@pytest.mark.slow
def test_widget_redraws_what_predict_says():
    view = ClusterPlannerView(model="GPT 145.6 B (80 layers, 12288)", tp=8, pp=8, dp=24, chunks=2,
                              global_batch=2304, recompute="full")
    before = drawn(view, "memory")
    assert before == {k: v for k, v in view.prediction.breakdown["memory"].items() if v > 0}
    view.pp.value = 16  # a slider moves: 3072 GPUs now
    after = drawn(view, "memory")
    assert after != before
    expected = planner.predict(view.models["GPT 145.6 B (80 layers, 12288)"], A100, gpus=3072, tp=8, pp=16,
                               global_batch=2304, chunks=2, recompute="full", flash_attention=False)
    assert after == {k: v for k, v in expected.breakdown["memory"].items() if v > 0}
    times = drawn(view, "time")
    assert sum(times.values()) == pytest.approx(expected.step_seconds, rel=1e-9)


def test_widget_shows_why_a_plan_is_impossible():
    view = ClusterPlannerView()
    view.choose(tp=5)
    assert view.prediction is None
    assert "tp=5 does not divide heads=96" in view.refusal_line.value
    assert view.memory.layout.display == "none"
    assert "tp=5 does not divide heads" in view.static_html()
    view.choose(tp=8, recompute="none", chunks=1, microbatch=4, dp=8, global_batch=512)
    assert view.prediction is not None and not view.prediction.fits
    assert "does not fit" in view.status.value and "needs" in view.refusal_line.value


# -- "local": this machine's engines -----------------------------------------------------------------------------------


def test_local_profile_is_measured_on_real_engines(cluster):
    hw = planner.hardware("local", cluster=cluster)
    assert hw.gpus_per_host == cluster.world_size == 2 and hw.dtype == "fp32"
    assert 1e8 < hw.peak("fp32") < 1e13  # a CPU core's matmul: between 0.1 GFLOP/s and 10 TFLOP/s
    assert 1e7 < hw.memory_bandwidth < 1e12 and 1e7 < hw.intra_host.bandwidth < 1e12
    assert 0 < hw.intra_host.latency < 0.01
    stored = planner.hardware("local")
    assert stored.measured["engines"] == 2 and not math.isnan(stored.peak("fp32"))
