"""Horovod's TensorFlow collectives on tf tensors, eagerly and in graphs, with gradients.

Each function validates its arguments when it is called (or traced), then runs one engine
request through :mod:`mpitrain.tensorflow._bridge`.  Floating tensors get Horovod's gradient
rules, the same as :mod:`mpitrain.torch.mpi_ops`: allreduce <- allreduce with the same op and
scaling; allgather <- averaged allreduce, then this rank's rows; broadcast <- averaged
allreduce, zero off the root.

Every rank of the process set must call each collective in the same order (inside a
``tf.function``, the order of the program).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import collectives as C
from .. import runtime
from ..compression import Compression, Compressor
from ..ops.types import ReduceOp, check_reduce_supported
from ..process_sets import ProcessSet, _set_of, global_process_set
from . import _bridge

_FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def set_size(process_set: ProcessSet = global_process_set) -> int:
    """Number of ranks in ``process_set`` (which must be registered)."""
    return len(runtime.state().engine.process_set(_set_of(process_set)).world_ranks)


def set_rank(process_set: ProcessSet = global_process_set) -> int:
    """This process's rank within ``process_set``."""
    return int(runtime.state().engine.process_set(_set_of(process_set)).rank)


def _linear(op: ReduceOp, what: str) -> None:
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"the gradient of {what} with op={op.name.title()} is not defined; "
                         "only Sum and Average are differentiable")


