"""Horovod's DistributedGradientTape and PartialDistributedGradientTape on Keras 3.

The wrapped tape's ``gradient`` returns the gradients averaged across the process set (one
fused request per call, see :class:`.gradients.GradientReducer`), except those of sources
registered as local (``register_local_source``, or the weights of ``local_layers``): a
model-parallel layer whose weights differ between ranks keeps its own gradient, divided by the
set size unless ``scale_local_gradients=False``.  Sources may be Keras 3 variables, which have
no ``ref()`` (Horovod's code path needs one).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
import tensorflow as tf

from ..compression import Compressor
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set
from ._support import not_converted
from .compression import Compression
from .gradients import GradientReducer, LocalSources, check_groups


class _DistributedTapeMixin:
    """Overrides ``gradient`` of the tape class it is mixed into."""

    _mpitrain_reducer: GradientReducer
    _mpitrain_local: LocalSources
    _mpitrain_scale_local: bool

    @not_converted
    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank: it is not reduced (and is divided by the
        set size when the tape scales local gradients)."""
        self._mpitrain_local.add(source)

    @not_converted
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The tape's gradients, averaged across the process set (one fused request), those
        of local sources kept.  ``use_generic_names`` is accepted for Horovod compatibility
        (requests are named by the engine).

        Every rank must call this the same number of times, with the same non-local sources
        in the same order.
        """
        del use_generic_names
        grads = super().gradient(  # type: ignore[misc]
            target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        reduced = self._mpitrain_reducer.reduce_except_local(
            flat, tf.nest.flatten(sources), self._mpitrain_local, self._mpitrain_scale_local)
        return tf.nest.pack_sequence_as(grads, reduced)

    @not_converted
    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False
                                       ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """:meth:`gradient`, split into ``(local, global)`` lists of (source, gradient) pairs,
        each in the order of ``sources``."""
        flat_sources = tf.nest.flatten(sources)
        grads = self.gradient(target, flat_sources, output_gradients, use_generic_names)
        local: list[tuple[Any, Any]] = []
        shared: list[tuple[Any, Any]] = []
        for source, grad in zip(flat_sources, grads):
            (local if source in self._mpitrain_local else shared).append((source, grad))
        return local, shared


@not_converted
def DistributedGradientTape(
        gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
        compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
        op: Any = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
        groups: Any = None, process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` averages across ranks.

    The returned tape records into the same underlying tape (wrap before or after the
    ``with`` block).  Each ``gradient()`` call is one collective step: every rank must call it
    the same number of times, with the same sources, in the same order.

    Args:
        gradtape: the tape to wrap.
        device_dense: accepted for Horovod compatibility.
        device_sparse: accepted for Horovod compatibility.
        compression: wire format for dense floating gradients.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        op: Average (default) or Sum.
        gradient_predivide_factor: see :class:`.gradients.GradientReducer`.
        num_groups: Horovod's deprecated spelling of ``groups``.
        groups: accepted and checked for Horovod compatibility (see
            :func:`.gradients.check_groups`).
        process_set: the ranks taking part (default: all).
        scale_local_gradients: divide the gradients of local sources by the set size.

    Returns:
        A tape of ``gradtape``'s class whose ``gradient`` reduces.

    Raises:
        TypeError: ``gradtape`` is not a ``tf.GradientTape``.
        ValueError: ``gradtape`` is already distributed, or a bad op/factor/groups.
    """
    del device_dense, device_sparse
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got "
                        f"{type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedTapeMixin):
        raise ValueError("this tape is already a DistributedGradientTape; wrapping it again "
                         "would reduce every gradient twice")
    check_groups(num_groups, groups)
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              process_set)
    base: Any = type(gradtape)
    cls: Any = type(base.__name__, (_DistributedTapeMixin, base),
               {"__module__": __name__, "__doc__": base.__doc__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording, the same watched variables
    tape._mpitrain_reducer = reducer
    tape._mpitrain_local = LocalSources()
    tape._mpitrain_scale_local = bool(scale_local_gradients)
    return tape


@not_converted
def local_layers_of(local_layers: Any) -> list[keras.layers.Layer]:
    """``local_layers`` (None, a layer, or layers) as a list of Keras layers.

    Raises:
        ValueError: an entry is not a Keras layer.
    """
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    layers = list(local_layers) if isinstance(local_layers, Iterable) else [local_layers]
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(f"local_layers must be keras layers, got "
                             f"{type(layer).__name__} {layer!r}")
    return layers


@not_converted
def PartialDistributedGradientTape(
        gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
        compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
        op: Any = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
        groups: Any = None, process_set: ProcessSet = global_process_set, local_layers: Any = None,
        scale_local_gradients: bool = True) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` that keeps the gradients of ``local_layers`` local.

    Args:
        local_layers: a Keras layer or layers whose trainable weights are local (their
            gradients are not reduced); None: none, the tape is a DistributedGradientTape.

    The other arguments are :func:`DistributedGradientTape`'s.

    Raises:
        ValueError: an entry of ``local_layers`` is not a Keras layer; as
            :func:`DistributedGradientTape` otherwise.
    """
    layers = local_layers_of(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape


__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "local_layers_of"]
