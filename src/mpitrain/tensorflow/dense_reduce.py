"""The differentiable dense allreduce of TF tensors, on its own so that both
:mod:`.reduce_ops` (allreduce) and :mod:`.gather_ops` (allgather, whose gradient is an
allreduce) build on it without importing each other; :func:`linear_reduction`, an engine
reduction with its gradient, is what it and :mod:`.reduce_ops`' reducescatter are made of.

The gradient, as in Horovod 0.28.1: the allreduce of the upstream gradients with the same op
and scale factors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from ..core.dtypes import ReduceOp, check_reduce_supported
from ..core.process_sets import ProcessSet
from . import _engine_ops
from ._support import check_linear, with_gradient


def check_scaled(tensors: Sequence[tf.Tensor], op: ReduceOp, pre: float, post: float) -> None:
    for i, t in enumerate(tensors):
        check_reduce_supported(t.dtype.name, op)
        if t.dtype == tf.bool and (pre != 1.0 or post != 1.0):
            raise ValueError(f"tensors[{i}] is bool: scale factors must be 1, got "
                             f"prescale_factor={pre}, postscale_factor={post}")


# A reduction's adjoint: (its inputs, the upstream gradients) -> the inputs' gradients.
Adjoint = Callable[[list[tf.Tensor], list[tf.Tensor]], list[tf.Tensor]]


def linear_reduction(kind: str, tensors: list[tf.Tensor], op: ReduceOp, pre: float,
                     post: float, name: str | None, process_set: ProcessSet,
                     adjoint: Adjoint) -> list[tf.Tensor]:
    """``kind`` (``"allreduce"`` or ``"reducescatter"``) of ``tensors`` as one request, with
    ``adjoint`` as its gradient: defined for Sum and Average only, as in Horovod."""
    engine_op = {"allreduce": _engine_ops.allreduce,
                 "reducescatter": _engine_ops.reducescatter}[kind]

    def run(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return engine_op(xs, op, pre, post, name, process_set)

    def gradient(xs: list[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        check_linear(op, kind)
        return adjoint(xs, dys)

    return with_gradient(run, gradient, tensors)


def dense_allreduce(tensors: list[tf.Tensor], op: ReduceOp, pre: float, post: float,
                    name: str | None, process_set: ProcessSet) -> list[tf.Tensor]:
    """Reduce ``tensors`` as they are (compressed already, where asked) as one request."""
    return linear_reduction(
        "allreduce", tensors, op, pre, post, name, process_set,
        lambda xs, dys: dense_allreduce(dys, op, pre, post, None, process_set))


__all__ = ["Adjoint", "check_scaled", "dense_allreduce", "linear_reduction"]
