"""Scaling sweeps (nbdist/training/scaling.py, nbdist/viz/scaling.py): the laws and the serial-fraction fit against
values computed by hand, the measurement's arithmetic on hand-made step records, and one real sweep over 1 and 2
engines in a real IPython kernel (where it replaces the kernel's cluster, as it does in a notebook)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from nbdist.errors import DistUsageError
from nbdist.training import scaling
from nbdist.training.scaling import Measurement, Scaling, Sweep, amdahl, fit_serial_fraction, gustafson, karp_flatt
from nbdist.viz.scaling import scaling_figure

# -- the laws, by hand ------------------------------------------------------------------------------------------------


def test_amdahl_gustafson_and_karp_flatt_match_values_computed_by_hand():
    assert amdahl(4, 0.25) == pytest.approx(16 / 7)  # 1 / (0.25 + 0.75 / 4) = 1 / 0.4375
    assert amdahl(2, 0.1) == pytest.approx(1 / 0.55)
    assert [amdahl(8, 0.0), amdahl(8, 1.0)] == [8.0, 1.0]  # all parallel: n; all serial: 1
    assert gustafson(4, 0.25) == 3.25  # 4 - 0.25 * 3
    assert [gustafson(8, 0.0), gustafson(8, 1.0)] == [8.0, 1.0]
    assert karp_flatt(2, 1.6) == pytest.approx(0.25)  # (1/1.6 - 1/2) / (1 - 1/2)
    assert karp_flatt(4, 4.0) == 0.0


@pytest.mark.parametrize("f", [0.1, 0.0, -0.05, 1.1])  # serial, none, super-linear, slower than one engine
def test_the_fit_recovers_the_serial_fraction_of_exact_speed_ups(f):
    engines = [1, 2, 4, 8]
    assert fit_serial_fraction(engines, [amdahl(n, f) for n in engines]) == pytest.approx(f, abs=1e-12)
    assert fit_serial_fraction(engines, [gustafson(n, f) for n in engines], "gustafson") == pytest.approx(f, abs=1e-12)


def test_the_fit_of_measurements_no_law_explains_exactly_matches_hand_computed_least_squares():
    # One informative point: Amdahl passes through it, 2 / (1 + f) = 1.6.
    assert fit_serial_fraction([1, 2], [1.0, 1.6]) == pytest.approx(0.25, abs=1e-12)
    # Two measurements at n = 2: the least-squares S(2) is their mean 1.8, so f = 2 / 1.8 - 1 = 1/9.
    assert fit_serial_fraction([2, 2], [1.6, 2.0]) == pytest.approx(1 / 9, abs=1e-12)
    # Gustafson is linear in f: f = sum((n-1)(n-S)) / sum((n-1)^2) = (1 * 0.2 + 3 * 0.9) / (1 + 9) = 0.29.
    assert fit_serial_fraction([1, 2, 4], [1.0, 1.8, 3.1], "gustafson") == pytest.approx(0.29, abs=1e-12)


def test_the_amdahl_fit_is_the_least_squares_minimum_found_by_brute_force():
    engines, speedups = [1, 2, 4], [1.0, 1.6, 2.5]  # Karp-Flatt fractions 0.25 and 0.2: no f fits both
    f = fit_serial_fraction(engines, speedups)
    grid = np.linspace(0.0, 0.5, 500_001)
    errors = sum((s - 1 / (grid + (1 - grid) / n)) ** 2 for n, s in zip(engines, speedups))
    assert f == pytest.approx(grid[errors.argmin()], abs=2e-6)
    assert 0.2 < f < 0.25


def test_the_fit_refuses_what_cannot_be_fitted_in_one_line():
    with pytest.raises(DistUsageError, match="more than one engine"):
        fit_serial_fraction([1], [1.0])
    with pytest.raises(DistUsageError, match="positive"):
        fit_serial_fraction([1, 2], [1.0, 0.0])
    with pytest.raises(DistUsageError, match="unknown law"):
        fit_serial_fraction([1, 2], [1.0, 1.5], "moore")


# -- measurements and their views, from hand-made step records ------------------------------------------------------


def record(step: int, starts: tuple, ends: tuple, compute: tuple, samples: int = 8) -> dict:
    """One History record with a rank per entry of starts / ends / compute (comm 1 ms, idle 0.5 ms each)."""
    ranks = {r: {"started": s, "ended": e, "compute_s": c, "comm_s": 0.001, "idle_s": 0.0005}
             for r, (s, e, c) in enumerate(zip(starts, ends, compute))}
    return {"step": step, "loss": 5.0 - step, "lr": 1e-3, "samples": samples, "ranks": ranks}


def test_a_measurement_reads_periods_median_and_split_from_the_history():
    rows = [record(3, (10.000, 10.001), (10.020, 10.021), (0.010, 0.012)),
            record(4, (10.030, 10.030), (10.050, 10.052), (0.014, 0.016)),
            record(5, (10.060, 10.062), (10.100, 10.110), (0.011, 0.013))]
    m = Measurement.from_history(rows, engines=2, device="cpu", threads=1)
    # periods: start to next start (earliest rank), the last one to the last rank's end: 0.03, 0.03, 0.05
    assert m.periods == pytest.approx((0.030, 0.030, 0.050))
    assert m.step_seconds == pytest.approx(0.030) and m.samples_per_second == pytest.approx(8 / 0.030)
    # the split: median over steps of the ranks' mean: compute medians of 0.011, 0.015, 0.012 -> 0.012
    assert m.split["compute_s"] == pytest.approx(0.012)
    assert m.split["comm_s"] == pytest.approx(0.001) and m.split["idle_s"] == pytest.approx(0.0005)
    assert m.split["between_s"] == pytest.approx(0.030 - 0.012 - 0.001 - 0.0005)
    assert m.losses == (2.0, 1.0, 0.0) and m.steps == 3


def measurement(n: int, batch: int, seconds: float) -> Measurement:
    split = {"compute_s": seconds / 2, "comm_s": seconds / 4, "idle_s": 0.0, "between_s": seconds / 4}
    return Measurement(n, batch, (seconds,) * 3, split, (1.0,), "cpu", 1)


def test_scaling_speed_ups_efficiency_table_and_figure_follow_the_measurements():
    strong = Scaling("strong", (measurement(1, 48, 0.030), measurement(2, 48, 0.020), measurement(4, 48, 0.015)))
    weak = Scaling("weak", (measurement(1, 16, 0.010), measurement(2, 32, 0.011), measurement(4, 64, 0.016)))
    assert strong.speedups == pytest.approx([1.0, 1.5, 2.0]) and strong.efficiencies == pytest.approx([1, .75, .5])
    assert weak.speedups == pytest.approx([1.0, 2 / 1.1, 4 / 1.6])
    assert strong.serial_fraction == fit_serial_fraction([1, 2, 4], [1.0, 1.5, 2.0], "amdahl")
    assert weak.serial_fraction == pytest.approx(fit_serial_fraction([1, 2, 4], weak.speedups, "gustafson"))
    text = str(Sweep(strong, weak, cores=2))
    assert "strong scaling: global batch 48" in text and "weak scaling: batch 16 per rank" in text
    assert [line.endswith("(engines share cores)") for line in text.splitlines() if line.startswith("      ")] == [
        False, False, True] * 2  # 4 engines on 2 cores
    assert f"f = {strong.serial_fraction:.3f} (Amdahl" in text and f"f = {weak.serial_fraction:.3f} (Gustafson" in text

    fig = Sweep(strong, weak, cores=2).figure()
    measured = [t for t in fig.data if t.name == "measured"]
    assert [list(t.x) for t in measured] == [[1, 2, 4]] * 2
    assert [list(t.y) for t in measured] == [pytest.approx(strong.speedups), pytest.approx(weak.speedups)]
    curves = [t for t in fig.data if t.name.startswith(("Amdahl", "Gustafson"))]
    assert [t.name for t in curves] == [f"Amdahl, fitted f = {strong.serial_fraction:.3f}",
                                        f"Gustafson, fitted f = {weak.serial_fraction:.3f}"]
    assert curves[0].y[-1] == pytest.approx(amdahl(8, strong.serial_fraction))  # drawn out to 2 x 4 engines
    compute = [t for t in fig.data if t.name == "compute"]
    assert [list(t.y) for t in compute] == [pytest.approx([15.0, 10.0, 7.5]), pytest.approx([5.0, 5.5, 8.0])]


def test_scaling_figure_draws_only_the_data_it_is_given():
    panel = {"title": "t", "engines": [1, 3], "speedup": [1.0, 2.5], "hover": ["a", "b"],
             "curve": {"engines": [1, 6], "speedup": [1.0, 4.0], "name": "law"},
             "split": {"compute_s": [0.002, 0.001]}}
    fig = scaling_figure([panel])
    assert {t.name for t in fig.data} == {"ideal: S(n) = n", "law", "measured", "compute"}
    ideal = next(t for t in fig.data if t.name.startswith("ideal"))
    assert list(ideal.x) == list(ideal.y) == [1, 6]


@pytest.mark.parametrize("arguments, message", [
    ({"engines": (2, 4), "batch_size": 8}, "must include 1"),
    ({"engines": (1, 1, 2), "batch_size": 8}, "distinct"),
    ({"engines": (1, 2, 4), "batch_size": 6}, "does not split evenly over 4 engines"),
    ({"engines": (1, 2)}, "give batch_size="),
    ({"engines": (1, 2), "per_rank": 0}, "per_rank must be at least 1"),
    ({"engines": (1, 2), "per_rank": 4, "cluster_options": {"engine": 2}}, "unknown cluster option"),
])
def test_a_sweep_refuses_bad_arguments_in_one_line_before_starting_anything(arguments, message):
    with pytest.raises(DistUsageError, match=message):
        scaling.sweep(len, len, len, len, **arguments)


# -- one real sweep ------------------------------------------------------------------------------------------------

SWEEP = """
import json, os, time, torch
import nbdist
from nbdist import models
from nbdist.training import scaling

