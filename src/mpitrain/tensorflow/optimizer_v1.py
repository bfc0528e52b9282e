"""A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` averages across ranks.

For ``MonitoredTrainingSession``-era code: ``opt.minimize(loss)`` builds one fused
allreduce of all gradients into the graph, then the wrapped optimizer's update.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .gradients import GradientReducer, LocalSources


class DistributedOptimizerV1(tf.compat.v1.train.Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``; gradients are reduced before being applied.

    Args:
        optimizer: the optimizer that applies the (reduced) gradients.
        reducer: how gradients are reduced (compression, op, process set).
        name: the op name prefix (default ``Distributed<OptimizerClass>``).
        use_locking: passed to ``tf.compat.v1.train.Optimizer``.
        scale_local_gradients: divide the gradients of local variables by the set size.
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, reducer: GradientReducer,
                 name: str | None = None, use_locking: bool = False,
                 scale_local_gradients: bool = True) -> None:
        super().__init__(use_locking=use_locking,
                         name=name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._reducer = reducer
        self._local_vars = LocalSources()
        self.scale_local_gradients = scale_local_gradients

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; divided by the set size when
        ``scale_local_gradients``), as Horovod's optimizer does for model-parallel layers."""
        self._local_vars.add(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's (gradient, variable) pairs, gradients reduced in one op.

        Every rank must build this for the same variables, in the same order.
        """
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        reduced = self._reducer.reduce_except_local([g for g, _ in pairs],
                                                    [v for _, v in pairs], self._local_vars,
                                                    self.scale_local_gradients)
        return list(zip(reduced, [v for _, v in pairs]))

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's update (the gradients are already reduced)."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
