"""When DistributedOptimizer's final gradients are submitted: one object per submission path.

:mod:`.optimizer` counts backward passes and keeps Horovod's step protocol; once a gradient is
final for the step (its last accumulation), it hands it to the one path it chose at
construction, which decides when the gradient goes and how the step ends:

* :class:`PerTensorPath`: each gradient alone, from its hook (the engine fuses them; on CPU
  they wait in flat bucket views, see :mod:`.gradient_submission`);
* :class:`GroupedPath`: ``groups=`` (or ``num_groups``): a group as one grouped request once
  every one of its gradients is final;
* :class:`CompressedPath`: a stateful compressor (PowerSGD, top-k, 1-bit) reducing buckets
  cut in backward's order (:mod:`.compressed_buckets`);
* :class:`LocalPath`: nothing to reduce (a process set of one, or this rank outside it).

What is submitted on each path is :class:`.gradient_submission.GradientSubmitter`'s.
``synchronize()`` is :meth:`GradientPath.submit_rest`, then :meth:`GradientPath.finish`: the
per-tensor and grouped paths submit what backward left unsent in the parameters' registration
order, the same on every rank, so that requests fuse alike everywhere (a compressor's buckets
go in bucket order).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from ..compression.stateful import GradientReducer
from .compressed_buckets import CompressedBuckets, buckets_for
from .gradient_submission import GradientSubmitter, InFlight

Group = tuple[torch.Tensor, ...]


class GradientPath(ABC):
    """One way of submitting a step's gradients (see the module)."""

    @abstractmethod
    def gradient_final(self, p: torch.Tensor) -> None:
        """``p``'s gradient will not change again this step: submit what is now complete."""

    def submit_rest(self) -> None:
        """``synchronize()`` begins: submit what backward did not (collective: every rank of
        the process set calls it)."""
        return  # by default everything went from backward, or goes in finish()

    @abstractmethod
    def finish(self) -> None:
        """Wait for everything submitted: each ``p.grad`` then holds its result."""

    @abstractmethod
    def end_round(self) -> None:
        """Forget this step's requests (after ``finish()``, even a failed one)."""

    def abandon(self) -> None:
        """After ``end_round()``, for a step that failed halfway: forget what it leaves (the
        counts of final gradients of a half-complete group)."""
        return  # by default end_round() forgot everything


class LocalPath(GradientPath):
    """No reduction: nothing is hooked, so nothing is ever final here."""

    def gradient_final(self, p: torch.Tensor) -> None:
        """Never called: a local optimizer registers no gradient hooks."""

    def finish(self) -> None:
        """Nothing was submitted, so nothing to wait for."""

    def end_round(self) -> None:
        """Nothing was submitted, so nothing to forget."""


class PerTensorPath(GradientPath):
    """Each gradient as its own named request, submitted from its hook.

    Args:
        submitter: makes the requests.
        params: the parameters that get gradients, in registration order.
    """

    def __init__(self, submitter: GradientSubmitter, params: Sequence[torch.Tensor]) -> None:
        self._submitter = submitter
        self._params = list(params)
        self._in_flight: dict[torch.Tensor, InFlight] = {}

    def bucket_order(self, keep: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
        """The parameters ``keep`` accepts, in the order their gradients become ready."""
        # backward produces gradients roughly in reverse registration order
        return [p for p in reversed(self._params) if keep(p)]

    def gradient_final(self, p: torch.Tensor) -> None:
        self._in_flight[p] = self._submitter.submit(p)

    def submit_rest(self) -> None:
        for p in self._params:
            if p not in self._in_flight:  # no gradient here yet: zeros meet the others'
                self._in_flight[p] = self._submitter.submit(p)

    def finish(self) -> None:
        for request in self._in_flight.values():
            request.finish()

    def end_round(self) -> None:
        self._in_flight.clear()


class GroupedPath(GradientPath):
    """Each group as one grouped request, submitted once all its gradients are final.

    Args:
        submitter: makes the requests.
        params: the parameters that get gradients, in registration order.
        groups: every one of ``params`` in exactly one group
            (:func:`.gradient_groups.split_groups`).
    """

    def __init__(self, submitter: GradientSubmitter, params: Sequence[torch.Tensor],
                 groups: Sequence[Group]) -> None:
        self._submitter = submitter
        self._params = list(params)
        self._group_of = {p: g for g in groups for p in g}
        self._ready = {g: 0 for g in groups}  # final gradients so far, per group
        self._in_flight: dict[Group, InFlight] = {}

    def bucket_order(self, keep: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
        """The parameters ``keep`` accepts: a group's back to back, in group order."""
        return [p for g in self._ready for p in g if keep(p)]

    def gradient_final(self, p: torch.Tensor) -> None:
        group = self._group_of[p]
        self._ready[group] += 1
        if self._ready[group] == len(group):
            self._submit(group)

    def _submit(self, group: Group) -> None:
        self._ready[group] = 0
        self._in_flight[group] = self._submitter.submit_group(group)

    def submit_rest(self) -> None:
        for p in self._params:
            group = self._group_of[p]
            if group not in self._in_flight:  # incomplete here: send it whole
                self._submit(group)

    def finish(self) -> None:
        for request in self._in_flight.values():
            request.finish()

    def end_round(self) -> None:
        self._in_flight.clear()

    def abandon(self) -> None:
        for group in self._ready:
            self._ready[group] = 0


class CompressedPath(GradientPath):
    """A stateful compressor's buckets: each begins once its gradients are final, in bucket
    order; ``finish()`` begins the rest and completes them all.

    Args:
        submitter: gives the dense gradients of a bucket.
        compressor: the stateful compressor, bound to the process set.
        params: the parameters that get gradients, in registration order.
    """

    def __init__(self, submitter: GradientSubmitter, compressor: GradientReducer,
                 params: Sequence[torch.Tensor]) -> None:
        self._submitter = submitter
        self.compressed = CompressedBuckets(compressor, buckets_for(params))

    def gradient_final(self, p: torch.Tensor) -> None:
        self.compressed.gradient_ready(p, self._submitter.dense_gradients)

    def finish(self) -> None:
        # Begins the buckets backward left, then completes all, in bucket order.
        self.compressed.synchronize(self._submitter.dense_gradients)

    def end_round(self) -> None:
        self.compressed.reset()


__all__ = ["CompressedPath", "GradientPath", "Group", "GroupedPath", "LocalPath",
           "PerTensorPath"]
