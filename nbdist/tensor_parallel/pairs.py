"""Which Linear layers tensor parallelism splits: the one source of that rule, read in the kernel (the plan's
profile, shape checks and memory) and sent to the ranks as DTensor's parallelize_module plan.

Megatron-LM (arXiv 1909.08053): in a GPT block q, k, v and mlp.fc are column-parallel (weight rows and bias split by
tp), attn.out and mlp.proj row-parallel (weight columns split, bias replicated); LayerNorms, embeddings and the
head are replicated. In a plain Sequential consecutive Linear layers pair up, column then row, with only
element-wise layers between them.

Plain data: imports torch.nn, never torch.distributed.
"""
from __future__ import annotations

from torch import nn

from nbdist.errors import DistUsageError

# Layers a column-parallel output may pass on its way to the row-parallel Linear: they act on each feature alone,
# so each rank can apply them to its slice of the features.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Dropout)


def _is_block(layer: nn.Module) -> bool:
    """A GPT block as nbdist.models builds it: attn.q/k/v/out and mlp.fc/proj are Linear layers."""
    attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    return (all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q", "k", "v", "out"))
            and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("fc", "proj")))


def tp_pairs(model: nn.Sequential, tp: int = 1) -> list[tuple[str, str]]:
    """(column-parallel, row-parallel) Linear layers by qualified name, in model order.

    A GPT block gives (q, out), (k, out), (v, out) and (fc, proj): attention's three column layers all feed `out`,
    so a row layer may appear in several pairs. A plain Sequential pairs its top-level Linear layers 1st with 2nd,
    3rd with 4th, ...; only element-wise layers may sit between two of a pair (anything else, a LayerNorm say,
    needs all the features), and an unpaired Linear stays replicated. With tp > 1 and no pair: refused.
    """
    if any(_is_block(layer) for layer in model):
        pairs = []
        for name, layer in model.named_children():
            if _is_block(layer):
                pairs += [(f"{name}.attn.{c}", f"{name}.attn.out") for c in ("q", "k", "v")]
                pairs.append((f"{name}.mlp.fc", f"{name}.mlp.proj"))
    else:
        pairs, column = [], None
        for name, layer in model.named_children():
            if isinstance(layer, nn.Linear) and column is None:
                column = name
            elif isinstance(layer, nn.Linear):
                pairs.append((column, name))
                column = None
            elif not isinstance(layer, ELEMENTWISE):
                column = None
    if not pairs and tp > 1:
        raise DistUsageError(f"the model has no pair of Linear layers to split: tensor parallel needs two Linear "
                             f"layers with only element-wise layers between them, or GPT blocks; got tp={tp}")
    return pairs


def tp_plan(model: nn.Sequential) -> dict[str, str]:
    """Qualified name -> "colwise" or "rowwise", every split Linear once: what parallelize_module's plan names."""
    plan = {}
    for column, row in tp_pairs(model):
        plan[column], plan[row] = "colwise", "rowwise"
    return plan


def check_tp(model: nn.Sequential, tp: int) -> None:
    """Refuse, in one line, a tp that does not divide the model's heads, hidden size or a pair's inner features."""
    config = getattr(model, "config", None)
    for what in ("heads", "hidden"):
        value = getattr(config, what, None)
        if value is not None and value % tp:
            raise DistUsageError(f"tp={tp} does not divide the model's {value} {what}: each tensor-parallel rank "
                                 f"takes {what} / tp of them")
    for column, row in tp_pairs(model, tp):
        inner = model.get_submodule(column).out_features
        if inner % tp:
            raise DistUsageError(f"tp={tp} does not divide the {inner} features between {column} and {row}, the "
                                 f"Linear pair tensor parallel splits")
