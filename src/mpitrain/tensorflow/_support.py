"""What the TF collectives share: process-set geometry and Horovod's gradient conventions.

Gradients follow Horovod 0.28.1's TensorFlow ops (``horovod/tensorflow/mpi_ops.py``): only
floating tensors are differentiable; a reduction is differentiable for Sum and Average only;
ops that gather or broadcast average the upstream gradients over the process set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import tensorflow as tf

from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set, rank_in, size_of

FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_F = TypeVar("_F", bound=Callable[..., Any])


def not_converted(fn: _F) -> _F:
    """Keep AutoGraph out of ``fn``: it is plain Python that builds ops, and converting it (and
    everything it calls) on every trace of a user's ``tf.function`` costs more than the ops."""
    wrapped: _F = tf.autograph.experimental.do_not_convert(fn)
    return wrapped


def set_size(process_set: ProcessSet = global_process_set) -> int:
    """Number of ranks in ``process_set`` (which must be registered)."""
    return size_of(process_set)


def set_rank(process_set: ProcessSet = global_process_set) -> int:
    """This process's rank within ``process_set``."""
    return rank_in(process_set)


def differentiable(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether gradients flow through a collective of ``tensors`` (all floating)."""
    return bool(tensors) and all(t.dtype in FLOATS for t in tensors)


def check_linear(op: ReduceOp, what: str) -> None:
    """Raise ValueError unless ``op`` (of a reduction being differentiated) is Sum or Average."""
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"the gradient of {what} with op={op.name.title()} is not defined; "
                         "only Sum and Average are differentiable")


def zeros_for_none(grads: Sequence[Any], like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Upstream gradients with ``None`` (an unused output) replaced by zeros."""
    return [tf.zeros_like(y) if g is None else g for g, y in zip(grads, like)]


def with_gradient(run: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                  gradient: Callable[[list[tf.Tensor], list[tf.Tensor]], list[tf.Tensor]],
                  tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """``run(tensors)``, a collective over a list, with ``gradient(xs, dys)`` as its gradient
    where the tensors are differentiable; ``dys`` has zeros for an unused output.  Otherwise
    no ``tf.custom_gradient`` is built: integer tensors have no gradient to carry."""
    if not differentiable(tensors):
        return run(tensors)

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        ys = run(list(xs))

        def backward(*dys: Any) -> list[tf.Tensor]:
            return gradient(list(xs), zeros_for_none(dys, ys))

        return ys, backward

    return list(forward(*tensors))


def zeros_after(tensor: tf.Tensor) -> tf.Tensor:
    """Zeros shaped like ``tensor`` that are computed only after ``tensor``.

    In a graph ``tf.zeros_like`` of a tensor of known shape does not read it, so a session
    would prune the collective that produced it on the ranks that return zeros, and the ranks
    that need its result would wait for them forever.
    """
    if tf.executing_eagerly():
        return tf.zeros_like(tensor)
    zeros = tf.zeros_like(tensor)
    with tf.control_dependencies([tensor]):
        return tf.identity(zeros)
