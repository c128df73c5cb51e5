"""nbdist.shard: how to spread one model over the engines, what it will cost, and the distributed model it builds.

    plan = nbdist.shard(lambda: models.gpt(layers=4), dp=2, tp=2, zero=0, microbatches=2)
    plan                                   # a table: per rank its replica, stage and slice; predicted memory
    model = plan.apply(lambda params: torch.optim.Adam(params, lr=1e-3))
    loss = model.step(x, y, models.lm_loss)  # one step on the global batch
    model.state_dict(); model.grads()       # gathered into the notebook under the unsplit model's keys

A plan is dp x pp x tp over the world (laid out as nbdist.mesh lays them: pp outermost, tp innermost) with a ZeRO
stage over dp, micro-batches and, with pp > 1, a pipeline schedule. Everything is checked here, in one line, before
anything runs: the product must be the world size, tp must divide the heads and the split features, the model must
have as many layers as stages. The kernel builds the model once on CPU to profile it (parameters, activation
bytes per layer: nbdist/sharding/profile.py); the ranks build their own copies from `model_fn`.

pp = 1 runs nbdist/sharding/ranks/sharded.py (DDP, ZeroRedundancyOptimizer, FSDP2, DTensor tensor parallel); pp > 1 runs
nbdist's pipeline on the mesh, its stages split over tp and averaged over dp.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable

from torch import nn

from nbdist.checks import check_functions, one_of, whole_number
from nbdist.cluster.api import Cluster, current
from nbdist.errors import DistUsageError
from nbdist.layout import Layout
from nbdist.measured import CoreShare
from nbdist.sharding import core_shares
from nbdist.sharding.memory import RankMemory, predict_memory
from nbdist.sharding.profile import profile_layers, sample_input, with_times
from nbdist.sharding.ranks import timing
from nbdist.sharding.reading import BatchNormWarning, ModelChoices, ModelReading  # noqa: F401 - BatchNormWarning: public
from nbdist.sharding.shape import micro_batch_size
from nbdist.sharding.step_time import Overheads, StepTime, default_alpha_beta, predict_step_seconds
from nbdist.tensor_parallel.plans import kinds
from nbdist.wire import portable

_measured_links: dict[tuple, object] = {}  # (cluster, its start, mesh, dimension) -> AlphaBeta, measured once
LINK_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)  # bytes of the all-reduces profile() fits each group's α-β to
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "naive")  # nbdist's synchronous schedules
LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))  # shard()'s keywords that make its Layout, as Layout names them


def shard(model_fn: Callable[[], nn.Module], dp: "int | Layout" = 1, pp: int = 1, tp: int = 1, zero: int = 0,
          microbatches: int = 1, schedule: str = "1f1b", *, chunks: int = 1, batch: int | None = None,
          balance: list[int] | None = None, split_points: list[str] | None = None, example_input=None,
          tp_plan: dict | str | None = None, sync_batchnorm: bool = False, zero3_sync: str = "every",
          optimizer: str = "adam", hook: str = "auto", bucket_cap_mb: float | None = None,
          cluster: Cluster | None = None) -> "Plan":
    """A plan of `model_fn`'s model over the running cluster (see the module docstring): a Layout
    (`shard(model_fn, Layout(dp=2, tp=2))`) or its choices as keywords (`shard(model_fn, dp=2, tp=2)`). `model_fn`
    builds any nn.Module (an nn.Sequential is cut between its items; any other model between its units:
    nbdist/models/structure.py). `batch` is the global batch the memory prediction assumes (default: 8 samples
    per micro-batch); `optimizer` the kind it assumes ("adam", "sgd", "sgd-momentum"); `hook` and `bucket_cap_mb`
    go to DDP; `chunks` model pieces per pipeline rank (interleaved-1f1b needs 2 or more); `balance` layers (units)
    per piece, or `split_points` the module names that begin each later piece (default: balanced by parameters).
    `example_input`: a few samples of what the model takes (a tensor, a tuple, or a dict for model(**batch)), which
    the profile runs; needed for any model but nbdist's own. `tp_plan`: with tp > 1, {module name: "colwise" |
    "rowwise" | a torch ParallelStyle} (Hugging Face wildcards such as "model.layers.*.mlp.up_proj" allowed) or
    "auto" (the plan the model's Hugging Face config carries); nbdist's own models pair their Linears themselves.
    `sync_batchnorm`: BatchNorm statistics over every replica's share (nbdist's SyncBatchNorm, CPU or GPU), so dp
    trains as one process. `zero3_sync="last"`: ZeRO-3 reduce-scatters accumulated gradients once (docs/sharding.md)."""
    layout = _layout_of({name: value for name, value in locals().items() if name in LAYOUT_FIELDS})
    model = ModelChoices(split_points, example_input, tp_plan, bool(sync_batchnorm))
    return Plan(model_fn, layout, batch, optimizer, hook, bucket_cap_mb, cluster or current(), model)


def _layout_of(given: dict) -> Layout:
    """The Layout of shard()'s layout keywords (`given`, named as Layout's fields): a Layout passed as `dp`, the
    other keywords left at Layout's defaults, or one made of the keywords."""
    if not isinstance(given["dp"], Layout):
        return Layout(**given)
    if any(given[f.name] != f.default for f in fields(Layout) if f.name != "dp"):
        raise DistUsageError("give the layout's choices in one place: a Layout, or keywords, not both")
    return given["dp"]


