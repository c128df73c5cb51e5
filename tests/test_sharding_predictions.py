"""A plan's predicted memory and step time (nbdist/sharding/: profile, shape, memory, step_time) against hand counts, the ZeRO paper's
figures, and what the memory meter (nbdist/runtime/ranks/memory.py) measures in this process.

One process, no cluster: the predictions are plain data; the 2-rank checks of ZeRO and FSDP2 against these
predictions are in tests/test_memory_meter.py.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nbdist.collectives.costmodel import AlphaBeta
from nbdist.cost.memory import fp32_zero_bytes, zero_paper_bytes
from nbdist.errors import DistUsageError
from nbdist.runtime.ranks.memory import ActivationMeter, state_bytes
from nbdist.schedules.generators import build
from nbdist.sharding.memory import predict_memory, zero1_shares
from nbdist.sharding.profile import profile_layers, with_times
from nbdist.sharding.ranks.timing import time_layers
from nbdist.sharding.shape import check_shape
from nbdist.sharding.step_time import Overheads, predict_step_seconds
from nbdist.tensor_parallel.pairs import tp_pairs, tp_plan

IN, HIDDEN, MID, OUT = 8, 16, 8, 4  # the MLP: Linear(8,16) ReLU Linear(16,8) ReLU Linear(8,4)
F32 = 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, MID), nn.ReLU(), nn.Linear(MID, OUT))


PSI = IN * HIDDEN + HIDDEN + HIDDEN * MID + MID + MID * OUT + OUT  # 316 parameters


class Attention(nn.Module):
    """Causal self-attention named as nbdist.models' GPT names it; heads read from q's width, so a tp-sliced copy
    (q/k/v with fewer output features) runs unchanged."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.ln2, self.mlp = nn.LayerNorm(hidden), Mlp(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def gpt(layers: int = 2, hidden: int = 16, heads: int = 4, vocab: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, hidden), *(Block(hidden, heads) for _ in range(layers)),
                          nn.Linear(hidden, vocab))
    model.config = SimpleNamespace(hidden=hidden, heads=heads, layers=layers, vocab=vocab)
    return model


