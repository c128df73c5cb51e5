"""What labs 34-38 say in prose, checked against the code that decides it (no cluster, no notebook run).

A lab prints what a run measures; these are the claims a run does not print: a model's size written in the text,
a default the text names, a cost the text quotes. The labs' predict-then-run cells and nbgrader exercises:
tests/test_lab_conventions.py.
"""
from __future__ import annotations

import inspect
import json
import re
import timeit
from pathlib import Path

import pytest

from nbdist import models, schedules
from nbdist.cost import collectives
from nbdist.training import trainer as trainer_module

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def cells(lab: str) -> list[dict]:
    return json.loads((NOTEBOOKS / f"{lab}.ipynb").read_text(encoding="utf-8"))["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def markdown(lab: str) -> str:
    return "\n".join(text(c) for c in cells(lab) if c["cell_type"] == "markdown")


# -- claims in the prose --------------------------------------------------------------------------------------------


def test_35_names_the_parameter_count_of_its_model():
    """The lab's model_fn builds this MLP; the prose says how many parameters all-reduce exchanges."""
    source = next(text(c) for c in cells("35_sync_vs_async") if "def model_fn" in text(c))
    assert "models.mlp(width=64, layers=3, inputs=16, outputs=1, seed=0)" in source
    count = sum(p.numel() for p in models.mlp(width=64, layers=3, inputs=16, outputs=1, seed=0).parameters())
    said = re.search(r"this model's ([\d,]+) parameters", markdown("35_sync_vs_async"))
    assert said and int(said.group(1).replace(",", "")) == count


def test_35_easgd_alpha_is_the_papers_beta_over_the_replicas():
    from nbdist.training.ranks import sync_modes

    assert "here 0.9/4" in markdown("35_sync_vs_async")
    assert sync_modes.EASGD_BETA == 0.9
    assert sync_modes.check_options("easgd", {}, 4)["alpha"] == pytest.approx(0.9 / 4)


def test_35_local_sgd_communicates_on_warmup_and_averaging_steps_as_the_exercise_says():
    """The exercise's rule is the one the synchronizer's docstring and torch's PeriodicModelAverager state."""
    from nbdist.training.ranks import sync_modes

    assert "(step - warmup) % period == 0" in inspect.getsource(sync_modes.LocalSGD.step).replace(
        "self.steps", "step")


def test_37_ring_all_reduce_bytes_per_rank_are_2_n_minus_1_over_n():
    """'1x on 2 ranks, 1.5x on 4, approaching 2x as n grows' (the lab prints the same from nbdist.cost)."""
    prose = markdown("37_scaling")
    assert "1× on 2 ranks, 1.5× on\n4, approaching 2× as n grows" in prose
    assert collectives.busiest_rank_share("ring", 2) == 1.0
    assert collectives.busiest_rank_share("ring", 4) == 1.5
    shares = [collectives.busiest_rank_share("ring", n) for n in (2, 4, 8, 64, 1024)]
    assert shares == sorted(shares) and 1.99 < shares[-1] < 2


def test_34_evaluates_with_the_trainers_default_number_of_eval_batches():
    source = next(text(c) for c in cells("34_training_dashboard") if "eval_batches=4" in text(c))
    assert "range(4)" in source
    assert inspect.signature(trainer_module.Trainer).parameters["eval_batches"].default == 4


def test_38_flight_recorder_costs_a_few_hundred_nanoseconds_per_call_and_keeps_512():
    import torch

    from nbdist.debugging.ranks import recorder

    assert "a few hundred nanoseconds per call" in markdown("38_debugging")
    assert "ring of 512" in markdown("38_debugging") and "last 512 calls" in markdown("38_debugging")
    assert recorder.SIZE == 512
    calls = 20_000
    best = min(timeit.repeat(lambda: recorder.end(recorder.begin(("world", (0, 1)), 1, "all_reduce", None, 256,
                                                                 torch.float32)), number=calls, repeat=5))
    assert best / calls < 1e-6, f"{best / calls * 1e9:.0f} ns per recorded call"


def test_38_the_exercise_formula_is_the_simulators_bubble():
    for p, m in ((2, 4), (4, 8), (8, 8)):
        assert schedules.simulate(schedules.build("1f1b", p, m)).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
