"""The Trainer's inputs checked in the kernel, before anything runs on the ranks: each problem is one line naming
the argument, what it was and what it must be. What only the ranks can tell (the data set against the model, the
loss function's result, a first step that fails) they say themselves, in one line too (training/ranks/inputs.py);
`failure_line` turns what they returned into that line, `optimizer_lines` says what the optimizer leaves out of
the model, and `nonfinite_line` says where a loss was not finite.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable

from nbdist.checks import check_functions, whole_number  # noqa: F401 - check_functions: the Trainer's
from nbdist.errors import DistUsageError, debugging
from nbdist.training.replies import Failure, Fitted, SetUp

LIVE = (True, False, "always")


def check_lr_schedule(lr_schedule, first: int, steps: int) -> None:
    """The factor of every step this fit runs: a finite number >= 0 (the ranks multiply the learning rate by it)."""
    if lr_schedule is None:
        return
    for step in range(first, first + steps):
        try:
            factor = lr_schedule(step)
        except Exception as e:  # noqa: BLE001 - the user's function: what it raised, in one line
            raise DistUsageError(f"lr_schedule({step}) raised {type(e).__name__}: {e}") from None
        try:
            value = float(factor)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(factor, (str, bytes)) or not math.isfinite(value) or value < 0:
            raise DistUsageError(f"lr_schedule({step}) gave {factor!r}: it must give a finite factor >= 0 of the "
                                 f"optimizer's learning rate")


def check_telemetry(live, straggler: dict, world: int) -> None:
    if not any(live is choice for choice in LIVE):
        raise DistUsageError(f"live must be True (the dashboard in a notebook), False or 'always', got {live!r}")
    if not isinstance(straggler, dict):
        raise DistUsageError(f"straggler must be a dict {{rank: seconds}}, got {type(straggler).__name__}")
    for rank, seconds in straggler.items():
        whole_number(rank, "a straggler's rank", 0)
        if rank >= world:
            raise DistUsageError(f"straggler names rank {rank}, but the ranks are 0..{world - 1}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise DistUsageError(f"straggler={{{rank}: {seconds!r}}}: the delay must be a number of seconds >= 0")


def check_loss_on_meta(loss_fn, output: tuple, target: tuple) -> None:
    """loss_fn on meta tensors shaped like a micro-batch's output and targets ((shape, dtype) each; no compute): one
    line if it returns no single number. What cannot run on the meta device is left for the ranks to say."""
    import torch

    from nbdist.training.ranks.inputs import CheckedLoss

    out, y = (torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in (output, target))
    try:
        with torch.no_grad():
            CheckedLoss(loss_fn)(out, y)
    except DistUsageError as e:
        raise DistUsageError(str(e)) from None
    except Exception:  # noqa: BLE001 - not runnable on meta: the ranks' first step will tell
        return


def steps_of(steps, epochs, length: Callable[[], int | None], batch_size: int) -> int:
    """fit's steps: `steps`, or `epochs` passes over a data set of `length()` samples (an epoch: its whole batches,
    as nbdist.data.batch_indices reads them); an iterable data set has no length to count epochs by. `length` is
    asked only for epochs, once they are checked: the data set is read on the ranks."""
    if (steps is None) == (epochs is None):
        raise DistUsageError("give fit either steps= or epochs=")
    if steps is not None:
        return whole_number(steps, "steps")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not 0 < epochs < math.inf:
        raise DistUsageError(f"epochs must be a positive number, got {epochs!r}")
    length = length()
    if length is None:
        raise DistUsageError("fit(epochs=...) counts passes over the data set, but an iterable data set has no "
                             "length: give steps=")
    return max(1, math.ceil(epochs * (length // batch_size)))


def failure_line(failures: dict[int, Failure]) -> str | None:
    """One line from the ranks that returned a failure instead of raising (rank -> set-up's problem, a first
    step's failure): the line, when every rank said the same; else each line with its ranks. NBDIST_DEBUG=1: the
    ranks' tracebacks are printed first."""
    failed = {rank: failure for rank, failure in failures.items() if failure.line}
    if not failed:
        return None
    if debugging():
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for rank, failure in sorted(failed.items())
                                 for line in failure.traceback.splitlines()))
    by_line: dict[str, list[int]] = {}
    for rank, failure in sorted(failed.items()):
        by_line.setdefault(failure.line, []).append(rank)
    if len(by_line) == 1:  # every rank that could tell said the same
        return next(iter(by_line))
    return "; ".join(f"{ranks_text(ranks)}: {line}" for line, ranks in by_line.items())