def _zeros_for_none(grads: Sequence[Any], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    return [tf.zeros_like(y) if g is None else g for g, y in zip(grads, like)]


# ------------------------------------------------------------------------------ allreduce
def _reduce_now(tensors: Sequence[tf.Tensor], op: ReduceOp, pre: float, post: float,
                compression: type[Compressor], name: str | None,
                process_set: ProcessSet) -> list[tf.Tensor]:
    engine_name = _bridge.op_name("allreduce", name)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return C.grouped_allreduce(list(arrays), name=engine_name, compression=compression,
                                   op=op, prescale_factor=pre, postscale_factor=post,
                                   process_set=process_set)

    return _bridge.run(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                       "grouped_allreduce")


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      name: str | None = None) -> list[tf.Tensor]:
    """Reduce a list of dense tensors across the process set as one fused request.

    Every rank must call this with the same number of tensors, shapes and dtypes, in the same
    order.  Inside a ``tf.function`` the whole list is one op, so one step's tensors always
    travel together.

    Args:
        tensors: dense tensors (or variables, or numpy arrays).
        average: deprecated; ``True`` is ``op=Average``, ``False`` is ``op=Sum``.
        device_dense: accepted for Horovod compatibility (mpitrain moves host memory).
        device_sparse: accepted for Horovod compatibility.
        compression: e.g. ``Compression.fp16``: the wire format of floating tensors.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor: multiplies every input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part (default: all).
        name: a name for the request (default: numbered in order, or fixed in v1 graphs).

    Returns:
        The reduced tensors, in order.

    Raises:
        TypeError: a tensor's dtype is not supported, or ``tensors`` is not a list.
        ValueError: an unknown op, or the step is being compiled by XLA.
    """
    del device_dense, device_sparse  # placement of the reduction is the engine's business
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"grouped_allreduce takes a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    converted = [_bridge.as_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    reduce_op = C._resolve_op(op, average)
    pre = C._factor(prescale_factor, "prescale_factor")
    post = C._factor(postscale_factor, "postscale_factor")
    for i, t in enumerate(converted):
        check_reduce_supported(t.dtype.name, reduce_op)
        if t.dtype == tf.bool and (pre != 1.0 or post != 1.0):
            raise ValueError(f"tensors[{i}] is bool: scale factors must be 1, got "
                             f"prescale_factor={pre}, postscale_factor={post}")
    if not converted:
        return []
    args = (reduce_op, pre, post, compression, name, process_set)
    if not all(t.dtype in _FLOATS for t in converted):
        return _reduce_now(converted, *args)

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        ys = _reduce_now(list(xs), *args)

        def backward(*dys: Any) -> list[tf.Tensor]:
            _linear(reduce_op, "allreduce")
            return _reduce_now(_zeros_for_none(dys, ys), reduce_op, pre, post, compression,
                               None, process_set)

        return ys, backward

    return list(forward(*converted))


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` across the process set; returns the result.

    A ``tf.IndexedSlices`` (a sparse gradient) is gathered instead of reduced: its values and
    indices are allgathered, and for Average the values are divided by the set size.  Every
    rank must call this in the same order.  Arguments as for :func:`grouped_allreduce`.
    """
    del ignore_name_scope  # names are the engine's: see _bridge.op_name
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, average, op, prescale_factor, postscale_factor, name,
                                 process_set)
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set, name)[0]


def _allreduce_sparse(slices: tf.IndexedSlices, average: bool | None, op: Any,
                      prescale_factor: float, postscale_factor: float, name: str | None,
                      process_set: ProcessSet) -> tf.IndexedSlices:
    reduce_op = C._resolve_op(op, average)
    _linear(reduce_op, "a sparse (IndexedSlices) allreduce")
    scale = C._factor(prescale_factor, "prescale_factor") * C._factor(
        postscale_factor, "postscale_factor")
    if reduce_op == ReduceOp.AVERAGE:
        scale /= set_size(process_set)
    values = allgather(slices.values, name=None if name is None else name + ".values",
                       process_set=process_set)
    indices = allgather(slices.indices, name=None if name is None else name + ".indices",
                        process_set=process_set)
    if scale != 1.0:
        values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


# ------------------------------------------------------------------------------ allgather
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
    x = _bridge.as_tensor(tensor, "tensor")
    _set_of(process_set)

    def gather(t: tf.Tensor) -> tf.Tensor:
        engine_name = _bridge.op_name("allgather", name)
        shape = [None] + (t.shape.as_list()[1:] if t.shape.rank else [])
        return _bridge.run(lambda a: [C.allgather(a, engine_name, process_set)], [t],
                           [t.dtype], [shape], "allgather")[0]

    if x.dtype not in _FLOATS:
        return gather(x)

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        y = gather(t)

        def backward(dy: tf.Tensor) -> tf.Tensor:
            rows = (tf.shape(t, out_type=tf.int64)[:1] if t.shape.rank
                    else tf.ones([1], tf.int64))  # a 0-d tensor was one row
            summed = grouped_allreduce([dy], op=ReduceOp.AVERAGE, process_set=process_set)[0]
            counts = allgather(rows, process_set=process_set)
            start = tf.reduce_sum(counts[:set_rank(process_set)])
            return tf.reshape(summed[start:start + rows[0]], tf.shape(t))

        return y, backward

    return forward(x)


# ------------------------------------------------------------------------------ broadcast
def _broadcast_now(tensors: Sequence[tf.Tensor], root_rank: int, name: str | None,
                   process_set: ProcessSet) -> list[tf.Tensor]:
    engine_name = _bridge.op_name("broadcast", name)

    def fn(*arrays: np.ndarray) -> list[Any]:
        handles = [C.broadcast_async(a, root_rank,
                                     None if engine_name is None else f"{engine_name}.{i}",
                                     process_set)
                   for i, a in enumerate(arrays)]
        return [C.synchronize(h) for h in handles]

    return _bridge.run(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors],
                       "broadcast")


def grouped_broadcast(tensors: Sequence[Any], root_rank: int, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Return ``root_rank``'s values of every tensor of a list, as one op (no gradient).

    Every rank must call this with the same shapes and dtypes, in the same order.

    Raises:
        TypeError: a dtype is not supported, or ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not in the process set, or XLA is compiling the step.
    """
    converted = [_bridge.as_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    C._set_rank(process_set, root_rank)
    if not converted:
        return []
    return _broadcast_now(converted, int(root_rank), name, process_set)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` (``root_rank`` is a world rank) on every rank.

    Every rank must call this with the same shape and dtype, in the same order.

    Raises:
        TypeError: the dtype is not supported, or ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not in the process set, or XLA is compiling the step.
    """
    del ignore_name_scope
    x = _bridge.as_tensor(tensor, "tensor")
    C._set_rank(process_set, root_rank)
    root = int(root_rank)
    if x.dtype not in _FLOATS:
        return _broadcast_now([x], root, name, process_set)[0]

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        y = _broadcast_now([t], root, name, process_set)[0]

        def backward(dy: tf.Tensor) -> tf.Tensor:
            reduced = grouped_allreduce([dy], op=ReduceOp.AVERAGE, process_set=process_set)[0]
            return reduced if runtime.rank() == root else tf.zeros_like(reduced)

        return y, backward

    return forward(x)