def tokens(batch: int = 4, seq: int = 6, vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def memory(layers, **plan):
    args = dict(dp=1, pp=1, tp=1, zero=0, boundaries=None, microbatches=1, schedule="1f1b", batch=8)
    return predict_memory(layers, **{**args, **plan})


# ---------------------------------------------------------------------------------------------------------------
# Which layers tensor parallel splits
# ---------------------------------------------------------------------------------------------------------------


def test_plain_linear_layers_pair_column_then_row_and_an_odd_last_one_stays_whole():
    assert tp_pairs(mlp()) == [("0", "2")]
    assert tp_plan(mlp()) == {"0": "colwise", "2": "rowwise"}
    four = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    assert tp_pairs(four) == [("0", "1"), ("2", "3")]


def test_a_layer_that_needs_all_features_breaks_a_pair():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    assert tp_pairs(model) == []
    with pytest.raises(DistUsageError, match="no pair of Linear layers to split: tensor parallel needs"):
        tp_pairs(model, tp=2)


def test_gpt_blocks_split_attention_and_mlp_as_megatron_does():
    expected = []
    for block in ("1", "2"):  # layer 0 is the embedding, layer 3 the head
        expected += [(f"{block}.attn.{c}", f"{block}.attn.out") for c in "qkv"] + [(f"{block}.mlp.fc", f"{block}.mlp.proj")]
    assert tp_pairs(gpt(layers=2)) == expected
    plan = tp_plan(gpt(layers=2))
    assert plan["1.attn.q"] == plan["1.mlp.fc"] == "colwise" and plan["1.attn.out"] == plan["1.mlp.proj"] == "rowwise"
    assert "3" not in plan and "0" not in plan  # head and embedding replicated


# ---------------------------------------------------------------------------------------------------------------
# Profiles against hand counts
# ---------------------------------------------------------------------------------------------------------------


def test_mlp_profile_counts_parameters_and_saved_bytes_by_hand():
    layers = profile_layers(mlp(), torch.randn(5, IN))
    assert [layer.params for layer in layers] == [IN * HIDDEN + HIDDEN, 0, HIDDEN * MID + MID, 0, MID * OUT + OUT]
    # column: weight and bias split; row: weight split, bias whole; last Linear unpaired
    assert [layer.tp_params for layer in layers] == [IN * HIDDEN + HIDDEN, 0, HIDDEN * MID, 0, 0]
    # saved for backward, per sample: Linear 0 its input; each ReLU its output, which the next Linear saves again
    assert [layer.activation_bytes_per_sample for layer in layers] == [F32 * IN, F32 * HIDDEN, 0, F32 * MID, 0]
    assert [layer.input_bytes_per_sample for layer in layers] == [0, 0, F32 * HIDDEN, 0, F32 * MID]
    # tensor parallel splits what lies between the pair: the ReLU's output (Linear 0's input stays whole)
    assert [layer.activation_split_bytes_per_sample for layer in layers] == [0, F32 * HIDDEN, 0, 0, 0]
    assert [layer.input_split_bytes_per_sample for layer in layers] == [0, 0, F32 * HIDDEN, 0, 0]
    assert [layer.output_bytes_per_sample for layer in layers] == [F32 * n for n in (HIDDEN, HIDDEN, MID, MID, OUT)]
    # one pair: the row's output all-reduced in forward (in the row's layer), the column's input gradient in
    # backward (in the column's layer)
    assert layers[2].tp_allreduce_bytes_per_sample == ((F32 * MID, 0),)
    assert layers[0].tp_allreduce_bytes_per_sample == ((0, F32 * IN),)


def test_the_measured_split_is_linear_in_one_over_tp():
    """Measured at tp=2 and at tp=4 on sliced copies, the split parts agree: one profile serves every tp."""
    x = tokens()
    at2, at4 = profile_layers(gpt(), x, tp=2), profile_layers(gpt(), x, tp=4)
    assert [layer.activation_split_bytes_per_sample for layer in at2] == \
        [layer.activation_split_bytes_per_sample for layer in at4]
    block = at2[1]
    assert 0 < block.activation_split_bytes_per_sample < block.activation_bytes_per_sample  # LayerNorms stay whole
    hidden_bytes = F32 * 6 * 16  # a (seq, hidden) activation per sample
    # forward: attn.out and mlp.proj (2); backward: q, k, v and mlp.fc each all-reduce their input gradient (4),
    # as DTensor does on separate q, k, v layers (Megatron fuses them: 2)
    assert block.tp_allreduce_bytes_per_sample == ((hidden_bytes, 0),) * 2 + ((0, hidden_bytes),) * 4


def test_a_meta_model_profiles_like_the_real_one():
    with torch.device("meta"):
        meta = gpt()
    meta.config = gpt().config
    assert profile_layers(meta, tokens()) == profile_layers(gpt(), tokens())


# ---------------------------------------------------------------------------------------------------------------
# Memory per rank against hand counts
# ---------------------------------------------------------------------------------------------------------------

# x, ReLU 1's output, ReLU 2's output (from the test above), and the output the loss saves
ACTIVATION_PER_SAMPLE = F32 * (IN + HIDDEN + MID + OUT)


def test_data_parallel_adam_holds_everything_and_a_share_of_the_batch():
    [rank] = memory(profile_layers(mlp(), torch.randn(4, IN)), dp=2, batch=8)
    assert (rank.params, rank.grads, rank.optimizer) == (F32 * PSI, F32 * PSI, 2 * F32 * PSI)
    assert rank.activations == ACTIVATION_PER_SAMPLE * 8 // 2
    assert rank.total == rank.params + rank.grads + rank.optimizer + rank.activations


@pytest.mark.parametrize("optimizer,states", [("sgd", 0), ("sgd-momentum", 1), ("adam", 2)])
def test_optimizer_states_by_kind(optimizer, states):
    [rank] = memory(profile_layers(mlp(), torch.randn(4, IN)), optimizer=optimizer)
    assert rank.optimizer == states * F32 * PSI


def test_zero1_takes_torchs_greedy_partition_not_an_even_split():
    # parameters largest first: 128 (w0) -> rank 0, 128 (w2) -> rank 1, 32 (w4) -> rank 0 (tie: lowest),
    # 16 (b0) -> rank 1, 8 (b2) -> rank 1, 4 (b4) -> rank 1: rank 0 holds 160, rank 1 156
    layers = profile_layers(mlp(), torch.randn(4, IN))
    assert zero1_shares([t for layer in layers for t in layer.tensors], 2) == [160, 156]
    [rank] = memory(layers, dp=2, zero=1)
    assert (rank.params, rank.grads, rank.optimizer) == (F32 * PSI, F32 * PSI, 2 * F32 * 160)


def test_zero2_and_zero3_shard_and_hold_unsharded_layers():
    layers = profile_layers(mlp(), torch.randn(4, IN))
    largest_layer = IN * HIDDEN + HIDDEN
    [z2] = memory(layers, dp=2, zero=2)
    [z3] = memory(layers, dp=2, zero=3)
    assert (z2.params, z2.grads, z2.optimizer) == (F32 * (PSI // 2 + PSI), F32 * PSI // 2, 2 * F32 * PSI // 2)
    assert (z3.params, z3.grads, z3.optimizer) == (F32 * (PSI // 2 + largest_layer), F32 * PSI // 2, F32 * PSI)


def test_fsdp2_pads_a_shard_the_way_it_cuts_dim_0():
    layers = profile_layers(nn.Sequential(nn.Linear(4, 5)), torch.randn(2, 4))
    [rank] = memory(layers, dp=2, zero=3, batch=2)
    assert rank.grads == F32 * (3 * 4 + 3)  # 5 rows -> ceil(5/2) = 3 rows of 4, and 3 of the 5 biases, per rank


def test_tensor_parallel_divides_the_split_parameters_and_activations():
    [rank] = memory(profile_layers(mlp(), torch.randn(4, IN)), tp=2)
    local = (IN * HIDDEN + HIDDEN) // 2 + HIDDEN * MID // 2 + MID + MID * OUT + OUT
    assert rank.params == F32 * local
    assert rank.activations == 8 * F32 * (IN + HIDDEN // 2 + MID + OUT)


@pytest.mark.parametrize("schedule,peaks", [("1f1b", [2, 1]), ("gpipe", [4, 4])])
def test_pipeline_stages_hold_the_micro_batches_the_schedule_keeps_in_flight(schedule, peaks):
    layers = profile_layers(mlp(), torch.randn(4, IN))
    ranks = memory(layers, pp=2, microbatches=4, schedule=schedule, boundaries=[(0, 2), (2, 5)])
    first = F32 * (IN + HIDDEN)  # Linear 0's input, ReLU 1's output
    second = F32 * (HIDDEN + MID + OUT)  # the received ReLU output that Linear 2 saves, ReLU 3's output, the loss's
    assert [r.activations for r in ranks] == [first * 2 * peaks[0], second * 2 * peaks[1]]  # micro-batch of 2
    assert [r.params for r in ranks] == [F32 * (IN * HIDDEN + HIDDEN), F32 * (PSI - IN * HIDDEN - HIDDEN)]


def test_interleaved_chunks_count_each_ranks_stages():
    """interleaved-1f1b with 2 chunks on 2 ranks: 4 stages, rank 0 holds stages 0 and 2, rank 1 stages 1 and 3."""
    layers = profile_layers(mlp(), torch.randn(4, IN))
    schedule = build("interleaved-1f1b", 2, 4, chunks=2)
    ranges = [(0, 1), (1, 2), (2, 3), (3, 5)]
    ranks = memory(layers, pp=2, microbatches=4, schedule=schedule, boundaries=ranges)
    assert [r.params for r in ranks] == [F32 * (IN * HIDDEN + HIDDEN + HIDDEN * MID + MID), F32 * (MID * OUT + OUT)]
    timed = with_times(layers, [(1e-3, 2e-3)] * len(layers))
    predicted = step(timed, pp=2, microbatches=4, schedule=schedule, boundaries=ranges, alpha_beta=FREE)
    busy = sum(predicted.pipeline.busy_time.values())
    assert busy == pytest.approx(4 * sum(predicted.forward_s) + 4 * sum(predicted.backward_s))


def test_gradient_accumulation_holds_one_micro_batch():
    [rank] = memory(profile_layers(mlp(), torch.randn(4, IN)), microbatches=4, schedule="gpipe")
    assert rank.activations == ACTIVATION_PER_SAMPLE * 2


def test_the_closed_form_for_fp32_agrees_with_the_per_tensor_prediction():
    layers = profile_layers(mlp(), torch.randn(4, IN))
    for zero in (0, 2):
        [rank] = memory(layers, dp=2, zero=zero)
        assert rank.params + rank.grads + rank.optimizer == fp32_zero_bytes(PSI, 2, zero)
    # ZeRO-2 in FSDP2 holds the separate sharded copy the paper's ZeRO-2 does not
    assert fp32_zero_bytes(PSI, 2, 2) - (4 * PSI + 12 * PSI / 2) == 4 * PSI / 2


def test_the_zero_papers_example():
    """Ψ = 7.5B parameters on N = 64 devices with K = 12 (ZeRO paper, figure 1): 120, 31.4, 16.6 and 1.9 GB."""
    figures = [round(zero_paper_bytes(7.5e9, 64, stage) / 1e9, 1) for stage in range(4)]
    assert figures == [120.0, 31.4, 16.6, 1.9]


# ---------------------------------------------------------------------------------------------------------------
# The prediction against the meter, one process (dp = pp = tp = 1)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build,sample,loss", [
    (mlp, lambda b: torch.randn(b, IN), lambda out: out.pow(2).mean()),
    (gpt, lambda b: tokens(b), lambda out: out.logsumexp(-1).mean()),
])
def test_predict_memory_matches_what_a_step_holds(build, sample, loss):
    model, batch = build(), 6
    predicted = memory(profile_layers(build(), sample(2)), batch=batch)[0]
    optimizer = torch.optim.Adam(model.parameters())
    with ActivationMeter() as meter:
        loss(model(sample(batch))).backward()
    optimizer.step()
    held = state_bytes(model, optimizer)
    assert (predicted.params, predicted.grads, predicted.optimizer) == (held["params"], held["grads"],
                                                                       held["optimizer"])
    assert abs(predicted.activations - meter.peak_bytes) <= 0.10 * meter.peak_bytes
    assert meter.live_bytes == 0


# ---------------------------------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------------------------------

FREE = AlphaBeta(alpha=0.0, beta=0.0)
COSTLY = AlphaBeta(alpha=1e-5, beta=1e-9)


def timed_mlp(forward: float = 1e-3, backward: float = 2e-3):
    layers = profile_layers(mlp(), torch.randn(4, IN))
    return with_times(layers, [(forward, backward)] * len(layers))


def step(layers, **plan):
    args = dict(dp=1, pp=1, tp=1, zero=0, boundaries=None, microbatches=1, schedule="1f1b", batch=8)
    return predict_step_seconds(layers, **{**args, **plan})


def test_one_rank_computes_every_micro_batch_in_turn():
    layers = timed_mlp()
    predicted = step(layers, microbatches=4, alpha_beta=FREE)
    per_microbatch = 2 * 5 * (1e-3 + 2e-3)  # 2 samples through 5 layers
    assert predicted.makespan_s == pytest.approx(4 * per_microbatch)
    assert predicted.total_s == pytest.approx(4 * per_microbatch) and predicted.bubble_fraction == pytest.approx(0)


def test_a_pipeline_of_equal_stages_has_1f1bs_bubble():
    layers = with_times(profile_layers(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), torch.randn(2, 8)),
                        [(1e-3, 2e-3)] * 2)
    p, m = 2, 4
    predicted = step(layers, pp=p, microbatches=m, alpha_beta=FREE)
    assert predicted.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    with_messages = step(layers, pp=p, microbatches=m, alpha_beta=COSTLY)
    assert with_messages.pp_message_s == pytest.approx(COSTLY.predict(F32 * 8 * 2))  # 8 features, 2 samples
    assert with_messages.makespan_s > predicted.makespan_s


@pytest.mark.parametrize("zero,collectives", [(0, 1.0), (1, 1.5)])
def test_data_parallel_sync_is_a_ring_all_reduce_of_the_gradients(zero, collectives):
    predicted = step(timed_mlp(), dp=2, zero=zero, alpha_beta=COSTLY)
    assert predicted.dp_sync_s == [pytest.approx(collectives * COSTLY.ring(F32 * PSI, 2))]
    assert predicted.total_s == pytest.approx(predicted.makespan_s + predicted.dp_sync_s[0])


def test_fsdp2_gathers_and_reduce_scatters_each_layer_every_micro_batch():
    predicted = step(timed_mlp(), dp=2, zero=3, microbatches=2, alpha_beta=COSTLY)
    per_layer = [F32 * n for n in (IN * HIDDEN + HIDDEN, HIDDEN * MID + MID, MID * OUT + OUT)]
    assert predicted.dp_sync_s == [pytest.approx(2 * sum(1.5 * COSTLY.ring(b, 2) for b in per_layer))]


def test_tensor_parallel_halves_the_split_compute_and_adds_two_all_reduces_per_pair():
    layers = timed_mlp()
    whole, split = step(layers, alpha_beta=COSTLY), step(layers, tp=2, alpha_beta=COSTLY)
    assert split.tp_forward_s == [pytest.approx(COSTLY.ring(F32 * MID * 8, 2))]
    assert split.tp_backward_s == [pytest.approx(COSTLY.ring(F32 * IN * 8, 2))]
    shares = [1 - layer.tp_params / layer.params / 2 if layer.params else 1 for layer in layers]
    assert split.forward_s == [pytest.approx(sum(1e-3 * 8 * s for s in shares))]
    assert split.forward_s[0] < whole.forward_s[0]


def test_time_layers_measures_every_layer_and_leaves_the_model_alone():
    model = mlp()
    times = time_layers(model, torch.randn(16, IN), repeats=3, device=torch.device("cpu"))
    assert len(times) == len(model) and all(f > 0 and b >= 0 for f, b in times)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Refusals: one line each
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,plan,message", [
    (gpt, dict(tp=3), "tp=3 does not divide the model's 4 heads"),
    (lambda: gpt(heads=2, hidden=18), dict(tp=2), None),  # 2 heads of 9 and 18 hidden: fine
    (lambda: nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8)), dict(tp=4),
     "tp=4 does not divide the 6 features between 0 and 2"),
    (mlp, dict(pp=6), "pp=6 needs at least 6 layers"),
    (mlp, dict(dp=3), "a batch of 8 does not split into dp=3"),
    (mlp, dict(dp=2, microbatches=3), "each replica's 4 samples do not split into 3 equal micro-batches"),
    (mlp, dict(zero=4), "zero must be a ZeRO stage 0, 1, 2 or 3, got 4"),
    (lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), dict(tp=2), "no pair of Linear layers to split"),
    (mlp, dict(tp=2, pp=2, boundaries=[(0, 1), (1, 5)]), "cut the tensor-parallel pair (0, 2) between two stages"),
    (mlp, dict(tp=2, pp=2), "boundaries [(0, 2), (2, 5)] cut the tensor-parallel pair (0, 2)"),  # balanced cut
    (mlp, dict(tp=2, pp=2, boundaries=[(0, 3), (3, 5)]), None),
    (mlp, dict(pp=2, boundaries=[(0, 2), (3, 5)]), "must be 2 non-empty (first, end) layer ranges"),
])
def test_check_shape_refuses_impossible_plans_in_one_line(model, plan, message):
    args = dict(dp=1, pp=1, tp=1, zero=0, microbatches=1, batch=8)
    if message is None:
        check_shape(model(), **{**args, **plan})
        return
    with pytest.raises(DistUsageError, match=re.escape(message)) as error:
        check_shape(model(), **{**args, **plan})
    assert "\n" not in str(error.value)


