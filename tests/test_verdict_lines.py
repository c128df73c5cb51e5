"""The parser that reads a lab's printed verdicts back (tests/verdict_lines.py), on lines measured.py makes."""
from verdict_lines import contradictions

from nbdist.measured import Repeats, compared, order, ranking, this_run


def test_the_parser_accepts_what_measured_prints_and_catches_a_swapped_verdict():
    fast, slow = Repeats((22.0, 29.0, 99.0), "µs"), Repeats((414.0, 471.0, 474.0), "µs")
    lines = this_run(compared(fast, slow, "MPI directly", "the backend, at 1 KiB"),
                     compared(slow, Repeats((300.0, 500.0, 450.0), "µs"), "a", "b"),
                     order(Repeats((2.0, 2.5, 1.9), "x"), Repeats((4.9,), "x"), "16 MiB", "1 KiB", "smaller"),
                     ranking({"SSP, s=2": 2900.0, "all-reduce": 3100.0, "EASGD": 2000.0}, "samples/s")).splitlines()
    assert [contradictions(line) for line in lines] == [[], [], [], [], []]
    assert lines[0].endswith("the backend, at 1 KiB's median is 442 µs above MPI directly's (16.2x)")
    swapped = lines[0].replace("MPI directly was faster than the backend, at 1 KiB",
                               "the backend, at 1 KiB was faster than MPI directly")
    assert swapped != lines[0] and any("not below" in c for c in contradictions(swapped.replace(
        "every repeat: MPI directly 29 µs (median of 3, 22-99), the backend, at 1 KiB 471 µs (median of 3, 414-474)",
        "every repeat: the backend, at 1 KiB 471 µs (median of 3, 414-474), MPI directly 29 µs (median of 3, 22-99)")))
    assert any("do not" in c for c in contradictions(lines[1].replace("(median of 3, 300-500)",
                                                                      "(median of 3, 480-500)").replace(
        "a was faster than b in every repeat", "a and b overlap: neither was faster in every repeat")))
    assert any("apart" in c for c in contradictions(lines[0].replace("442 µs above", "42 µs above")))
    assert any("not their order" in c for c in contradictions(lines[3].replace("all-reduce 3,100", "all-reduce 1,100")))
