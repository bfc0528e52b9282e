"""MXNet's optimizer interface (``create_state``/``update`` per key) over torch tensors.

The KVStore's replicated server and the gluon-style Trainer both apply updates through an
:class:`Updater`: it keeps one state per key, counts updates per key (Adam's bias correction
and learning-rate schedules use the count), and serialises its states for checkpoints.  The
update rules follow MXNet's documented formulas (``sgd_update``, ``sgd_mom_update``,
``adam_update``): gradients are multiplied by ``rescale_grad`` and clipped to
``clip_gradient`` first, weight decay enters as ``wd * weight``.

All tensors are updated in place; numpy arrays are handled as torch views of the same memory.
"""

from __future__ import annotations

import io
import math
import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def as_torch(x: Any, what: str) -> torch.Tensor:
    """A CPU torch view of a numpy array or torch tensor (no copy).

    Raises:
        TypeError: ``x`` is neither, or lives off the CPU.
    """
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(f"{what} is on {x.device}; mpitrain.kvstore serves CPU tensors")
        return x.detach()
    raise TypeError(f"{what} must be a numpy array or torch tensor, got {type(x).__name__}")


class Optimizer(ABC):
    """Base class: MXNet's optimizer attributes and per-key bookkeeping.

    Args:
        learning_rate: the step size (``lr_scheduler``, if given, overrides it per update).
        wd: weight decay (L2), added to the gradient as ``wd * weight``.
        rescale_grad: multiplies every gradient first (Trainer sets ``1 / batch_size``).
        clip_gradient: clip the rescaled gradient to ``[-c, c]`` (``None``: no clipping).
        lr_scheduler: a callable ``num_update -> learning rate`` (MXNet's schedulers are).
        param_idx2name: key -> parameter name, for ``lr_mult``/``wd_mult`` by name.

    Raises:
        ValueError: a negative learning rate or weight decay, or a non-positive clip.
    """

    def __init__(self, learning_rate: float = 0.01, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None,
                 lr_scheduler: Callable[[int], float] | None = None,
                 param_idx2name: dict[Any, str] | None = None) -> None:
        if learning_rate < 0 or wd < 0:
            raise ValueError(f"learning_rate and wd must be >= 0, got {learning_rate}, {wd}")
        if clip_gradient is not None and clip_gradient <= 0:
            raise ValueError(f"clip_gradient must be positive or None, got {clip_gradient}")
        self.lr = float(learning_rate)
        self.wd = float(wd)
        self.rescale_grad = float(rescale_grad)
        self.clip_gradient = clip_gradient
        self.lr_scheduler = lr_scheduler
        self.idx2name = dict(param_idx2name or {})
        self.lr_mult: dict[Any, float] = {}
        self.wd_mult: dict[Any, float] = {}
        self.num_update = 0
        self._index_update_count: dict[Any, int] = {}

    @property
    def learning_rate(self) -> float:
        """The current rate: the scheduler's at ``num_update``, else the fixed one."""
        if self.lr_scheduler is not None:
            return float(self.lr_scheduler(self.num_update))
        return self.lr

    def set_learning_rate(self, lr: float) -> None:
        """Set a fixed rate.

        Raises:
            ValueError: a scheduler is in charge of the rate.
        """
        if self.lr_scheduler is not None:
            raise ValueError("this optimizer's rate comes from its lr_scheduler; change the "
                             "scheduler instead of calling set_learning_rate")
        self.lr = float(lr)

    def set_lr_mult(self, args_lr_mult: dict[Any, float]) -> None:
        """Per-key (or per-name) learning-rate multipliers."""
        self.lr_mult = dict(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict[Any, float]) -> None:
        """Per-key (or per-name) weight-decay multipliers."""
        self.wd_mult = dict(args_wd_mult)

    def _mult(self, table: dict[Any, float], index: Any) -> float:
        if index in table:
            return table[index]
        return table.get(self.idx2name.get(index, None), 1.0)

    def _get_lr(self, index: Any) -> float:
        return self.learning_rate * self._mult(self.lr_mult, index)

    def _get_wd(self, index: Any) -> float:
        return self.wd * self._mult(self.wd_mult, index)

    def _update_count(self, index: Any) -> int:
        count = self._index_update_count.get(index, 0) + 1
        self._index_update_count[index] = count
        self.num_update = max(self.num_update, count)
        return count

    def _prepare(self, index: Any, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The rescaled, clipped gradient (a new tensor; ``grad`` is left as it is)."""
        g = grad * self.rescale_grad
        if self.clip_gradient is not None:
            g.clamp_(-self.clip_gradient, self.clip_gradient)
        return g

    def create_state(self, index: Any, weight: torch.Tensor) -> Any:
        """The per-key state for ``weight`` (``None`` when the rule needs none)."""
        return None

    @abstractmethod
    def update(self, index: Any, weight: torch.Tensor, grad: torch.Tensor, state: Any) -> None:
        """Apply one update to ``weight`` in place (``grad`` is not modified)."""


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, as MXNet's ``sgd(_mom)_update``.

    ``mom = momentum * mom - lr * (g + wd * w); w += mom`` (``w -= lr * (g + wd * w)``
    without momentum), where ``g`` is the rescaled, clipped gradient.
    """

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)

    def create_state(self, index: Any, weight: torch.Tensor) -> Any:
        return torch.zeros_like(weight) if self.momentum else None

    def update(self, index: Any, weight: torch.Tensor, grad: torch.Tensor, state: Any) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        step = self._prepare(index, weight, grad)
        if wd:
            step.add_(weight, alpha=wd)
        if state is None:
            weight.sub_(step, alpha=lr)
            return
        state.mul_(self.momentum).sub_(step, alpha=lr)
        weight.add_(state)


