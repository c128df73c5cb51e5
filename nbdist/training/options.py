"""The Trainer's options, each given once (kernel side): one object per concern (spec.py: Data, Optimization,
Checkpointing, Telemetry), or, as a shortcut, that object's fields as keywords (`Trainer(..., batch_size=32)`),
routed here to their concern. Why one place: the keywords are read from the dataclasses' fields, so an option added
to a concern is a keyword too, with its default; only the three named otherwise before the concerns existed keep
their names (ALIASES). All is checked here, before anything runs on the ranks: each problem one line.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import MISSING, fields, replace
from typing import Any

from nbdist.checks import one_of, whole_number
from nbdist.errors import DistUsageError
from nbdist.layout import ZERO3_SYNCS, Layout
from nbdist.training.spec import NONFINITE, PRECISIONS, SYNC_KINDS, Checkpointing, Data, Optimization, Telemetry

GROUPS: dict[str, type] = {"data": Data, "optimization": Optimization, "checkpointing": Checkpointing,
                           "telemetry": Telemetry}
ALIASES = {"checkpoint_dir": ("checkpointing", "dir"), "checkpoint_every": ("checkpointing", "every"),
           "async_checkpoint": ("checkpointing", "asynchronous")}  # keyword -> (concern, field), where they differ


def _keywords() -> dict[str, tuple[str, str]]:
    """Every keyword -> (concern, field): a field's own name, or its alias (then only the alias)."""
    renamed = {where: keyword for keyword, where in ALIASES.items()}
    found: dict[str, tuple[str, str]] = {}
    for group, cls in GROUPS.items():
        for f in fields(cls):
            keyword = renamed.get((group, f.name), f.name)
            if keyword in found or keyword in GROUPS:
                raise TypeError(f"the Trainer's keyword {keyword!r} would name two options: rename or alias one")
            found[keyword] = (group, f.name)
    return found


KEYWORDS = _keywords()


def grouped(given: dict[str, Any], keywords: dict[str, Any]) -> dict[str, Any]:
    """Each concern's object: the one given (`given[concern]`, or None) or one made of its keywords; one line for a
    keyword no concern has, or one given beside its concern's object."""
    for name in keywords:
        if name not in KEYWORDS:
            raise DistUsageError(_unknown(name))
    out = {}
    for group, cls in GROUPS.items():
        mine = {KEYWORDS[k][1]: v for k, v in keywords.items() if KEYWORDS[k][0] == group}
        obj = given.get(group)
        if obj is None:
            obj = cls(**mine)
        elif not isinstance(obj, cls):
            raise DistUsageError(f"{group} must be a {cls.__name__}, got {type(obj).__name__}")
        elif mine:
            flat = [k for k in keywords if KEYWORDS[k][0] == group]
            inside = ", ".join(f"{KEYWORDS[k][1]}=..." for k in flat)
            raise DistUsageError(f"give the {group} options in one place: {', '.join(flat)} given beside {group}="
                                 f"{cls.__name__}(...); give {cls.__name__}(..., {inside}) or every {group} option "
                                 "as a keyword")
        out[group] = obj
    o, t, c = out["optimization"], out["telemetry"], out["checkpointing"]
    out["optimization"] = replace(o, sync_options=_own(o.sync_options))  # a copy: later edits change no run
    out["telemetry"] = replace(t, straggler=_own(t.straggler))
    out["checkpointing"] = replace(c, asynchronous=bool(c.asynchronous))
    return out


def _own(mapping):
    """None as no entries; a dict copied; anything else left for the checks to name."""
    return {} if mapping is None else dict(mapping) if isinstance(mapping, dict) else mapping


def _unknown(name: str) -> str:
    fields_to_keywords = {f: k for k, (_, f) in KEYWORDS.items()}  # `dir` -> checkpoint_dir
    close = ([fields_to_keywords[name]] if name in fields_to_keywords and fields_to_keywords[name] != name
             else difflib.get_close_matches(name, list(KEYWORDS), n=1))
    guess = f" (did you mean {close[0]}?)" if close else ""
    listed = "; ".join(f"{group}: {', '.join(k for k, (g, _) in KEYWORDS.items() if g == group)}" for group in GROUPS)
    return f"Trainer has no option {name!r}{guess}: its options are {listed}"


