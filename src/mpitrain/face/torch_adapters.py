"""Register mpitrain with torch.distributed whenever the program uses torch, even lazily.

``init()`` exports the job's layout (``RANK``, ``WORLD_SIZE``... see :mod:`mpitrain.core.job_env`),
so a library built on torch.distributed (Hugging Face's Trainer, Accelerate, Lightning) takes
the job for a distributed one and calls ``init_process_group()`` through torch's ``env://``
rendezvous, which also wants ``MASTER_ADDR``/``MASTER_PORT``: mpirun sets neither.
:mod:`mpitrain.torch.c10d` wraps that rendezvous so the missing pieces come from MPI, and
registers the "mpitrain" backend.  ``import mpitrain`` must not import torch (a numpy or
TensorFlow job never pays for it), so :func:`register_when_torch_loads` registers now if torch
is loaded, and otherwise once the program imports it: a one-shot import hook on ``torch``.
``import mpitrain`` has every ``init()`` call it (:func:`mpitrain.core.departures.when_running`):
a face's hook, so that the session below never names the torch face above it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any


def _register() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():  # a torch built without distributed support
        return
    # By name: the torch face loads only where the program has loaded torch.
    importlib.import_module("mpitrain.torch.c10d").register()


class _AfterTorchLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``torch`` so :func:`_register` runs after it."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; the finders below do the finding
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            original(module)
            _register()  # torch is whole now (sys.modules["torch"] complete)

        loader.exec_module = exec_then_register
        return spec


def register_when_torch_loads() -> None:
    """Register mpitrain's torch.distributed backend and rendezvous now or at ``import torch``.

    Communicates nothing; idempotent (the hook is installed once and removes itself).
    """
    if "torch" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterTorchLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchLoads())


__all__ = ["register_when_torch_loads"]
