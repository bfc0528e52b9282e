"""broadcast and grouped_broadcast on TF tensors.

The gradient of a broadcast is Horovod 0.28.1's: the upstream gradients averaged over the
process set on the root, zeros on every other rank.  Every rank still takes part in that
average, so in a graph the zeros are made to wait for it (see :func:`._support.zeros_after`).

Every rank of the process set must call each of these in the same order (inside a
``tf.function``, the order of the program).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import collectives
from ..core import runtime
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set
from . import _bridge, _engine_ops, reduce_ops
from ._support import differentiable, zeros_after
from ._support import not_converted as _not_converted


@_not_converted
def grouped_broadcast(tensors: Sequence[Any], root_rank: int, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Return ``root_rank``'s values of every tensor of a list, as one op (no gradient).

    Every rank must call this with the same shapes and dtypes, in the same order.

    Raises:
        TypeError: a dtype is not supported, or ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not in the process set, or XLA is compiling the step.
    """
    converted = [_bridge.as_tensor(t, f"tensors[{i}]", moved_only=True)
                 for i, t in enumerate(tensors)]
    collectives.requests.rank_within(process_set, root_rank)
    if not converted:
        return []
    return _engine_ops.broadcast(converted, int(root_rank), name, process_set)


@_not_converted
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
    x = _bridge.as_tensor(tensor, "tensor", moved_only=True)
    collectives.requests.rank_within(process_set, root_rank)
    root = int(root_rank)
    if not differentiable([x]):
        return _engine_ops.broadcast([x], root, name, process_set)[0]

    @tf.custom_gradient
    def forward(t: tf.Tensor) -> Any:
        y = _engine_ops.broadcast([t], root, name, process_set)[0]

        def backward(dy: Any) -> tf.Tensor:
            grad = tf.zeros_like(y) if dy is None else dy
            averaged = reduce_ops.allreduce(grad, op=ReduceOp.AVERAGE, process_set=process_set)
            return averaged if runtime.rank() == root else zeros_after(averaged)

        return y, backward

    return forward(x)
