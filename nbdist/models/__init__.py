"""Models nbdist's labs train, built the same on every rank and in the notebook from a seed.

Both are one flat nn.Sequential, so a pipeline can cut them between items and tensor parallelism can split their
Linear pairs. They import torch and torch.nn only: the notebook kernel and the engines both use them.
"""
from __future__ import annotations

from nbdist.models.gpt import GPTConfig, gpt, lm_loss
from nbdist.models.mlp import mlp

__all__ = ["GPTConfig", "gpt", "lm_loss", "mlp"]
