"""Horovod's Keras-face collectives: ``allreduce(value, ...)`` and friends on plain values.

Horovod's Keras faces take any tensor-compatible value (a number, a list, a numpy array, a
tensor), make it a constant, run the TensorFlow collective and hand back its result: the
evaluated tensor eagerly, the tensor itself inside a graph (Keras 3 has no session to evaluate
it in).  ``name`` names that constant in Horovod, which nothing observes; here it is accepted
and unused, and the collective is numbered by the engine like any unnamed one.

Every rank must call each of these in the same order.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...collectives import Average
from ...compression import Compressor
from .. import broadcast_ops, gather_ops, reduce_ops
from ..compression import Compression


def _constant(value: Any) -> tf.Tensor:
    return value if tf.is_tensor(value) else tf.convert_to_tensor(value)


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: type[Compressor] = Compression.none) -> tf.Tensor:
    """The reduction of ``value`` over every rank (Average unless ``op``/``average`` say else)."""
    del name
    return reduce_ops.allreduce(_constant(value), average=average, compression=compression,
                                op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor)


def allgather(value: Any, name: str | None = None) -> tf.Tensor:
    """Every rank's ``value`` concatenated along the first dimension, in rank order."""
    del name
    return gather_ops.allgather(_constant(value))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """``root_rank``'s ``value`` on every rank."""
    del name
    return broadcast_ops.broadcast(_constant(value), root_rank)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> tf.Tensor:
    """This rank's block of rows of the reduction of ``value`` over every rank."""
    del name
    return reduce_ops.reducescatter(_constant(value), op=op)


__all__ = ["allgather", "allreduce", "broadcast", "reducescatter"]
