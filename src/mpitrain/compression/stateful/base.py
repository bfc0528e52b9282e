"""The interface of a stateful gradient compressor, and what every one of them shares."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import collectives
from ...core.process_sets import ProcessSet, global_process_set, size_of

_instances = itertools.count()


@dataclass
class _Deferred:
    """A bucket whose whole reduction waits for :meth:`GradientReducer.finish`."""

    tensors: list[torch.Tensor]
    key: str
    average: bool


def compressible(tensor: torch.Tensor) -> bool:
    """Whether a compressor may take ``tensor``: a dense floating-point tensor."""
    return tensor.layout == torch.strided and tensor.dtype.is_floating_point


class GradientReducer(ABC):
    """Averages a list of gradients across a process set, in place, compressed on the wire.

    ``reduce`` is collective: every rank of the process set calls it with tensors of the same
    shapes and dtypes, in the same order, under the same ``key`` (one key per bucket, of a DDP
    model or of a DistributedOptimizer).  State (error feedback, warm starts) is kept per
    key and rank; :meth:`state_dict` returns this rank's, for checkpoints.
    """

    def __init__(self) -> None:
        self._tag = f"compress{next(_instances)}"
        self.process_set: ProcessSet = global_process_set
        self.wire_bytes = 0  # bytes this rank put on the wire, summed over reduce() calls

    # ---------------------------------------------------------------- the contract
    @abstractmethod
    def reduce(self, tensors: Sequence[torch.Tensor], key: str = "grads",
               last: bool = True, average: bool = True) -> None:
        """Average ``tensors`` across the process set, in place.

        Args:
            key: names the bucket whose state (errors, factors) this call uses.
            last: this is the last bucket of the step (PowerSGD counts steps on it).
            average: False leaves the sum instead (an MXNet KVStore push sums).
        """

    # ------------------------------------------------ in stages, overlapping backward
    # A DistributedOptimizer begins each bucket as soon as backward has produced its
    # gradients, then at synchronize() advances every bucket, then finishes them, all in
    # bucket order.  Every rank must make the same calls in the same order (the stages
    # submit collectives).  By default nothing starts early: finish() does the whole reduce.

    def begin(self, tensors: Sequence[torch.Tensor], key: str, average: bool = True) -> Any:
        """Start reducing ``tensors`` (what can go on the wire before the step); returns
        what :meth:`advance` and :meth:`finish` take."""
        return _Deferred(list(tensors), key, average)

    def advance(self, started: Any) -> None:
        """The next stage of a begun reduction, submitted before any bucket finishes."""
        return  # by default there is none: finish() does everything

    def finish(self, started: Any, last: bool = True) -> None:
        """Complete a begun reduction: ``tensors`` hold the average (or sum) after it."""
        assert isinstance(started, _Deferred)
        self.reduce(started.tensors, started.key, last, started.average)

    def complete(self, begun: Sequence[Any]) -> None:
        """Advance every begun bucket of a step, then finish each (the last one as the step's
        last), in bucket order: the end of a step for DistributedOptimizer and the DDP
        drop-in alike."""
        for started in begun:
            self.advance(started)
        for i, started in enumerate(begun):
            self.finish(started, last=i == len(begun) - 1)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: enough to continue bit for bit after :meth:`load_state_dict`."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on the same rank of the same world)."""

    # ---------------------------------------------------------------- shared helpers
    @property
    def world(self) -> int:
        return size_of(self.process_set)

    def process_rank(self) -> int:
        """This rank's index in the process set (its position in an allgather's result)."""
        rank = self.process_set.rank()
        if rank is None:
            raise ValueError(f"this rank is not a member of {self.process_set!r}")
        return int(rank)

    def bind(self, process_set: ProcessSet) -> GradientReducer:
        """Reduce over ``process_set`` (the optimizer or model using it says which)."""
        self.process_set = process_set
        return self

    def name(self, key: str, what: str) -> str:
        return f"{self._tag}.{key}.{what}"

    def allreduce_sum(self, tensors: Sequence[torch.Tensor], key: str, what: str) -> None:
        """Sum ``tensors`` across ranks in place: one fused, negotiated request."""
        self.wait(self.allreduce_sum_async(tensors, key, what))

    def allreduce_sum_async(self, tensors: Sequence[torch.Tensor], key: str,
                            what: str) -> Any:
        """Start summing ``tensors`` across ranks in place; None when there is nothing to
        send, else the handle :meth:`wait` takes."""
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return None
        self.wire_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return collectives.grouped_allreduce_async_(tensors, op=collectives.Sum,
                                                    name=self.name(key, what),
                                                    process_set=self.process_set)

    @staticmethod
    def wait(handle: Any) -> None:
        """Wait for a handle of :meth:`allreduce_sum_async` (None: nothing was sent)."""
        if handle is not None:
            collectives.synchronize(handle)

    def allgather(self, tensors: Sequence[torch.Tensor], key: str,
                  what: str) -> list[torch.Tensor]:
        """Every rank's ``tensors`` concatenated along dimension 0, in rank order."""
        self.wire_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return list(collectives.grouped_allgather(list(tensors), name=self.name(key, what),
                                                  process_set=self.process_set))

    def average_plainly(self, tensors: Sequence[torch.Tensor], key: str,
                        average: bool = True) -> None:
        """Average (or sum) tensors uncompressed: what a compressor does with what it cannot
        take."""
        self.allreduce_sum(tensors, key, "plain")
        if average:
            for t in tensors:
                t.div_(self.world)
