#!/usr/bin/env python
"""Does a plan's step prediction hold on a loaded machine: within 25 % for every strategy, quiet and beside two
busy processes?

The question (issue 43). A classroom machine is shared: `plan.profile()` measures what the ranks get there (layer
times in core seconds, the share of a core each rank gets with every rank busy), and the prediction says the load
it assumed. Per strategy on 2 and 4 engines, the plan is profiled and predicted, then built and stepped
(nbdist.sharding.accuracy.check: the notebooks' local table), first as the machine is ("quiet", though other work
may run), then beside two `python3 -c 'while True: pass'` processes this script starts and kills. Each row prints
predicted and measured step (median of --steps), their ratio, the within-25 % verdict, the share of a core the
prediction assumed and the load the row saw (machine_load(), the cluster's own ranks counted in it).

    python benchmarks/bench_plan_under_load.py [--engines 2,4] [--model 4,160,64] [--batch 24] [--steps 5]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from contextlib import contextmanager

from common import Measure, Run
from workloads import Gpt, adam

from nbdist import data, models
from nbdist.measured import machine_load
from nbdist.sharding import accuracy

TOLERANCE = 0.25
PLANS = {
    2: [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=3), dict(tp=2), dict(pp=2, microbatches=4)],
    4: [dict(dp=4), dict(dp=2, pp=2, microbatches=2), dict(dp=2, tp=2), dict(dp=2, pp=2, microbatches=2, zero=1),
        dict(dp=4, zero=3), dict(pp=2, tp=2, microbatches=2)],
}
BUSY = "while True: pass"


@contextmanager
def busy_processes(count: int):
    """`count` processes spinning on a core each, killed on leaving (by their own ids)."""
    started = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]
    try:
        yield started
    finally:
        for p in started:
            p.kill()
            p.wait()


def row(cluster, model_fn, settings: dict, condition: str, args, log) -> Measure:
    corpus = data.byte_corpus()
    checked = accuracy.check(model_fn, settings, batch=args.batch, steps=args.steps, optimizer_fn=adam,
                             loss_fn=models.lm_loss, cluster=cluster,
                             batches=lambda step: data.token_batch(corpus, step, args.batch, args.gpt.seq))
    ratio = checked.measured_median_s / checked.predicted_s
    load = machine_load()
    share = checked.assumes.share if checked.assumes is not None else 1.0
    verdict = "within 25 %" if abs(ratio - 1) <= TOLERANCE else "MISS"
    log(f"  {cluster.world_size} engines {condition:6} {checked.strategy:32} predicted {1e3 * checked.predicted_s:7.1f} ms"
        f"  measured {1e3 * checked.measured_median_s:7.1f} ms  ratio {ratio:4.2f}  {verdict:11}  share assumed "
        f"{share:.2f}, load {load.average:.1f} on {load.cores} cores")
    return Measure(f"{cluster.world_size} engines, {condition}, {checked.strategy}: |measured / predicted - 1|", "%",
                   [100 * abs(t / checked.predicted_s - 1) for t in checked.measured_s], [], "abs<=",
                   100 * TOLERANCE, per="step",
                   notes={"predicted_ms": 1e3 * checked.predicted_s, "measured_ms": [1e3 * t for t in checked.measured_s],
                          "ratio": ratio, "share": share, "load": load.average, "cores": load.cores})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="2,4", help="comma-separated: 2, 4")
    p.add_argument("--model", default="4,160,64", help="layers,hidden,seq of nbdist.models.gpt")
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--busy", type=int, default=2, help="busy processes beside the cluster in the loaded rows")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.gpt = Gpt.parse(args.model)
    measures = []
    with Run() as run:
        for n in (int(v) for v in args.engines.split(",")):
            cluster = run.start(n)
            model_fn = args.gpt.builder()
            accuracy.check(model_fn, PLANS[n][0], batch=args.batch, steps=2, optimizer_fn=adam,  # warm-up
                           loss_fn=models.lm_loss, cluster=cluster,
                           batches=lambda step: data.token_batch(data.byte_corpus(), step, args.batch, args.gpt.seq))
            for settings in PLANS[n]:
                measures.append(row(cluster, model_fn, settings, "quiet", args, run.log))
            with busy_processes(args.busy):
                for settings in PLANS[n]:
                    measures.append(row(cluster, model_fn, settings, "loaded", args, run.log))
        within = sum(abs(m.notes["ratio"] - 1) <= TOLERANCE for m in measures)
        ratios = [m.notes["ratio"] for m in measures]
        run.log(f"{within} of {len(measures)} rows within 25 %; measured / predicted {min(ratios):.2f}-"
                f"{max(ratios):.2f}")
    settings = {k: v for k, v in vars(args).items() if k != "gpt"}
    return run.finish(measures, json_path=args.json, settings=settings)


if __name__ == "__main__":
    sys.exit(main())
