"""``hvd.elastic`` for TensorFlow 2 (``import mpitrain.tensorflow as hvd``): Horovod's
``horovod.tensorflow.elastic`` on mpitrain's in-place recovery (:mod:`mpitrain.elastic`).

``run`` is the framework-neutral loop, with one addition: inside ``tf.function`` (Keras'
``fit`` included) a collective that failed because a peer died surfaces as a TensorFlow
``OpError`` carrying mpitrain's message, which is turned back into ``HorovodInternalError`` so
the loop recovers instead of ending the job.  ``TensorFlowKerasState`` keeps a model's and its
optimizer's variables (eager TensorFlow 2; TF1 graph sessions are not supported), committed in
host memory and broadcast from rank 0 after a reset; ``TensorFlowState`` does the same for a
list of variables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from ..collectives import broadcast_object
from ..core.errors import (
    ElasticLimitError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    carries_collective_failure,
)
from ..core.runtime import rank
from ..elastic import ObjectState, State, driver
from ..session import init, shutdown
from .functions import broadcast_variables

R = TypeVar("R")

def _internal(func: Callable[..., R]) -> Callable[..., R]:
    """``func``, with a TensorFlow-wrapped collective failure raised as HorovodInternalError."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as exc:
            # numpy_function ops re-raise the Python exception's text inside an OpError.
            if carries_collective_failure(str(exc.message)):
                raise HorovodInternalError(exc.message) from exc
            raise

    return wrapper


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorate a training function so that it survives the loss of ranks (see
    :func:`mpitrain.elastic.run`; needs Open MPI's ``--with-ft ulfm``)."""
    return driver.run(_internal(func))


def _optimizer_variables(optimizer: Any) -> list[Any]:
    """Keras 3 has ``optimizer.variables`` (a list), Keras 2 ``optimizer.variables()``."""
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class _VariablesState(ObjectState):
    """Variables (re-listed at every use: an optimizer creates its slots lazily) and plain
    values, committed as numpy copies."""

    def __init__(self, variables: Callable[[], Sequence[Any]], **kwargs: Any) -> None:
        if not tf.executing_eagerly():
            raise ValueError("mpitrain's TensorFlow elastic state needs eager execution "
                             "(TensorFlow 2); TF1 graph sessions are not supported")
        self._variables = variables
        self._saved: list[np.ndarray] = []
        self._save_variables()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _save_variables(self) -> None:
        self._saved = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        current = list(self._variables())
        # Slots an optimizer created after the commit have no saved value: keep them.
        for var, value in zip(current, self._saved):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = list(self._variables())
        if variables:
            broadcast_variables(variables, root_rank=0)
        self._save_variables()
        super().sync()

    def snapshot(self) -> Any:
        return {"variables": self._saved, **super().snapshot()}

    def load_snapshot(self, snapshot: Any) -> None:
        self._saved = list(snapshot["variables"])
        super().load_snapshot(snapshot)
        for var, value in zip(self._variables(), self._saved):
            var.assign(value)


class TensorFlowKerasState(_VariablesState):
    """A Keras model's and optimizer's variables plus plain values (``epoch=0, batch=0``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: accepted for Horovod compatibility (TF1 sessions are not supported).
        kwargs: plain values, exposed as attributes and committed with the variables.

    Raises:
        ValueError: the model is not built, or TensorFlow is not executing eagerly.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        del backend
        if hasattr(model, "built") and not model.built:
            raise ValueError("the model must be built first: call model.build(input_shape) "
                             "or run it on a batch")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                          None)
        super().__init__(lambda: [*self.model.variables,
                                  *_optimizer_variables(self.optimizer)], **kwargs)


class TensorFlowState(_VariablesState):
    """A list of ``tf.Variable`` plus plain values (eager TensorFlow 2)."""

    def __init__(self, variables: Sequence[Any], session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("TensorFlowState(session=...): TF1 graph sessions are not "
                             "supported; use eager TensorFlow 2")
        self.variables = list(variables)
        super().__init__(lambda: self.variables, **kwargs)


__all__ = ["ElasticLimitError", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TensorFlowKerasState", "TensorFlowState", "init", "run", "shutdown"]
