"""Gluon's Trainer over torch parameters, Horovod's DistributedTrainer and broadcast_parameters.

``Trainer(params, "sgd", {"learning_rate": 0.1}, kvstore="dist_sync")`` behaves as MXNet's
gluon Trainer: every parameter is initialised in the KVStore from rank 0 and pulled back (so
all ranks start equal; here when the Trainer is built, which is therefore collective);
``step(batch_size)`` sets the optimizer's
``rescale_grad = 1 / batch_size``, sums the gradients across ranks through the store and
updates.  With ``update_on_kvstore`` the store's replicated server applies the update and the
weights are pulled; otherwise gradients are push-pulled and each rank updates locally.  As in
MXNet, gradients are *summed* over ranks: pass the batch size you want them divided by.

``DistributedTrainer`` is Horovod's: no KVStore, gradients averaged with one fused allreduce
(so ``step`` takes the per-rank batch size), and ``broadcast_parameters`` for the start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import collectives
from ..compression import Compression, Compressor
from ..core.process_sets import ProcessSet, global_process_set, size_of
from ..face import files as _files
from ..torch.functions import broadcast_parameters as _broadcast_parameters
from .store import KVStore
from .store import create as create_kvstore
from .updater import Optimizer, Updater, as_torch
from .updater import create as create_optimizer

_DIST_TYPES = ("dist_sync_mpi", "dist_sync", "dist_device_sync", "dist")


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) pairs from a module, a mapping or an iterable of parameters."""
    if isinstance(params, torch.nn.Module):
        return list(params.named_parameters())
    if isinstance(params, Mapping):
        return [(str(k), v) for k, v in params.items()]
    if isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, str)):
        return [(str(i), p) for i, p in enumerate(params)]
    raise TypeError(f"params must be a module, a dict of parameters or a list of them, got "
                    f"{type(params).__name__}")


class Trainer:
    """Applies an optimizer to a set of torch parameters, through a KVStore across ranks.

    Building it is collective when it has a KVStore: every rank's parameters are set to
    rank 0's.

    Args:
        params: ``model.parameters()``, ``dict(model.named_parameters())`` or a module.
        optimizer: a name (``"sgd"``, ``"adam"``) or an :class:`Optimizer`.
        optimizer_params: keyword arguments for a named optimizer.
        kvstore: a KVStore type, a :class:`KVStore`, or ``None`` (no communication).
        compression_params: passed to ``kvstore.set_gradient_compression``.
        update_on_kvstore: apply updates in the store (default: yes for ``dist_*`` types,
            as MXNet does; no otherwise).

    Raises:
        TypeError: bad params or optimizer.
        ValueError: a parameter appears twice, or update_on_kvstore without a store.
    """

    def __init__(self, params: Any, optimizer: str | Optimizer,
                 optimizer_params: dict[str, Any] | None = None,
                 kvstore: str | KVStore | None = "dist_sync_mpi",
                 compression_params: dict[str, Any] | None = None,
                 update_on_kvstore: bool | None = None) -> None:
        self._params = _named(params)
        ids = [id(p) for _, p in self._params]
        if len(set(ids)) != len(ids):
            raise ValueError("a parameter appears more than once in params")
        for name, p in self._params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not a tensor")
        self._optimizer = create_optimizer(optimizer, **(optimizer_params or {}))
        self._optimizer.idx2name = {i: name for i, (name, _) in enumerate(self._params)}
        self._scale = self._optimizer.rescale_grad
        self._updater = Updater(self._optimizer)
        self._kvstore = create_kvstore(kvstore) if isinstance(kvstore, str) else kvstore
        if update_on_kvstore is None:
            update_on_kvstore = self._kvstore is not None and self._kvstore.type in _DIST_TYPES
        if update_on_kvstore and self._kvstore is None:
            raise ValueError("update_on_kvstore=True needs a kvstore")
        self._update_on_kvstore = bool(update_on_kvstore)
        self._compression_params = compression_params
        self._kv_initialized = False
        # Torch parameters exist already (gluon defers this to the first step, after the
        # first backward on unsynchronised weights): start from rank 0's weights at once.
        self._init_kvstore()

    # -------------------------------------------------------------------- properties
    @property
    def learning_rate(self) -> float:
        """The optimizer's current learning rate."""
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Set the optimizer's learning rate (every rank must set the same)."""
        self._optimizer.set_learning_rate(lr)

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    # ------------------------------------------------------------------------ steps
    def _init_kvstore(self) -> None:
        if self._kv_initialized:
            return
        self._kv_initialized = True
        kv = self._kvstore
        if kv is None:
            return
        if self._compression_params:
            kv.set_gradient_compression(self._compression_params)
        keys = list(range(len(self._params)))
        weights = [p.detach() for _, p in self._params]
        kv.init(keys, weights)  # rank 0's values ...
        kv.pull(keys, out=weights)  # ... everywhere
        if self._update_on_kvstore:
            kv.set_optimizer(self._optimizer)

    def _grads(self, ignore_stale_grad: bool) -> list[tuple[int, torch.Tensor, bool]]:
        """(key, gradient, fresh) for every parameter; a missing gradient counts as zeros."""
        out = []
        for i, (name, p) in enumerate(self._params):
            if p.grad is None:
                if not ignore_stale_grad:
                    raise ValueError(f"parameter {name!r} has no gradient; pass "
                                     "ignore_stale_grad=True to skip it")
                out.append((i, torch.zeros_like(p.detach()), False))
            else:
                out.append((i, as_torch(p.grad, f"gradient of {name!r}"), True))
        return out

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """Sum gradients across ranks and update, with ``rescale_grad = 1 / batch_size``.

        Collective: every rank must call it once per step.
        """
        self._rescale(batch_size)
        self._init_kvstore()
        grads = self._grads(ignore_stale_grad)
        self._allreduce_grads(grads)
        self._apply(grads)

    def allreduce_grads(self) -> None:
        """Only sum the gradients across ranks, in place (for update_on_kvstore=False).

        Raises:
            ValueError: the trainer updates on the kvstore, where this split is impossible.
        """
        if self._update_on_kvstore:
            raise ValueError("allreduce_grads() needs update_on_kvstore=False (the store "
                             "applies the update when it receives the gradient)")
        self._init_kvstore()
        self._allreduce_grads(self._grads(ignore_stale_grad=True))

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        """Only apply the update from the (already summed) gradients.

        Raises:
            ValueError: the trainer updates on the kvstore.
        """
        if self._update_on_kvstore:
            raise ValueError("update() needs update_on_kvstore=False; call step() instead")
        self._rescale(batch_size)
        self._init_kvstore()
        self._apply(self._grads(ignore_stale_grad))

    def _rescale(self, batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, float)) \
                or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive number, got {batch_size!r}")
        self._optimizer.rescale_grad = self._scale / batch_size

    def _allreduce_grads(self, grads: list[tuple[int, torch.Tensor, bool]]) -> None:
        kv = self._kvstore
        if kv is None:
            return
        for key, grad, _ in grads:  # every push first: the engine overlaps them
            kv.push(key, grad)
        if not self._update_on_kvstore:
            for key, grad, _ in grads:
                kv.pull(key, out=grad)

    def _apply(self, grads: list[tuple[int, torch.Tensor, bool]]) -> None:
        if self._update_on_kvstore:
            assert self._kvstore is not None
            for key, _, _ in grads:
                self._kvstore.pull(key, out=self._params[key][1].detach())
            return
        for key, grad, fresh in grads:
            if fresh:
                self._updater(key, grad, self._params[key][1].detach())

    # ----------------------------------------------------------------------- states
    def save_states(self, fname: str | os.PathLike[str]) -> None:
        """Write the optimizer and its states from rank 0, atomically (collective)."""
        self._init_kvstore()
        if self._update_on_kvstore:
            assert self._kvstore is not None
            self._kvstore.save_optimizer_states(fname, dump_optimizer=True)
        else:
            _files.save_on_rank0(fname, self._updater.get_states(dump_optimizer=True))

    def load_states(self, fname: str | os.PathLike[str]) -> None:
        """Every rank reads the optimizer and its states from ``fname``."""
        self._init_kvstore()
        if self._update_on_kvstore:
            assert self._kvstore is not None
            self._kvstore.load_optimizer_states(fname)
            updater = self._kvstore._optimizer_updater()
        else:
            self._updater.set_states(_files.read(fname))
            updater = self._updater
        self._updater = updater
        self._optimizer = updater.optimizer


