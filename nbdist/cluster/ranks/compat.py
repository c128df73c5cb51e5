"""torch.distributed names that changed between the torch versions nbdist supports: one place picks what is there
(runs ON the engines: it imports torch.distributed).

torch 2.13 names the tensor forms of all-gather and reduce-scatter `all_gather_single` and `reduce_scatter_single`;
older releases (nbdist supports torch >= 2.4, see pyproject.toml) have only `all_gather_into_tensor` and
`reduce_scatter_tensor`. Both take (output, input, ...) in the same order, so code written against these two names
runs on either:

    %%dist
    from nbdist.cluster.ranks.compat import all_gather_single, reduce_scatter_single
"""
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["all_gather_single", "reduce_scatter_single"]
