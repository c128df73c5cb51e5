"""A plain multi-layer perceptron, and the building rule every nbdist model follows: weights from a seed.

Why a seed and not a broadcast: each rank builds its own copy of the model (or of its pipeline stage). When the
weights depend only on the seed and the config, every copy is identical without sending a byte, and the notebook
can build the same model to check the ranks against.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from nbdist.checks import whole_number


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build under torch's CPU generator seeded with `seed`; the caller's random state is left as it was.

    Modules are made on the CPU whatever the default device: a CUDA default would draw from the CUDA generator,
    which this does not seed, and the copies on different ranks would differ. Only torch's meta device is kept:
    there nothing is drawn, and a pipeline or plan builds its shape-only copy that way."""
    whole_number(seed, "seed", minimum=0)
    meta = torch.get_default_device().type == "meta"
    with torch.random.fork_rng(devices=[]), torch.device("meta" if meta else "cpu"):
        torch.manual_seed(seed)
        yield


def mlp(width: int = 64, layers: int = 4, inputs: int | None = None, outputs: int | None = None,
        seed: int = 0) -> nn.Sequential:
    """`Linear, ReLU, Linear, ReLU, ..., Linear` with `layers` Linear layers: inputs -> width ... width -> outputs.

    Consecutive Linear layers are the pairs tensor parallelism splits (the first by columns, the second by rows),
    and every item of the Sequential is a place a pipeline can cut."""
    width = whole_number(width, "mlp width")
    layers = whole_number(layers, "mlp layers")
    inputs = width if inputs is None else whole_number(inputs, "mlp inputs")
    outputs = width if outputs is None else whole_number(outputs, "mlp outputs")
    sizes = [inputs] + [width] * (layers - 1) + [outputs]
    with seeded(seed):
        items: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
            last = i == layers - 1
            items.append(_init(nn.Linear(fan_in, fan_out), gain=1.0 if last else 2.0))
            if not last:
                items.append(nn.ReLU())
        return nn.Sequential(*items)


def _init(linear: nn.Linear, gain: float) -> nn.Linear:
    """He-normal weights (gain 2 before a ReLU keeps activations' scale through the layers) and small random
    biases, written out here so that a change in torch's default init cannot change the model.

    Why random biases, not zeros: a tensor-parallel row split must add the bias once, not once per rank; with
    zero biases a test could not tell."""
    fan_in = linear.in_features
    nn.init.normal_(linear.weight, 0.0, math.sqrt(gain / fan_in))
    nn.init.uniform_(linear.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
    return linear
