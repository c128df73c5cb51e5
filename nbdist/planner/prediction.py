"""`predict`: one plan of a model on a cluster, and everything it will cost, every term visible (a Prediction).

    p = planner.predict(model, hw, gpus=1536, tp=8, pp=8, global_batch=2304, recompute="full")
    p.step_seconds, p.tokens_per_second, p.tflops_per_gpu, p.mfu, p.memory_per_gpu, p.fits
    p.breakdown["time"]     # seconds per step on the critical rank, by term; they add up to step_seconds
    p.breakdown["memory"]   # bytes on the accelerator that holds most, by part; they add up to memory_per_gpu

TFLOP/s per GPU counts what the accelerators execute, the recomputed forward included (how Megatron-LM reports
it); MFU counts the model's FLOPs only (no recomputation) against the datasheet peak (PaLM's definition).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.checks import one_of
from nbdist.cost.hardware import Hardware
from nbdist.planner import memory as mem
from nbdist.planner import step
from nbdist.planner.model import GPT
from nbdist.planner.pipeline import PipelineRun
from nbdist.planner.shapes import Shape, shape
from nbdist.units import format_bytes, format_seconds

TIME_TERMS = ("matmul", "element-wise", "recomputation", "tensor-parallel all-reduces",
              "context-parallel k/v ring (exposed)", "ZeRO collectives (exposed)", "pipeline sends (blocking)",
              "pipeline bubble and messages", "data-parallel sync (exposed)", "all-gather of updated weights",
              "tied embedding sync", "optimizer")


@dataclass(frozen=True)
class Prediction:
    """A plan and its predicted step. Read `breakdown` for every term; `why()` says what dominates."""

    model: GPT
    hardware: Hardware
    shape: Shape
    dtype: str
    overlap: bool
    costs: step.Costs = field(repr=False)
    pipeline: PipelineRun = field(repr=False)
    memory_rank: int
    memory: dict[str, float] = field(repr=False)

    # -- time --------------------------------------------------------------------------------------------------

    @property
    def exposed_dp_sync(self) -> float:
        """The gradient reduction's time not hidden under the first chunk's (rank 0's last) backward."""
        full = self.costs.dp_sync
        return max(0.0, full - self.costs.chunks[0].backward) if self.overlap else full

    @property
    def step_seconds(self) -> float:
        c = self.costs
        return self.pipeline.makespan + self.exposed_dp_sync + c.dp_gather + c.embedding_sync + c.optimizer

    @property
    def critical_rank(self) -> int:
        """The pipeline rank with the most compute per step: the one the makespan waits for."""
        busy = self.pipeline.busy
        return max(range(len(busy)), key=busy.__getitem__)

    @property
    def breakdown(self) -> dict[str, dict[str, float]]:
        """{"time": seconds per step by TIME_TERMS (the critical rank's compute, then what follows the pipeline),
        "memory": bytes by memory.PARTS on the pipeline rank that holds most}."""
        r, s, c = self.critical_rank, self.shape, self.costs
        mine = c.chunks[r::s.pp]
        m = s.microbatches

        def total(term) -> float:
            return m * sum(term(chunk) for chunk in mine)

        busy = self.pipeline.busy[r]
        time = {
            "matmul": total(lambda k: k.matmul_forward + k.matmul_backward),
            "element-wise": total(lambda k: k.elementwise_forward + k.elementwise_backward),
            "recomputation": total(lambda k: k.recompute),
            "tensor-parallel all-reduces": total(lambda k: k.tp_forward + k.tp_backward),
            "context-parallel k/v ring (exposed)": total(lambda k: k.cp_forward + k.cp_backward),
            "pipeline sends (blocking)": total(lambda k: k.send_forward + k.send_backward),
        }
        rest = busy - sum(time.values())  # what ZeRO-2/3's collectives add beyond the compute they run beneath
        time["ZeRO collectives (exposed)"] = rest if rest > 1e-9 * busy else 0.0
        time |= {"pipeline bubble and messages": self.pipeline.makespan - busy,
                 "data-parallel sync (exposed)": self.exposed_dp_sync,
                 "all-gather of updated weights": c.dp_gather, "tied embedding sync": c.embedding_sync,
                 "optimizer": c.optimizer}
        return {"time": time, "memory": dict(self.memory)}

    # -- throughput --------------------------------------------------------------------------------------------

    @property
    def tokens_per_step(self) -> int:
        return self.shape.global_batch * self.model.seq

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def flops_per_step(self) -> float:
        """FLOPs the accelerators execute per step (recomputation included)."""
        return self.model.flops_per_iteration(self.shape.global_batch, self.shape.recompute)

    @property
    def tflops_per_gpu(self) -> float:
        """Executed TFLOP/s per accelerator, recomputation included (Megatron-LM's convention)."""
        return self.flops_per_step / self.step_seconds / self.shape.gpus / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's FLOPs (no recomputation) per second / (gpus × peak)."""
        useful = self.model.model_flops_per_iteration(self.shape.global_batch)
        return useful / self.step_seconds / (self.shape.gpus * self.hardware.peak(self.dtype))

    def time_to_train(self, tokens: float) -> float:
        """Seconds to train on `tokens` tokens at this step's pace."""
        return tokens / self.tokens_per_second

    # -- memory ------------------------------------------------------------------------------------------------

    @property
    def memory_per_gpu(self) -> float:
        """Bytes on the accelerator that holds most (the framework's reserve included)."""
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_per_gpu <= self.hardware.memory_bytes

    @property
    def reason(self) -> str | None:
        """Why the plan does not fit (None when it does): the bytes, and the largest part."""
        if self.fits:
            return None
        part = max(self.memory, key=self.memory.get)
        return (f"needs {format_bytes(self.memory_per_gpu)} per GPU on pipeline rank {self.memory_rank}, the "
                f"{self.hardware.name} has {format_bytes(self.hardware.memory_bytes)} (largest part: {part}, "
                f"{format_bytes(self.memory[part])})")

    # -- words -------------------------------------------------------------------------------------------------

    def describe(self) -> str:
        return f"{self.shape.gpus} × {self.hardware.name}: {self.shape.describe()}"

    def why(self) -> str:
        """The step in one sentence: its largest terms and their shares."""
        time = self.breakdown["time"]
        top = sorted(time.items(), key=lambda kv: -kv[1])[:3]
        shares = ", ".join(f"{name} {value / self.step_seconds:.0%}" for name, value in top if value > 0)
        return (f"{self.describe()}: step {format_seconds(self.step_seconds)} ({shares}), bubble "
                f"{self.pipeline.bubble_fraction:.1%}, {self.tflops_per_gpu:.4g} TFLOP/s per GPU, MFU {self.mfu:.1%}, "
                f"{format_bytes(self.memory_per_gpu)} per GPU")

    def table(self) -> list[tuple[str, str]]:
        """(quantity, value) rows: the outputs, then every term of time and memory."""
        rows = [("plan", self.describe()), ("step", format_seconds(self.step_seconds)),
                ("tokens/s", f"{self.tokens_per_second:,.0f}"), ("TFLOP/s per GPU", f"{self.tflops_per_gpu:.4g}"),
                ("MFU", f"{self.mfu:.1%}"), ("memory per GPU", format_bytes(self.memory_per_gpu)),
                ("fits", "yes" if self.fits else f"no: {self.reason}")]
        rows += [(f"time: {k}", format_seconds(v)) for k, v in self.breakdown["time"].items()]
        rows += [(f"memory: {k}", format_bytes(v)) for k, v in self.memory.items()]
        return rows

    def __str__(self) -> str:
        width = max(len(k) for k, _ in self.table())
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self.table())

    def __repr__(self) -> str:
        return f"<Prediction {self.why()}>"


