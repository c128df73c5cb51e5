"""Reading a lab's printed verdicts back: the labs whose verdicts read timings are run beside two busy processes
(tests/test_notebooks.py, the one run of each lab), and no printed verdict may contradict its numbers.

A class runs the labs on a shared, loaded machine, where timings stretch and orders flip. So a lab says nothing
about a timing in its markdown; it prints each verdict from its run ("this run: ..." lines, made by
nbdist/measured.py from repeats, with the load line after them), and the test reads those lines back from the
executed notebook and checks each against the numbers printed in it, with this parser (not measured.py's code):

- "A was faster than B in every repeat: A m (median of k, lo-hi), B ...": every repeat of A below every one of B;
- "A and B overlap: neither was ...": the printed spreads do overlap;
- "...; B's median is d above A's (r x)": B is the one with the higher median, d and r are its difference and ratio;
- "from highest to lowest: a 3; b 2; ...": the values are in that order.

Which labs run loaded (`UNDER_LOAD`), and why only these (the suite is at its time limit: each runs once, loaded
instead of quiet): the three whose verdicts flipped under load before they were printed from the run, and whose
lines compare the most timings: 42 (all-reduce times through gloo, nbdist's MPI backend and MPI directly; nbdist's
DDP, ZeRO-3 and pipeline steps against torch's own), 35 (throughput, idle time and loss of four synchronisation
strategies, balanced, with a straggler and with hiccups) and 10 (schedules against 1F1B, and the learner's stage
split against the bad one, whose old `assert faster` failed under load). Every other lab's verdicts are checked the
same way on its quiet run.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import sys

UNDER_LOAD = ("10_pipeline_lab.ipynb", "35_sync_vs_async.ipynb", "42_backends_and_frameworks.ipynb")
BUSY = 2  # processes spinning beside the lab: on 2 cores with a lab's 2-4 engines, the load of a shared classroom

_NUMBER = r"-?[\d,]*\.?\d+(?:e-?\d+)?"


def _repeats(name: str) -> str:
    """A printed Repeats: '471 µs (median of 3, 414-474)', '4.8x (median of 3, 2-5.1)' or '12 ms (one run)'."""
    return (rf"(?P<{name}>{_NUMBER})(?:x|%| [^\s(]+)? \((?:median of \d+, (?P<{name}lo>{_NUMBER})-"
            rf"(?P<{name}hi>{_NUMBER})|one run)\)")


_ORDER = re.compile(rf"this run: (?P<a>.+?) was (?P<word>\w+) than (?P<b>.+?) in every repeat: (?P=a) {_repeats('x')}, "
                    rf"(?P=b) {_repeats('y')}(?P<rest>.*)$")
_OVERLAP = re.compile(rf"this run: (?P<a>.+?) and (?P<b>.+?) overlap: neither was \w+ in every repeat: (?P=a) "
                      rf"{_repeats('x')}, (?P=b) {_repeats('y')}(?P<rest>.*)$")
_BY = re.compile(rf"; (?P<high>.+?)'s median is (?P<d>{_NUMBER})(?:x|%| \S+)? above (?P<low>.+?)'s \((?P<r>{_NUMBER})x\)$")
_RANKING = re.compile(r"this run: from (?P<end>highest|lowest) to \w+: (?P<items>.+)$")


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _spread(match: re.Match, name: str) -> tuple[float, float, float]:
    median = _value(match[name])
    if match[f"{name}lo"] is None:
        return median, median, median
    return median, _value(match[f"{name}lo"]), _value(match[f"{name}hi"])


def _half_step(text: str) -> float:
    """Half the last printed digit's step: how far the number printed as `text` may be from the one computed."""
    digits = text.replace(",", "").lstrip("-")
    return 0.5 * 10.0 ** -(len(digits.split(".")[1]) if "." in digits else 0)


