"""``hvd.elastic`` for PyTorch (``import mpitrain.torch as hvd``): Horovod's
``horovod.torch.elastic``, with the framework-neutral core of :mod:`mpitrain.elastic`."""

from __future__ import annotations

from ...elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    HostUpdateResult,
    ObjectState,
    State,
    run,
    run_fn,
)
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt",
           "ObjectState", "State", "TorchState", "run", "run_fn"]
