"""rank_op, size_op and friends: this process's place in the job, read when the graph runs.

Horovod offers these so that a graph can be built in one environment and run in another (a
saved graph, an elastic job): the value is read from mpitrain when the op runs, not when it is
built.  Eagerly they return the current value as a constant.  None of them is differentiable.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from ..core import runtime
from ..core.process_sets import registry, size_of
from . import _bridge
from ._support import not_converted as _not_converted

# Horovod's process_set_included_op error codes (horovod/common/basics.py).
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _int_op(read: Callable[[], int], what: str, name: str | None) -> tf.Tensor:
    if tf.executing_eagerly():
        return tf.constant(read(), tf.int32)
    _bridge.refuse_xla(f"mpitrain.tensorflow.{what}")
    # Stateful, so that no graph optimisation folds it into the value seen when optimising.
    out = tf.numpy_function(lambda: np.int32(read()), [], tf.int32, stateful=True,
                            name=name or f"mpitrain_{what}")
    out.set_shape([])
    return out


def _set_size(process_set_id: int) -> int:
    return size_of(registry.get(int(process_set_id)))


def _included(process_set_id: int) -> int:
    if not runtime.is_initialized():
        return PROCESS_SET_ERROR_INIT
    try:
        ranks = registry.get(int(process_set_id)).ranks
    except ValueError:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(runtime.rank() in ranks)


@_not_converted
def rank_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar: this process's rank, read when the op runs."""
    return _int_op(runtime.rank, "rank_op", name)


@_not_converted
def local_rank_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar: this process's rank on its node, read when the op runs."""
    return _int_op(runtime.local_rank, "local_rank_op", name)


@_not_converted
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """An int32 scalar: the number of ranks of the process set (default: all), when run."""
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, (int, np.integer)):
        raise TypeError(f"process_set_id must be an int, got {process_set_id!r}")
    return _int_op(lambda: _set_size(process_set_id), "size_op", name)


@_not_converted
def local_size_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar: the number of ranks on this process's node, read when the op runs."""
    return _int_op(runtime.local_size, "local_size_op", name)


@_not_converted
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """An int32 scalar: 1 if this process is in the process set, 0 if not, when run.

    As in Horovod, -1 means mpitrain is not initialised and -3 that the set is not registered.
    """
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, (int, np.integer)):
        raise TypeError(f"process_set_id must be an int, got {process_set_id!r}")
    return _int_op(lambda: _included(process_set_id), "process_set_included_op", name)
