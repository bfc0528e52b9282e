"""A Keras 3 DistributedOptimizer: the wrapped optimizer's ``apply`` sees averaged gradients.

Keras 3 optimizers have no ``get_gradients`` to hook; every update, from ``model.fit`` or from
``apply_gradients``, passes through ``apply(grads, trainable_variables)``, so that is what is
overridden.  The returned optimizer is an instance of a subclass of the user's optimizer class
(same name and module, so saved configurations load as the plain optimizer).
"""

from __future__ import annotations

from typing import Any

import keras

from ...compression import Compressor
from ...core.dtypes import ReduceOp
from ...core.process_sets import ProcessSet, global_process_set
from ..compression import Compression
from ..gradients import GradientReducer, LocalSources, check_groups, check_one_pass


class _DistributedApplyMixin:
    """Reduces gradients across ranks before the optimizer class it is mixed into applies them."""

    _mpitrain_reducer: GradientReducer
    _mpitrain_local: LocalSources
    _mpitrain_scale_local: bool

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; divided by the set size when
        ``scale_local_gradients``), as Horovod's optimizer does for model-parallel layers."""
        self._mpitrain_local.add(var)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Average ``grads`` across the process set (one fused request), then apply them.

        Every rank must call this for the same non-local variables, in the same order.
        """
        grads = list(grads)
        if len(self._mpitrain_local):
            variables = list(trainable_variables if trainable_variables is not None
                             else self._trainable_variables)  # type: ignore[attr-defined]
            reduced = self._mpitrain_reducer.reduce_except_local(
                grads, variables, self._mpitrain_local, self._mpitrain_scale_local)
        else:
            reduced = self._mpitrain_reducer.reduce(grads)
        return super().apply(reduced, trainable_variables)  # type: ignore[misc]


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = ReduceOp.AVERAGE,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Return a copy of a Keras 3 optimizer that averages gradients across ranks.

    Use it in place of the original (``model.compile(optimizer=hvd.DistributedOptimizer(opt),
    jit_compile=False)``), usually with the learning rate scaled by ``hvd.size()``.  The copy
    is made from the optimizer's config, so wrap it before training starts.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (not yet used for training).
        name: a new name for the optimizer (default: the original's).
        device_dense: accepted for Horovod compatibility.
        device_sparse: accepted for Horovod compatibility.
        compression: wire format for dense floating gradients (e.g. ``Compression.fp16``).
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        gradient_predivide_factor: see :class:`mpitrain.tensorflow.gradients.GradientReducer`.
        op: Average (default) or Sum.
        backward_passes_per_step: only 1 (see
            :func:`mpitrain.tensorflow.gradients.check_one_pass` for several passes).
        average_aggregated_gradients: accepted for Horovod compatibility (one pass).
        num_groups: Horovod's deprecated spelling of ``groups``.
        groups: accepted and checked for Horovod compatibility: all gradients of an update
            already travel as one fused request (see
            :func:`mpitrain.tensorflow.gradients.check_groups`).
        process_set: the ranks taking part (default: all).
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the set size.

    Returns:
        The distributed optimizer.

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer.
        ValueError: it is already distributed, a bad op/factor, or several backward passes.
    """
    del device_dense, device_sparse
    check_one_pass(backward_passes_per_step, average_aggregated_gradients)
    check_groups(num_groups, groups)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedApplyMixin):
        raise ValueError("this optimizer is already distributed; wrapping it again would "
                         "reduce every gradient twice")
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              process_set)
    base: Any = type(optimizer)
    cls: Any = type(base.__name__, (_DistributedApplyMixin, base),
               {"__module__": base.__module__, "__doc__": base.__doc__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed = cls.from_config(config)
    distributed._mpitrain_reducer = reducer
    distributed._mpitrain_local = LocalSources()
    distributed._mpitrain_scale_local = bool(scale_local_gradients)
    return distributed
