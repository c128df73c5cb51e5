"""Published training runs the planner is checked against: each run's configuration as its paper gives it, and the
TFLOP/s per GPU the paper reports. Predictions come from the configuration only; the published figure is only
compared with.

- Megatron-LM, Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21 (arXiv 2104.04473), Table 1: weak scaling from 1.7 B to 1 T parameters on A100 80 GB
  (Selene: DGX A100, NVSwitch, 8 × HDR InfiniBand per node), sequence 2,048, vocabulary 51,200, activation
  recomputation, the interleaved schedule, mixed precision. The table gives neither the micro-batch size nor the
  chunks per rank: b = 1 (the paper's large-model runs), and the smallest v >= 2 that divides each stage's layers
  (v = 1 when none does, or without a pipeline).
- Megatron-Turing NLG 530B, Smith et al., arXiv 2201.11990, section 2.3 (system performance): 105 layers, hidden
  20,480, 128 heads, sequence 2,048, tp = 8, pp = 35, global batch 1,920, on 280, 350 and 420 DGX A100 nodes:
  126, 121 and 113 TFLOP/s per GPU (iterations of 60.1, 50.2 and 44.4 s; Megatron's FLOPs formula gives those
  figures from those times). DeepSpeed's pipeline (1F1B, no interleaving), micro-batch 1.

Both ran before FlashAttention and without overlapping the data-parallel gradient reduction with the backward:
every row is predicted with flash_attention=False and overlap=False.
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.cost.hardware import Hardware
from nbdist.planner.catalog import hardware
from nbdist.planner.model import GPT, gpt
from nbdist.planner.prediction import Prediction, predict

MEGATRON = "Megatron-LM (arXiv 2104.04473), Table 1"
MTNLG = "Megatron-Turing NLG 530B (arXiv 2201.11990), section 2.3"


@dataclass(frozen=True)
class Run:
    """A published configuration and the TFLOP/s per GPU its paper reports."""

    source: str
    model: GPT
    gpus: int
    tp: int
    pp: int
    global_batch: int
    published_tflops: float
    microbatch: int = 1
    chunks: int = 1

    @property
    def label(self) -> str:
        return f"{self.model.parameters / 1e9:.1f} B on {self.gpus}"

    def predict(self, hw: Hardware) -> Prediction:
        return predict(self.model, hw, gpus=self.gpus, tp=self.tp, pp=self.pp, global_batch=self.global_batch,
                       microbatch=self.microbatch, chunks=self.chunks, recompute="full", flash_attention=False,
                       overlap=False)


def interleaving(layers: int, pp: int) -> int:
    """The smallest chunks per rank v >= 2 that divides each stage's layers (1 without a pipeline or if none)."""
    if pp == 1:
        return 1
    per_stage = layers // pp
    return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 1)


def _megatron(heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tflops: float) -> Run:
    model = gpt(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)
    return Run(MEGATRON, model, gpus, tp, pp, batch, tflops, chunks=interleaving(layers, pp))


TABLE1 = [  # heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU
    _megatron(24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron(32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron(32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron(48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron(64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron(80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron(96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron(128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron(128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron(160, 25600, 128, 8, 64, 3072, 3072, 163),
]

_MTNLG_MODEL = gpt(layers=105, hidden=20480, heads=128, seq=2048, vocab=51200, name="MT-NLG 530B")
MT_NLG = [Run(MTNLG, _MTNLG_MODEL, nodes * 8, 8, 35, 1920, tflops) for nodes, tflops in ((280, 126), (350, 121),
                                                                                         (420, 113))]


def reproduce(runs: list[Run] | None = None, hw: Hardware | None = None) -> list[dict]:
    """Per run: its configuration, the predicted and published TFLOP/s per GPU, their ratio, the memory per GPU
    and whether it fits (default: Table 1 on the a100-80gb profile)."""
    hw = hw or hardware("a100-80gb")
    rows = []
    for run in TABLE1 if runs is None else runs:
        p = run.predict(hw)
        rows.append({"run": run.label, "source": run.source, "parameters": run.model.parameters, "gpus": run.gpus,
                     "tp": run.tp, "pp": run.pp, "dp": p.shape.dp, "chunks": run.chunks,
                     "global batch": run.global_batch, "predicted": p.tflops_per_gpu,
                     "published": run.published_tflops, "ratio": p.tflops_per_gpu / run.published_tflops,
                     "memory": p.memory_per_gpu, "fits": p.fits, "bubble": p.pipeline.bubble_fraction,
                     "prediction": p})
    return rows


def order_agreement(predicted: list[float], published: list[float], tie: float = 2.0) -> float:
    """The share of pairs of runs that the prediction orders as the paper does (which run is faster), over the
    pairs whose published figures differ by more than `tie` TFLOP/s (closer pairs are a tie in a paper's
    rounding and run-to-run noise)."""
    pairs = [(i, j) for i in range(len(published)) for j in range(i + 1, len(published))
             if abs(published[i] - published[j]) > tie]
    same = sum((predicted[i] - predicted[j]) * (published[i] - published[j]) > 0 for i, j in pairs)
    return same / len(pairs) if pairs else 1.0
