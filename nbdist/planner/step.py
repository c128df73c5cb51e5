"""The time of one training step, every term from a formula you can read.

Per micro-batch and model chunk (one tensor-parallel rank's share of its layers):
- compute: the block's kernels (ops.py: q/k/v, attention, MLP matmuls; LayerNorm, softmax, dropout, GeLU,
  residual adds), each on a roofline, max(FLOPs / (peak × matmul efficiency), bytes / (memory bandwidth ×
  memory efficiency)); the first chunk adds the embedding, the last the logits and the cross-entropy. Backward
  twice the forward; recomputation runs the block's forward again (full) or its attention core (selective).
  Small models lose most to the element-wise kernels: their bytes grow with s·h (and a·s²), the FLOPs with s·h².
- tensor parallelism: 2 all-reduces of the micro-batch's activation (s·b·h elements) per block in the forward, 2
  in the backward, 2 more when the forward is recomputed (Megatron-LM, arXiv 1909.08053); the first chunk adds
  the vocabulary-parallel embedding's. Ring-priced on the link the tp group spans; not overlapped with compute.
- context parallelism (cp > 1, Megatron-core's ring attention): each rank holds s/cp of every sequence, so every
  token-wise term above is /cp; per block, the k and v of the other cp - 1 ranks pass around the ring (cp - 1
  steps of this rank's 2·b·(s/cp)·kv_width/t elements) under the attention core's compute, and only what sticks
  out is charged; the backward passes k and v again with their gradients (twice the forward's bytes), a
  recomputed forward passes them once more. The gradient sync spans dp × cp ranks (they hold the same weights).
- pipeline: one message per micro-batch and chunk boundary, s·b·h/cp elements; across hosts each tp rank sends its
  1/t over its own port and the tp group all-gathers it on the host (Megatron-LM's scatter/gather). The schedule
  simulator (pipeline.py) plays the step with these durations: its makespan holds the bubble and the waits.
- ZeRO-2/3 (FSDP2, each pipeline stage on its own): per micro-batch a reduce-scatter of the gradients (and for
  ZeRO-3 an all-gather of the weights before the forward and again before the backward, a third time before a
  full recomputation), each ring-priced over the data-parallel group; one call per block, each paying the ring's
  latency once per step ((n - 1) steps: at thousands of ranks that, not the bytes, grows), or one per parameter
  tensor as DeepSpeed's ZeRO-3 of 2021 issued them, with the list form's per-member copies (cost/zero3.py).

After the pipeline: the data-parallel gradient sync (ZeRO-0: all-reduce; ZeRO-1/2: reduce-scatter, and an
all-gather of the updated weights after the optimizer), the tied embedding's all-reduce between the first and
last pipeline rank, and the optimizer (Adam reads and writes 28 bytes per parameter it updates: gradient,
master weight, two moments, the half-precision copy).

Overlap (`overlap=True`, what DDP, FSDP and Megatron-core permit): the gradient reduce-scatter or all-reduce runs
under the last micro-batch's backward, and ZeRO-3's gathers under the compute of the micro-batch before; only
what sticks out is charged. `overlap=False` charges every collective in full and makes pipeline sends block
their rank until the message is through (Megatron-LM 2021).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from nbdist.cost import data_parallel, zero3
from nbdist.cost.hardware import Hardware
from nbdist.planner import memory, ops, pipeline
from nbdist.planner.model import GPT
from nbdist.planner.shapes import Placement, Shape, groups, place

ADAM_BYTES_PER_PARAMETER = 28.0  # read the gradient (2-4), read+write master weight, momentum, variance (24), write the copy


@dataclass(frozen=True)
class ChunkTime:
    """One micro-batch's seconds on one model chunk, by term. `forward` and `backward` are what the pipeline
    simulator plays (collectives of ZeRO-2/3 included as permitted by the overlap)."""

    matmul_forward: float
    matmul_backward: float
    elementwise_forward: float
    elementwise_backward: float
    recompute: float
    tp_forward: float
    tp_backward: float
    zero_forward: float
    zero_backward: float
    overlap: bool
    send_forward: float = 0.0  # blocking pipeline sends (overlap=False): this chunk's activation to the next
    send_backward: float = 0.0  # and its input gradient to the previous
    cp_forward: float = 0.0  # context parallelism's k/v ring, what its attention compute does not hide
    cp_backward: float = 0.0

    @property
    def compute_forward(self) -> float:
        return self.matmul_forward + self.elementwise_forward

    @property
    def compute_backward(self) -> float:
        return self.matmul_backward + self.elementwise_backward + self.recompute

    @property
    def forward(self) -> float:
        return (_with(self.compute_forward + self.tp_forward + self.cp_forward, self.zero_forward, self.overlap)
                + self.send_forward)

    @property
    def backward(self) -> float:
        return (_with(self.compute_backward + self.tp_backward + self.cp_backward, self.zero_backward, self.overlap)
                + self.send_backward)


def _with(compute: float, comm: float, overlap: bool) -> float:
    """Compute plus a collective that may run beneath it: the longer of the two when overlapped, else both."""
    return max(compute, comm) if overlap else compute + comm


@dataclass(frozen=True)
class Costs:
    """What a plan's step consists of, before the pipeline is simulated."""

    chunks: list[ChunkTime]
    message: float  # one pipeline message
    dp_sync: float  # gradient reduction after the pipeline (full, before overlap)
    dp_gather: float  # ZeRO-1/2: the updated weights all-gathered after the optimizer
    embedding_sync: float
    optimizer: float
    placement: dict[str, Placement]


