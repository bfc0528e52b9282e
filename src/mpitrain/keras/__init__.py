"""``import mpitrain.keras as hvd``: Horovod's standalone-Keras face (``horovod.keras``) on Keras 3.

Horovod kept ``horovod.keras`` for Keras 2 running on any backend.  Keras 3 with the TensorFlow
backend is ``tf.keras``, so this face is :mod:`mpitrain.tensorflow.keras` under Horovod's
``horovod.keras`` signatures: ``DistributedOptimizer`` without the local-aggregation arguments,
``PartialDistributedOptimizer`` (gradients of ``local_layers`` stay on their rank),
``allreduce`` averaging by default, the same callbacks and elastic helpers.  Keras 3 on another
backend (JAX, torch) cannot carry mpitrain's TensorFlow collectives; importing this face then
raises an ImportError that says so.  Compile models with ``jit_compile=False`` (the callbacks
enforce it).
"""

from __future__ import annotations

from typing import Any

import keras

if keras.backend.backend() != "tensorflow":  # pragma: no cover - depends on KERAS_BACKEND
    raise ImportError(f"mpitrain.keras needs Keras 3's TensorFlow backend (KERAS_BACKEND="
                      f"tensorflow), got {keras.backend.backend()!r}")

from ..collectives import Adasum, Average, Sum, start_timeline, stop_timeline
from ..compression import Compressor
from ..core.process_sets import ProcessSet, global_process_set
from ..tensorflow import basics
from ..tensorflow.basics import *  # noqa: F403 - init, shutdown and the queries: basics.__all__
from ..tensorflow.compression import Compression
from ..tensorflow.keras import DistributedOptimizer as _KerasDistributedOptimizer
from ..tensorflow.keras import values as _values
from ..tensorflow.tape import local_layers_of
from . import callbacks, elastic


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, num_groups: int = 0, groups: Any = None) -> Any:
    """Wrap a Keras 3 optimizer so that the gradients it applies are averaged across ranks.

    See :func:`mpitrain.tensorflow.keras.DistributedOptimizer` (this is it, with
    ``horovod.keras``'s parameters).
    """
    return _KerasDistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                      sparse_as_dense, gradient_predivide_factor, op,
                                      num_groups=num_groups, groups=groups)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = Average,
                                groups: Any = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A :func:`DistributedOptimizer` that leaves the gradients of ``local_layers`` local.

    Args:
        local_layers: a Keras layer or layers whose trainable weights are local to each rank
            (not reduced; divided by the set size unless ``scale_local_gradients=False``).
        (others): as for :func:`mpitrain.tensorflow.keras.DistributedOptimizer`.

    Raises:
        ValueError: an entry of ``local_layers`` is not a Keras layer, or as
            :func:`DistributedOptimizer`.
    """
    layers = local_layers_of(local_layers)
    distributed = _KerasDistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, groups=groups, process_set=process_set,
        scale_local_gradients=scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            distributed.register_local_var(weight)
    return distributed


def allreduce(value: Any, name: str | None = None, average: bool | None = True,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: type[Compressor] = Compression.none) -> Any:
    """The average (or ``op``) of ``value`` over every rank (see
    :func:`mpitrain.tensorflow.keras.allreduce`).

    ``average`` defaults to True here, as in ``horovod.keras``, so an ``op`` given beside it
    wins (Horovod raises then: its default ``average`` collides with any ``op``).
    """
    if op is None:
        op = Average if average or average is None else Sum
    return _values.allreduce(value, name, None, prescale_factor, postscale_factor, op,
                             compression)


def allgather(value: Any, name: str | None = None) -> Any:
    """Every rank's ``value`` concatenated along the first dimension, in rank order."""
    return _values.allgather(value, name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """``root_rank``'s ``value`` on every rank."""
    return _values.broadcast(value, root_rank, name)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> Any:
    """This rank's block of rows of the reduction of ``value`` over every rank."""
    return _values.reducescatter(value, name, op)


__all__ = [
    *basics.__all__,
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "callbacks",
    "elastic",
    "reducescatter",
    "start_timeline",
    "stop_timeline",
]
