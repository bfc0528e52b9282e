"""SyncBatchNormalization: a Keras 3 BatchNormalization whose batch statistics span a scope of
ranks.

A drop-in for ``keras.layers.BatchNormalization`` (and Horovod's
``hvd.SyncBatchNormalization``): in training, the mean and variance of every channel are those
of the union of the batches of all ranks of ``comm_scope`` - every rank (``"global"``), the
ranks of this node (``"local"``, as AIACC-Training offered), or any registered process set.
In inference the moving statistics are used and nothing is communicated.

One allreduce per call, of ``[count, count*mean, count*(var + mean^2)]`` per channel packed into
float64 (2C+1 numbers), as mpitrain's torch SyncBatchNorm does: ranks may hold batches of
different sizes (Horovod's layer averages the ranks' statistics with equal weights, which is
wrong then), a rank with an empty batch contributes exact zeros, and each rank's own mean and
variance come from Keras' stable two-pass moments, so ``E[x^2] - E[x]^2`` only loses the spread
between ranks' means to float64 rounding.  The exchange is differentiable (the gradient of a
Sum allreduce is the Sum allreduce of the upstream gradients), so the input gradient is that
of the loss summed over the ranks, as in torch's SyncBatchNorm; ``gamma``'s and ``beta``'s
gradients stay local and the optimizer's gradient reduction combines them.

Every rank of the scope must call the layer in training mode together (it is a collective).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ..collectives import Sum
from ..core.process_sets import ProcessSet
from ..face.scopes import GLOBAL, check_scope, resolve_scope
from .reduce_ops import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalisation over the batches of every rank of a scope.

    Args:
        fused: accepted for Horovod compatibility; only ``False``/``None`` (Keras 3 has no fused
            kernel to choose).
        comm_scope: ``"global"``/``1`` (every rank, the default), ``"local"``/``0`` (the ranks
            of this node; collective on first use) or a registered ProcessSet.
        process_set: Horovod's name for the scope (a ProcessSet); overrides ``comm_scope``.
        **kwargs: ``keras.layers.BatchNormalization``'s arguments (``axis``, ``momentum``,
            ``epsilon``, ``center``, ``scale``, ``renorm``, initializers, ...), and Keras 2's
            ``virtual_batch_size``/``adjustment`` when None (Horovod's layer passes every
            keyword on to Keras).

    Raises:
        ValueError: ``fused=True``, ``synchronized=True`` (that is tf.distribute's
            synchronisation; this layer is mpitrain's), a Keras 2-only argument that is
            set, or an unknown scope.
        TypeError: a scope of another type.
    """

    def __init__(self, fused: bool | None = False, comm_scope: Any = GLOBAL,
                 process_set: ProcessSet | None = None, **kwargs: Any) -> None:
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True")
        if kwargs.get("synchronized"):
            raise ValueError("synchronized=True asks tf.distribute to synchronise the "
                             "statistics; SyncBatchNormalization synchronises them over "
                             "comm_scope through mpitrain instead: leave it False")
        for keras2_only in ("virtual_batch_size", "adjustment"):
            # Keras 2's BatchNormalization took these (and Horovod's layer passes them on);
            # Keras 3 dropped them, so only their "off" value can be honoured.
            if keras2_only in kwargs:
                value = kwargs.pop(keras2_only)
                if value is not None:
                    raise ValueError(f"{keras2_only}={value!r}: Keras 3's BatchNormalization "
                                     f"has no {keras2_only}; leave it None")
        scope = comm_scope if process_set is None else process_set
        check_scope(scope)
        kwargs.setdefault("name", "sync_batch_normalization")
        super().__init__(**kwargs)
        self.comm_scope = scope

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        if not isinstance(self.comm_scope, ProcessSet):  # a set is this job's, not a config's
            config["comm_scope"] = self.comm_scope
        return config

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        x = tf.convert_to_tensor(inputs)
        axes = list(self._reduction_axes)
        if mask is None:
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
            mean, var = tf.nn.moments(x, axes)
        else:  # as Keras: the mask covers every dimension but the last (the channels)
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
            count = tf.reduce_sum(weights) / tf.cast(tf.shape(x)[-1], x.dtype)
            mean, var = tf.nn.weighted_moments(x, axes, weights)
        # An empty batch has NaN moments; it must add exact zeros to the sums.
        present = count > 0
        mean = tf.where(present, mean, tf.zeros_like(mean))
        var = tf.where(present, var, tf.zeros_like(var))
        count64 = tf.cast(count, tf.float64)
        mean64, var64 = tf.cast(mean, tf.float64), tf.cast(var, tf.float64)
        packed = tf.concat([tf.reshape(count64, [1]), count64 * mean64,
                            count64 * (var64 + mean64 * mean64)], axis=0)
        total = allreduce(packed, op=Sum,
                          process_set=resolve_scope(self.comm_scope))
        channels = tf.shape(mean64)[0]
        n = tf.maximum(total[0], 1.0)
        group_mean = total[1:channels + 1] / n
        group_var = tf.maximum(total[channels + 1:] / n - group_mean * group_mean, 0.0)
        return tf.cast(group_mean, x.dtype), tf.cast(group_var, x.dtype)