SHOWN_NAMES = 4  # the parameters an optimizer leaves out, named before "and N more"


def optimizer_lines(set_up: list[SetUp]) -> tuple[str | None, str | None]:
    """(a refusal, a warning) from what every rank's set-up found of the optimizer against the model's trainable
    parameters (ranks/inputs.optimizer_coverage), over the whole model: an optimizer that steps none of them would
    train nothing, refused; one that leaves some out, one warning line naming them (freezing a part on purpose is
    requires_grad=False, which no line is said for)."""
    missing = sorted({name for r in set_up for name in r.unstepped})
    if not missing:
        return None, None
    if not any(r.stepped for r in set_up):
        return ("optimizer_fn's optimizer holds none of the model's parameters (it was passed them and steps other "
                "tensors): training would leave the model unchanged; build it over the parameters it is passed, e.g. "
                "torch.optim.Adam(params, lr=1e-3)"), None
    shown = ", ".join(missing[:SHOWN_NAMES]) + (f" and {len(missing) - SHOWN_NAMES} more"
                                                if len(missing) > SHOWN_NAMES else "")
    return None, (f"optimizer_fn's optimizer leaves out {len(missing)} of the model's trainable parameters "
                  f"({shown}): they get gradients and never change; build it over every parameter it is passed, or "
                  f"set requires_grad=False on those it should not train")


def ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def nonfinite_line(results: list[Fitted], policy: str) -> str | None:
    """Where this fit's loss first was not finite, on which ranks, where the fit stopped (or that it went on) and
    what the weights hold now; None when every loss was finite (or on_nonfinite="ignore")."""
    seen = {r.rank: r.nonfinite for r in results if r.nonfinite is not None}
    if not seen:
        return None
    first, count = min(s.first for s in seen.values()), max(s.count for s in seen.values())
    values: dict[str, list[int]] = {}
    for rank, s in sorted(seen.items()):
        if s.mine is not None:
            values.setdefault(f"{s.mine}", []).append(rank)
    where = ", ".join(f"{value} on {ranks_text(ranks)}" for value, ranks in values.items()) or "not finite"
    last = max(r.step for r in results) - 1
    bad = sorted(rank for rank, s in seen.items() if not s.weights_finite)
    weights = f"the weights are now non-finite on {ranks_text(bad)}" if bad else "the weights are still finite"
    head = f"step {first}: the loss is {where} (the first non-finite loss of this fit)"
    if policy == "warn":
        return (f"{head}; on_nonfinite='warn' trained on to step {last} ({count} non-finite step"
                f"{'s' * (count > 1)}): {weights}")
    if last == first:
        stopped = "the fit stopped after it, and its optimizer step had run"
    else:
        lag = max(s.lag for s in seen.values())
        stopped = f"the fit stopped after step {last} (the replicas learn each other's losses {lag} steps late)"
    return f"{head}; {stopped}: {weights} (on_nonfinite='warn' or 'ignore' trains on)"


def nonfinite_eval_line(results: list[Fitted]) -> str | None:
    """The first step of this fit whose eval loss was not finite (the training loss being finite, its data or what
    the model makes of it is the likely cause); None when every eval loss was finite."""
    evals = sorted((row["step"], row["eval_loss"]) for r in results for row in r.records
                   if isinstance(row.get("eval_loss"), float))
    bad = [(step, value) for step, value in evals if not math.isfinite(value)]
    if not bad:
        return None
    steps = sorted({step for step, _ in bad})
    return (f"step {bad[0][0]}: the eval loss is {bad[0][1]} ({len(steps)} of this fit's {len({s for s, _ in evals})} "
            f"evaluations not finite): eval_data_fn's data, or the model's output on it, is not finite")