class Plan:
    """A checked plan: its shape, the model's profile, and predictions per rank."""

    def __init__(self, model_fn, layout: Layout, batch, optimizer, hook, bucket_cap_mb, cluster: Cluster,
                 choices: ModelChoices | None = None):
        if not callable(model_fn):
            raise DistUsageError(f"model_fn must be a function that builds the model, got {type(model_fn).__name__}")
        self.cluster, self.model_fn, self.layout = cluster, model_fn, layout
        dp, pp, tp, microbatches = layout.dp, layout.pp, layout.tp, layout.microbatches
        self.optimizer_kind, self.hook, self.bucket_cap_mb = _checked_ddp_choices(optimizer, hook, bucket_cap_mb)
        if batch is not None:
            whole_number(batch, "batch")
        if dp * pp * tp != cluster.world_size:
            gpus = " (one GPU each)" if all(d.startswith("cuda") for d in cluster.devices) else ""
            raise DistUsageError(f"dp × pp × tp = {dp} × {pp} × {tp} = {dp * pp * tp}, but the cluster has "
                                 f"{cluster.world_size} ranks{gpus}: the product must be the world size")
        self.schedule = self._schedule(layout.schedule)
        self._refuse_unsupported()
        self.batch = batch or 8 * dp * microbatches
        read = self.reading = ModelReading(model_fn, self.layout, self.batch, choices or ModelChoices())
        self.choices, self.model, self.flat, self.example = read.choices, read.model, read.flat, read.example
        self.units, self.tied, self.tp_styles, self.boundaries = read.units, read.tied, read.tp_styles, read.boundaries
        self.batchnorm_note = read.batchnorm_note
        self.layers = profile_layers(self.model, sample_input(self.model, example=self.example), tp,
                                     kinds(self.tp_styles), self.units,
                                     strict=all(isinstance(v, str) for v in self.tp_styles.values()))
        self.overheads: Overheads | None = None  # measured by profile()
        self.cores: CoreShare | None = None  # measured by profile(): the share of a core each rank gets now
        self.links: dict = {}  # measured by profile(): dimension -> the α-β of an all-reduce on its groups

    # the layout's choices, read where the plan is used (plan.dp, ...); the built schedule is the plan's own
    dp = property(lambda self: self.layout.dp)
    pp = property(lambda self: self.layout.pp)
    tp = property(lambda self: self.layout.tp)
    zero = property(lambda self: self.layout.zero)
    microbatches = property(lambda self: self.layout.microbatches)
    chunks = property(lambda self: self.layout.chunks)
    balance = property(lambda self: self.layout.balance)

    def _refuse_unsupported(self) -> None:
        """A pipeline's ZeRO rules (pipeline_parallel/inputs.py), said here before anything is built."""
        if self.pp > 1:
            from nbdist.pipeline_parallel.inputs import check_pipeline_zero

            check_pipeline_zero(self.zero, self.dp, self.schedule.splits_backward, self.tp > 1)

    def _schedule(self, name: str):
        """The pipeline schedule (built and checked here: its micro-batch and chunk rules), or its name at pp=1."""
        if self.pp == 1:
            if self.chunks != 1:
                raise DistUsageError(f"chunks={self.chunks} cuts pipeline stages, but pp=1 has none")
            return name
        from nbdist.schedules.generators import build

        one_of(name, SCHEDULES, "schedule")
        return build(name, self.pp, self.microbatches, self.chunks)

    # -- what it will cost ----------------------------------------------------------------------------------------

    def predicted_memory(self) -> list[RankMemory]:
        """Bytes per rank of each pipeline stage (ranks of one stage hold the same), for the plan's batch."""
        return predict_memory(self.layers, dp=self.dp, pp=self.pp, tp=self.tp, zero=self.zero,
                                      boundaries=self.boundaries, microbatches=self.microbatches,
                                      schedule=self.schedule, batch=self.batch, optimizer=self.optimizer_kind)

    def profile(self, repeats: int = 5) -> "Plan":
        """Time every layer on rank 0 (on CPU in core seconds) at this plan's micro-batch size, and the share of a
        core each rank gets now with every rank busy (`cores`, other work counted). Returns the plan."""
        whole_number(repeats, "repeats")
        size = micro_batch_size(self.batch, self.dp, self.microbatches)
        times = self.cluster.run(timing.model_layer_times, portable(self.model_fn), size, repeats,
                                 example=self.example, units=None if self.flat else self.units, ranks=[0])[0]
        self.layers = with_times(self.layers, times)
        shares = [core_shares.share_now(self.cluster)]
        self.links = self._measure_links(fresh=True)  # the load now, not a cached plan's
        shares.append(core_shares.share_now(self.cluster))
        self.cores = core_shares.measured(self.cluster, shares)
        self.overheads = self._measure_overheads()  # less its collectives as a rank alone (the share so far)
        self.cores = core_shares.measured(self.cluster, [*shares, core_shares.share_now(self.cluster)])
        return self

    def _measure_links(self, fresh: bool = False) -> dict:
        """Per parallel dimension with more than one rank (dp, tp), the α-β of an all-reduce on its groups,
        measured with every group of the mesh at once (the cores shared as in a step): 4 ranks on 2 cores pay
        several times a 2-rank group's latency, which the default fit (2 ranks alone) does not know."""
        from nbdist.collectives.costmodel import coefficients, fit_alpha_beta

        dims = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        if self.dp == 1 and self.tp == 1:  # no collective to price (one engine, or a pipeline alone)
            return {}
        mesh = self.cluster.mesh(**{d: n for d, n in dims.items() if n > 1})
        links = {}
        for dim in ("dp", "tp"):
            n = dims[dim]
            if n == 1:
                continue
            key = (id(self.cluster), self.cluster.generation, mesh.name, dim)
            if key in _measured_links and not fresh:  # the plan explorer's controls make new plans of the same shapes again and again
                links[dim] = _measured_links[key]
                continue
            times = self.cluster.run(timing.group_all_reduce_seconds, mesh.name, dim, list(LINK_SIZES))
            rows = [{"op": "all_reduce", "via": "torch", "size_bytes": size, "seconds": max(t[i] for t in times)}
                    for i, size in enumerate(LINK_SIZES)]
            whole = fit_alpha_beta(rows)
            a, b = coefficients("ring", n)  # the step prices a group's all-reduce as a ring of per-message costs
            links[dim] = _measured_links[key] = replace(whole, alpha=whole.alpha / a, beta=whole.beta / b, ranks=n)
        return links

    def _measure_overheads(self) -> Overheads:
        """The libraries' own costs on these engines (DTensor per split Linear, FSDP2 per unit, the optimizer per
        parameter), measured with every rank busy as in a step, on this plan's own groups (FSDP2 over 4 ranks
        costs more than over the 2 of a dp=2 x pp=2 plan); the slowest rank's figures."""
        dims = {d: n for d, n in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)) if n > 1}
        mesh = self.cluster.mesh(**(dims or {"dp": self.cluster.world_size}))
        shapes = [p.shape for layer in self.layers for p in layer.tensors]  # the optimizer timed on the model's
        own = self.flat and not self.choices.tp_plan  # the model's own layers timed (a Sequential's), else the probe
        costs = self.cluster.run(timing.mechanism_costs, mesh.name, self.tp, self.zero, self.optimizer_kind,
                                 shapes=shapes, model_fn=portable(self.model_fn) if own else None,
                                 size=micro_batch_size(self.batch, self.dp, self.microbatches),
                                 split=kinds(self.tp_styles) if self.tp > 1 and own else None)
        return Overheads(
            tp_linear=self._tp_linear(costs),
            fsdp_unit=self._fsdp_unit(costs),
            optimizer_per_param=max(c["optimizer_per_param"] for c in costs),
            optimizer_per_dtensor=max(c["optimizer_per_dtensor"] for c in costs),
            optimizer_per_tensor=max(c["optimizer_per_tensor"] for c in costs),
        )

    def _tp_linear(self, costs: list[dict]) -> tuple[float, float]:
        """DTensor's own (forward, backward) seconds per split Linear and micro-batch: the model's most divided
        layer timed as DTensor on its tp group, less the same layer sliced in plain tensors and less its
        all-reduces as the prediction prices them (on the tp link), over its split Linears; the slowest rank's."""
        if self.tp == 1:
            return 0.0, 0.0
        if "tp_layer" not in costs[0]:  # the probe's pair timed (a model not nbdist's own)
            return tuple(max(c["tp_linear"][i] for c in costs) for i in (0, 1))
        layer = self.layers[costs[0]["tp_layer"]["index"]]
        linears = len(layer.tp_allreduce_bytes_per_sample) or 1
        size = micro_batch_size(self.batch, self.dp, self.microbatches)
        link = self.links.get("tp") or default_alpha_beta()
        reduces = [sum(link.ring(entry[i] * size, self.tp) for entry in layer.tp_allreduce_bytes_per_sample
                       if entry[i]) / self.contention() for i in (0, 1)]  # as a rank alone takes them
        added = _slowest_added(costs, "tp_layer", "dtensor", "split")
        return tuple(max(0.0, added[i] - reduces[i]) / linears for i in (0, 1))

    def _fsdp_unit(self, costs: list[dict]) -> tuple[float, float]:
        """FSDP2's own (forward, backward) seconds per unit and micro-batch: the model's largest layer timed as
        one unit on the dp group, less the same layer plain and less its gathers and reduce-scatter as the
        prediction prices them (step_time._dp_sync, on the dp link); the slowest rank's."""
        if self.zero < 2:
            return 0.0, 0.0
        if "fsdp_layer" not in costs[0]:  # the probe's unit timed (a model not nbdist's own)
            return tuple(max(c["fsdp_unit"][i] for c in costs) for i in (0, 1))
        layer = self.layers[costs[0]["fsdp_layer"]["index"]]
        link = self.links.get("dp") or default_alpha_beta()
        moved = link.gather(sum(p.numel(self.tp) for p in layer.tensors) * 4, self.dp)
        moved /= self.contention()  # as a rank alone takes them: the unit's time is in core seconds
        priced = (moved, moved * (2 if self.zero == 3 else 1))  # backward: gathered again (ZeRO-3), then reduced
        added = _slowest_added(costs, "fsdp_layer", "sharded", "plain")
        return tuple(max(0.0, added[i] - priced[i]) for i in (0, 1))

    def predicted_step(self, alpha_beta=None) -> StepTime:
        """The step's time, every term visible (compute per stage, tensor-, data- and pipeline-parallel
        communication, the simulated schedule); profile() first. `alpha_beta`: a fit of this cluster's
        all-reduce (nbdist.collectives.fit_alpha_beta); without it, the links profile() measured, and for what they
        do not price the default (step_time.default_alpha_beta)."""
        if any(layer.forward_s is None for layer in self.layers) or self.overheads is None:
            self.profile()
        slower = self.contention()
        # the libraries' costs are core seconds (as the layers); the tp all-reduces (in each F and B) were measured
        # with every rank busy: per rank alone; the schedule shares the cores again (step_time.sharing_the_cores)
        wanted = {d for d, n in (("dp", self.dp), ("tp", self.tp)) if n > 1}
        if alpha_beta is None and not wanted <= set(self.links):  # a plan made by changed(): from the cache
            self.links = self._measure_links()
        links = {} if alpha_beta is not None else dict(self.links)
        if "tp" in links:
            links["tp"] = replace(links["tp"], alpha=links["tp"].alpha / slower, beta=links["tp"].beta / slower)
        step = predict_step_seconds(self.layers, dp=self.dp, pp=self.pp, tp=self.tp, zero=self.zero,
                                    boundaries=self.boundaries, microbatches=self.microbatches, schedule=self.schedule,
                                    batch=self.batch, alpha_beta=alpha_beta, overheads=self.overheads, links=links,
                                    contention=slower, others=self.cores.others_fraction if self.cores else 0.0)
        return replace(step, assumes=self.cores)

    def contention(self) -> float:
        """How much longer a rank computes in the step than in the profile (sharding/core_shares.py)."""
        return core_shares.contention(self.cluster, self.cores)

    def ranks(self) -> list[dict]:
        """One row per rank: its coordinates, its layers and its predicted memory."""
        mesh = self.layout.mesh()
        memory = self.predicted_memory()
        rows = []
        for rank in range(self.cluster.world_size):
            c = mesh.coords(rank)
            rows.append({"rank": rank, **c, "layers": self._layers_of(c["pp"]), "memory": memory[c["pp"]]})
        return rows

    def _layers_of(self, pipeline_rank: int) -> str:
        """'0..3' (a Sequential's items), or the first and last unit of any other model ('model.embed_tokens ..
        model.layers.1')."""
        ranges = [(0, len(self.units))] if self.boundaries is None else [
            self.boundaries[s] for s in self.schedule.stages_of(pipeline_rank)]
        if self.flat:
            return ", ".join(f"{a}..{b - 1}" for a, b in ranges)
        return ", ".join(self.units[a] if b - a == 1 else f"{self.units[a]} .. {self.units[b - 1]}" for a, b in ranges)

    def describe(self) -> str:
        """The plan in one line."""
        parts = [f"dp={self.dp}", f"pp={self.pp}", f"tp={self.tp}", f"zero={self.zero}",
                 f"microbatches={self.microbatches}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule.name}" + (f" chunks={self.chunks}" if self.chunks > 1 else ""))
        params = sum(p.numel() for p in self.model.parameters())
        return f"plan {' '.join(parts)} of a {params:,}-parameter model on {self.cluster.world_size} ranks"

    def table(self) -> list[str]:
        from nbdist.units import format_bytes

        header = ["rank", "pp", "dp", "tp", "layers", "params", "grads", "optimizer", "activations", "total"]
        rows = [[str(r["rank"]), str(r["pp"]), str(r["dp"]), str(r["tp"]), r["layers"],
                 *(format_bytes(getattr(r["memory"], k)) for k in ("params", "grads", "optimizer", "activations",
                                                                    "total"))]
                for r in self.ranks()]
        widths = [max(len(x) for x in column) for column in zip(header, *rows)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header, *rows]]
        return [self.describe(), f"predicted memory per rank (fp32, {self.optimizer_kind}, global batch "
                                 f"{self.batch}):", *lines]

    def __repr__(self) -> str:
        return "\n".join(self.table())

    def widget(self):
        """The plan explorer (JupyterLab): this plan's controls, the model's layers, per-rank predicted memory and
        step time redrawn as a control moves, and an Apply button (nbdist/sharding/explorer.py)."""
        from nbdist.sharding.explorer import PlanExplorer

        return PlanExplorer(self)

    def changed(self, **settings) -> "Plan":
        """A new plan of the same model with some settings changed (dp, pp, tp, zero, microbatches, schedule, chunks,
        batch, balance, optimizer): what the plan explorer calls as its controls move. The model's profile (and layer
        times, once measured) are reused where the tensor-parallel degree is the same."""
        current = {**{name: getattr(self.layout, name) for name in LAYOUT_FIELDS},
                   "schedule": self.schedule if isinstance(self.schedule, str) else self.schedule.name,
                   "batch": self.batch, "optimizer": self.optimizer_kind}
        unknown = sorted(set(settings) - set(current))
        if unknown:
            raise DistUsageError(f"unknown plan setting(s) {', '.join(unknown)}: choose from {', '.join(current)}")
        merged = {**current, **settings}
        c = self.choices
        if "pp" in settings or "chunks" in settings or "balance" in settings:
            c = replace(c, split_points=None)  # the split points were for the old stages
        plan = shard(self.model_fn, hook=self.hook, bucket_cap_mb=self.bucket_cap_mb, cluster=self.cluster,
                     split_points=c.split_points, example_input=c.example_input,
                     tp_plan=c.tp_plan if merged["tp"] > 1 else None, sync_batchnorm=c.sync_batchnorm, **merged)
        if self.layers[0].forward_s is not None:  # layers are timed whole; the prediction divides by tp
            plan.layers = with_times(plan.layers, [(l.forward_s, l.backward_s) for l in self.layers])
            same = (merged["tp"], merged["zero"], merged["optimizer"]) == (self.tp, self.zero, self.optimizer_kind)
            plan.overheads = self.overheads if same else None
            plan.cores = self.cores
        return plan

    def side_by_side(self, model) -> list[dict]:
        """Per rank, this plan's prediction beside what `model` (its apply(): Sharded or Pipeline) measured: bytes of
        parameters, gradients, optimizer state and activations (from the last step run with memory=True), and the
        step time (the last step's, against predicted_step() once the plan was profiled)."""
        predicted = self.predicted_memory()
        profiled = all(layer.forward_s is not None for layer in self.layers)
        step = self.predicted_step().total_s if profiled else None
        rows = []
        for measured in model.measured_memory():
            want = predicted[self.layout.coords(measured["rank"])["pp"]]
            row = {"rank": measured["rank"]}
            for kind in ("params", "grads", "optimizer", "activations"):
                row[f"{kind} predicted"], row[f"{kind} measured"] = getattr(want, kind), measured[kind]
            row["step s predicted"], row["step s measured"] = step, model.step_seconds()
            rows.append(row)
        return rows

    # -- building it ----------------------------------------------------------------------------------------------

    def apply(self, optimizer_fn: Callable | None = None):
        """Build the plan on the cluster: a Sharded model (pp = 1) or a Pipeline (pp > 1), both with
        step(inputs, targets, loss_fn) -> loss, state_dict(), grads() and a measured timeline. A plan whose
        predicted memory exceeds what a rank's device has free is refused first (check_fits)."""
        if optimizer_fn is not None:
            check_functions(optimizer_fn=optimizer_fn)
        self.check_fits()
        if self.pp > 1:
            from nbdist.pipeline_parallel.api import pipeline

            mesh = self.cluster.mesh(pp=self.pp, dp=self.dp, tp=self.tp)
            built = pipeline(self.model_fn, schedule=self.schedule, microbatches=self.microbatches,
                             chunks=self.chunks, mesh=mesh, cluster=self.cluster, optimizer=optimizer_fn,
                             balance=[b - a for a, b in self.boundaries] if self.flat else None,
                             tp_plan=self._tp_plans(), zero=self.zero,
                             example_input=self.example, sync_batchnorm=self.choices.sync_batchnorm,
                             read_model=self.model,
                             split_points=None if self.flat else [self.units[a] for a, _ in self.boundaries[1:]])
            built.plan = self  # side_by_side() compares against this plan
            return built
        from nbdist.sharding.sharded import Sharded

        return Sharded(self, optimizer_fn)

    def check_equal(self, inputs, targets=None, loss_fn=None, steps: int = 3, optimizer_fn=None,
                    atol: float = 1e-5):
        """Build this plan, train `steps` steps on one batch and compare its losses and gathered weights with one
        process doing the same (sharding/equality.py); returns an Equality (True when equal, its repr says the
        largest difference and where). `inputs`: what the model takes; `loss_fn=None`: the output's own loss."""
        from nbdist.sharding.equality import check_equal

        return check_equal(self, inputs, targets, loss_fn, steps, optimizer_fn, atol)

    def check_fits(self) -> None:
        """Refuse, before anything is allocated, a plan whose predicted bytes on some rank (model states and the
        activations of the plan's batch) exceed what that rank's device has free: its GPU's free memory, or on
        CPU engines the host's available memory shared by the engines there. One line, both figures."""
        from collections import Counter

        from nbdist.checks import fits
        from nbdist.runtime.ranks.placement import memory_report

        engines_on = Counter(self.cluster.hosts)
        predicted = self.predicted_memory()
        for report in self.cluster.run(memory_report):
            share = 1 if report["device"].startswith("cuda") else engines_on[self.cluster.hosts[report["rank"]]]
            need = predicted[self.layout.coords(report["rank"])["pp"]].total
            fits(int(need), report["free"] // share, report["total"] // share, report["rank"], report["device"],
                 f"this plan (predicted: {self.optimizer_kind} model states and the activations of a global batch "
                 f"of {self.batch})")

    def _tp_plans(self) -> dict[int, dict] | None:
        """Per stage, the tensor-parallel plan of that stage's module: a Sequential's slice numbers its layers from
        0; a pruned stage holds the model as `model` (pipeline_parallel/split.py)."""
        if self.tp == 1:
            return None
        from nbdist.models.structure import unit_of

        plans: dict[int, dict] = {s: {} for s in range(len(self.boundaries))}
        for name, style in self.tp_styles.items():
            index = unit_of(self.units, name)
            stage = next(s for s, (a, b) in enumerate(self.boundaries) if a <= index < b)
            if self.flat:
                first, _, rest = name.partition(".")
                plans[stage][f"{int(first) - self.boundaries[stage][0]}" + (f".{rest}" if rest else "")] = style
            else:
                plans[stage][f"model.{name}"] = style
        return plans


