"""Where the Trainer's batches come from, ON the ranks: what a user's data function returns, read in an order that
does not depend on the engine count.

- A map-style data set (len() and [i]), or a DataLoader over one: global batch k is nbdist.data.batch_indices
  (torch's DistributedSampler order: an epoch's permutation from seed + epoch, whole batches), replica r of R takes
  every R-th sample of it from position r, exactly what DistributedSampler(num_replicas=R, rank=r, seed=seed,
  drop_last=True) deals that replica. A DataLoader gives its data set and its collate_fn (a Hugging Face data
  collator, say); its own sampler and shuffling are replaced by that order, and its batch_size must be the
  Trainer's (the global batch).
- An iterable data set (an IterableDataset, or anything iterable without [i]): the stream read in order, global
  batch k its samples k*B .. (k+1)*B - 1 (every rank reads the stream; the end of it starts it again, an epoch),
  replica r of R every R-th from position r. An iterator (a generator) can be read only once: refused, in one line.

Samples are (input, target) pairs or dicts of tensors (Hugging Face style, `model(**batch)`); a batch is made by
the DataLoader's collate_fn or torch's default_collate.
"""
from __future__ import annotations

import torch

from nbdist import data as datasets
from nbdist.errors import DistUsageError
from nbdist.training.ranks.inputs import InputError, describe
from nbdist.training.replies import Sample


class DataSource:
    """One data function's data, read by global batch (see the module docstring)."""

    def __init__(self, given, label: str):
        from torch.utils.data import DataLoader, IterableDataset, default_collate

        self.label = label
        self.collate_fn, self.loader_batch = None, None
        if isinstance(given, DataLoader):
            self.collate_fn = None if given.collate_fn is default_collate else given.collate_fn
            self.loader_batch = given.batch_size
            given = given.dataset
        self.data = given
        mapped = hasattr(given, "__len__") and hasattr(given, "__getitem__") and not isinstance(given, IterableDataset)
        if mapped:
            self.length = len(given)
            if self.length == 0:
                raise InputError(f"{label} returned an empty data set")
            self.first = given[0]
        elif hasattr(given, "__iter__"):
            if iter(given) is given:
                raise InputError(f"{label} returned an iterator ({type(given).__name__}), which can be read only once: "
                                 f"return an iterable data set whose __iter__ starts it again (an IterableDataset) or "
                                 f"a list")
            self.length = None
            self.first = next(iter(given), None)
            if self.first is None:
                raise InputError(f"{label} returned an iterable that gives no sample")
            self._stream, self._position = None, 0
        else:
            raise InputError(f"{label} must return a map-style data set (len() and [i]), an iterable data set or a "
                             f"DataLoader, got {type(given).__name__}")
        _check_sample(self.first, label)

    def check_batch_size(self, batch_size: int) -> None:
        if self.loader_batch is not None and self.loader_batch != batch_size:
            raise InputError(f"{self.label}'s DataLoader makes batches of {self.loader_batch}, but the Trainer's "
                             f"batch_size is {batch_size}: give batch_size={self.loader_batch} (the global batch, "
                             f"dealt out over the replicas)")
        length = self.length if self.length is not None else self._pass_length(batch_size)
        if length is not None and batch_size > length:
            one_pass = "" if self.length is not None else " (one pass of the iterable)"
            raise InputError(f"batch_size {batch_size} is larger than {self.label}'s {length} samples{one_pass}: a "
                             f"step would read some twice; give batch_size <= {length}")

    def _pass_length(self, batch_size: int) -> int | None:
        """An iterable's samples in one pass if it ends before `batch_size` (None: it has a whole batch or more).
        Read anew up to one batch: a stream shorter than a batch would have each step read samples twice, counted
        twice in its gradient, without a word (the map-style data sets are refused alike, by their length)."""
        import itertools

        seen = sum(1 for _ in itertools.islice(iter(self.data), batch_size))
        return seen if seen < batch_size else None

    def share(self, step: int, batch_size: int, seed: int, replicas: int, replica: int):
        """Replica `replica`'s part of global batch `step`, collated (on CPU)."""
        if self.length is not None:
            indices = datasets.batch_indices(self.length, step, batch_size, seed)
            return datasets.collate(self.data, datasets.replica_share(indices, replicas, replica), self.collate_fn)
        samples = self._read(step * batch_size, batch_size)
        mine = samples[replica::replicas]
        return self.collate_fn(mine) if self.collate_fn is not None else _default(mine)

    def _read(self, start: int, count: int) -> list:
        """Samples start .. start + count - 1 of the stream, epochs one after another."""
        if self._stream is None or self._position > start:
            self._restart()
        for _ in range(start - self._position):
            self._next()
        return [self._next() for _ in range(count)]

    def _restart(self) -> None:
        self._stream, self._position = iter(self.data), 0

    def _next(self):
        try:
            sample = next(self._stream)
        except StopIteration:
            self._stream = iter(self.data)  # a new epoch
            sample = next(self._stream, None)
            if sample is None:
                raise InputError(f"{self.label}'s iterable gave no sample on its next pass") from None
        self._position += 1
        return sample


def _default(samples: list):
    from torch.utils.data import default_collate

    if isinstance(samples[0], (tuple, list)) and all(isinstance(t, torch.Tensor) for t in samples[0]):
        return tuple(torch.stack([s[i] for s in samples]) for i in range(len(samples[0])))
    return default_collate(samples)


def _check_sample(sample, label: str) -> None:
    from collections.abc import Mapping

    if isinstance(sample, Mapping) and sample and all(isinstance(v, (torch.Tensor, int, float, list))
                                                      for v in sample.values()):
        return
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and all(isinstance(t, torch.Tensor) for t in sample):
        return
    raise InputError(f"{label}'s samples must be (input, target) pairs of tensors or dicts of tensors (Hugging Face "
                     f"style), got {describe(sample)}")


def sample(data_fn: bytes, label: str = "data_fn", loss_given: bool = True, samples: int = 2,
           batch_size: int | None = None) -> Sample:
    """The first `samples` samples of the data set as the loop makes a batch of them (`example`: (inputs,
    targets), what the kernel profiles a model with and sizes a pipeline's messages by); or the line (`problem`)
    where the data set is not one the loop can read, or (given `batch_size`) cannot make that global batch of: what
    the ranks' set-up would say, said by the read the kernel makes anyway."""
    from nbdist.models import batches
    from nbdist.training.ranks.inputs import named
    from nbdist.wire import restore

    fn = restore(data_fn)
    label = named(fn, label)
    try:
        source = DataSource(fn(), label)
        if batch_size is not None:
            source.check_batch_size(batch_size)
        collated = source.share(0, min(samples, source.length or samples), 0, 1, 0)
        x, y = batches.inputs_and_targets(collated, loss_given, label)
    except DistUsageError as e:
        return Sample(None, str(e))
    return Sample((x, y))
