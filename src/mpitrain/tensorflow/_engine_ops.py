"""One engine request per call, on TF tensors, with no gradient: the layer under the public ops.

Each function builds (or, eagerly, runs) one collective through :mod:`._bridge` and states the
static shapes of its outputs.  Validation of the caller's arguments happens one layer up, in
the public ops, so that it runs once, at the call or while tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import collectives
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet
from . import _bridge
from ._support import set_rank, set_size


def _reduction(kind: str, grouped: Callable[..., list[np.ndarray]],
               tensors: Sequence[tf.Tensor], op: ReduceOp, pre: float, post: float,
               name: str | None, process_set: ProcessSet, shapes: list[Any]) -> list[tf.Tensor]:
    """One fused request of the front door's ``grouped`` reduction (allreduce or
    reducescatter: the same arguments, different outputs' ``shapes``)."""
    engine_name = _bridge.op_name(kind, name)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return grouped(list(arrays), name=engine_name, op=op, prescale_factor=pre,
                       postscale_factor=post, process_set=process_set)

    return _bridge.run(fn, tensors, [t.dtype for t in tensors], shapes, kind)


def allreduce(tensors: Sequence[tf.Tensor], op: ReduceOp, pre: float, post: float,
              name: str | None, process_set: ProcessSet) -> list[tf.Tensor]:
    """Reduce the tensors together (one fused request); results keep the inputs' shapes."""
    return _reduction("allreduce", collectives.grouped_allreduce, tensors, op, pre, post, name,
                      process_set, [t.shape for t in tensors])


def _gathered_shape(t: tf.Tensor) -> list[Any]:
    return [None] + (t.shape.as_list()[1:] if t.shape.rank else [])


def allgather(tensors: Sequence[tf.Tensor], name: str | None,
              process_set: ProcessSet) -> list[tf.Tensor]:
    """Concatenate every rank's tensors along the first dimension (one request for all)."""
    engine_name = _bridge.op_name("allgather", name)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return collectives.grouped_allgather(list(arrays), name=engine_name,
                                             process_set=process_set)

    inputs = [_bridge.carried(t) for t in tensors]
    outs = _bridge.run(fn, inputs, [t.dtype for t in inputs],
                       [_gathered_shape(t) for t in tensors], "allgather")
    return [_bridge.restored(o, t.dtype) for o, t in zip(outs, tensors)]


def broadcast(tensors: Sequence[tf.Tensor], root_rank: int, name: str | None,
              process_set: ProcessSet) -> list[tf.Tensor]:
    """``root_rank``'s values of the tensors (a world rank), in flight together."""
    engine_name = _bridge.op_name("broadcast", name)

    def fn(*arrays: np.ndarray) -> list[Any]:
        handles = [collectives.broadcast_async(
                       a, root_rank, None if engine_name is None else f"{engine_name}.{i}",
                       process_set) for i, a in enumerate(arrays)]
        return [collectives.synchronize(h) for h in handles]

    inputs = [_bridge.carried(t) for t in tensors]
    outs = _bridge.run(fn, inputs, [t.dtype for t in inputs], [t.shape for t in tensors],
                       "broadcast")
    return [_bridge.restored(o, t.dtype) for o, t in zip(outs, tensors)]


def alltoall(tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None,
             process_set: ProcessSet) -> tuple[tf.Tensor, tf.Tensor]:
    """Send rows to every rank, ``splits`` (int32, one per rank; None: even) of them to each.

    Returns:
        The received rows in rank order and how many came from each rank (int32).
    """
    engine_name = _bridge.op_name("alltoall", name)
    size = set_size(process_set)
    given = splits is not None
    splits_t = splits if given else tf.zeros([size], tf.int32)

    def fn(a: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
        out, received = collectives.alltoall(a, splits=s if given else None,
                                             name=engine_name, process_set=process_set)
        return [out, np.asarray(received, dtype=np.int32)]

    moved = _bridge.carried(tensor)
    out, received = _bridge.run(fn, [moved, splits_t], [moved.dtype, tf.int32],
                                [_gathered_shape(tensor), [size]], "alltoall")
    return _bridge.restored(out, tensor.dtype), received


def scattered_rows(rows: int | None, process_set: ProcessSet) -> int | None:
    """Rows this rank keeps of a reducescatter of ``rows`` (the first ``rows % p`` get one more)."""
    if rows is None:
        return None
    size, rank = set_size(process_set), set_rank(process_set)
    return rows // size + (1 if rank < rows % size else 0)


def reducescatter(tensors: Sequence[tf.Tensor], op: ReduceOp, pre: float, post: float,
                  name: str | None, process_set: ProcessSet) -> list[tf.Tensor]:
    """Reduce the tensors together and keep this rank's block of rows of each."""
    shapes = [[scattered_rows(t.shape.as_list()[0], process_set)] + t.shape.as_list()[1:]
              if t.shape.rank else None for t in tensors]
    return _reduction("reducescatter", collectives.grouped_reducescatter, tensors, op, pre,
                      post, name, process_set, shapes)