def test_predictions_refuse_what_they_cannot_price():
    layers = profile_layers(mlp(), torch.randn(4, IN))
    with pytest.raises(DistUsageError, match="unknown optimizer 'lamb'"):
        memory(layers, optimizer="lamb")
    with pytest.raises(DistUsageError, match="no layer times yet"):
        step(layers)
    with pytest.raises(DistUsageError, match="but the plan has pp=2 and microbatches=2"):
        memory(layers, pp=2, microbatches=2, schedule=build("1f1b", 2, 4))
    with pytest.raises(DistUsageError, match="1f1b needs microbatches >= stages"):
        memory(layers, pp=2, microbatches=1)


# The step split into terms (the local accuracy table's "term that dominates")
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [dict(microbatches=4), dict(dp=2, zero=1), dict(dp=2, zero=3, microbatches=2),
                                  dict(tp=2), dict(pp=2, microbatches=4), dict(pp=2, microbatches=4, schedule="gpipe")])
def test_the_terms_of_a_step_add_up_to_it(plan):
    layers = with_times(profile_layers(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), torch.randn(2, 8)),
                        [(1e-3, 2e-3)] * 3)
    extra = Overheads(tp_linear=(1e-4, 2e-4), fsdp_unit=(3e-4, 4e-4), optimizer_per_param=1e-6)
    predicted = step(layers, alpha_beta=COSTLY, overheads=extra, **plan)
    terms = predicted.terms()
    assert sum(terms.values()) == pytest.approx(predicted.total_s)
    assert all(seconds >= 0 for seconds in terms.values()), terms
    m = plan.get("microbatches", 1)
    assert terms["optimizer"] == pytest.approx(max(predicted.optimizer_s))
    assert terms["data-parallel sync"] == pytest.approx(max(predicted.dp_sync_s))
    assert (terms["tensor-parallel all-reduces"] > 0) == (plan.get("tp", 1) > 1)
    assert (terms["pipeline bubbles and messages"] > 0) == (plan.get("pp", 1) > 1)
    if plan.get("pp", 1) == 1:  # one stage: its compute, every micro-batch in turn
        samples = 8 // plan.get("dp", 1) // m
        assert terms["compute"] == pytest.approx(m * samples * sum(
            (1e-3 + 2e-3) * (1 - l.tp_params / l.params * (1 - 1 / plan.get("tp", 1)) if l.params else 1.0)
            for l in layers))