def signature(init) -> inspect.Signature:
    """`init`'s signature with **options spelled out as the keywords (each with its field's default), so that
    help(), a notebook's tooltip and inspect show every option."""
    params = [p for p in inspect.signature(init).parameters.values()
              if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    by_field = {(cls, f.name): f for cls in GROUPS.values() for f in fields(cls)}
    for keyword, (group, name) in KEYWORDS.items():
        f = by_field[(GROUPS[group], name)]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        params.append(inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    return inspect.Signature(params)


def check(d: Data, o: Optimization, c: Checkpointing, world: int) -> None:
    """One line for the first option that cannot work, before anything is built."""
    from nbdist.training.ranks.sync_modes import check_options

    one_of(o.precision, PRECISIONS, "precision")
    one_of(o.sync, SYNC_KINDS, "sync")
    one_of(o.on_nonfinite, NONFINITE, "on_nonfinite")
    if not isinstance(o.sync_options, dict):
        raise DistUsageError(f"sync_options must be a dict (e.g. {{'period': 4}}), got {type(o.sync_options).__name__}")
    check_options(o.sync, o.sync_options, world)
    if o.zero3_sync not in ZERO3_SYNCS:
        raise DistUsageError(f"zero3_sync must be 'every' (ZeRO-3 reduce-scatters after every micro-batch) or 'last' "
                             f"(only after the last), got {o.zero3_sync!r}")
    whole_number(d.batch_size, "batch_size")
    whole_number(o.grad_accum, "grad_accum")
    whole_number(d.seed, "seed", 0)
    whole_number(d.eval_batches, "eval_batches")
    for label, every in (("checkpoint_every", c.every), ("eval_every", d.eval_every)):
        if every is not None:
            whole_number(every, label)
    if c.every and not c.dir:
        raise DistUsageError("checkpoint_every needs a checkpoint_dir to write into")
    if d.eval_every and d.eval_data_fn is None:
        raise DistUsageError("eval_every needs an eval_data_fn (the evaluation data set)")
    if d.eval_data_fn is not None and not d.eval_every:
        raise DistUsageError("eval_data_fn is evaluated every eval_every steps: give eval_every too")
    if d.eval_batches != Data.eval_batches and d.eval_data_fn is None:
        raise DistUsageError(f"eval_batches={d.eval_batches} needs an eval_data_fn (the evaluation data set)")
    if o.clip is not None and not (isinstance(o.clip, (int, float)) and o.clip > 0):
        raise DistUsageError(f"clip must be a positive number (the largest gradient norm), got {o.clip!r}")


def with_zero3_sync(plan, o: Optimization):
    """The Trainer's plan with its zero3_sync option in it (nbdist.Layout's field, which the plan's accumulation
    reads). Left at "every", the plan's own is used; "last" goes into a Layout or a dict of nbdist.shard's choices,
    must agree with a Plan already made or a key given twice, and is one line where it cannot apply (no plan:
    plain data parallelism; whole replicas)."""
    if o.zero3_sync == "every":
        return plan
    if plan is None or o.sync != "allreduce":
        whole = "plan=None is plain data parallelism" if o.sync == "allreduce" else f"sync={o.sync!r} trains replicas"
        raise DistUsageError(f"zero3_sync={o.zero3_sync!r} changes how ZeRO-3 accumulates, but {whole}: give "
                             "plan={'dp': ..., 'zero': 3} with grad_accum > 1")
    if isinstance(plan, Layout):
        plan = {f.name: getattr(plan, f.name) for f in fields(plan) if getattr(plan, f.name) != f.default}
    if isinstance(plan, dict):
        given = plan.get("zero3_sync", o.zero3_sync)
    else:
        given = getattr(getattr(plan, "layout", None), "zero3_sync", o.zero3_sync)
    if given != o.zero3_sync:
        raise DistUsageError(f"zero3_sync={o.zero3_sync!r} but the plan has zero3_sync={given!r}: give it in one "
                             "place")
    return {**plan, "zero3_sync": given} if isinstance(plan, dict) else plan


def microbatches(plan: dict, grad_accum: int, batch_size: int) -> int:
    """The micro-batches of a plan given as a dict: its own, else grad_accum's, else for a pipeline (pp > 1) a
    count of its own: one per replica and step would leave a pipeline nothing to overlap, and 1F1B-style schedules
    refuse fewer than pp. The choice is the count nearest 2·pp (the bubble's share, (pp-1)/(m+pp-1), falls from 1/3
    at m = pp to 1/5 at 2·pp for pp = 2) that is at least pp, a multiple of pp for interleaved-1f1b, and divides each
    replica's share of the batch into micro-batches of at least 2 samples (1 where none can; a BatchNorm cannot
    train on 1); pp itself where nothing divides it (the batch's own check then says what does not divide)."""
    pp, dp = plan.get("pp", 1), plan.get("dp", 1)
    if "microbatches" in plan or grad_accum != 1 or not (_whole(pp) and pp > 1):
        return grad_accum
    dp = dp if _whole(dp) and dp > 0 else 1
    share = batch_size // dp if batch_size % dp == 0 else 0
    multiple = pp if plan.get("schedule") == "interleaved-1f1b" else 1
    fits = [m for m in range(pp, share + 1) if share % m == 0 and m % multiple == 0]
    return min(fits, key=lambda m: (share // m < 2, abs(m - 2 * pp), m), default=pp)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
