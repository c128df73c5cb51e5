"""Data nothing downloads, the same in every process given a seed: text bytes for language models, and a
regression task with a known answer.

Why every batch is a function of (seed, step): each rank (and the notebook, to check the ranks) can make the
global batch of any step by itself, with no data loader, no file to share and no broadcast.
"""
from __future__ import annotations

import functools
import hashlib
import math
import sysconfig
from pathlib import Path
from typing import Callable

import torch

from nbdist.checks import whole_number
from nbdist.errors import DistUsageError

TEACHER_WIDTH = 32  # the hidden width of the regression task's fixed teacher


def generator(*key: object) -> torch.Generator:
    """A torch.Generator seeded from `key`, e.g. ("tokens", seed, step).

    hashlib, unlike hash(), is not salted per process, so the same key gives the same numbers on every rank; and
    keys that name their purpose never share a stream (a teacher's weights are not the first batch's inputs)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


# -- text ----------------------------------------------------------------------------------------------------------


def byte_corpus(max_bytes: int = 1 << 20) -> torch.Tensor:
    """The bytes (uint8) of the standard library's own `*.py` files (directly in its folder, sorted by name),
    concatenated up to `max_bytes`: real text every Python install has.

    The files are read once per process (every rank reads them); each call returns a fresh tensor, so changing
    one cannot change what the next caller gets."""
    data = _stdlib_source(whole_number(max_bytes, "max_bytes"))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.lru_cache(maxsize=4)
def _stdlib_source(max_bytes: int) -> bytes:
    chunks, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= max_bytes:
            break
        chunk = path.read_bytes()[: max_bytes - size]
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def token_batch(corpus: torch.Tensor, step: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: `batch` windows of seq+1 tokens at random offsets in `corpus`; x is each
    window but its last token, y each window but its first (the next token to predict). int64, (batch, seq)."""
    step, batch, seq = whole_number(step, "step", 0), whole_number(batch, "batch"), whole_number(seq, "seq")
    whole_number(seed, "seed", 0)
    if corpus.dim() != 1 or corpus.is_floating_point() or corpus.is_complex():
        raise DistUsageError(f"the corpus must be a 1-D tensor of token ids, got {corpus.dtype} of shape "
                             f"{tuple(corpus.shape)}")
    if len(corpus) <= seq:
        raise DistUsageError(f"the corpus has {len(corpus)} tokens, too few for windows of seq+1 = {seq + 1}")
    offsets = torch.randint(0, len(corpus) - seq, (batch,), generator=generator("tokens", seed, step))
    windows = corpus[(offsets[:, None] + torch.arange(seq + 1)).to(corpus.device)].long()
    return windows[:, :-1], windows[:, 1:]


# -- regression ----------------------------------------------------------------------------------------------------


