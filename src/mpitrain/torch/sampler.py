"""torch's DistributedSampler, sized from mpitrain, that can resume in the middle of an epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from ..core import runtime


class DistributedSampler(torch.utils.data.DistributedSampler):
    """This rank's share of a dataset, reshuffled per epoch; its position can be checkpointed.

    Same arguments and order as :class:`torch.utils.data.DistributedSampler`;
    ``num_replicas`` and ``rank`` default to mpitrain's ``size()`` and ``rank()``.
    ``state_dict()`` records the epoch and how many indices this epoch has handed out;
    after ``load_state_dict()`` the next iteration of that epoch continues from there
    (``save_checkpoint``/``load_checkpoint`` do this when given ``sampler=``).

    The count is of indices handed to the DataLoader: exact with ``num_workers=0``; with
    worker processes the loader reads ahead, so save at epoch boundaries there.
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset,
                         num_replicas=runtime.size() if num_replicas is None else num_replicas,
                         rank=runtime.rank() if rank is None else rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.yielded = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        for index in indices[start:]:
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples - self._resume_at

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume_at = 0  # a resume position belongs to its own epoch only
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """Where this epoch stands: ``{"epoch": e, "yielded": n}``."""
        return {"epoch": int(self.epoch), "yielded": int(self.yielded)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue epoch ``state["epoch"]`` after its first ``state["yielded"]`` indices."""
        self.epoch = int(state["epoch"])
        self.yielded = self._resume_at = int(state["yielded"])


__all__ = ["DistributedSampler"]
