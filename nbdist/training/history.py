"""A training run's history in the notebook: one record per step, merged from what every rank reported, and the
views people already use: samples/s, a per-rank compute / communication / idle split, TensorBoard event files,
and a Chrome / Perfetto trace of the steps (chrome://tracing, ui.perfetto.dev). Plain data; runs anywhere."""
from __future__ import annotations

import json


class History:
    def __init__(self):
        self.by_step: dict[int, dict] = {}
        self.step = 0  # steps done: one past the last step trained, or the step a checkpoint resumed at

    def add(self, rank_records: list[dict]) -> None:
        """Merge one rank's records (training/ranks/training.RankTrainer.records) into the per-step records."""
        for r in rank_records:
            row = self.by_step.setdefault(r["step"], {"step": r["step"], "loss": r["loss"], "lr": r["lr"],
                                                      "samples": r["samples"], "ranks": {}})
            if r["loss"] is not None:  # the replica modes agree on a step's loss a few steps later
                row["loss"] = r["loss"]
            row["ranks"][r["rank"]] = {k: r[k] for k in ("started", "ended", "compute_s", "comm_s", "idle_s")}
            for key in ("eval_loss", "checkpoint", "checkpoint_stall_s", "tokens"):
                if key in r:
                    row[key] = r[key]
            if r.get("staleness"):
                row.setdefault("staleness", {})[r["rank"]] = r["staleness"]
            row["seconds"] = (max(v["ended"] for v in row["ranks"].values())
                              - min(v["started"] for v in row["ranks"].values()))
            self.step = max(self.step, r["step"] + 1)

    def truncate(self, step: int) -> None:
        """Forget the steps at and after `step` (a resume went back to it) and continue from there."""
        self.by_step = {k: v for k, v in self.by_step.items() if k < step}
        self.step = step

    @property
    def records(self) -> list[dict]:
        return [self.by_step[k] for k in sorted(self.by_step)]

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    def throughput(self, last: int | None = None) -> float:
        """Samples per second over the records (the newest `last` of them): samples / time from the first step's
        start to the last step's end, so pauses between fit() calls are not counted unless within one fit."""
        rows = self.records[-last:] if last else self.records
        if not rows:
            return 0.0
        return sum(r["samples"] for r in rows) / sum(r["seconds"] for r in rows)

    def split(self) -> dict[int, dict[str, float]]:
        """Per rank, the seconds of compute, communication and idle summed over the steps."""
        out: dict[int, dict[str, float]] = {}
        for row in self.records:
            for rank, part in row["ranks"].items():
                mine = out.setdefault(rank, {"compute_s": 0.0, "comm_s": 0.0, "idle_s": 0.0})
                for key in mine:
                    mine[key] += part[key]
        return dict(sorted(out.items()))

    def summary(self) -> str:
        """A few lines for a headless run: steps, loss, throughput, each rank's split."""
        rows = self.records
        if not rows:
            return "no steps trained yet"
        rate, tokens = self.throughput(), rows[-1].get("tokens", 0) / rows[-1]["samples"]
        lines = [f"steps {rows[0]['step']}-{rows[-1]['step']}: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}; "
                 f"{rate:.1f} samples/s" + (f", {rate * tokens:,.0f} tokens/s" if tokens else "")]
        evals = [r for r in rows if "eval_loss" in r]
        if evals:
            lines.append(f"eval loss at step {evals[-1]['step']}: {evals[-1]['eval_loss']:.4f}")
        for rank, part in self.split().items():
            total = sum(part.values()) or 1.0
            lines.append(f"rank {rank}: compute {100 * part['compute_s'] / total:.0f} %, communication "
                         f"{100 * part['comm_s'] / total:.0f} %, idle {100 * part['idle_s'] / total:.0f} %")
        return "\n".join(lines)

    # -- exports ------------------------------------------------------------------------------------------------

    def to_chrome_trace(self, path: str) -> str:
        """The steps as a Chrome trace (JSON; open in chrome://tracing or ui.perfetto.dev): one row per rank, each
        step a span with its compute, communication and idle parts."""
        events = []
        for row in self.records:
            for rank, part in row["ranks"].items():
                at = part["started"] * 1e6
                events.append({"name": f"step {row['step']}", "ph": "X", "pid": 0, "tid": rank, "ts": at,
                               "dur": (part["ended"] - part["started"]) * 1e6, "args": {"loss": row["loss"]}})
                for kind in ("compute_s", "comm_s", "idle_s"):
                    if part[kind] > 0:
                        events.append({"name": kind[:-2], "ph": "X", "pid": 0, "tid": rank, "ts": at,
                                       "dur": part[kind] * 1e6})
                        at += part[kind] * 1e6
        meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
                for rank in self.split()]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        return path

    def to_tensorboard(self, log_dir: str) -> str:
        """Loss, evaluation loss, learning rate and samples/s as TensorBoard scalars (torch's SummaryWriter)."""
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir) as writer:
            for row in self.records:
                writer.add_scalar("loss/train", row["loss"], row["step"])
                if "eval_loss" in row:
                    writer.add_scalar("loss/eval", row["eval_loss"], row["step"])
                if row["lr"] is not None:
                    writer.add_scalar("learning_rate", row["lr"], row["step"])
                writer.add_scalar("samples_per_second", row["samples"] / row["seconds"], row["step"])
        return log_dir
