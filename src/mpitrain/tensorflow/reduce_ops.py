"""allreduce, grouped_allreduce, reducescatter and grouped_reducescatter on TF tensors.

Gradients as in Horovod 0.28.1: an allreduce's gradient is the allreduce of the upstream
gradients with the same op and scale factors; a reducescatter's is the allgather of the upstream
gradients, times the set size for Sum and times the scale factors.  A ``tf.IndexedSlices`` (a
sparse gradient, e.g. of an embedding) is allgathered instead of reduced: its values and
indices are gathered, and for Average the values are divided by the set size.

Every rank of the process set must call each of these in the same order (inside a
``tf.function``, the order of the program).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import collectives
from ..compression import Compressor
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from . import _bridge, gather_ops
from ._support import not_converted as _not_converted
from ._support import set_size
from .compression import Compression, for_tensorflow
from .dense_reduce import check_scaled, dense_allreduce, linear_reduction


def _check_sparse(op: ReduceOp, pre: float, post: float) -> None:
    """Horovod's refusals for ``tf.IndexedSlices``, made before anything is sent.

    Raises:
        NotImplementedError: an op other than Sum/Average, or a scale factor.  A plain one, as
            Horovod raises: inside a ``tf.function`` AutoGraph re-raises only built-in error
            classes as themselves.
    """
    if op == ReduceOp.ADASUM:
        raise NotImplementedError("op=Adasum does not support sparse tensors "
                                   "(tf.IndexedSlices); pass sparse_as_dense=True to "
                                   "DistributedOptimizer")
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError(f"tf.IndexedSlices are reduced with Sum and Average only, "
                                   f"got op={op.name.title()}")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError(f"prescale_factor/postscale_factor are not supported with "
                                   f"tf.IndexedSlices, got {pre} and {post}")


def _sparse_allreduce(slices: list[tf.IndexedSlices], op: ReduceOp,
                      process_set: ProcessSet) -> list[tf.IndexedSlices]:
    values = gather_ops.grouped_allgather([s.values for s in slices], process_set=process_set)
    indices = gather_ops.grouped_allgather([s.indices for s in slices], process_set=process_set)
    if op == ReduceOp.AVERAGE:
        # TensorFlow's true division, as Horovod: integer values average to floating ones.
        values = [v / tf.cast(set_size(process_set), v.dtype) for v in values]
    return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape)
            for v, i, s in zip(values, indices, slices)]


@_not_converted
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False,
                      name: str | None = None) -> list[Any]:
    """Reduce a list of tensors across the process set; dense ones as one fused request.

    ``tf.IndexedSlices`` entries are gathered instead (see the module docstring), all of them
    in one grouped allgather of values and one of indices.

    Args:
        tensors: tensors, variables, numpy arrays or ``tf.IndexedSlices``.
        average: deprecated; ``True`` is ``op=Average``, ``False`` is ``op=Sum``.
        device_dense: accepted for Horovod compatibility (mpitrain moves host memory).
        device_sparse: accepted for Horovod compatibility.
        compression: e.g. ``Compression.fp16``: the wire format of dense floating tensors.
        op: Average (default), Sum, Min, Max, Product or Adasum (Sum or Average with
            IndexedSlices).
        prescale_factor: multiplies every input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part (default: all).
        ignore_name_scope: accepted for Horovod compatibility (names are the engine's).
        name: a name for the request (default: numbered in order, or fixed in v1 graphs).

    Returns:
        The reduced tensors (``tf.IndexedSlices`` for sparse inputs), in order.

    Raises:
        TypeError: a tensor's dtype is not supported, or ``tensors`` is not a list.
        ValueError: an unknown op, or XLA compilation.
        NotImplementedError: IndexedSlices with an op other than Sum/Average or with scale
            factors (as Horovod).
    """
    del device_dense, device_sparse, ignore_name_scope
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"grouped_allreduce takes a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    compression = for_tensorflow(compression)
    reduce_op = collectives.resolve_op(op, average)
    pre = collectives.scale_factor(prescale_factor, "prescale_factor")
    post = collectives.scale_factor(postscale_factor, "postscale_factor")
    set_id_of(process_set)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(reduce_op, pre, post)
    converted = {i: _bridge.as_tensor(tensors[i], f"tensors[{i}]") for i in dense}
    # Compressed as TF tensors, as Horovod does: any Compressor written for TensorFlow works,
    # and the casts are TensorFlow ops (differentiable, fused into the step's graph).
    pairs = {i: compression.compress(t) for i, t in converted.items()}
    check_scaled([pairs[i][0] for i in dense], reduce_op, pre, post)
    out: list[Any] = list(tensors)
    if dense:
        reduced = dense_allreduce([pairs[i][0] for i in dense], reduce_op, pre, post, name,
                                   process_set)
        for i, r in zip(dense, reduced):
            out[i] = compression.decompress(r, pairs[i][1])
    if sparse:
        gathered = _sparse_allreduce([tensors[i] for i in sparse], reduce_op, process_set)
        for i, g in zip(sparse, gathered):
            out[i] = g
    return out


@_not_converted
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` (or gather a ``tf.IndexedSlices``) across the process set.

    Every rank must call this in the same order.  Arguments as for :func:`grouped_allreduce`.
    """
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set,
                             ignore_name_scope, name)[0]