def _agrees(match: re.Match, by: re.Match) -> bool:
    """Whether the printed difference and ratio of the medians can come from the printed medians (each rounded)."""
    first_is_high = by["high"] == match["a"]
    high, low = (match["x"], match["y"]) if first_is_high else (match["y"], match["x"])
    h, dh, lo, dl = _value(high), _half_step(high), _value(low), _half_step(low)
    d, dd, r, dr = _value(by["d"]), _half_step(by["d"]), _value(by["r"]), _half_step(by["r"])
    if not (h - dh) - (lo + dl) - dd <= d <= (h + dh) - (lo - dl) + dd:
        return False
    return lo - dl <= 0 or (h - dh) / (lo + dl) - dr <= r <= (h + dh) / (lo - dl) + dr


def contradictions(line: str) -> list[str]:
    """What in one printed verdict line its own numbers contradict (nothing for a line that is not a verdict)."""
    found = []
    match = _ORDER.match(line) or _OVERLAP.match(line)
    if match:
        (xm, xlo, xhi), (ym, ylo, yhi) = _spread(match, "x"), _spread(match, "y")
        if match.re is _ORDER and not xhi <= ylo:
            found.append(f"says {match['a']} was {match['word']} in every repeat, but its highest {xhi} is not below "
                         f"{match['b']}'s lowest {ylo}")
        if match.re is _OVERLAP and (xhi < ylo or yhi < xlo):
            found.append(f"says {match['a']} and {match['b']} overlap, but their spreads {xlo}-{xhi} and {ylo}-{yhi} "
                         "do not")
        by = _BY.match(match["rest"])
        if match["rest"] and not by:
            found.append(f"cannot read what follows the order: {match['rest']!r}")
        if by:
            (high, low) = (xm, ym) if by["high"] == match["a"] else (ym, xm)
            if {by["high"], by["low"]} != {match["a"], match["b"]} or high < low:
                found.append(f"names {by['high']} as the higher median, but the medians are {xm} and {ym}")
            if not _agrees(match, by):
                found.append(f"says {by['d']} apart and {by['r']}x, but the medians {high} and {low} are "
                             f"{high - low:.3g} apart, {high / low if low else float('inf'):.3g}x")
    ranked = _RANKING.match(line)
    if ranked:
        values = [_value(re.search(rf"({_NUMBER})(?: \S+)?$", item)[1]) for item in ranked["items"].split("; ")]
        expected = sorted(values, reverse=ranked["end"] == "highest")
        if values != expected:
            found.append(f"ranks {values} from the {ranked['end']}, which is not their order")
    return found


def printed_lines(nb) -> list[str]:
    """Every line the notebook printed, without the "[rank 0] " that %%dist puts before an engine's lines."""
    return [re.sub(r"^\[rank \d+\] ", "", line) for cell in nb.cells for output in cell.get("outputs", [])
            if output.get("output_type") == "stream" for line in output.get("text", "").splitlines()]


@contextlib.contextmanager
def busy_cores(name: str):
    """For a lab in UNDER_LOAD: BUSY processes spinning while it runs (a shared classroom machine's background);
    yields the spinners (none for other labs)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY)] \
        if name in UNDER_LOAD else []
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def check_verdicts(name: str, nb) -> None:
    """No printed verdict of an executed lab contradicts its numbers. A lab run loaded (its verdicts all read
    timings) must print verdicts, each group of them ending with its load line; other labs' verdicts may read
    other things (a loss, a count), and carry a load line where they read a timing (not checked here)."""
    lines = printed_lines(nb)
    verdicts = [i for i, line in enumerate(lines) if line.startswith("this run: ")]
    assert verdicts or name not in UNDER_LOAD, f"{name} printed no verdict ('this run: ...')"
    for i in verdicts if name in UNDER_LOAD else ():  # each group of verdicts ends with the load it ran under
        following = next((line for line in lines[i:] if not line.startswith("this run: ")), "")
        assert following.startswith("machine: load "), (name, lines[i], following)
    wrong = {lines[i]: contradictions(lines[i]) for i in verdicts if contradictions(lines[i])}
    assert not wrong, (name, wrong)
