"""The planner's models as they are built now (grouped-query attention, SwiGLU, untied output, no biases, RMSNorm,
rotary positions, no dropout, a padded vocabulary) against references: Llama 3's published parameter counts, hand
counts of every matrix and of every saved activation, the kernels' FLOPs equal to the model's FLOP count, the
parameters of every pipeline rank adding up to the model; a Llama-3-class run predicted and searched on H100s;
impossible splits refused in one line.
"""
from __future__ import annotations

import pytest

from nbdist import planner
from nbdist.errors import DistUsageError
from nbdist.planner import memory, ops, published, step
from nbdist.planner.shapes import shape

LLAMA3_8B = planner.llama(32, 4096, 32, 8, 14336, name="Llama 3 8B")
LLAMA3_70B = planner.llama(80, 8192, 64, 8, 28672, name="Llama 3 70B")
H100 = planner.hardware("h100-sxm")


@pytest.mark.parametrize("model, published", [(LLAMA3_8B, 8_030_261_248), (LLAMA3_70B, 70_553_706_496)])
def test_llama3_parameter_counts_are_the_published_ones(model, published):
    """The sizes of meta-llama/Meta-Llama-3-8B and -70B (config.json): their checkpoints hold exactly these."""
    assert model.parameters == published


def test_a_block_is_counted_matrix_by_matrix():
    """A small model with every option, counted by hand: q and out h×h, k and v h×(kv·hd), gate/up/down h×ff."""
    h, heads, kv, ff, vocab, seq = 64, 8, 2, 96, 1000, 16
    m = planner.gpt(layers=3, hidden=h, heads=heads, seq=seq, vocab=vocab, ff=ff, kv_heads=kv, gated=True,
                    tied=False, bias=False, norm="rmsnorm", positions="rotary", dropout=False)
    kv_width = kv * h // heads  # 16
    matrices = 2 * h * h + 2 * h * kv_width + 3 * h * ff
    assert m.layer_parameters() == matrices + 2 * h  # two RMSNorm weights
    assert m.parameters == 3 * (matrices + 2 * h) + 2 * vocab * h + h  # embedding and output apart, final norm
    assert m.dense_flops_per_token() == 2 * matrices  # a multiply-add per weight and token
    with_biases = planner.gpt(layers=3, hidden=h, heads=heads, seq=seq, vocab=vocab, ff=ff, kv_heads=kv, gated=True)
    biases = h + 2 * kv_width + h + 2 * ff + h  # q, k, v, out, gate, up, down
    assert with_biases.layer_parameters() == matrices + biases + 4 * h  # two LayerNorms, weight and bias
    assert with_biases.layer_split_parameters() == with_biases.layer_parameters() - 4 * h - 2 * h


def test_saved_activations_are_counted_tensor_by_tensor():
    """Korthikanti et al.'s table 2, tensor by tensor, for grouped-query attention and SwiGLU without dropout:
    2-byte activations of b·s tokens."""
    h, heads, kv, ff, s, b, t = 64, 8, 2, 96, 16, 2, 2
    m = planner.gpt(layers=1, hidden=h, heads=heads, seq=s, vocab=1000, ff=ff, kv_heads=kv, gated=True,
                    dropout=False)
    kv_width, tokens = kv * h // heads, s * b
    unsplit = 2 * tokens * h * 4  # the two norms' inputs, the attention's input, the MLP's input
    split = 2 * tokens * (h + kv_width + kv_width + h + ff + ff + ff) / t  # q, k, v, out's input, gate, up, down's
    scores = 2 * heads * b * s * s / t  # the softmax output (no dropout: no mask, no dropped copy)
    assert m.activation_bytes_per_layer(b, t, "none", False) == pytest.approx(unsplit + split + scores, rel=1e-12)
    # sequence parallelism splits what tensor parallelism leaves whole
    assert m.activation_bytes_per_layer(b, t, "none", True) == pytest.approx(unsplit / t + split + scores, rel=1e-12)
    gpt = planner.gpt(layers=1, hidden=h, heads=heads, seq=s, vocab=1000)  # the paper's own case: 34 + 5as/h
    assert gpt.activation_bytes_per_layer(b, 1, "none", False) == pytest.approx(s * b * h * (34 + 5 * heads * s / h))


@pytest.mark.parametrize("model", [LLAMA3_8B, planner.gpt(layers=4, hidden=1024, heads=16, seq=2048, vocab=50257)])
@pytest.mark.parametrize("tp", [1, 4])
def test_the_kernels_compute_what_the_model_counts(model, tp):
    """ops.py (what is timed) and model.py (what TFLOP/s are reported against) are written apart: one block's
    matmul FLOPs on one of t ranks are the model's forward FLOPs per token × tokens / t."""
    b = 2
    kernels = ops.block_kernels(model, b, tp, False, 2.0, flash_attention=False)
    flops = sum(k.flops for k in kernels if k.matmul)
    per_token = model.dense_flops_per_token() + model.attention_flops_per_token()
    assert flops == pytest.approx(per_token * b * model.seq / tp, rel=1e-12)
    flash = ops.block_kernels(model, b, tp, False, 2.0, flash_attention=True)
    assert sum(k.flops for k in flash if k.matmul) == pytest.approx(flops, rel=1e-12)


