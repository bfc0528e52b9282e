"""``mpitrain.tensorflow.DistributedOptimizer``: one name for Keras 3 and tf.compat.v1
optimizers.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ..compression import Compressor
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set
from .compression import Compression
from .gradients import GradientReducer, check_groups, check_one_pass
from .keras.optimizer_keras3 import DistributedOptimizer as KerasDistributedOptimizer
from .optimizer_v1 import DistributedOptimizerV1


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: Any = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap an optimizer so that the gradients it applies are averaged across ranks.

    A ``tf.compat.v1.train.Optimizer`` is wrapped at ``compute_gradients`` (so ``minimize``
    works in graphs); a Keras 3 optimizer at ``apply`` (see
    :func:`mpitrain.tensorflow.keras.DistributedOptimizer`).  Every rank must build or run the
    update for the same variables, in the same order.

    Args:
        optimizer: the optimizer to wrap.
        name: a name for the wrapper.
        use_locking: for ``tf.compat.v1`` optimizers, as in TensorFlow.

    The other arguments, for either kind of optimizer, are
    :func:`mpitrain.tensorflow.keras.DistributedOptimizer`'s.

    Returns:
        The distributed optimizer.

    Raises:
        TypeError: ``optimizer`` is neither kind of optimizer.
    """
    check_one_pass(backward_passes_per_step, average_aggregated_gradients)
    check_groups(num_groups, groups)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  process_set)
        return DistributedOptimizerV1(optimizer, reducer, name, use_locking,
                                      scale_local_gradients)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer or a "
                        f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}")
    return KerasDistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                     sparse_as_dense, gradient_predivide_factor, op,
                                     process_set=process_set,
                                     scale_local_gradients=scale_local_gradients)
