"""``import mpitrain.torch as hvd``: the same Horovod face as ``import mpitrain``.

The adapters for PyTorch live in this package's modules; attribute access on the package
forwards to :mod:`mpitrain`, so ``hvd.init()``, ``hvd.DistributedOptimizer`` and the rest work
under either import.

Importing this package registers mpitrain as a torch.distributed backend
(``init_process_group(backend="mpitrain")``, see :mod:`mpitrain.torch.c10d`) and lets
GradScaler wait for DistributedOptimizer's reductions (:mod:`mpitrain.torch.amp`); nothing else
happens at import, and MPI starts only at ``init()``.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401 - fail here, with the remedy, if it is missing
except ImportError as _exc:
    raise ImportError("mpitrain.torch needs PyTorch: pip install 'mpitrain[torch]' (on CPU-only "
                      "machines install torch's CPU build first, see the install guide)") from _exc

import importlib
import importlib.util
from typing import Any

import mpitrain

from .amp import install as _install_amp_support
from .c10d import register as _register_c10d_backend

_register_c10d_backend()
_install_amp_support()


def __getattr__(name: str) -> Any:
    # ``from . import flat_buckets`` inside this package asks for the attribute before it
    # imports the submodule: import it, rather than loading the whole face (a cycle).
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    try:
        value = getattr(mpitrain, name)
    except AttributeError:
        raise AttributeError(f"module 'mpitrain.torch' has no attribute {name!r}") from None
    # Kept here, so that the next ``hvd.allreduce`` is a plain lookup instead of a file-system
    # probe (find_spec above: ~10 us on every call of a training loop).  mpitrain's face
    # never rebinds its names, so the copy cannot go stale.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(mpitrain.__all__) | set(globals()))
