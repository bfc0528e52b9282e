"""The DDP drop-in's communication hooks: three kinds behind one small interface.

:class:`CompressorHook` runs a stateful compressor of :mod:`mpitrain.compression.stateful`
(PowerSGD, top-k, 1-bit) on a bucket's gradients in place; :class:`CastHook` does what torch's
``fp16_compress_hook``/``bf16_compress_hook`` on the default group do, without their copies;
:class:`TorchHook` runs any other torch hook (``hook(state, bucket) -> Future``) on a
:class:`GradBucket` and copies its result back.  The
reducer asks a hook whether buckets begin while backward runs (``begins_in_backward``), begins
them in bucket order (``begin``), and at the end of backward has it complete them all
(``finish``).  :func:`comm_hook_for` is the one place that tells the kinds apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .... import collectives
from ....collectives.buckets import Bucket
from ....compression.stateful import GradientReducer
from ....core.process_sets import ProcessSet, size_of
from .torch_hooks import check_hook_group, ensure_default_group_for, uses_default_group

# torch's hooks that make one collective per bucket (no collective in a callback).
ONE_COLLECTIVE_HOOKS = (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook,
                        default_hooks.bf16_compress_hook)
# torch's hooks that only cast the bucket to a 16-bit type on the wire, and that type.
CAST_HOOKS = ((default_hooks.fp16_compress_hook, torch.float16),
              (default_hooks.bf16_compress_hook, torch.bfloat16))


def _plain(hook: Any) -> Any:
    return getattr(hook, "func", hook)  # functools.partial, as torch's registry wraps them


class GradBucket:
    """torch.distributed.GradBucket's methods over one of the reducer's buckets.

    The hook gets a copy of the bucket's gradients in memory torch owns: the bucket itself
    lives in memory the engine allocated, which torch cannot resize, and torch's
    ``batched_powerSGD_hook`` pads its buffer in place with ``resize_``.  As in torch's
    reducer, ``set_buffer`` replaces the tensor the hook works on (torch's
    ``fp16_compress_wrapper`` hands the wrapped hook a float16 copy this way), and
    ``gradients()`` are views of whichever buffer is current; the reducer copies the hook's
    result back into the bucket, converting its dtype.
    """

    def __init__(self, bucket: Bucket, count: int) -> None:
        self._bucket = bucket
        self._count = count
        self._buffer = bucket.flat[:bucket.numel].clone()
        base = bucket.flat.storage_offset()
        self._layout = [(v.storage_offset() - base, v.numel(), v.shape) for v in bucket.views]

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer[start:start + n].view(shape) for start, n, shape in self._layout]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._bucket.index == self._count - 1


class CompressorHook:
    """A stateful compressor: each bucket begins (its first stage) as soon as it is complete;
    at the end every bucket advances, then finishes, into the bucket's own views."""

    begins_in_backward = True

    def __init__(self, compressor: GradientReducer, process_set: ProcessSet) -> None:
        self.compressor = compressor.bind(process_set)

    def begin(self, bucket: Bucket, count: int) -> Any:
        return self.compressor.begin(bucket.views, key=f"bucket{bucket.index}")

    def finish(self, buckets: Sequence[Bucket], begun: list[Any]) -> None:
        assert len(begun) == len(buckets)  # every bucket was ready, so every one began
        self.compressor.complete(begun)