# -------------------------------------------------------------------------- reducescatter
def _reducescatter(tensors: list[tf.Tensor], op: ReduceOp, pre: float, post: float,
                   name: str | None, process_set: ProcessSet) -> list[tf.Tensor]:
    def adjoint(xs: list[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        scale = pre * post * (set_size(process_set) if op == ReduceOp.SUM else 1.0)
        if scale != 1.0:
            dys = [g * tf.cast(scale, g.dtype) for g in dys]
        gathered = gather_ops.grouped_allgather(dys, process_set=process_set)
        return [tf.reshape(g, tf.shape(x)) for g, x in zip(gathered, xs)]

    return linear_reduction("reducescatter", tensors, op, pre, post, name, process_set, adjoint)


@_not_converted
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none,
                          op: Any = collectives.Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None) -> list[tf.Tensor]:
    """Reduce each tensor of a list across the set and keep this rank's block of rows of each.

    With n rows over p ranks the first ``n % p`` ranks get one extra row.  One fused request.

    Args:
        tensors: tensors of at least one dimension, the same shapes on every rank.
        device_dense: accepted for Horovod compatibility.
        compression: wire format of floating tensors (e.g. ``Compression.fp16``).
        op: Average (default), Sum, Min, Max or Product.
        process_set: the ranks taking part (default: all).
        prescale_factor: multiplies every input before the reduction.
        postscale_factor: multiplies the result.
        name: a name for the request.

    Raises:
        TypeError: a dtype is not supported, or ``tensors`` is not a list.
        ValueError: a scalar, an unknown op, or XLA compilation.
    """
    del device_dense
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"grouped_reducescatter takes a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    reduce_op = collectives.resolve_op(op, None)
    pre = collectives.scale_factor(prescale_factor, "prescale_factor")
    post = collectives.scale_factor(postscale_factor, "postscale_factor")
    set_id_of(process_set)
    compression = for_tensorflow(compression)
    converted = [_bridge.as_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    pairs = [compression.compress(t) for t in converted]
    check_scaled([c for c, _ in pairs], reduce_op, pre, post)
    for i, t in enumerate(converted):
        if t.shape.rank == 0:
            raise ValueError(f"reducescatter needs tensors[{i}] with at least one dimension, "
                             "got a scalar")
    if not converted:
        return []
    reduced = _reducescatter([c for c, _ in pairs], reduce_op, pre, post, name, process_set)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


@_not_converted
def reducescatter(tensor: Any, device_dense: str = "",
                  compression: type[Compressor] = Compression.none, op: Any = collectives.Average,
                  name: str | None = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` across the set and return this rank's block of rows.

    Every rank must call this in the same order.  Arguments as for
    :func:`grouped_reducescatter`.
    """
    del ignore_name_scope
    return grouped_reducescatter([tensor], device_dense, compression, op, process_set,
                                 prescale_factor, postscale_factor, name)[0]
