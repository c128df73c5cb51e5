"""Published training runs the planner is checked against: each run's configuration as its paper gives it, and the
TFLOP/s per GPU the paper reports. Predictions come from the configuration only; the published figure is only
compared with.

- Megatron-LM, Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21 (arXiv 2104.04473), Table 1: weak scaling from 1.7 B to 1 T parameters on A100 80 GB
  (Selene: DGX A100, NVSwitch, 8 × HDR InfiniBand per node), sequence 2,048, vocabulary 51,200, activation
  recomputation, the interleaved schedule, mixed precision. The table gives neither the micro-batch size nor the
  chunks per rank: b = 1 (the paper's large-model runs), and the smallest v >= 2 that divides each stage's layers
  (v = 1 when none does, or without a pipeline).
- The same paper, Table 2: GPT-3 175B (96 layers, hidden 12,288, 96 heads) at global batch 1,536 on 384, 768 and
  1,536 GPUs. ZeRO-3 without model parallelism (DeepSpeed's, 2021: dp over every GPU, micro-batch 4, 2, 1, so one
  micro-batch per step): 144, 88, 44 TFLOP/s per GPU. PTD-P (tp = 8, pp = 12, micro-batch 1): 153, 149, 141.
  Assumed as for Table 1: full recomputation, the interleaved schedule with Table 1's v; for ZeRO-3 DeepSpeed's
  way of issuing its collectives then (one all-gather per parameter tensor, list form; nbdist/cost/zero3.py).
- Megatron-Turing NLG 530B, Smith et al., arXiv 2201.11990, section 2.4 (System Performance Evaluation): 105 layers, hidden
  20,480, 128 heads, sequence 2,048, tp = 8, pp = 35, global batch 1,920, on 280, 350 and 420 DGX A100 nodes:
  126, 121 and 113 TFLOP/s per GPU (iterations of 60.1, 50.2 and 44.4 s; Megatron's FLOPs formula gives those
  figures from those times). DeepSpeed's pipeline (1F1B, no interleaving), micro-batch 1.

- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023 (arXiv
  2205.05198): 22 B, 175 B, 530 B and 1 T GPT models on Selene (the same A100 80 GB nodes), tp = 8, one replica
  (dp = 1), sequence 2,048, vocabulary 51,200; Table 3 gives the configurations (heads/hidden/layers 64/6144/48,
  96/12288/96, 128/20480/105, 160/25600/128; pp 1, 8, 35, 64; GPUs 8, 64, 280, 512; global batch 4, 64, 280,
  512; micro-batch 4, 1, 1, 1), Table 5 the iteration times: full recomputation 1.42, 18.13, 49.05, 94.42 s;
  sequence parallelism + selective recomputation ("present work") 1.10, 13.75, 37.83, 71.49 s, for a
  model-FLOPs utilisation of 41.5, 51.4, 56.0, 56.3 % (Megatron's 72-formula over 312 TFLOP/s per GPU gives
  those figures from those times, to 0.2 point). Assumed where the paper is silent: the non-interleaved 1F1B
  schedule, the full-recomputation rows without sequence parallelism (the paper's baseline: tensor parallelism
  with full recomputation).

These three ran before FlashAttention and without overlapping the data-parallel gradient reduction with the
backward: their rows are predicted with flash_attention=False and overlap=False.

- Llama 3 405B, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4, on H100 80 GB (the h100-sxm profile):
  126 layers, hidden 16,384, 128 heads, 8 k/v heads, SwiGLU 53,248, vocabulary 128,256; tp = 8, pp = 16, 16 M
  tokens a batch; 8,192 GPUs (cp = 1, sequence 8,192) 430 TFLOP/s per GPU, 16,384 GPUs 400, 16,384 GPUs with
  cp = 16 (sequence 131,072) 380. Shown, not counted: the paper gives neither the chunks per rank of its
  interleaved schedule nor its recomputation, and the prediction moves by 25-35 % between v = 1 and v = 2.
  Assumed: v = 1, no recomputation, FlashAttention, sequence parallelism, the optimizer state sharded over the
  data-parallel ranks (ZeRO-1: Meta shards it with FSDP), the gradient reduction overlapped.
"""
from __future__ import annotations

from dataclasses import dataclass

from nbdist.cost.hardware import Hardware
from nbdist.planner.catalog import hardware
from nbdist.planner.model import GPT, gpt, llama
from nbdist.planner.prediction import Prediction, predict
from nbdist.units import format_count, format_parameters

MEGATRON = "Megatron-LM (arXiv 2104.04473), Table 1"
NARAYANAN_T2 = "Megatron-LM (arXiv 2104.04473), Table 2"
MTNLG = "Megatron-Turing NLG 530B (arXiv 2201.11990), section 2.4"
KORTHIKANTI = "Korthikanti et al. (arXiv 2205.05198), Tables 3 and 5"
LLAMA3 = "Llama 3 (arXiv 2407.21783), Table 4"
A100_PEAK_TFLOPS = 312.0  # dense bf16/fp16, what the papers' utilisation figures divide by
H100_PEAK_TFLOPS = 989.0


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
    recompute: str = "full"
    sequence_parallel: bool = False
    cp: int = 1
    zero: int = 0
    modern: bool = False  # FlashAttention and the gradient reduction overlapped (2023 and later); else neither
    zero3_calls: str = "layer"  # ZeRO-3's collectives per block (FSDP2) or per tensor (DeepSpeed 2021)

    @property
    def label(self) -> str:
        setting = "" if self.source != KORTHIKANTI else (", SP + selective" if self.sequence_parallel else ", full")
        setting += "" if self.source != NARAYANAN_T2 else (", ZeRO-3" if self.zero == 3 else ", PTD-P")
        setting += f", cp={self.cp}" if self.cp > 1 else ""
        return f"{format_parameters(self.model.parameters)} on {format_count(self.gpus, 'GPU')}{setting}"

    def predict(self, hw: Hardware) -> Prediction:
        return predict(self.model, hw, gpus=self.gpus, tp=self.tp, pp=self.pp, global_batch=self.global_batch,
                       microbatch=self.microbatch, chunks=self.chunks, recompute=self.recompute,
                       sequence_parallel=self.sequence_parallel, flash_attention=self.modern, overlap=self.modern,
                       cp=self.cp, zero=self.zero, zero3_calls=self.zero3_calls)

    def published_mfu(self) -> float:
        """The paper's figure as model-FLOPs utilisation (Megatron's formula without recomputation / peak)."""
        return self.published_tflops * self.model.model_flops_per_iteration(self.global_batch) / (
            self.model.flops_per_iteration(self.global_batch, self.recompute) * self.peak_tflops)

    @property
    def peak_tflops(self) -> float:
        """The dense 16-bit peak the paper's utilisation divides by: A100 312, H100 SXM 989."""
        return H100_PEAK_TFLOPS if self.source == LLAMA3 else A100_PEAK_TFLOPS


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

