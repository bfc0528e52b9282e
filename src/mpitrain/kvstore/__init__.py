"""MXNet's KVStore and gluon Trainer habits on numpy arrays and torch tensors (no MXNet).

    from mpitrain import kvstore
    kv = kvstore.create("dist_sync")       # or "dist_sync_mpi", "horovod", "local"
    kv.init(0, weight); kv.push(0, grad); kv.pull(0, out=weight)
    trainer = kvstore.Trainer(model.parameters(), "sgd", {"learning_rate": 0.1}, kvstore=kv)

See :mod:`mpitrain.kvstore.store` for the semantics (a replicated server on every rank) and
:mod:`mpitrain.kvstore.trainer` for the Trainers.  ``import mpitrain.mxnet as hvd`` gives
Horovod's MXNet face (``DistributedTrainer``, ``broadcast_parameters``) on the same code.
"""

try:
    import torch as _torch  # noqa: F401 - fail here, with the remedy, if it is missing
except ImportError as _exc:
    raise ImportError("mpitrain.kvstore (and mpitrain.mxnet) needs PyTorch, whose tensors and "
                      "optimizers it runs on: pip install 'mpitrain[torch]'") from _exc

from . import updater
from .compression import GradientCompression
from .store import KVStore, create
from .trainer import DistributedTrainer, Trainer, broadcast_parameters
from .updater import SGD, Adam, Optimizer, Updater

# MXNet spells the module of its optimizers ``mx.optimizer``: the same name here.
optimizer = updater

__all__ = [
    "SGD",
    "Adam",
    "DistributedTrainer",
    "GradientCompression",
    "KVStore",
    "Optimizer",
    "Trainer",
    "Updater",
    "broadcast_parameters",
    "create",
    "optimizer",
]