@pytest.mark.parametrize("tied", [True, False])
def test_every_rank_s_parameters_add_up_to_the_model(tied):
    """pp = 4, tp = 1: the ranks hold every parameter once, plus (tied) the last stage's copy of the embedding."""
    m = planner.gpt(layers=8, hidden=256, heads=8, seq=128, vocab=1000, kv_heads=2, gated=True, tied=tied)
    s = shape(m, gpus=4, tp=1, pp=4, global_batch=8, microbatch=1)
    held = sum(memory.rank_parameters(m, s, r) for r in range(4))
    assert held == m.parameters + (m.vocab * m.hidden if tied else 0)
    costs = step.costs(m, s, H100, "bf16", overlap=True)
    assert (costs.embedding_sync > 0) == tied  # an untied output layer has no copy to keep equal


def test_a_padded_vocabulary_costs_what_megatron_holds():
    """GPT-2's 50,257 tokens padded as Megatron-LM pads them (128·t): 50,304 on one rank, 50,432 over two."""
    m = planner.gpt(layers=2, hidden=768, heads=12, seq=1024, vocab=50257, vocab_multiple=128)
    assert (m.padded_vocab(1), m.padded_vocab(2)) == (50304, 50432)
    assert m.parameters == planner.gpt(layers=2, hidden=768, heads=12, seq=1024, vocab=50257).parameters
    assert m.output_bytes(1, 2) == 4 * 1024 * 50432 / 2
    logits = next(k for k in ops.last_kernels(m, 1, 2, 2.0) if k.name == "logits")
    assert logits.flops == 2 * 1024 * 768 * 50432 / 2
    assert planner.gpt(layers=2, hidden=768, heads=12, seq=1024, vocab=50257).padded_vocab(2) == 50257


def test_a_llama3_class_run_is_predicted_and_searched_on_h100s():
    """Llama 3 70B on 64 H100s, tp = 8, pp = 2, sequence 8,192: with the optimizer state sharded (Megatron's
    distributed optimizer, ZeRO-1) it fits, without it not; its terms add up to the step."""
    run = dict(gpus=64, tp=8, pp=2, global_batch=64, recompute="selective", sequence_parallel=True,
               flash_attention=True)
    assert not planner.predict(LLAMA3_70B, H100, **run).fits  # 4.4 B parameters a GPU × 18 bytes and more
    p = planner.predict(LLAMA3_70B, H100, zero=1, **run)
    assert p.fits, p.why()
    assert sum(p.breakdown["time"].values()) == pytest.approx(p.step_seconds, rel=1e-9)
    assert 0.2 < p.mfu < 0.8  # H100 at 79.9 % of peak on a large matmul (hardware profile)
    found = planner.search(LLAMA3_8B, H100, gpus=16, global_batch=32)
    assert found.plans and all(plan.fits for plan in found.plans)
    assert all(8 % plan.shape.tp == 0 for plan in found.plans)  # tp divides the 8 k/v heads


def test_impossible_models_and_splits_are_refused_in_one_line():
    with pytest.raises(DistUsageError, match=r"kv_heads \(3\) must divide heads \(32\)"):
        planner.llama(32, 4096, 32, 3, 14336)
    with pytest.raises(DistUsageError, match=r"tp=16 does not divide kv_heads=8"):
        planner.predict(LLAMA3_8B, H100, gpus=16, tp=16, global_batch=16)
    with pytest.raises(DistUsageError, match="norm"):
        planner.gpt(layers=2, hidden=64, heads=8, seq=16, vocab=100, norm="batchnorm")


# -- context parallelism -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flash", [True, False])
def test_context_parallelism_divides_each_rank_s_activations_and_flops(flash):
    """cp ranks hold s/cp tokens each: saved bytes, and a block's FLOPs (its queries against all s keys), are
    exactly 1/cp of one rank's without it."""
    m = LLAMA3_8B
    for cp in (2, 4, 16):
        one = m.activation_bytes_per_layer(1, 8, "none", True, 2, flash)
        assert m.activation_bytes_per_layer(1, 8, "none", True, 2, flash, cp) == pytest.approx(one / cp, rel=1e-12)
        flops = [sum(k.flops for k in ops.block_kernels(m, 1, 8, True, 2.0, flash, c)) for c in (1, cp)]
        assert flops[1] == pytest.approx(flops[0] / cp, rel=1e-12)


