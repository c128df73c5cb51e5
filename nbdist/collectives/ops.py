"""The collectives the benchmark times, as plain data read on both sides: the notebook checks requests against it
(nbdist/collectives/sweep.py), the engines build buffers from it (nbdist/collectives/ranks/collective_timing.py)."""
from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
VIAS = ("torch", "mpi")  # torch.distributed with the group's backend; mpi4py on the tensors' own memory
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all")  # ops that split S into one equal chunk per rank
ELEMENT_BYTES = 4  # float32
ROOT = 0  # broadcast's root

GLOO_REDUCE_SCATTER_NOTE = (
    "gloo has no reduce-scatter: torch clones the input, all-reduces all S bytes and keeps this rank's chunk "
    "(moves 2(n-1)/n·S, not (n-1)/n·S: busbw about half of all_reduce's)"
)
