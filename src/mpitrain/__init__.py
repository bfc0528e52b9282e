"""mpitrain: MPI-native data-parallel training with Horovod's API.

    import mpitrain as hvd
    hvd.init()
    ...

This package is the Horovod face (``import mpitrain.torch as hvd`` is the same, with torch);
its names are defined in ``face/api.py`` and loaded the first time one is used (PEP 562), so that
``import mpitrain.runner`` -- ``mpitrainrun``, ``mpitrain-hostfile`` -- runs in a fraction of a
second on a login node without torch, numba or MPI.  ``from mpitrain import allreduce``,
``hvd.init()``, ``dir(hvd)`` and ``from mpitrain import *`` all load the face.  The face itself
needs no torch (collectives take numpy arrays too); the torch-only names
(``DistributedOptimizer``, ``broadcast_parameters``, ...) load the torch face on first use, and
without torch installed they raise an ImportError naming the extra to install.

Importing mpitrain does not start MPI; ``init()`` does.  It does set what MPI reads when it
starts (see ``core/_mpi.prepare_environment``), so import mpitrain before mpi4py.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from .core import (
    _mpi,  # noqa: F401 - first: importing it sets what MPI reads when it starts
    departures,
    failure,
)
from .core.version import __version__ as __version__
from .face import torch_adapters

# A rank failing or ending before init() must not leave the others waiting for it.
failure.install_import_time_hooks()
# With a start timeout, no rank waits in MPI_Init for ever for one that never starts MPI.
departures.watch_mpi_start()
# init() tells torch-based libraries the job is distributed (job_env): their env://
# rendezvous must then find mpitrain's, whether torch is loaded yet or not.
departures.when_running(torch_adapters.register_when_torch_loads)

if TYPE_CHECKING:
    from .face.api import *  # noqa: F403 - the names type checkers see; loaded lazily below
    from .face.api import __all__ as __all__


def _load_face() -> None:
    """Import the face and bind its names here, so later lookups never come back."""
    # The face imports numba and the engine: loaded on first use, so `import mpitrain` is light.
    from .face import api as _face

    namespace = globals()
    for name in _face.__all__:
        namespace[name] = getattr(_face, name)
    # A star import asks for every name in __all__: the torch names only where torch is.
    with_torch = importlib.util.find_spec("torch") is not None
    namespace["__all__"] = sorted([*_face.__all__, *(_face.TORCH_NAMES if with_torch else ())])


def _load_torch_name(name: str, module: str) -> Any:
    """Bind ``name`` from the torch face (``mpitrain.torch.<module>``), or say what to install."""
    if importlib.util.find_spec("torch") is None:
        raise ImportError(f"mpitrain.{name} needs PyTorch, which is not installed: "
                          "pip install 'mpitrain[torch]'")
    value = getattr(importlib.import_module(f"{__name__}.torch.{module}"), name)
    globals()[name] = value
    return value


def __getattr__(name: str) -> Any:
    # Dunder probes (copy, pickle, inspect, pytest look for __wrapped__, __path__ ...) must
    # not pay for torch; only __all__ (star import) needs the face.
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'mpitrain' has no attribute {name!r}")
    # A submodule is imported, not the face: ``from . import config`` asks for the attribute
    # before it imports, and must stay light (as must the face's own ``from . import _face``).
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    _load_face()
    if name in globals():
        return globals()[name]
    from .face.api import TORCH_NAMES  # already loaded by _load_face

    if name in TORCH_NAMES:
        return _load_torch_name(name, TORCH_NAMES[name])
    raise AttributeError(f"module 'mpitrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    _load_face()
    return sorted(set(globals()) | set(__all__))
