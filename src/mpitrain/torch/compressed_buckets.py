"""A stateful compressor's work for DistributedOptimizer, overlapped with backward.

The gradients are cut into buckets in the order backward produces them (the reverse of the
parameters' order), one element type and device per bucket, each up to the engine's fusion
threshold (``HOROVOD_FUSION_THRESHOLD``, 64 MiB by default), the first too, as the buckets of
uncompressed gradients.  As soon as every gradient of a bucket is final, the bucket *begins*
(PowerSGD: error added, ``P = M Q`` computed and its allreduce submitted) while the rest of
backward runs; ``synchronize()`` begins whatever is left, *advances* every bucket (PowerSGD:
``Q`` computed and submitted), then *finishes* them (decompressed, error kept).

A model smaller than the threshold makes one bucket, which begins when backward ends.  Smaller
buckets were tried, torch DDP's (1 MiB first, then 25 MiB): on 2 namespace hosts x 2 ranks at
1 Gbit/s (2026-11-27) they made the steps of benchmarks/compression_training.py's CNN and
transformer 10-13% slower with PowerSGD and 1-bit (twice the collectives per step, and no idle
core here for the overlap to use), so the cut follows the fusion threshold, which a user can
lower where backward leaves the network idle.

Buckets begin strictly in bucket order, whatever order the hooks fire in: a stage submits
collectives and may draw from the compressor's shared random generator (PowerSGD's first Q),
so every rank must make the same calls in the same order.  A bucket whose turn has not come
waits until the buckets before it are ready, or until ``synchronize()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..collectives.buckets import group_gradients
from ..compression.stateful import GradientReducer


def buckets_for(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` (in registration order) in buckets in backward's order: the reverse order,
    one element type and device per bucket, each up to the engine's fusion threshold."""
    return group_gradients(list(reversed(params)), cap_bytes=None, first_cap_bytes=None)


class CompressedBuckets:
    """Which buckets are ready, which have begun, and the step's three passes.

    Args:
        compressor: the stateful compressor (its ``begin``/``advance``/``finish``).
        buckets: the parameters to reduce, in buckets in backward's order
            (:func:`buckets_for`).
        key: prefix of each bucket's key in the compressor's state.
    """

    def __init__(self, compressor: GradientReducer, buckets: Sequence[Sequence[torch.Tensor]],
                 key: str = "optimizer") -> None:
        self.compressor = compressor
        self.key = key
        self.buckets = [list(b) for b in buckets]
        self._bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)
        self._started: list[Any] = []  # one per begun bucket, in bucket order

    def gradient_ready(self, p: torch.Tensor,
                       gradients: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
        """``p``'s gradient is final for this step: begin every bucket whose turn it is.

        ``gradients`` gives the tensors to reduce for a bucket's parameters."""
        self._ready[self._bucket_of[p]] += 1
        self._begin(gradients, everything=False)

    def synchronize(self, gradients: Callable[[list[torch.Tensor]], list[torch.Tensor]]
                    ) -> None:
        """Begin what is left, advance every bucket, finish every bucket: the gradients then
        hold their averages."""
        try:
            self._begin(gradients, everything=True)
            self.compressor.complete(self._started)
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget this step (after it finished, or when it is abandoned)."""
        self._ready = [0] * len(self.buckets)
        self._started = []

    def _begin(self, gradients: Callable[[list[torch.Tensor]], list[torch.Tensor]],
               everything: bool) -> None:
        while len(self._started) < len(self.buckets):
            i = len(self._started)
            if not everything and self._ready[i] < len(self.buckets[i]):
                return
            self._started.append(self.compressor.begin(gradients(self.buckets[i]),
                                                       key=f"{self.key}.{i}"))
