"""``hvd.elastic`` for Keras (``import mpitrain.tensorflow.keras as hvd``): Horovod's
``horovod.tensorflow.keras.elastic``.

``KerasState`` is :class:`~mpitrain.tensorflow.elastic.TensorFlowKerasState`; the callbacks
keep it current during ``model.fit``: ``CommitStateCallback`` commits every
``batches_per_commit`` batches and at each epoch's end, ``UpdateBatchStateCallback`` records
the batch reached (and, after a reset, shortens the interrupted epoch by the batches already
done), ``UpdateEpochStateCallback`` records the epochs finished across resets.  As in
Horovod's examples, call ``model.fit(..., epochs=total - state.epoch)`` inside the elastic
function (Keras then counts from 0 again after each reset; the callback adds the offset).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..elastic import (
    ElasticLimitError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TensorFlowKerasState,
    init,
    run,
    shutdown,
)

_Callback: Any = tf.keras.callbacks.Callback


class KerasState(TensorFlowKerasState):
    """A Keras model and optimizer, and plain values (``epoch=0, batch=0``) to track."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(_Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive integer, got "
                             f"{batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same count on every rank

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(_Callback):
    """Keep ``state.batch`` at the last batch finished; resume an epoch where it stopped."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        steps = self.params.get("steps") if self.params else None
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(_Callback):
    """Keep ``state.epoch`` at the number of epochs finished, counted across resets."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        # Keras counts this fit()'s epochs from 0: offset by the epochs done before the last
        # reset, and +1 because this one is done (a reset now must not repeat it).
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["CommitStateCallback", "ElasticLimitError", "HorovodInternalError",
           "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "init", "run", "shutdown"]