def predict(model: GPT, hw: Hardware, gpus: int, tp: int = 1, pp: int = 1, *, global_batch: int,
            microbatch: int = 1, chunks: int = 1, zero: int = 0, recompute: str = "none",
            sequence_parallel: bool = False, flash_attention: bool = True, dtype: str | None = None,
            overlap: bool = True, cp: int = 1, zero3_calls: str = "layer") -> Prediction:
    """The predicted step of `model` on `gpus` accelerators of `hw` with dp = gpus / (tp·cp·pp) (see the module
    docstring; `cp`: context parallelism, each sequence split over cp ranks; `zero3_calls`: "layer", ZeRO-3's
    collectives one per block as FSDP2 issues them, or "parameter", one per tensor as DeepSpeed's ZeRO-3 of 2021
    did, nbdist/cost/zero3.py). Impossible plans are refused in one
    line (DistUsageError); a plan that does not fit in memory is predicted anyway, with `fits` False and `reason`
    saying why."""
    dtype = dtype or hw.dtype
    one_of(dtype, tuple(hw.peak_flops), f"dtype for {hw.name}")
    s = shape(model, gpus, tp, pp, global_batch, microbatch, chunks, zero, recompute, sequence_parallel,
              flash_attention, cp, zero3_calls)
    return predict_shape(model, hw, s, dtype, overlap)


def predict_shape(model: GPT, hw: Hardware, s: Shape, dtype: str, overlap: bool = True) -> Prediction:
    """predict() of an already checked Shape."""
    c = step.costs(model, s, hw, dtype, overlap)
    rank, bytes_ = mem.peak_memory(model, s, hw, dtype)
    return Prediction(model, hw, s, dtype, overlap, c, step.simulate(c, s), rank, bytes_)
