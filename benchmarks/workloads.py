"""What the benchmarks train and send, sized from their command lines: nbdist's own models and data, none built by hand.

`Mlp` (`WIDTHxLAYERS/BATCH`) is `nbdist.models.mlp(width, layers)` and a batch; `Gpt` (`layers,hidden,seq`) is
`nbdist.models.gpt(...)` with 4 heads and nbdist.data's byte corpus; `Llama` (`layers,hidden,seq`) a Hugging Face
LlamaForCausalLM nbdist did not write, with a data set of token dicts; `adam` is the optimizer every training benchmark
uses; `parse_size` reads message sizes ("4K", "64M"). Builders are `functools.partial`s of module functions, so
cloudpickle sends them to the engines by reference (the engines import nbdist, and this module: nbdist gives them the
kernel's import path, which holds benchmarks/), and every rank, torch's anchor and this process build the same model
from the same seed.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from nbdist import data, models

adam = partial(torch.optim.Adam, lr=1e-3)  # the optimizer of every training benchmark (called with the parameters)


def parse_size(text: str) -> int:
    """"4K" -> 4096, "64M" -> 67108864, "512" -> 512 (binary prefixes, as the sizes S of nccl-tests)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


@dataclass(frozen=True)
class Mlp:
    """`nbdist.models.mlp(width, layers, seed=0)`: `layers` x Linear(w, w), a ReLU between consecutive ones (none
    after the last), and a batch: `WIDTHxLAYERS/BATCH` on the command line."""

    width: int
    layers: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> Mlp:
        shape, _, batch = text.partition("/")
        width, _, layers = shape.partition("x")
        return cls(int(width), int(layers), int(batch))

    @classmethod
    def parse_list(cls, text: str) -> list[Mlp]:
        return [cls.parse(s) for s in text.split(",") if s.strip()]

    def __str__(self) -> str:
        return f"{self.width}x{self.layers}/{self.batch}"

    @property
    def parameters(self) -> int:
        return self.layers * (self.width * self.width + self.width)

    def builder(self):
        """A zero-argument function building the model (seed 0): every rank (and torch's side) builds the same."""
        return partial(models.mlp, width=self.width, layers=self.layers, seed=0)

    def batch_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of one batch (seed 1)."""
        g = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.width, generator=g), torch.randn(self.batch, self.width, generator=g)


@dataclass(frozen=True)
class Gpt:
    """`nbdist.models.gpt(seq, layers, hidden, heads=4, seed=0)`: `layers,hidden,seq` on the command line."""

    layers: int
    hidden: int
    seq: int
    heads: int = 4

    @classmethod
    def parse(cls, text: str) -> Gpt:
        layers, hidden, seq = (int(v) for v in text.split(","))
        return cls(layers, hidden, seq)

    def __str__(self) -> str:
        return f"{self.layers},{self.hidden},{self.seq}"

    def builder(self):
        """A zero-argument function building the model (seed 0), as nbdist.shard / nbdist.Trainer take it."""
        return partial(models.gpt, seq=self.seq, layers=self.layers, hidden=self.hidden, heads=self.heads, seed=0)

    def text(self):
        """A zero-argument function giving the byte corpus cut into windows of `seq` tokens (nbdist.data)."""
        return partial(data.text_dataset, seq=self.seq)


@dataclass(frozen=True)
class Llama:
    """A Hugging Face `LlamaForCausalLM` nbdist did not write, random-initialised from seed 0: `layers,hidden,seq`
    on the command line (4 attention heads, 2 key-value heads, intermediate 2 x hidden, vocabulary 256), trained on
    dicts of input ids and labels (its own loss), a map-style data set of random tokens (seed 1)."""

    layers: int
    hidden: int
    seq: int
    vocab: int = 256

    @classmethod
    def parse(cls, text: str) -> Llama:
        layers, hidden, seq = (int(v) for v in text.split(","))
        return cls(layers, hidden, seq)

    def __str__(self) -> str:
        return f"llama {self.layers},{self.hidden},{self.seq}"

    def builder(self):
        return partial(_llama, self.layers, self.hidden, self.seq, self.vocab)

    def data(self, samples: int = 512):
        return partial(TokenDicts, samples, self.seq, self.vocab)

    def batch(self, size: int) -> dict:
        return TokenDicts(size, self.seq, self.vocab).all()


def _llama(layers: int, hidden: int, seq: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=max(seq, 64)))


class TokenDicts(torch.utils.data.Dataset):
    """`samples` random token windows of `seq`, each {"input_ids", "labels"} (a causal LM shifts the labels)."""

    def __init__(self, samples: int, seq: int, vocab: int):
        self.ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def all(self) -> dict:
        return {"input_ids": self.ids, "labels": self.ids}


def shifted_cross_entropy(output, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss from its logits (the model's output, or its `.logits`), as Hugging Face's ForCausalLMLoss
    computes it (each position predicts the next label): the loss_fn both pipelines take."""
    logits = getattr(output, "logits", output)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
