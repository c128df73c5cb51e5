"""What labs 30-33 say in prose, checked against the code that decides it (no cluster, no notebook run).

A lab prints what its run measures; these are the claims a run does not print: the rule DDP fills its buckets by,
the PowerSGD settings nbdist picks against torch's defaults, which tensors PowerSGD compresses, the ZeRO formulas
and the paper's example, the mesh's rank order, what one tensor-parallel rank holds. The labs' predict-then-run
cells and nbgrader exercises: tests/test_lab_conventions.py.
"""
from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from nbdist import models
from nbdist.cost.memory import fp32_zero_bytes, zero_paper_bytes
from nbdist.data_parallel.ranks.hooks import _powersgd_state
from nbdist.layout import Layout
from nbdist.sharding.memory import predict_memory
from nbdist.sharding.profile import profile_layers, sample_input


def big_gpt():
    return models.gpt(vocab=256, seq=32, layers=4, hidden=256, heads=4, seed=0)


def small_gpt():
    return models.gpt(vocab=256, seq=32, layers=4, hidden=64, heads=4, seed=0)


# -- lab 30 ---------------------------------------------------------------------------------------------------------


def test_ddp_buckets_close_at_the_cap_so_the_smallest_cap_gives_one_bucket_per_tensor_above_it():
    """Lab 30, section 3: 'close it as soon as it holds bucket_cap_mb or more', so at 0.1 MiB there are as many
    buckets as tensors larger than the cap (not one per tensor), and a bucket can exceed its cap."""
    params = list(reversed(list(big_gpt().parameters())))  # DDP fills buckets from the model's end
    cap = int(0.1 * 2**20)
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [cap])
    larger = sum(p.numel() * p.element_size() > cap for p in params)
    assert len(buckets) == larger < len(params)
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in buckets]
    assert max(sizes) > cap
    assert all(size >= cap for size in sizes[:-1])  # every bucket but the last closed at or past its cap


def test_powersgd_starts_at_step_2_in_nbdist_where_torch_defaults_to_1000():
    """Lab 30, section 4: 'nbdist builds torch's PowerSGDState with start_powerSGD_iter=2, where torch's default is
    1000', and min_compression_rate keeps torch's default of 2."""
    torch_defaults = inspect.signature(powerSGD_hook.PowerSGDState.__init__).parameters
    assert torch_defaults["start_powerSGD_iter"].default == 1000
    state = _powersgd_state(None).powersgd
    assert state.start_powerSGD_iter == 2
    assert state.min_compression_rate == torch_defaults["min_compression_rate"].default == 2


def test_powersgd_never_compresses_a_1d_tensor():
    """Lab 30, section 4: a bias or LayerNorm weight (m = 1) never passes torch's min_compression_rate test."""
    for n in (1, 64, 4096, 2**20):
        assert not powerSGD_hook._should_compress(n, 1, 1, 2)[0]
    compressed = [p for p in small_gpt().parameters()
                  if powerSGD_hook._should_compress(p.shape[0], p.numel() // p.shape[0], 1, 2)[0]]
    assert compressed and all(p.dim() == 2 for p in compressed)


# -- lab 31 ---------------------------------------------------------------------------------------------------------


def test_one_tp_rank_holds_the_split_linears_share_and_every_whole_part():
    """Lab 31, exercise 3: the rule the solution states (column Linears split, row Linears' weights split, their
    biases and everything else whole) is the plan's prediction of one rank's parameters under tp=2."""
    model = small_gpt()
    column, row = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc."), ("attn.out.", "mlp.proj.")
    by_rule = 4 * sum(p.numel() // 2 if any(c in n for c in column) or (any(r in n for r in row)
                                                                         and n.endswith("weight")) else p.numel()
                      for n, p in model.named_parameters())
    layers = profile_layers(model, sample_input(model), tp=2)
    plan = predict_memory(layers, dp=1, pp=1, tp=2, zero=0, boundaries=None, microbatches=1, schedule="1f1b",
                          batch=2)
    assert by_rule == plan[0].params
    assert by_rule > 4 * sum(p.numel() for p in model.parameters()) / 2  # 'a little more than half'


# -- lab 32 ---------------------------------------------------------------------------------------------------------


def test_zero_paper_example_is_the_papers_figure_1():
    """Lab 32, exercise 1: Ψ = 7.5 B, N = 64, K = 12 gives 120, 31.4, 16.6 and 1.9 GB (arXiv 1910.02054, figure 1)."""
    assert [round(zero_paper_bytes(7.5e9, 64, s, k=12) / 1e9, 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("n", [2, 4, 64])
def test_fsdp2_zero2_beats_zero1_in_fp32_only_past_two_ranks(n):
    """Lab 32, exercise 3: 8Ψ + 8Ψ/N against 4Ψ + 16Ψ/N, equal at N = 2."""
    psi = 1_000_000
    one, two = fp32_zero_bytes(psi, n, 1), fp32_zero_bytes(psi, n, 2)
    assert (one == two) if n == 2 else (two < one)


# -- lab 33 ---------------------------------------------------------------------------------------------------------


def test_the_mesh_numbers_ranks_pp_outermost_tp_innermost():
    """Lab 33, section 1 and its exercise: rank = (pp · dp_size + dp) · tp_size + tp."""
    mesh = Layout(pp=2, dp=2, tp=2).mesh()
    for rank in range(8):
        c = mesh.coords(rank)
        assert (c["pp"] * 2 + c["dp"]) * 2 + c["tp"] == rank
    assert mesh.groups("tp")[0] == [0, 1]