class TorchHook:
    """A torch hook.  One of torch's one-collective hooks begins each bucket while backward
    runs, as torch's reducer calls it; any other runs for each bucket at the end, each waited
    for before the next (its futures' callbacks may chain collectives, on whichever thread
    completes them: two buckets in flight would order them differently on different ranks)."""

    def __init__(self, state: Any, hook: Any, process_set: ProcessSet) -> None:
        check_hook_group(state, hook, process_set)
        self.state, self.hook, self.process_set = state, hook, process_set
        self.begins_in_backward = any(_plain(hook) is known for known in ONE_COLLECTIVE_HOOKS)
        self._group_checked = False  # torch's default group made if the hook needs one

    def begin(self, bucket: Bucket, count: int) -> Any:
        if not self._group_checked:
            ensure_default_group_for(self.state, self.hook, self.process_set)
            self._group_checked = True
        return self.hook(self.state, GradBucket(bucket, count))

    def finish(self, buckets: Sequence[Bucket], begun: list[Any]) -> None:
        assert len(begun) == (len(buckets) if self.begins_in_backward else 0)
        for i, bucket in enumerate(buckets):
            future = begun[i] if self.begins_in_backward else self.begin(bucket, len(buckets))
            result = future.wait()
            result = result[0] if isinstance(result, (list, tuple)) else result
            # A hook may answer in another dtype, or (resized) in a longer buffer.
            bucket.flat[:bucket.numel].copy_(result.reshape(-1)[:bucket.numel])


class CastHook:
    """torch's ``fp16_compress_hook``/``bf16_compress_hook`` over the default group, with
    torch's arithmetic and no copy per step: torch's hook casts a copy of the bucket into a
    new 16-bit tensor, divides it by the world size, allreduces its sum and casts the result
    into the copy, which the drop-in then copies into the bucket.  Here each bucket casts into
    a 16-bit wire buffer kept from step to step, divided the same way (the same roundings),
    whose sum is reduced in place as it would be through torch.distributed's backend, and is
    widened once, into the bucket.  Each bucket begins as soon as it is complete."""

    begins_in_backward = True

    def __init__(self, wire_dtype: torch.dtype, process_set: ProcessSet, tag: str) -> None:
        self.wire_dtype, self.process_set, self.tag = wire_dtype, process_set, tag
        self._wire: dict[int, torch.Tensor] = {}

    def begin(self, bucket: Bucket, count: int) -> Any:
        grads = bucket.flat[:bucket.numel]
        wire = self._wire.get(bucket.index)
        if wire is None or wire.device != grads.device:
            wire = self._wire[bucket.index] = torch.empty(bucket.numel, dtype=self.wire_dtype,
                                                          device=grads.device)
        wire.copy_(grads).div_(size_of(self.process_set))
        return collectives.allreduce_async_(wire, name=f"ddp.{self.tag}.cast.{bucket.index}",
                                            op=collectives.Sum, process_set=self.process_set)

    def finish(self, buckets: Sequence[Bucket], begun: list[Any]) -> None:
        assert len(begun) == len(buckets)  # every bucket was ready, so every one began
        for bucket, handle in zip(buckets, begun):
            collectives.synchronize(handle)
            bucket.flat[:bucket.numel].copy_(self._wire[bucket.index])


def comm_hook_for(state: Any, hook: Any, process_set: ProcessSet,
                  tag: str) -> CompressorHook | CastHook | TorchHook:
    """The hook object for ``register_comm_hook(state, hook)``; ``tag`` names the drop-in's
    collectives apart from another drop-in's.

    Raises:
        TypeError: ``hook`` is neither a stateful compressor nor callable.
    """
    if isinstance(hook, GradientReducer):
        return CompressorHook(hook, process_set)
    wire = next((dtype for known, dtype in CAST_HOOKS if _plain(hook) is known), None)
    if wire is not None and state is None and uses_default_group(state, hook):
        check_hook_group(state, hook, process_set)  # the refusal torch's hook would get
        return CastHook(wire, process_set, tag)
    if callable(hook):
        return TorchHook(state, hook, process_set)
    raise TypeError(f"hook must be a callable hook(state, bucket) -> Future or a stateful "
                    f"compressor such as hvd.Compression.powersgd(), got {hook!r}")


__all__ = ["CAST_HOOKS", "CastHook", "CompressorHook", "GradBucket", "ONE_COLLECTIVE_HOOKS",
           "TorchHook", "comm_hook_for"]