class DistributedTrainer(Trainer):
    """Horovod's trainer: gradients averaged across ranks in one fused allreduce, no KVStore.

    Call :func:`broadcast_parameters` once before training so every rank starts equal.
    ``step(batch_size)`` takes the per-rank batch size.

    Args:
        params: as for :class:`Trainer`.
        optimizer: as for :class:`Trainer`.
        optimizer_params: as for :class:`Trainer`.
        compression: wire format for floating gradients (e.g. ``Compression.fp16``).
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``size / factor`` after it.
        prefix: prefixes the names of the gradients' requests (several trainers at once).
        process_set: the ranks taking part (default: all).
    """

    def __init__(self, params: Any, optimizer: str | Optimizer,
                 optimizer_params: dict[str, Any] | None = None,
                 compression: type[Compressor] = Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix: str | None = None,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(params, optimizer, optimizer_params, kvstore=None)
        factor = collectives.scale_factor(gradient_predivide_factor, "gradient_predivide_factor")
        if factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {factor}")
        self._predivide = factor
        self._compression = compression
        self._prefix = prefix or ""
        self._process_set = process_set
        size = size_of(process_set)
        self._scale *= factor / size  # the sum of gradients becomes their average

    def _allreduce_grads(self, grads: list[tuple[int, torch.Tensor, bool]]) -> None:
        tensors = [g for _, g, _ in grads]
        if not tensors:
            return
        reduced = collectives.grouped_allreduce(tensors,
                                                name=f"{self._prefix}DistributedTrainer.grads",
                                                compression=self._compression, op=collectives.Sum,
                                                prescale_factor=1.0 / self._predivide,
                                                process_set=self._process_set)
        for g, r in zip(tensors, reduced):
            g.copy_(r)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every tensor of ``params`` with ``root_rank``'s, in place (collective).

    Horovod's MXNet name for :func:`mpitrain.torch.functions.broadcast_parameters` (one
    implementation): a module, a dict name -> tensor or array, or a list of them; dicts in
    sorted name order.
    """
    _broadcast_parameters(params, root_rank, prefix, process_set)
