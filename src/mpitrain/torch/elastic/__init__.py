"""``hvd.elastic`` for PyTorch (``import mpitrain.torch as hvd``): Horovod's
``horovod.torch.elastic``, with the framework-neutral core of :mod:`mpitrain.elastic`."""

from __future__ import annotations

from ...core.errors import ElasticLimitError, HorovodInternalError, HostsUpdatedInterrupt

# From the modules of the framework-neutral core, not its package face, which offers this
# module's names to ``import mpitrain as hvd`` users: one direction of import.
from ...elastic.driver import run, run_fn
from ...elastic.state import HostUpdateResult, ObjectState, State
from ...session import init, shutdown
from .sampler import ElasticSampler
from .state import TorchState

# init and shutdown are here because Horovod's horovod.torch.elastic has them too.
__all__ = ["ElasticLimitError", "ElasticSampler", "HorovodInternalError", "HostUpdateResult",
           "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "init", "run", "run_fn",
           "shutdown"]