def regression_teacher(inputs: int = 16, outputs: int = 1, seed: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fixed function the regression targets come from: y = tanh(x @ w1) @ w2, weights drawn from `seed`.

    Exposed so a lab (or a test) can say how close a trained model came to the answer, not only to the data."""
    inputs, outputs = whole_number(inputs, "inputs"), whole_number(outputs, "outputs")
    whole_number(seed, "seed", 0)
    g = generator("teacher", seed, inputs, outputs)
    w1 = torch.randn(inputs, TEACHER_WIDTH, generator=g) / math.sqrt(inputs)
    w2 = torch.randn(TEACHER_WIDTH, outputs, generator=g) / math.sqrt(TEACHER_WIDTH)

    def teacher(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1) @ w2

    return teacher


def regression(samples: int = 1024, inputs: int = 16, outputs: int = 1, seed: int = 0,
               noise: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed data set (X, Y), float32: X standard normal (samples, inputs), Y the teacher's answer plus noise."""
    return _draw(whole_number(samples, "samples"), inputs, outputs, seed, noise, generator("regression", seed))


def regression_batch(step: int, batch: int = 64, inputs: int = 16, outputs: int = 1, seed: int = 0,
                     noise: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh batch for `step` from the same teacher as `regression(..., seed)`: an endless data set."""
    g = generator("regression batch", seed, whole_number(step, "step", 0))
    return _draw(whole_number(batch, "batch"), inputs, outputs, seed, noise, g)


def _draw(samples: int, inputs: int, outputs: int, seed: int, noise: float,
          g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise >= 0:
        raise DistUsageError(f"noise must be a number >= 0, got {noise!r}")
    teacher = regression_teacher(inputs, outputs, seed)
    x = torch.randn(samples, inputs, generator=g)
    return x, teacher(x) + noise * torch.randn(samples, outputs, generator=g)


# -- map-style data sets and their order (the Trainer's) ---------------------------------------------------------


class TokenWindows(torch.utils.data.Dataset):
    """Item i: the i-th non-overlapping window of seq+1 tokens of `corpus`, as (x, y) = (window[:-1], window[1:])."""

    def __init__(self, corpus: torch.Tensor, seq: int):
        self.corpus, self.seq = corpus, whole_number(seq, "seq")
        if len(corpus) <= self.seq:
            raise DistUsageError(f"the corpus has {len(corpus)} tokens, too few for windows of seq+1 = {seq + 1}")

    def __len__(self) -> int:
        return (len(self.corpus) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.corpus[i * self.seq: i * self.seq + self.seq + 1].long()
        return window[:-1], window[1:]


def text_dataset(seq: int = 64, max_bytes: int = 1 << 20) -> TokenWindows:
    """The byte corpus (standard library sources) cut into windows of `seq` tokens: a map-style data set."""
    return TokenWindows(byte_corpus(max_bytes), seq)


def regression_dataset(samples: int = 1024, inputs: int = 16, outputs: int = 1, seed: int = 0,
                       noise: float = 0.01) -> torch.utils.data.TensorDataset:
    """`regression(...)` as a map-style data set of (x, y) pairs."""
    return torch.utils.data.TensorDataset(*regression(samples, inputs, outputs, seed, noise))


def batch_indices(length: int, step: int, batch: int, seed: int = 0) -> torch.Tensor:
    """The data-set indices of global batch `step`, in torch's DistributedSampler order: each epoch a permutation
    of the data set drawn from `seed + epoch` (DistributedSampler(shuffle=True, seed=seed) after set_epoch(epoch)),
    cut into length // batch whole batches (the last partial one dropped, as drop_last=True does); batch k of the
    run is batch k mod (length // batch) of epoch k // (length // batch). It depends on nothing else, so the global
    batch of a step is the same on any engine count or plan, and a resumed run reads on where the interrupted one
    stopped. Replica r of R takes positions r, r + R, ... of it (`replica_share`), which is exactly what
    DistributedSampler(num_replicas=R, rank=r, shuffle=True, seed=seed, drop_last=True) with a BatchSampler of
    batch // R gives that replica."""
    length, batch = whole_number(length, "data set length"), whole_number(batch, "batch")
    per_epoch = length // batch
    if per_epoch == 0:
        raise DistUsageError(f"a global batch of {batch} samples is larger than the data set's {length}: give "
                             f"batch_size <= {length}")
    epoch, k = divmod(whole_number(step, "step", 0), per_epoch)
    return _epoch_order(length, seed, epoch)[k * batch: (k + 1) * batch]


@functools.lru_cache(maxsize=4)
def _epoch_order(length: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(length, generator=torch.Generator().manual_seed(seed + epoch))


def replica_share(indices: torch.Tensor, replicas: int, replica: int) -> torch.Tensor:
    """Replica `replica`'s samples of a global batch: every `replicas`-th, from its own position (DistributedSampler
    deals a batch out this way)."""
    return indices[replica::replicas]


def collate(dataset, indices: torch.Tensor, collate_fn=None):
    """The samples at `indices` made one batch: by `collate_fn` (a DataLoader's, e.g. a Hugging Face data
    collator), else torch's default_collate ((x, y) pairs give [X, Y]; dicts a dict of stacked tensors)."""
    samples = [dataset[int(i)] for i in indices]
    if collate_fn is not None:
        return collate_fn(samples)
    if samples and isinstance(samples[0], (tuple, list)) and all(isinstance(t, torch.Tensor) for t in samples[0]):
        return tuple(torch.stack([s[i] for s in samples]) for i in range(len(samples[0])))  # the common case, fast
    from torch.utils.data import default_collate

    return default_collate(samples)