def costs(model: GPT, s: Shape, hw: Hardware, dtype: str, overlap: bool) -> Costs:
    """Every term of the step except the pipeline's simulated makespan."""
    where = groups(s, hw)
    e = memory.element_bytes(dtype)
    activation = s.microbatch * model.seq / s.cp * model.hidden * e
    layers = memory.chunk_layers(model, s.pp * s.chunks)
    chunks = [_chunk(model, s, hw, dtype, where, n, k == 0, k == len(layers) - 1, overlap)
              for k, n in enumerate(layers)]
    message = _message(activation, s, where)
    if not overlap:  # a blocking send holds its rank until the message is through (Megatron-LM 2021)
        chunks = [replace(c, send_forward=message if k < len(chunks) - 1 else 0.0,
                          send_backward=message if k > 0 else 0.0) for k, c in enumerate(chunks)]
    w, g, _ = memory.state_bytes(dtype)
    psi = [memory.rank_parameters(model, s, r) for r in range(s.pp)]
    dp = where["dp"]
    after = [data_parallel.after_backward(s.zero, p * g, p * w, dp.all_reduce, dp.gather) for p in psi]
    dp_sync, dp_gather = max(reduce for reduce, _ in after), max(gather for _, gather in after)
    shards = s.replicas if s.zero >= 1 else 1
    optimizer = max(psi) / shards * ADAM_BYTES_PER_PARAMETER / hw.streaming_bandwidth()
    return Costs(chunks, message, dp_sync, dp_gather, _embedding_sync(model, s, hw, g),
                 optimizer, where)


def _chunk(model: GPT, s: Shape, hw: Hardware, dtype: str, where: dict[str, Placement], layers: int, first: bool,
           last: bool, overlap: bool) -> ChunkTime:
    e = memory.element_bytes(dtype)
    block = ops.block_kernels(model, s.microbatch, s.tp, s.sequence_parallel, e, s.flash_attention, s.cp)
    kernels = layers * block + (ops.first_kernels(model, s.microbatch, s.tp, e, s.cp) if first else []) + (
        ops.last_kernels(model, s.microbatch, s.tp, e, s.cp) if last else [])
    matmul_f, elementwise_f = _seconds(kernels, hw, dtype, True), _seconds(kernels, hw, dtype, False)
    attention = ops.attention_kernels(model, s.microbatch, s.tp, e, s.flash_attention, s.cp)
    again = {"none": [], "full": block, "selective": attention}[s.recompute]
    recompute = layers * sum(k.seconds(hw.matmul_flops(dtype), hw.streaming_bandwidth()) for k in again)
    tp = where["tp"].all_reduce(s.microbatch * model.seq / s.cp * model.hidden * e)
    tp_f = (2 * layers + (1 if first else 0)) * tp
    tp_b = (4 if s.recompute == "full" else 2) * layers * tp
    zero_f, zero_b = _zero_per_microbatch(model, s, dtype, where["dp"], layers, hw.streaming_bandwidth())
    cp_f, cp_b = _context_exchange(model, s, where["cp"], e, _seconds(attention, hw, dtype, True))
    return ChunkTime(matmul_f, 2 * matmul_f, elementwise_f, 2 * elementwise_f, recompute, tp_f, tp_b, zero_f,
                     zero_b, overlap, cp_forward=layers * cp_f,
                     cp_backward=layers * (cp_b + (cp_f if s.recompute != "none" else 0.0)))


