"""A stateful compressor's work for DistributedOptimizer, overlapped with backward.

The gradients are cut into buckets in the order backward produces them (the reverse of the
parameters' order), as torch's DDP cuts them: a small first bucket, so that communication starts
early, then buckets of up to 25 MiB.  As soon as every gradient of a bucket is final, the bucket
*begins* (PowerSGD: error added, ``P = M Q`` computed and its allreduce submitted) while the rest
of backward runs; ``synchronize()`` begins whatever is left, *advances* every bucket (PowerSGD:
``Q`` computed and submitted), then *finishes* them (decompressed, error kept).

Buckets begin strictly in bucket order, whatever order the hooks fire in: a stage submits
collectives and may draw from the compressor's shared random generator (PowerSGD's first Q),
so every rank must make the same calls in the same order.  A bucket whose turn has not come
waits until the buckets before it are ready, or until ``synchronize()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compressors import GradientReducer

# torch DDP's defaults (``bucket_cap_mb=25``, and a first bucket of 1 MiB so that the first
# collective starts early in backward).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def cut_buckets(params: Sequence[torch.Tensor], first_bytes: int = FIRST_BUCKET_BYTES,
                bytes_each: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """``params`` in order, cut after the parameter that fills a bucket to its size."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    filled = 0
    for p in params:
        current.append(p)
        filled += p.numel() * p.element_size()
        if filled >= (first_bytes if not buckets else bytes_each):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class CompressedBuckets:
    """Which buckets are ready, which have begun, and the step's three passes.

    Args:
        compressor: the stateful compressor (its ``begin``/``advance``/``finish``).
        params: the parameters to reduce, in registration order.
        key: prefix of each bucket's key in the compressor's state.
    """

    def __init__(self, compressor: GradientReducer, params: Sequence[torch.Tensor],
                 key: str = "optimizer") -> None:
        self.compressor = compressor
        self.key = key
        self.buckets = cut_buckets(list(reversed(params)))
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
            for started in self._started:
                self.compressor.advance(started)
            last = len(self._started) - 1
            for i, started in enumerate(self._started):
                self.compressor.finish(started, last=i == last)
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