def model_fn():
    from nbdist import models
    return models.gpt(vocab=256, seq=16, layers=2, hidden=32, heads=4, seed=0)

def data_fn():
    from nbdist import data
    return data.text_dataset(seq=16, max_bytes=1 << 15)

def adam(params):
    import torch
    return torch.optim.Adam(params, lr=1e-3)

c = nbdist.start(2)
started = time.perf_counter()
result = scaling.sweep(model_fn, data_fn, models.lm_loss, adam, engines=(1, 2), batch_size=8, per_rank=4, steps=4,
                       warmup=1)
wall = time.perf_counter() - started
left = nbdist.current()
default_threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())  # nbdist's for a lone engine
out = {"wall": wall, "left": left.world_size, "threads_left": left.run(torch.get_num_threads),
       "default_threads": default_threads}
for s in result.kinds:
    out[s.kind] = {"engines": s.engines, "speedups": s.speedups, "f": s.serial_fraction,
                   "batches": [m.batch_size for m in s.measurements], "losses": [m.losses for m in s.measurements],
                   "periods": [m.periods for m in s.measurements], "threads": [m.threads for m in s.measurements]}
print("RESULT " + json.dumps(out))
nbdist.stop()
"""


def test_a_real_sweep_over_1_and_2_engines_measures_the_same_training_and_fits_it(kernel):
    ran = kernel.execute(SWEEP, timeout=120)
    assert ran.error is None, ran.shown
    out = json.loads(ran.stdout.split("RESULT ", 1)[1])
    lines = ran.stdout.splitlines()
    # the kernel's running 2-engine cluster is measured first (it can be kept), then 1 engine, which is left
    assert lines[0].startswith("2 engine(s): strong") and lines[1].startswith("1 engine(s): strong"), ran.stdout
    assert out["left"] == 1 and "the cluster left running has 1 engine(s)" in ran.stdout
    # torch threads: 1 per engine while measuring, then nbdist's default again (a lone engine gets every core)
    assert out["threads_left"] == [out["default_threads"]]
    strong, weak = out["strong"], out["weak"]
    for kind in (strong, weak):
        assert kind["engines"] == [1, 2] and kind["threads"] == [1, 1]
        assert [len(p) for p in kind["periods"]] == [4, 4] and all(t > 0 for p in kind["periods"] for t in p)
        assert kind["speedups"][0] == 1.0
    assert strong["batches"] == [8, 8] and weak["batches"] == [4, 8]
    # every measured second happened inside the sweep
    assert sum(t for kind in (strong, weak) for p in kind["periods"] for t in p) < out["wall"]
    # strong scaling compares like with like: the same global batches train the same model on 1 and 2 engines
    assert strong["losses"][0] == pytest.approx(strong["losses"][1], abs=1e-5)
    # with one informative engine count, each fitted law passes through the measured speed-up
    assert amdahl(2, strong["f"]) == pytest.approx(strong["speedups"][1], abs=1e-9)
    assert gustafson(2, weak["f"]) == pytest.approx(weak["speedups"][1], abs=1e-9)
