"""How a ZeRO-3 implementation issues its collectives: how many calls one pass over a block makes, and what each
call costs beyond its ring (a call pays the ring's latency once per step: cutting the same bytes into more calls
multiplies that latency; on every GPU of a cluster that is thousands of steps).

Two issuers, both read from their sources:
- "layer" (FSDP2, torchtitan, nbdist's own ZeRO-3: `fully_shard` per transformer block): one
  all_gather_into_tensor of the block's flat shard per pass, one reduce_scatter_tensor of its gradients.
- "parameter" (DeepSpeed's ZeRO-3 of 2021, what Megatron-LM's Table 2 compared against, arXiv 2104.04473):
  `_allgather_param` gathers one parameter tensor at a time (deepspeed/runtime/zero/partition_parameters.py) by
  the list form `torch.distributed.all_gather(partitions, ...)`: DeepSpeed's loop makes the N views `partitions`
  (one `narrow` per member), and torch's ProcessGroupNCCL gathers into a flat buffer and copies it back into
  the N views (one `copy_` per member; the whole tensor read and written once more). Gradients are
  reduce-scattered in buckets of DeepSpeed's default `reduce_bucket_size`, 5e8 elements.

A tensor operation's own overhead, the price of each of those per-member views and copies: "on the order of
2 µs" for a torch function on a torch.Tensor (PyTorch's benchmarks/overrides_benchmark/README.md). They scale
with the members N, as the ring's steps do: at a micro-batch of one sequence per GPU they, not the bytes, are what
grows as GPUs are added (benchmarks/README.md, "ZeRO-3 at scale").
"""
from __future__ import annotations

import math

from nbdist.checks import one_of

ISSUERS = ("layer", "parameter")
TENSOR_OP_SECONDS = 2e-6  # one torch operation's overhead (PyTorch benchmarks/overrides_benchmark/README.md)
LIST_OPS_PER_MEMBER = 2  # DeepSpeed's narrow of the member's view + torch's copy_ back into it
REDUCE_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size


def gathers_per_pass(issuer: str, layers: int, block_tensors: int) -> int:
    """All-gather calls one pass (forward, recomputed forward or backward) over `layers` blocks makes."""
    one_of(issuer, ISSUERS, "ZeRO-3 issuer")
    return layers * (block_tensors if issuer == "parameter" else 1)


def scatter_calls(issuer: str, layers: int, parameters: float) -> int:
    """Reduce-scatter calls for the gradients of `layers` blocks holding `parameters` (whole, before sharding)."""
    one_of(issuer, ISSUERS, "ZeRO-3 issuer")
    return max(1, math.ceil(parameters / REDUCE_BUCKET_ELEMENTS)) if issuer == "parameter" else layers


def list_form_seconds(issuer: str, calls: int, members: int, gathered_bytes: float, bandwidth: float) -> float:
    """What `calls` all-gathers of `gathered_bytes` in all cost besides their rings: for the list form, per call N
    views made and N copies back, and the gathered bytes read and written once more at `bandwidth` (bytes/s);
    nothing for all_gather_into_tensor."""
    one_of(issuer, ISSUERS, "ZeRO-3 issuer")
    if issuer == "layer":
        return 0.0
    return calls * members * LIST_OPS_PER_MEMBER * TENSOR_OP_SECONDS + 2 * gathered_bytes / bandwidth
