"""allgather, grouped_allgather and alltoall on TF tensors.

Gradients as in Horovod 0.28.1: an allgather's gradient is the upstream gradient averaged over
the process set, then this rank's rows of it; an alltoall's is the alltoall of the upstream
gradient sent back along the received splits.

Every rank of the process set must call each of these in the same order (inside a
``tf.function``, the order of the program).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from . import _bridge, _engine_ops
from ._support import differentiable, set_rank, set_size, with_gradient
from ._support import not_converted as _not_converted
from .dense_reduce import dense_allreduce


def _rows(t: tf.Tensor) -> tf.Tensor:
    """The first dimension of ``t`` as a 1-element int64 tensor (a 0-d tensor is one row)."""
    return tf.shape(t, out_type=tf.int64)[:1] if t.shape.rank else tf.ones([1], tf.int64)


def _allgather(tensors: list[tf.Tensor], name: str | None,
               process_set: ProcessSet) -> list[tf.Tensor]:
    def run(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return _engine_ops.allgather(xs, name, process_set)

    def gradient(xs: list[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        upstream = [tf.convert_to_tensor(g) for g in dys]
        summed = dense_allreduce(upstream, ReduceOp.AVERAGE, 1.0, 1.0, None, process_set)
        counts = _engine_ops.allgather([_rows(x) for x in xs], None, process_set)
        me = set_rank(process_set)
        grads = []
        for x, g, c in zip(xs, summed, counts):
            start = tf.reduce_sum(c[:me])
            grads.append(tf.reshape(g[start:start + c[me]], tf.shape(x)))
        return grads

    return with_gradient(run, gradient, tensors)


@_not_converted
def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather each tensor of a list (one request): every rank's rows, in rank order.

    Raises:
        TypeError: a dtype is not supported, or ``tensors`` is not a list.
        ValueError: the step is being compiled by XLA.
    """
    del ignore_name_scope
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"grouped_allgather takes a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    converted = [_bridge.as_tensor(t, f"tensors[{i}]", moved_only=True)
                 for i, t in enumerate(tensors)]
    set_id_of(process_set)
    if not converted:
        return []
    return _allgather(converted, name, process_set)


@_not_converted
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must agree.  A 0-d tensor counts
    as one row.  Every rank must call this in the same order.

    Raises:
        TypeError: the dtype is not supported.
        ValueError: the step is being compiled by XLA.
    """
    del ignore_name_scope
    x = _bridge.as_tensor(tensor, "tensor", moved_only=True)
    set_id_of(process_set)
    return _allgather([x], name, process_set)[0]


def _splits_tensor(splits: Any, size: int) -> tf.Tensor:
    try:
        s = tf.convert_to_tensor(splits)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"splits must be integers, got {splits!r}: {exc}") from None
    if not s.dtype.is_integer:
        raise TypeError(f"splits must be integers, got dtype {s.dtype.name}")
    if s.shape.rank is not None and (s.shape.rank != 1 or s.shape[0] not in (None, size)):
        raise ValueError(f"splits must be a vector of {size} entries (one per rank), got "
                         f"shape {s.shape}")
    if tf.executing_eagerly():
        values = s.numpy()
        if np.any(values < 0):
            raise ValueError(f"splits must be non-negative, got {values.tolist()}")
    return tf.cast(s, tf.int32)


@_not_converted
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows of ``tensor`` to every rank and receive theirs (Horovod's ``alltoall``).

    Rows go out consecutively: the first ``splits[0]`` to rank 0 of the set, the next
    ``splits[1]`` to rank 1, ...; without ``splits`` the rows are split evenly (the first
    dimension must then be divisible by the set size).  Every rank must call this in the same
    order.

    Returns:
        The received rows, in rank order; with ``splits`` given, the tuple ``(received rows,
        received splits)`` (int32, rows from each rank), as Horovod returns.

    Raises:
        TypeError: the dtype is not supported, or ``splits`` is not integral.
        ValueError: a scalar tensor, ``splits`` of the wrong length or negative, or XLA.
    """
    del ignore_name_scope
    x = _bridge.as_tensor(tensor, "tensor", moved_only=True)
    if x.shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
    set_id_of(process_set)
    size = set_size(process_set)
    splits_t = None if splits is None else _splits_tensor(splits, size)
    if not differentiable([x]):
        out, received = _engine_ops.alltoall(x, splits_t, name, process_set)
        return (out, received) if splits is not None else out

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        out, received = _engine_ops.alltoall(t, splits_t, name, process_set)

        def backward(d_out: Any, d_received: Any = None) -> tf.Tensor:
            del d_received  # integer counts carry no gradient
            grad = tf.zeros_like(out) if d_out is None else d_out
            back, _ = alltoall(grad, splits=received, process_set=process_set)
            return tf.reshape(back, tf.shape(t))

        return (out, received), backward

    out, received = forward(x)
    return (out, received) if splits is not None else out
