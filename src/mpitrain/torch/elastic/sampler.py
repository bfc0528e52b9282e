"""ElasticSampler: a dataset split over the ranks that, after a reset, splits what is left of
the epoch over the new set of ranks, so no sample of the epoch is skipped or seen twice.

How it stays exact: an epoch's order is one permutation, the same on every rank (seeded by
``seed + epoch``).  Rank r of n takes positions r, r+n, r+2n, ... of what remains, so after
every rank has processed k samples the ranks together have processed exactly the first k*n
positions.  The sampler keeps that count (``processed_num``, advanced by ``record_batch``),
commits it with the state, and after a reset the remaining positions are dealt out again over
the new ``size()``.  As with torch's DistributedSampler, the last round of an epoch is padded
with the first remaining samples so every rank gets the same number.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from ...core import runtime


class ElasticSampler(torch.utils.data.Sampler):
    """This rank's share of the samples of an epoch not yet processed (Horovod's semantics).

    Use it in a ``TorchState`` (which commits and syncs it), call ``record_batch`` after each
    batch, and ``set_epoch`` at the *end* of each epoch (it clears the processed count).

    Args:
        dataset: a dataset with ``len()``, of constant size.
        shuffle: shuffle the order of each epoch (the same order on every rank).
        seed: the shuffle's seed; must be the same on every rank.

    Raises:
        TypeError: ``dataset`` has no ``len()``, or ``seed`` is not an int.
        ValueError: mpitrain is not initialised (the split needs ``rank()`` and ``size()``).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"ElasticSampler(dataset={type(dataset).__name__}): the dataset "
                            "needs a len()")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"ElasticSampler(seed={seed!r}): the seed must be an int")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order, nothing processed yet.  Call it at the end of
        an epoch, so that an epoch cut short by a reset is not started over."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch(epoch={epoch!r}): the epoch must be an int >= 0")
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples as processed on every rank.

        Every rank calls it after the same batch: the count is of samples processed by the
        whole job (``batch_size * size()``).  ``batch_idx`` is accepted for Horovod's
        signature; the count does not depend on it.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"record_batch(batch_size={batch_size!r}): the batch size must be "
                             "an int >= 0")
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """The epoch and how many of its samples the job has processed."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue from ``state_dict`` (from :meth:`state_dict`), split over today's ranks."""
        missing = {"epoch", "processed_num"} - set(state_dict)
        if missing:
            raise ValueError(f"ElasticSampler.load_state_dict: {sorted(missing)} missing from "
                             f"{state_dict!r}")
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Deal the samples of this epoch not yet processed over ``size()`` ranks."""
        self.num_replicas = runtime.size()
        self.rank = runtime.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        # Pad so every rank gets num_samples (wrapping, for a remainder smaller than the pad).
        while indices and len(indices) < self.total_size:
            indices += indices[:self.total_size - len(indices)]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


__all__ = ["ElasticSampler"]