def _slowest_added(costs: list[dict], key: str, timed: str, base: str) -> tuple[float, float]:
    """Per direction (forward, backward), the most any rank's `costs[key][timed]` took over its `costs[key][base]`:
    a step waits for its slowest rank."""
    return tuple(max(c[key][timed][i] - c[key][base][i] for c in costs) for i in (0, 1))


def _checked_ddp_choices(optimizer: str, hook: str, bucket_cap_mb) -> tuple[str, str, float | None]:
    """The optimizer the memory prediction assumes, DDP's communication hook and bucket size: known and
    positive, or one line (the ranks would otherwise meet them mid-build, or never)."""
    from nbdist.cost.memory import OPTIMIZER_STATES
    from nbdist.data_parallel.ranks.hooks import HOOKS, RENAMED

    one_of(optimizer, tuple(OPTIMIZER_STATES), "optimizer")
    if hook not in RENAMED:  # an old name still works, with its own warning
        one_of(hook, ("auto", *HOOKS), "hook")
    if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                      or not 0 < bucket_cap_mb < float("inf")):
        raise DistUsageError(f"bucket_cap_mb must be a positive number of MiB (or None for DDP's 25), got "
                             f"{bucket_cap_mb!r}")
    return optimizer, hook, bucket_cap_mb