def test_the_k_v_ring_is_charged_where_attention_does_not_hide_it():
    """cp - 1 steps, each one rank's k and v (2·b·(s/cp)·kv_width/t elements) over the cp group's link, minus the
    attention core's compute; the backward moves twice as much, and the breakdown adds it up per micro-batch."""
    hw = planner.hardware("h100-sxm", gpus_per_host=1)  # every cp group crosses hosts: the ring is slow
    m = planner.llama(4, 1024, 8, 8, 4096, seq=4096, vocab=32000)
    s = shape(m, gpus=8, tp=1, pp=1, global_batch=4, cp=8)
    where = step.groups(s, hw)
    assert where["cp"].members == 8 and where["cp"].hosts == 8
    piece = 2 * 1 * (4096 / 8) * m.kv_width * 2.0  # bytes of one rank's k and v, bf16
    ring = 7 * (where["cp"].link.latency + piece / where["cp"].bandwidth)
    attention = sum(k.seconds(hw.matmul_flops("bf16"), hw.streaming_bandwidth())
                    for k in ops.attention_kernels(m, 1, 1, 2.0, True, 8) if k.matmul)
    forward, backward = step._context_exchange(m, s, where["cp"], 2.0, attention)
    assert forward == pytest.approx(ring - attention) and forward > 0
    assert backward == pytest.approx(2 * ring - 2 * attention)
    p = planner.predict(m, hw, gpus=8, global_batch=4, cp=8)
    per_step = p.shape.microbatches * m.layers * (forward + backward)
    assert p.breakdown["time"]["context-parallel k/v ring (exposed)"] == pytest.approx(per_step, rel=1e-9)
    assert where["dp"].members == 8  # the gradient sync spans dp × cp ranks: they hold the same weights


def test_long_sequences_need_context_parallelism_to_keep_the_pipeline_busy():
    """Llama 3 405B at 128 K tokens (Table 4's last row): 16 M tokens are 128 sequences. Without cp, 128
    replicas get one micro-batch each and a 16-stage pipeline idles; cp = 16 leaves 8 replicas 16 each."""
    model = planner.llama(126, 16384, 128, 8, 53248, seq=131072)
    run = dict(gpus=16384, tp=8, pp=16, global_batch=128, zero=1, sequence_parallel=True)
    without, with_cp = (planner.predict(model, H100, cp=cp, **run) for cp in (1, 16))
    assert without.pipeline.bubble_fraction > 0.9 > 0.5 > with_cp.pipeline.bubble_fraction
    assert with_cp.tflops_per_gpu > 2 * without.tflops_per_gpu
    rows = published.reproduce(published.LLAMA3_RUNS, H100)
    assert all(row["fits"] for row in rows)
    assert rows[2]["prediction"].shape.cp == 16


@pytest.mark.slow
def test_search_offers_context_parallelism_when_asked():
    model = planner.llama(32, 4096, 32, 8, 14336, seq=131072)
    plans = planner.search(model, H100, gpus=64, global_batch=8, max_cp=16)
    assert plans.best.shape.cp > 1  # 8 sequences on 64 GPUs: splitting them beats idling
    assert all(p.shape.cp == 1 for p in planner.search(model, H100, gpus=64, global_batch=8))


def test_context_parallel_refusals_are_one_line():
    with pytest.raises(DistUsageError, match=r"cp=3 does not split the sequence of 8192 into 2·cp = 6"):
        planner.predict(LLAMA3_8B, H100, gpus=24, cp=3, global_batch=8)
    with pytest.raises(DistUsageError, match=r"multiple of tp × cp × pp = 2 × 4 × 1 = 8"):
        planner.predict(LLAMA3_8B, H100, gpus=12, tp=2, cp=4, global_batch=8)
    with pytest.raises(DistUsageError, match="nbdist cannot run it"):
        shape(LLAMA3_8B, gpus=8, tp=1, pp=1, global_batch=8, cp=8).layout


def test_zero2_in_a_pipeline_shards_gradients_and_pays_a_reduce_scatter_per_microbatch():
    """FSDP2 on each stage (ZeRO-2 with pp > 1): gradients 1/dp of ZeRO-1's, and each micro-batch's backward
    carries its chunk's reduce-scatter."""
    run = dict(gpus=64, tp=8, pp=2, global_batch=64, sequence_parallel=True, recompute="selective")
    one, two = (planner.predict(LLAMA3_8B, H100, zero=z, **run) for z in (1, 2))
    assert two.breakdown["memory"]["gradients"] == pytest.approx(one.breakdown["memory"]["gradients"] / 4)
    assert all(c.zero_backward > 0 for c in two.costs.chunks) and all(c.zero_backward == 0 for c in one.costs.chunks)
    found = planner.search(LLAMA3_8B, H100, gpus=64, global_batch=64, zero=(2,), top=50, exact=50)
    assert any(p.shape.pp > 1 for p in found.candidates if p.fits)  # offered now
