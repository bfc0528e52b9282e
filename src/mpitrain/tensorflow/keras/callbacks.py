"""Horovod's Keras callbacks for Keras 3: start equal, report averaged metrics, warm up the lr.

Every callback here also turns XLA off for the model it is given (``jit_compile=False``),
because the training step carries mpitrain's collectives as ``tf.numpy_function`` ops that XLA
cannot compile; a warning says so when it was on.

Collective semantics: every rank must run ``fit`` with the same callbacks, the same number of
epochs and the same number of steps per epoch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from ... import collectives
from ...core import runtime
from ...core.process_sets import ProcessSet, global_process_set
from ..functions import BroadcastFromRoot, broadcast_variables


def _without_xla(model: Any) -> None:
    if model is None or getattr(model, "run_eagerly", False) or not getattr(model, "compiled",
                                                                           False):
        return
    if model.jit_compile:
        warnings.warn("mpitrain: the model was compiled with jit_compile=True; XLA cannot "
                      "compile mpitrain's collectives, so training runs with "
                      "jit_compile=False", stacklevel=3)
        model.jit_compile = False
        model.train_function = None  # rebuilt, without XLA, when fit() asks for it


class _MpitrainCallback(keras.callbacks.Callback):
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        _without_xla(model)


class BroadcastGlobalVariablesCallback(BroadcastFromRoot, _MpitrainCallback):
    """Copy ``root_rank``'s weights and optimizer state to every rank when training starts.

    If the model already has its weights, that happens before the first step, after building
    the optimizer if needed so that its slots travel too: training starts from one state
    everywhere.  A model that creates its weights on its first call (a ``Sequential`` without
    an ``Input``) has none to send then; its state is sent after the first batch instead, as
    Horovod does, once the model and the optimizer exist.  Arguments: see
    :class:`..functions.BroadcastFromRoot`.
    """

    broadcast_done = False  # set on the instance once the state went out

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # Every rank builds the same model, so every rank makes the same choice here.
        if not self.broadcast_done and self.model.weights:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        variables = list(self.model.weights)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, process_set=self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(_MpitrainCallback):
    """At the end of each epoch, replace every metric in ``logs`` by its average over ranks.

    Put it before callbacks that read the metrics (checkpointing, early stopping, lr
    reduction) so they all see the same numbers.

    Args:
        device: accepted for Horovod compatibility.
        process_set: the ranks taking part (default: all).
    """

    def __init__(self, device: str = "", process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        del device
        self.process_set = process_set
        self._checked_keys: list[str] | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is None:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        if keys != self._checked_keys:
            everyone = collectives.allgather_object(keys, process_set=self.process_set)
            if any(k != keys for k in everyone):
                raise ValueError(f"MetricAverageCallback: ranks report different metrics "
                                 f"{everyone}; every rank must compile the same metrics")
            self._checked_keys = keys
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = collectives.allreduce(values, op=collectives.Average,
                                         process_set=self.process_set)
        for k, v in zip(keys, averaged.tolist()):
            logs[k] = v


@dataclass(frozen=True)
class _Schedule:
    """What a :class:`LearningRateScheduleCallback` was asked for, fixed at construction."""

    multiplier: Callable[[float], float]
    start_epoch: int
    end_epoch: int | None
    staircase: bool
    momentum_correction: bool

    def covers(self, epoch: int) -> bool:
        """Whether the schedule sets the rate during ``epoch``."""
        return self.start_epoch <= epoch and (self.end_epoch is None or epoch < self.end_epoch)


def _as_multiplier(multiplier: float | Callable[[float], float]) -> Callable[[float], float]:
    """``multiplier`` as a function of the epoch (a number is a constant one)."""
    if callable(multiplier):
        return multiplier
    if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool):
        factor = float(multiplier)
        return lambda epoch: factor
    raise TypeError(f"multiplier must be a number or a function of the epoch, got "
                    f"{multiplier!r}")


class LearningRateScheduleCallback(_MpitrainCallback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in a range.

    Args:
        initial_lr: the base rate (usually already scaled by ``hvd.size()``); ``None`` takes
            the optimizer's rate when training starts.
        multiplier: a number, or a function of the epoch (fractional when not ``staircase``).
        start_epoch: first epoch the schedule applies to.
        end_epoch: the epoch it stops before (``None``: to the end).
        staircase: change once per epoch; otherwise every batch, with the fractional epoch
            ``epoch + batch / steps_per_epoch``.
        momentum_correction: when the rate changes by a factor r, scale an SGD optimizer's
            momentum buffers by r too (the velocity carries the old rate; Goyal et al.).
        steps_per_epoch: batches per epoch (default: what ``fit`` reports).

    Raises:
        TypeError: ``multiplier`` is neither a number nor callable.
        ValueError: the optimizer's rate is a schedule and cannot be set (at train begin).
    """

    def __init__(self, initial_lr: float | None, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self._schedule = _Schedule(_as_multiplier(multiplier), start_epoch, end_epoch, staircase,
                                   momentum_correction)
        # Where None, resolved when training starts: the optimizer's rate, fit()'s steps.
        self.initial_lr = initial_lr
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def __getattr__(self, name: str) -> Any:
        """Horovod's attribute names for the settings (``start_epoch``, ``staircase``, ...),
        which its users' subclasses read; they live in the frozen schedule, read-only."""
        schedule = self.__dict__.get("_schedule")
        if schedule is not None and name in _Schedule.__dataclass_fields__:
            return getattr(schedule, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _set_lr(self, new_lr: float) -> None:
        optimizer = self.model.optimizer
        old_lr = float(np.asarray(optimizer.learning_rate))
        try:
            optimizer.learning_rate = new_lr
        except TypeError as exc:
            raise ValueError(f"{type(self).__name__} sets the learning rate, but this "
                             f"optimizer's rate is a schedule: {exc}") from None
        momentums = getattr(optimizer, "momentums", None)
        if (self._schedule.momentum_correction and isinstance(optimizer, keras.optimizers.SGD)
                and momentums and old_lr > 0 and new_lr != old_lr):
            ratio = new_lr / old_lr
            for m in momentums:
                m.assign(m * ratio)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = float(np.asarray(self.model.optimizer.learning_rate))
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self._schedule.staircase and not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__}(staircase=False) needs steps_per_epoch: "
                             "fit() did not report it; pass steps_per_epoch=")

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch
        if self._schedule.staircase and self._schedule.covers(epoch):
            assert self.initial_lr is not None
            self._set_lr(self.initial_lr * self._schedule.multiplier(epoch))

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._schedule.staircase or not self._schedule.covers(self.current_epoch):
            return
        assert self.initial_lr is not None and self.steps_per_epoch
        epoch = self.current_epoch + batch / self.steps_per_epoch
        self._set_lr(self.initial_lr * self._schedule.multiplier(epoch))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the first epochs.

    Large-batch training (lr scaled by the number of ranks) diverges early without it (Goyal
    et al., "Accurate, Large Minibatch SGD").  The ramp is linear in the fractional epoch and
    ends exactly on ``initial_lr`` at the end of the last warmup epoch.

    Args:
        initial_lr: the rate after warmup (usually the single-rank rate times ``hvd.size()``);
            ``None`` takes the optimizer's rate when training starts.
        warmup_epochs: length of the ramp.
        momentum_correction: see :class:`LearningRateScheduleCallback`.
        steps_per_epoch: batches per epoch (default: what ``fit`` reports).
        verbose: print the rate reached at the end of warmup (rank 0).
    """

    def __init__(self, initial_lr: float | None, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs}")

        def ramp(epoch: float) -> float:
            size = runtime.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, ramp, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == self.warmup_epochs - 1:
            # The last batch ramped to just below the target; land on it exactly.
            assert self.initial_lr is not None
            self._set_lr(self.initial_lr)
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and runtime.rank() == 0:
            lr = float(np.asarray(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")
