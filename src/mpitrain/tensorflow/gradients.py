"""Averaging one step's gradients across ranks, shared by the tape and both DistributedOptimizers.

:class:`GradientReducer`: the dense gradients of one step go out as one fused
``grouped_allreduce`` (one op inside a ``tf.function``, so every rank issues the same
collectives in the same order), sparse ones (``tf.IndexedSlices``) are allgathered unless
``sparse_as_dense``.  Gradients of *local* variables (Horovod's ``register_local_source``/
``register_local_var``: a model-parallel layer that differs between ranks) are not reduced;
with ``scale_local_gradients`` they are divided by the set size, as Horovod does (its
pull/3695: a local gradient then has the scale of the averaged ones).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import collectives
from ..compression import Compressor
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from ._support import not_converted, set_size
from .compression import Compression
from .reduce_ops import grouped_allreduce


def source_key(source: Any) -> Any:
    """A hashable identity for a variable: its ``ref()`` where TensorFlow gives one.  Keras 3
    variables have no ``ref()`` and are unhashable, so theirs is the object's id (a
    :class:`LocalSources` keeps the object alive, so the id is not reused)."""
    ref = getattr(source, "ref", None)
    return ref() if callable(ref) else ("id", id(source))


class LocalSources:
    """The variables whose gradients stay on this rank."""

    def __init__(self) -> None:
        self._kept: dict[Any, Any] = {}

    def add(self, source: Any) -> None:
        self._kept[source_key(source)] = source

    def __contains__(self, source: Any) -> bool:
        return source_key(source) in self._kept

    def __len__(self) -> int:
        return len(self._kept)


def _divided(grad: Any, size: int) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def check_groups(num_groups: Any, groups: Any) -> None:
    """Validate Horovod's grouping arguments, which mpitrain accepts without using: all the
    gradients of a step already travel as one fused request, the best grouping there is.

    Raises:
        ValueError: ``groups`` is neither a list of lists of variables nor a positive int.
    """
    if num_groups:
        warnings.warn("num_groups has been replaced by groups in Horovod (and is ignored: "
                      "mpitrain fuses all gradients of a step)", DeprecationWarning,
                      stacklevel=3)
    if groups is not None and not (isinstance(groups, list) or
                                   (isinstance(groups, int) and not isinstance(groups, bool)
                                    and groups > 0)):
        raise ValueError(f"groups must be a positive int or a list of lists of variables, "
                         f"got {groups!r}")


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
    def reduce_except_local(self, grads: Sequence[Any], sources: Sequence[Any],
                            local: LocalSources, scale_local: bool) -> list[Any]:
        """:meth:`reduce` for the gradients of ``sources`` that are not in ``local``; the
        local ones stay on this rank, divided by the set size if ``scale_local``.

        Every rank must call this with the same non-local sources, in the same order.
        """
        is_local = [s in local for s in sources]
        out = self.reduce([None if mine else g for g, mine in zip(grads, is_local)])
        size = set_size(self.process_set)
        for i, (g, mine) in enumerate(zip(grads, is_local)):
            if mine:
                out[i] = _divided(g, size) if scale_local and g is not None else g
        return out

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
