"""The line a lab prints after it measures what the learner predicted (nbdist/verdicts.py)."""
from __future__ import annotations

import math

import pytest

from nbdist.errors import DistUsageError
from nbdist.verdicts import compare


def test_a_close_number_says_how_far_and_which_way():
    verdict = compare("bubble fraction", 0.3, 0.375)
    assert verdict.close is True
    assert "20% low" in str(verdict) and "0.3" in str(verdict) and "0.375" in str(verdict)


def test_a_far_number_is_a_ratio_written_for_people():
    verdict = compare("step time", 5.0, 0.05, "s")
    assert verdict.close is False
    assert "×100 of it" in str(verdict) and "e+" not in str(verdict)


def test_a_prediction_not_yet_written_is_told_not_scored():
    for blank in (..., None):
        verdict = compare("speed-up", blank, 1.8)
        assert verdict.close is None and "no prediction written" in str(verdict)


def test_a_prediction_of_zero_or_of_the_other_sign_says_the_difference_not_a_ratio():
    """Lab 39 printed "×0.00 of it" for a prediction of 0 calls against 1 measured: a ratio reads nothing there."""
    assert str(compare("calls per step", 0, 1, "calls")) == (
        "calls per step: you predicted 0 calls, measured 1 call: 1 call low (far; within 25% counts as close)")
    assert "5 s high" in str(compare("lag", 2.0, -3.0, "s")) and "×" not in str(compare("lag", 2.0, -3.0, "s"))
    assert compare("skips", 0, 0, "steps").close is True


def test_one_of_a_counted_unit_is_singular():
    assert "measured 1 call" in str(compare("calls", ..., 1, "calls"))
    assert "you predicted 1 step, measured 2 steps" in str(compare("skips", 1, 2, "steps"))
    assert "measured 1 ms" in str(compare("time", 1.2, 1, "ms"))  # a symbol keeps its letters


def test_a_choice_is_right_or_not_ignoring_case():
    assert compare("faster algorithm", " Ring", "ring").close is True
    assert compare("faster algorithm", "tree", "ring").close is False


@pytest.mark.parametrize("args, message", [
    (("", 1, 1), "what must name"),
    (("x", 1, 1, "", 0), "tolerance"),
    (("x", math.inf, 1), "finite"),
])
def test_bad_input_is_one_line(args, message):
    with pytest.raises(DistUsageError, match=message):
        compare(*args)


def test_a_verdict_reads_as_its_line_wherever_it_is_shown():
    verdict = compare("speed-up", 1.5, 1.8)
    assert repr(verdict) == str(verdict) == verdict._repr_markdown_() == verdict.line


def test_the_old_module_name_still_works_and_says_the_new_one():
    import importlib
    import sys

    sys.modules.pop("nbdist.predict", None)
    with pytest.warns(FutureWarning, match="nbdist.verdicts"):
        old = importlib.import_module("nbdist.predict")
    assert old.compare is compare
