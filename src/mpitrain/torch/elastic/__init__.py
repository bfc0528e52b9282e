"""``hvd.elastic`` for PyTorch (``import mpitrain.torch as hvd``): Horovod's
``horovod.torch.elastic``, with the framework-neutral core of :mod:`mpitrain.elastic`."""

from __future__ import annotations

from ...elastic import (
    ElasticLimitError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    HostUpdateResult,
    ObjectState,
    State,
    init,
    run,
    run_fn,
    shutdown,
)
from .sampler import ElasticSampler
from .state import TorchState

# init and shutdown are here because Horovod's horovod.torch.elastic has them too.
__all__ = ["ElasticLimitError", "ElasticSampler", "HorovodInternalError", "HostUpdateResult",
           "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "init", "run", "run_fn",
           "shutdown"]
