"""Averaging one step's gradients across ranks, and Horovod's DistributedGradientTape on top.

:class:`GradientReducer` is shared by the tape and both DistributedOptimizers: the dense
gradients of one step go out as one fused ``grouped_allreduce`` (one op inside a
``tf.function``, so every rank issues the same collectives in the same order), sparse ones
(``tf.IndexedSlices``) are allgathered unless ``sparse_as_dense``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import collectives
from ..compression import Compression, Compressor
from ..dtypes import ReduceOp
from ..process_sets import ProcessSet, global_process_set, set_id_of
from ._support import not_converted, set_size
from .reduce_ops import grouped_allreduce


class GradientReducer:
    """Reduces a list of gradients (``None`` entries pass through) across the process set.

    Args:
        compression: wire format for dense floating gradients (e.g. ``Compression.fp16``).
        sparse_as_dense: turn ``tf.IndexedSlices`` into dense tensors and reduce them too.
        op: Average (default) or Sum.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it (keeps fp16 sums in range).
        process_set: the ranks taking part.

    Raises:
        ValueError: an op other than Average/Sum, or a predivide factor with Sum.
        TypeError: a factor that is not a positive number.
    """

    def __init__(self, compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, op: Any = ReduceOp.AVERAGE,
                 gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet = global_process_set) -> None:
        self.op = collectives.resolve_op(op, None)
        if self.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"gradients are reduced with op=Average or op=Sum, got "
                             f"op={self.op.name.title()}")
        factor = collectives.scale_factor(gradient_predivide_factor, "gradient_predivide_factor")
        if factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {factor}")
        if factor != 1.0 and self.op != ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor only applies with op=Average, got "
                             f"op={self.op.name.title()} and factor {factor}")
        if not (isinstance(compression, type) and issubclass(compression, Compressor)):
            raise TypeError(f"compression must be one of mpitrain.Compression's compressors, "
                            f"got {compression!r}")
        set_id_of(process_set)
        self.compression = compression
        self.sparse_as_dense = bool(sparse_as_dense)
        self.predivide = factor
        self.process_set = process_set

    def _dense_args(self) -> dict[str, Any]:
        if self.predivide == 1.0:
            return {"op": self.op}
        size = set_size(self.process_set)
        return {"op": ReduceOp.SUM, "prescale_factor": 1.0 / self.predivide,
                "postscale_factor": self.predivide / size}

    @not_converted
    def reduce(self, grads: Sequence[Any]) -> list[Any]:
        """Return ``grads`` reduced across the process set; ``None`` stays ``None``.

        Every rank must call this with the same structure of gradients, in the same order.
        """
        out: list[Any] = list(grads)
        present = [i for i, g in enumerate(out) if g is not None]
        for i in present:
            if self.sparse_as_dense and isinstance(out[i], tf.IndexedSlices):
                out[i] = tf.convert_to_tensor(out[i])
        # One call: the dense gradients travel as one fused request, the sparse ones
        # (IndexedSlices) as one grouped allgather of values and one of indices.
        reduced = grouped_allreduce([out[i] for i in present], compression=self.compression,
                                    process_set=self.process_set, **self._dense_args())
        for i, r in zip(present, reduced):
            out[i] = r
        return out


def check_one_pass(backward_passes_per_step: Any, average_aggregated_gradients: Any) -> None:
    """Accept Horovod's local-aggregation arguments where they mean one pass per update.

    Horovod can sum ``backward_passes_per_step`` backward passes locally before one allreduce;
    mpitrain reduces every pass.  For several passes per update give the Keras 3 optimizer
    ``gradient_accumulation_steps=N``: it averages the N reduced gradients (Horovod's
    ``average_aggregated_gradients=True``), at the cost of N exchanges instead of one.

    Raises:
        TypeError: ``backward_passes_per_step`` is not an int.
        ValueError: it is not 1.
    """
    del average_aggregated_gradients  # only meaningful with several passes
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step,
                                                                        int):
        raise TypeError(f"backward_passes_per_step must be an int, got "
                        f"{backward_passes_per_step!r}")
    if backward_passes_per_step != 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: mpitrain "
                         "reduces the gradients of every backward pass; to update every N "
                         "passes give the Keras optimizer gradient_accumulation_steps=N (it "
                         "averages them, as Horovod's average_aggregated_gradients=True)")


class _DistributedTapeMixin:
    """Overrides ``gradient`` of the tape class it is mixed into."""

    _mpitrain_reducer: GradientReducer

    @not_converted
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The tape's gradients, averaged across the process set (one fused request)."""
        grads = super().gradient(  # type: ignore[misc]
            target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, self._mpitrain_reducer.reduce(flat))


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "",
                            compression: type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: Any = ReduceOp.AVERAGE,
                            gradient_predivide_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> tf.GradientTape:
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
        gradient_predivide_factor: see :class:`GradientReducer`.
        process_set: the ranks taking part (default: all).

    Returns:
        A tape of ``gradtape``'s class whose ``gradient`` reduces.

    Raises:
        TypeError: ``gradtape`` is not a ``tf.GradientTape``.
        ValueError: ``gradtape`` is already distributed, or a bad op/factor.
    """
    del device_dense, device_sparse
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got "
                        f"{type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedTapeMixin):
        raise ValueError("this tape is already a DistributedGradientTape; wrapping it again "
                         "would reduce every gradient twice")
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              process_set)
    base: Any = type(gradtape)
    cls: Any = type(base.__name__, (_DistributedTapeMixin, base),
               {"__module__": __name__, "__doc__": base.__doc__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recording, the same watched variables
    tape._mpitrain_reducer = reducer
    return tape