def _context_exchange(model: GPT, s: Shape, cp: Placement, e: float, attention: float) -> tuple[float, float]:
    """(forward, backward) seconds per block of context parallelism's ring that the attention core's compute
    (`attention`: its matmul seconds, forward) does not hide: cp - 1 steps, each passing one rank's k and v."""
    if s.cp == 1:
        return 0.0, 0.0
    piece = 2 * s.microbatch * model.seq / s.cp * model.kv_width / s.tp * e
    ring = (s.cp - 1) * (cp.link.latency + piece / cp.bandwidth)
    return max(0.0, ring - attention), max(0.0, 2 * ring - 2 * attention)


def _seconds(kernels: list[ops.Kernel], hw: Hardware, dtype: str, matmul: bool) -> float:
    """Seconds of the matmul kernels (matmul=True) or of the element-wise ones, each on its roofline."""
    flops, bandwidth = hw.matmul_flops(dtype), hw.streaming_bandwidth()
    return sum(k.seconds(flops, bandwidth) for k in kernels if k.matmul == matmul)


def _zero_per_microbatch(model: GPT, s: Shape, dtype: str, dp: Placement, layers: int,
                         bandwidth: float) -> tuple[float, float]:
    """(forward, backward) seconds of ZeRO-2/3's collectives in each micro-batch on a chunk of `layers` layers
    (FSDP2 on each stage: its share of the first rank's parameters). Each call pays its ring's latency: one per
    block as FSDP2 issues them, one per tensor (and the list form's copies) as DeepSpeed's ZeRO-3 of 2021 did
    (cost/zero3.py); `bandwidth`: the accelerator's streaming bandwidth, for those copies."""
    if s.zero < 2:
        return 0.0, 0.0
    w, g, _ = memory.state_bytes(dtype)
    first = sum(memory.chunk_layers(model, s.pp * s.chunks)[::s.pp])
    psi = memory.rank_parameters(model, s, 0) * layers / first
    latency = dp.gather(0.0)  # one call's ring latency: (n - 1) steps
    scatters = zero3.scatter_calls(s.zero3_calls, layers, psi)
    scatter = dp.gather(psi * g) + (scatters - 1) * latency
    if s.zero == 2:
        return 0.0, scatter
    calls = zero3.gathers_per_pass(s.zero3_calls, layers, model.block_tensors)
    gather = (dp.gather(psi * w) + (calls - 1) * latency
              + zero3.list_form_seconds(s.zero3_calls, calls, dp.members, psi * w, bandwidth))
    return gather, scatter + gather * (2 if s.recompute == "full" else 1)


def _message(activation: float, s: Shape, where: dict[str, Placement]) -> float:
    """One pipeline message of `activation` bytes between neighbouring stages."""
    if s.pp == 1:
        return 0.0
    link = where["pp"]
    if link.hosts == 1 or s.tp == 1:
        return link.link.latency + activation / link.bandwidth
    part = activation / s.tp  # scatter: each tp rank sends its slice over its own port
    regather = 0.0 if s.sequence_parallel else where["tp"].gather(activation)
    return link.link.latency + part / link.bandwidth + regather


def _embedding_sync(model: GPT, s: Shape, hw: Hardware, grad_bytes: float) -> float:
    """The tied embedding's gradient, all-reduced between the first and last pipeline rank (an untied output
    layer has no copy to keep equal)."""
    if s.pp == 1 or not model.tied:
        return 0.0
    pair = place([0, (s.pp - 1) * s.tp * s.cp * s.dp], hw)
    return pair.all_reduce(model.padded_vocab(s.tp) * model.hidden / s.tp * grad_bytes)


def simulate(c: Costs, s: Shape) -> pipeline.PipelineRun:
    """The pipeline of one step with these costs (nbdist's schedule simulator)."""
    forward = tuple(chunk.forward for chunk in c.chunks)
    backward = tuple(chunk.backward for chunk in c.chunks)
    latency = 0.0 if c.chunks[0].send_forward or c.chunks[-1].send_backward else c.message  # blocking: inside F, B
    return pipeline.run(s.schedule, s.pp, s.microbatches, s.chunks, forward, backward, latency)
