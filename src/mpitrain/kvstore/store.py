"""MXNet's KVStore API for data-parallel training, served by mpitrain's engine.

There is no server: the "server" is replicated on every rank.  ``push`` sums a key's values
(the devices' copies) locally, then across ranks with a named, asynchronous allreduce; the
stored value becomes that sum, or, after ``set_optimizer``, every rank applies the same update
to its copy of the weight with the same summed gradient, so the copies stay identical.
``pull`` waits for the key's pending push and copies the stored value out.  Keys are matched
across ranks by name, so ranks may push different keys in different orders, but every rank
must push every key the same number of times.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import torch

from .. import collectives, session
from ..core import runtime
from ..face import files as _files
from .compression import Finish, GradientCompression
from .updater import Optimizer, Updater, as_torch

TYPES = {
    "dist_sync_mpi": "dist_sync_mpi",
    "dist_sync": "dist_sync_mpi",
    "dist_device_sync": "dist_sync_mpi",
    "dist": "dist_sync_mpi",
    "horovod": "dist_sync_mpi",
    "local": "dist_sync_mpi",
    "device": "dist_sync_mpi",
}
# Stores are created in the same order on every rank, so this numbers them alike everywhere
# and keeps the requests of two stores with the same keys apart.
_store_ids = itertools.count()


class KVStore:
    """A synchronous key-value store over every rank (see the module docstring).

    Create it with :func:`create` (every rank creates its stores in the same order).  Every
    method that moves data is collective: every rank must call it for the same keys, with
    the same shapes and dtypes.
    """

    OPTIMIZER = "optimizer"

    def __init__(self, name: str) -> None:
        self._type = name
        self._id = next(_store_ids)
        self._store: dict[Any, torch.Tensor] = {}
        self._pending: dict[Any, tuple[Any, Finish]] = {}
        self._key_type: type | None = None
        self._updater: Callable[[Any, torch.Tensor, torch.Tensor], None] | None = None
        self._compression = GradientCompression(None)

    # ----------------------------------------------------------------------- properties
    @property
    def type(self) -> str:
        """The type this store was created as (``"dist_sync"``, ``"horovod"``, ...)."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return runtime.rank()

    @property
    def num_workers(self) -> int:
        """The number of workers (ranks)."""
        return runtime.size()

    @property
    def local_rank(self) -> int:
        """This worker's rank on its machine."""
        return runtime.local_rank()

    # ------------------------------------------------------------------------- helpers
    def _check_key(self, key: Any) -> Any:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"KVStore keys are ints or strings, got {key!r}")
        if self._key_type is None:
            self._key_type = type(key)
        elif not isinstance(key, self._key_type):
            raise TypeError(f"key {key!r}: all keys of a store must be of one type "
                            f"({self._key_type.__name__})")
        return key

    def _pairs(self, key: Any, value: Any, what: str) -> list[tuple[Any, list[Any]]]:
        """(key, [values]) pairs from MXNet's argument forms."""
        if isinstance(key, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(key):
                raise ValueError(f"{what}: {len(key)} keys need a list of as many values, got "
                                 f"{type(value).__name__}")
            return [(self._check_key(k), list(v) if isinstance(v, (list, tuple)) else [v])
                    for k, v in zip(key, value)]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise ValueError(f"{what}: key {key!r} got an empty list of values")
        return [(self._check_key(key), values)]

    def _stored(self, key: Any) -> torch.Tensor:
        stored = self._store.get(key)
        if stored is None:
            raise ValueError(f"key {key!r} has not been initialised; call init({key!r}, value) "
                             "first")
        return stored

    def _like_stored(self, key: Any, value: Any, what: str) -> torch.Tensor:
        t = as_torch(value, what)
        stored = self._stored(key)
        if t.shape != stored.shape or t.dtype != stored.dtype:
            raise ValueError(f"{what} for key {key!r} has shape {tuple(t.shape)} and dtype "
                             f"{t.dtype}; the key holds {tuple(stored.shape)} {stored.dtype}")
        return t

    def _name(self, verb: str, key: Any) -> str:
        return f"kvstore{self._id}.{verb}.{key}"

    def _settle(self, key: Any) -> None:
        """Finish the key's pending push: store the sum, or apply the update with it."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        handle, finish = pending
        merged = finish(collectives.synchronize(handle) if handle is not None else None)
        stored = self._store[key]
        if self._updater is None:
            stored.copy_(merged)
        else:
            self._updater(key, merged, stored)

    def _settle_all(self) -> None:
        for key in list(self._pending):
            self._settle(key)

    # ------------------------------------------------------------------------- data path
    def init(self, key: Any, value: Any) -> None:
        """Create keys with rank 0's values (collective; each key only once).

        Args:
            key: an int or str key, or a list of them.
            value: an array/tensor, or a list of them for a list of keys.

        Raises:
            ValueError: a key is already initialised, or keys and values do not pair up.
            TypeError: a bad key or value type.
        """
        handles = []
        for k, values in self._pairs(key, value, "init"):
            if k in self._store:
                raise ValueError(f"key {k!r} is already initialised")
            if len(values) != 1:
                raise ValueError(f"init: key {k!r} takes one value, got {len(values)}")
            copy = as_torch(values[0], f"value of key {k!r}").clone().contiguous()
            self._store[k] = copy
            handles.append(collectives.broadcast_async_(copy, 0, name=self._name("init", k)))
        for h in handles:
            collectives.synchronize(h)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Sum ``value`` (a list of values is summed first) into the key across all ranks.

        Returns at once; the sum (or the update it drives) lands before the next ``pull`` or
        ``push`` of the key.  Collective: every rank pushes every key it pushes.

        Args:
            key: a key or a list of keys.
            value: an array/tensor or a list of them per key (summed: one per device).
            priority: accepted for MXNet compatibility; the engine orders by readiness.

        Raises:
            ValueError: an uninitialised key, or a value whose shape/dtype differs.
        """
        del priority
        for k, values in self._pairs(key, value, "push"):
            parts = [self._like_stored(k, v, f"push value {i}") for i, v in enumerate(values)]
            merged = parts[0].clone()
            for part in parts[1:]:
                merged.add_(part)
            self._settle(k)
            self._pending[k] = self._compression.start(k, merged, self._name("push", k))

    def pull(self, key: Any, out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the key's value (after its pending push) into ``out``.

        Args:
            key: a key or a list of keys.
            out: an array/tensor or a list (one per device) per key; overwritten in place.
            priority: accepted for MXNet compatibility.
            ignore_sparse: accepted for MXNet compatibility (values are dense).

        Raises:
            ValueError: ``out`` is missing, or its shape/dtype differs from the key's.
        """
        del priority, ignore_sparse
        if out is None:
            raise ValueError("pull needs out= (the arrays to copy the values into)")
        for k, outs in self._pairs(key, out, "pull"):
            self._settle(k)
            stored = self._stored(k)
            for i, o in enumerate(outs):
                self._like_stored(k, o, f"pull out {i}").copy_(stored)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """``push(key, value)`` then ``pull(key, out)``; ``out=None`` overwrites ``value``."""
        self.push(key, value, priority)
        self.pull(key, value if out is None else out, priority)

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialise keys with rank 0's ``value`` and copy it into ``out`` (collective)."""
        self.init(key, value)
        self.pull(key, out, priority)

    # ------------------------------------------------------------------------- updates
    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Apply ``optimizer`` to each pushed gradient (a replicated server on every rank).

        Every rank must pass an equal optimizer; updates then keep the weights identical.

        Raises:
            TypeError: ``optimizer`` is not an :class:`mpitrain.kvstore.updater.Optimizer`.
        """
        self._settle_all()
        self._updater = Updater(optimizer)

    def set_updater(self, updater: Callable[[Any, torch.Tensor, torch.Tensor], None]) -> None:
        """Apply ``updater(key, summed_grad, stored_weight)`` on each push instead."""
        if not callable(updater):
            raise TypeError(f"updater must be callable, got {type(updater).__name__}")
        self._settle_all()
        self._updater = updater

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushes: ``{"type": "fp16"}``, ``"bf16"``, ``"2bit"`` with a threshold, or
        ``"powersgd"``/``"topk"``/``"onebit"`` (see :mod:`mpitrain.kvstore.compression`)."""
        self._settle_all()
        self._compression = GradientCompression(compression_params)

    def _optimizer_updater(self) -> Updater:
        if not isinstance(self._updater, Updater):
            raise ValueError("this store has no optimizer: call set_optimizer() first")
        return self._updater

    def save_optimizer_states(self, fname: str | os.PathLike[str],
                              dump_optimizer: bool = False) -> None:
        """Write the optimizer's states to ``fname`` from rank 0, atomically (collective).

        The states are the same on every rank, so rank 0's copy is all there is to save.
        """
        updater = self._optimizer_updater()
        self._settle_all()
        _files.save_on_rank0(fname, updater.get_states(dump_optimizer))

    def load_optimizer_states(self, fname: str | os.PathLike[str]) -> None:
        """Every rank reads the optimizer's states from ``fname``."""
        updater = self._optimizer_updater()
        self._settle_all()
        updater.set_states(_files.read(fname))

    # -------------------------------------------------------------------------- misc
    def barrier(self) -> None:
        """Return once every rank has called barrier (pending pushes finish first)."""
        self._settle_all()
        collectives.barrier()

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability`` (``KVStore.OPTIMIZER``: yes).

        Raises:
            ValueError: an unknown capability.
        """
        if capability == self.OPTIMIZER:
            return True
        raise ValueError(f"unknown capability {capability!r}; known: [{self.OPTIMIZER!r}]")


def create(name: str = "dist_sync_mpi") -> KVStore:
    """Create a KVStore, initialising mpitrain if needed (collective, like ``mpitrain.init``).

    Args:
        name: ``"dist_sync_mpi"`` or one of its aliases ``"dist_sync"``, ``"horovod"``,
            ``"local"`` (also ``"dist_device_sync"``, ``"dist"``, ``"device"``): under mpirun
            they all span every rank; alone, a world of one.

    Raises:
        ValueError: an unknown type, or ``"dist_async"`` (every rank applies the same
            update at the same step here; there is no asynchronous mode).
    """
    if not isinstance(name, str):
        raise TypeError(f"KVStore type must be a string, got {type(name).__name__}")
    if name not in TYPES:
        hint = (" (asynchronous updates are not supported: every rank applies the same "
                "update in step)" if "async" in name else "")
        raise ValueError(f"unknown KVStore type {name!r}{hint}; use one of {sorted(TYPES)}")
    if not runtime.is_initialized():
        session.init()
    return KVStore(name)