class Adam(Optimizer):
    """Adam as MXNet's ``adam_update``, with the bias correction folded into the rate.

    ``g += wd * w; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)``.
    """

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
                 **kwargs: Any) -> None:
        kwargs.setdefault("learning_rate", 0.001)
        super().__init__(**kwargs)
        for name, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def create_state(self, index: Any, weight: torch.Tensor) -> Any:
        return torch.zeros_like(weight), torch.zeros_like(weight)

    def update(self, index: Any, weight: torch.Tensor, grad: torch.Tensor, state: Any) -> None:
        t = self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        lr *= math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        g = grad * self.rescale_grad
        if wd:
            g.add_(weight, alpha=wd)
        if self.clip_gradient is not None:
            g.clamp_(-self.clip_gradient, self.clip_gradient)
        mean, var = state
        mean.mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
        var.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        weight.sub_(mean / (var.sqrt() + self.epsilon), alpha=lr)


_REGISTRY: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam}


def create(name: str | Optimizer, **kwargs: Any) -> Optimizer:
    """An optimizer by MXNet's name (``"sgd"``, ``"adam"``), or ``name`` itself if it is one.

    Raises:
        ValueError: an unknown name.
        TypeError: ``name`` is neither a string nor an :class:`Optimizer`.
    """
    if isinstance(name, Optimizer):
        if kwargs:
            raise ValueError(f"optimizer_params {sorted(kwargs)} given with an optimizer "
                             "instance; set them on the instance instead")
        return name
    if not isinstance(name, str):
        raise TypeError(f"optimizer must be a name or an Optimizer, got {type(name).__name__}")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; available: {sorted(_REGISTRY)}")
    return cls(**kwargs)


class Updater:
    """Applies an optimizer key by key, creating each key's state on first use.

    Args:
        optimizer: the update rule.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Updater needs an mpitrain.kvstore Optimizer, got "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        self.states: dict[Any, Any] = {}

    def __call__(self, index: Any, grad: torch.Tensor, weight: torch.Tensor) -> None:
        """Update ``weight`` in place from ``grad`` (MXNet's argument order)."""
        if weight.dtype not in _FLOATS:
            raise TypeError(f"key {index!r}: only floating weights can be updated, got "
                            f"{weight.dtype}")
        if index not in self.states:
            self.states[index] = self.optimizer.create_state(index, weight)
        self.optimizer.update(index, weight, grad, self.states[index])

    def get_states(self, dump_optimizer: bool = False) -> bytes:
        """The states (and update counts; the optimizer too if asked) as bytes."""
        payload: dict[str, Any] = {
            "states": self.states,
            "counts": dict(self.optimizer._index_update_count),
            "num_update": self.optimizer.num_update,
        }
        if dump_optimizer:
            payload["optimizer"] = self.optimizer
        buffer = io.BytesIO()
        torch.save(payload, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
        return buffer.getvalue()

    def set_states(self, data: bytes) -> None:
        """Restore what :meth:`get_states` produced (the optimizer too, if it was dumped).

        Raises:
            ValueError: ``data`` is not such a payload.
        """
        try:
            payload = torch.load(io.BytesIO(data), weights_only=False)
            states, counts = payload["states"], payload["counts"]
        except Exception as exc:  # noqa: BLE001 - any decoding failure means a bad file
            raise ValueError(f"not an mpitrain.kvstore optimizer state: {exc}") from None
        if "optimizer" in payload:
            self.optimizer = payload["optimizer"]
        self.states = states
        self.optimizer._index_update_count = dict(counts)
        self.optimizer.num_update = int(payload["num_update"])
