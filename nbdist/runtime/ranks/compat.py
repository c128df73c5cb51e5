"""torch.distributed names that changed between the torch versions nbdist supports: one place picks what is there
(runs ON the engines: it imports torch.distributed).

torch 2.13 names the tensor forms of all-gather and reduce-scatter `all_gather_single` and `reduce_scatter_single`;
older releases (nbdist supports torch >= 2.4, see pyproject.toml) have only `all_gather_into_tensor` and
`reduce_scatter_tensor`. Both take (output, input, ...) in the same order, so code written against these two names
runs on either:

    %%dist
    from nbdist.runtime.ranks.compat import all_gather_single, reduce_scatter_single

FSDP2's `fully_shard` (and its `FSDPModule`) became public in torch 2.6 as torch.distributed.fsdp.fully_shard;
torch 2.4 and 2.5 have them only at torch.distributed._composable.fsdp. `from nbdist.runtime.ranks.compat import
fully_shard` finds either, on first use, so that importing this module never fails for code that needs no FSDP2.
"""
import importlib

import torch
import torch.distributed as dist

from nbdist.errors import DistUsageError

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")  # torch >= 2.6, then 2.4 and 2.5
FSDP2_NAMES = ("fully_shard", "FSDPModule")
MINIMUM_TORCH = "2.4"  # pyproject.toml's: FSDP2 appeared in torch.distributed._composable.fsdp then


def fsdp2(name: str, modules: tuple[str, ...] = FSDP2_MODULES):
    """FSDP2's `name` from the first of `modules` that has it (feature-tested, not read from the version number,
    which says nothing of builds that moved or kept it); one line naming this torch and the minimum if none has."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise DistUsageError(f"FSDP2's {name} is in none of {', '.join(modules)} in this torch ({torch.__version__}): "
                         f"ZeRO stages 2 and 3 need torch >= {MINIMUM_TORCH}")


def __getattr__(name: str):
    """`fully_shard` and `FSDPModule` looked up when first asked for (PEP 562), then kept."""
    if name not in FSDP2_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found = globals()[name] = fsdp2(name)
    return found


__all__ = ["all_gather_single", "fsdp2", "reduce_scatter_single"]  # not the FSDP2 names: `import *` would look them up