_GPT3 = gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, name="GPT-3 175B")
TABLE2_ZERO3 = [Run(NARAYANAN_T2, _GPT3, gpus, 1, 1, 1536, tflops, microbatch=1536 // gpus, zero=3,
                    zero3_calls="parameter") for gpus, tflops in ((384, 144), (768, 88), (1536, 44))]
TABLE2_PTDP = [Run(NARAYANAN_T2, _GPT3, gpus, 8, 12, 1536, tflops, chunks=interleaving(96, 12))
               for gpus, tflops in ((384, 153), (768, 149), (1536, 141))]
TABLE2 = TABLE2_ZERO3 + TABLE2_PTDP

_MTNLG_MODEL = gpt(layers=105, hidden=20480, heads=128, seq=2048, vocab=51200, name="MT-NLG 530B")
MT_NLG = [Run(MTNLG, _MTNLG_MODEL, nodes * 8, 8, 35, 1920, tflops) for nodes, tflops in ((280, 126), (350, 121),
                                                                                         (420, 113))]


def _korthikanti(heads: int, hidden: int, layers: int, pp: int, gpus: int, batch: int, micro: int,
                 seconds: float, selective: bool) -> Run:
    """One of Table 5's runs: its iteration time as the TFLOP/s per GPU the GPUs executed (recomputation
    included, as every row here counts)."""
    model = gpt(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)
    recompute = "selective" if selective else "full"
    tflops = model.flops_per_iteration(batch, recompute) / seconds / gpus / 1e12
    return Run(KORTHIKANTI, model, gpus, 8, pp, batch, tflops, micro, 1, recompute, selective)


KORTHIKANTI_SIZES = [  # heads, hidden, layers, pp, GPUs, global batch, micro-batch; Table 5's seconds: full, present
    ((64, 6144, 48, 1, 8, 4, 4), (1.42, 1.10)),
    ((96, 12288, 96, 8, 64, 64, 1), (18.13, 13.75)),
    ((128, 20480, 105, 35, 280, 280, 1), (49.05, 37.83)),
    ((160, 25600, 128, 64, 512, 512, 1), (94.42, 71.49)),
]
KORTHIKANTI_RUNS = [_korthikanti(*sizes, seconds, selective) for sizes, times in KORTHIKANTI_SIZES
                    for seconds, selective in zip(times, (False, True))]


def _llama3(gpus: int, cp: int, seq: int, tflops: float) -> Run:
    model = llama(126, 16384, 128, 8, 53248, seq=seq, vocab=128256, name="Llama 3 405B")
    return Run(LLAMA3, model, gpus, 8, 16, 16 * 2**20 // seq, tflops, recompute="none", sequence_parallel=True,
               cp=cp, zero=1, modern=True)


LLAMA3_RUNS = [_llama3(8192, 1, 8192, 430), _llama3(16384, 1, 8192, 400), _llama3(16384, 16, 131072, 380)]


def reproduce(runs: list[Run] | None = None, hw: Hardware | None = None) -> list[dict]:
    """Per run: its configuration, the predicted and published TFLOP/s per GPU, their ratio, the memory per GPU
    and whether it fits (default: Table 1 on the a100-80gb profile)."""
    hw = hw or hardware("a100-80gb")
    rows = []
    for run in TABLE1 if runs is None else runs:
        p = run.predict(hw)
        rows.append({"run": run.label, "source": run.source, "parameters": run.model.parameters, "gpus": run.gpus,
                     "tp": run.tp, "pp": run.pp, "dp": p.shape.dp, "cp": run.cp, "chunks": run.chunks,
                     "global batch": run.global_batch, "predicted": p.tflops_per_gpu,
                     "published": run.published_tflops, "ratio": p.tflops_per_gpu / run.published_tflops,
                     "memory": p.memory_per_gpu, "fits": p.fits, "bubble": p.pipeline.bubble_fraction,
                     "mfu": p.mfu, "published mfu": run.published_mfu(), "prediction": p})
    return rows


def order_agreement(predicted: list[float], published: list[float], tie: float = 2.0) -> float:
    """The share of pairs of runs that the prediction orders as the paper does (which run is faster), over the
    pairs whose published figures differ by more than `tie` TFLOP/s (closer pairs are a tie in a paper's
    rounding and run-to-run noise)."""
    pairs = [(i, j) for i in range(len(published)) for j in range(i + 1, len(published))
             if abs(published[i] - published[j]) > tie]
    same = sum((predicted[i] - predicted[j]) * (published[i] - published[j]) > 0 for i, j in pairs)
    return same / len(pairs) if pairs else 1.0