def test_the_dominant_term_is_the_largest():
    predicted = step(timed_mlp(), dp=2, alpha_beta=AlphaBeta(alpha=1.0, beta=0.0))  # a link of 1 s a message
    assert predicted.dominant() == "data-parallel sync"
    assert step(timed_mlp(), alpha_beta=FREE).dominant() == "compute"


def test_ranks_sharing_the_cores_stretch_a_step_only_where_they_are_busy_at_once():
    """4 CPU ranks on 2 cores compute 2x slower while all are busy. With one stage (dp, tp) every rank is busy the
    whole schedule: the step is its alone-time x 2. In a pipeline, warm-up and cool-down keep some stages idle:
    there the busy ones have the cores to themselves, so the stretch is less than the whole schedule's."""
    layers = timed_mlp()
    alone = step(layers, dp=2, alpha_beta=COSTLY)
    shared = step(layers, dp=2, alpha_beta=COSTLY, contention=2.0)
    assert shared.makespan_s == pytest.approx(2 * alone.makespan_s)  # the schedule as it runs: x 2
    assert shared.shared_cores_s == pytest.approx(alone.makespan_s)
    assert shared.forward_s == alone.forward_s  # each stage's price is a rank's alone
    assert shared.terms()["ranks sharing the cores"] == pytest.approx(shared.shared_cores_s)
    assert sum(shared.terms().values()) == pytest.approx(shared.total_s)
    piped = step(layers, pp=2, microbatches=2, alpha_beta=COSTLY, contention=2.0)
    by_itself = step(layers, pp=2, microbatches=2, alpha_beta=COSTLY)
    assert 0 < piped.shared_cores_s < by_itself.makespan_s  # less than 2x: somewhere only one stage computes
    assert piped.makespan_s == pytest.approx(by_itself.makespan_s + piped.shared_cores_s)
    assert sum(piped.terms().values()) == pytest.approx(piped.total_s)
    assert step(layers, pp=2, microbatches=2, alpha_beta=COSTLY).shared_cores_s == 0.0  # a rank per core


def test_a_rank_waiting_for_a_message_shares_the_cores_only_while_it_polls_without_sleeping():
    """The MPI backend's waits test without pause for YIELD_SECONDS, then sleep between tests (cost/waiting.py):
    a stage waiting in a pipeline's warm-up slows its host's busy ranks for that window only."""
    from nbdist.cost.waiting import YIELD_SECONDS
    from nbdist.schedules.simulate import Timeline
    from nbdist.sharding.step_time import sharing_the_cores

    long = 10 * YIELD_SECONDS
    timeline = Timeline.from_spans({0: [("0F0", 0.0, long)], 1: [("1RECV_F0", 0.0, long), ("1F0", long, 2 * long)]},
                                   unit="")
    shared = sharing_the_cores(timeline, contention=2.0)  # 2 stages: both busy -> 2x, one busy -> 1x
    assert shared.makespan == pytest.approx(2 * long + YIELD_SECONDS)  # only the poll's first window doubled
    assert sharing_the_cores(timeline, contention=1.0) is timeline
