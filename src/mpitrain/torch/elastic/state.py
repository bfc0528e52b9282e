"""TorchState: a model, an optimizer, samplers and plain values, committed in host memory and
synchronised from rank 0 after a reset (Horovod's ``horovod.torch.elastic.state``).

Each keyword argument whose type has a handler (module, optimizer, ElasticSampler) is tracked
by that handler; the rest are plain values of :class:`~mpitrain.elastic.ObjectState`.  A
commit deep-copies the state dicts (on the host for CPU tensors; a GPU tensor's copy stays on
its device, as in Horovod), so it costs one copy of the model and optimizer per commit.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any

import torch

from ...collectives import broadcast_object
from ...core.runtime import rank
from ...elastic.state import ObjectState
from ..functions import broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler


class StateHandler(ABC):
    """Keeps one tracked value's last commit: ``save``, ``restore``, ``sync``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    @abstractmethod
    def save(self) -> None:
        """Keep a copy of the value as it is now (the commit)."""

    @abstractmethod
    def restore(self) -> None:
        """Put the last saved copy back into the value."""

    @abstractmethod
    def sync(self) -> None:
        """Make every rank's value rank 0's (collective)."""

    @abstractmethod
    def snapshot(self) -> Any:
        """The last saved copy (picklable), for restart mode's state file."""

    @abstractmethod
    def load_snapshot(self, saved: Any) -> None:
        """Make ``saved`` the last saved copy and load it."""

    def set_value(self, value: Any) -> None:
        """Track ``value`` instead (an attribute assigned anew), committing it at once."""
        self.value = value
        self.save()


class StateDictHandler(StateHandler):
    """A value with ``state_dict()``/``load_state_dict()``: a commit is a deep copy of its state
    dict (a GPU tensor's copy stays on its device), a restore loads that copy back."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved_state = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self._saved_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_state)

    def snapshot(self) -> Any:
        return self._saved_state

    def load_snapshot(self, saved: Any) -> None:
        self._saved_state = saved
        self.restore()


class ModelStateHandler(StateDictHandler):
    """A module's parameters and buffers."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateDictHandler):
    """An optimizer's state (moments, step counts) and hyper-parameters."""

    def restore(self) -> None:
        abandon = getattr(self.value, "abandon_step", None)
        if abandon is not None:  # a DistributedOptimizer: drop the failed step's requests
            abandon()
        super().restore()

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateDictHandler):
    """An ElasticSampler's epoch and processed count (re-dealt over the ranks on load)."""

    def sync(self) -> None:
        # Loading re-deals the remaining samples over today's ranks, on rank 0 too.
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The (type, handler class) pairs TorchState consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the (type, handler class) pairs (e.g. to track a new kind of object)."""
    global _handler_registry
    _handler_registry = registry


def _handlers_of(values: dict[str, Any]) -> tuple[dict[str, StateHandler], dict[str, Any]]:
    """Split keyword values into handled ones and plain ones (None stays plain)."""
    handlers: dict[str, StateHandler] = {}
    plain: dict[str, Any] = {}
    for name, value in values.items():
        handler_cls = next((h for t, h in _handler_registry if isinstance(value, t)), None)
        if handler_cls is None:
            plain[name] = value
        else:
            handlers[name] = handler_cls(value)
    return handlers, plain


class TorchState(ObjectState):
    """The state of a PyTorch training process, for :func:`mpitrain.elastic.run`.

    Args:
        model: a module whose parameters and buffers are tracked (optional).
        optimizer: an optimizer whose state is tracked (optional).
        **kwargs: more values, each an attribute of the state: modules, optimizers and
            ElasticSamplers get their handlers, anything else is a plain picklable value.

    ``commit()`` copies everything; ``restore()`` loads the copies back; ``sync()``
    broadcasts models, optimizer states, samplers and values from rank 0 (collective).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers, plain = _handlers_of(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def snapshot(self) -> Any:
        return {"handlers": {name: h.snapshot() for name, h in self._handlers.items()},
                **super().snapshot()}

    def load_snapshot(self, snapshot: Any) -> None:
        for name, handler in self._handlers.items():
            handler.load_snapshot(snapshot["handlers"][name])
        super().load_snapshot(snapshot)

    def __setattr__(self, name: str, value: Any) -> None:
        # Assigning a new model or optimizer to a tracked name tracks (and commits) the new one.
        if name != "_handlers" and name in getattr(self, "_handlers", {}) and hasattr(self, name):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)


__all__ = ["ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler", "StateDictHandler",
           "StateHandler", "TorchState", "get_handler_registry", "set_handler_registry"]
