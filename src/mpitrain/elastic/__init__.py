"""Elastic training (``hvd.elastic``): state that survives a reset, and the loop that resets.

``import mpitrain as hvd`` is the PyTorch face, so ``hvd.elastic`` offers PyTorch's pieces
too (``TorchState``, ``ElasticSampler``, from :mod:`mpitrain.torch.elastic`); they are loaded
on first use so that the framework-neutral core imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..core.errors import ElasticLimitError, HorovodInternalError, HostsUpdatedInterrupt
from ..session import init, shutdown
from .driver import run, run_fn
from .state import HostUpdateResult, ObjectState, State

_TORCH_NAMES = {"ElasticSampler", "TorchState"}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        # Deferred: torch is heavy and optional for the core (TensorFlow's face uses it too).
        return getattr(importlib.import_module("mpitrain.torch.elastic"), name)
    raise AttributeError(f"module 'mpitrain.elastic' has no attribute {name!r}")


# init and shutdown are here because Horovod's horovod.torch.elastic has them too.
__all__ = ["ElasticLimitError", "ElasticSampler", "HorovodInternalError", "HostUpdateResult",
           "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "init", "run", "run_fn",
           "shutdown"]
