"""A stand-in ``horovod`` package: Horovod's module names, mpitrain's modules.

Put on the path by :mod:`mpitrain.horovod_compat` (``mpitrainrun --horovod-compat`` or
``python -m mpitrain.horovod_compat``), never by installing mpitrain.  Importing it installs a
finder that answers every ``horovod.<name>`` import with the mpitrain module of the table below
-- the same object, so ``horovod.torch.DistributedOptimizer is mpitrain.DistributedOptimizer``
and a class never exists twice.  A Horovod module without a counterpart fails to import with a
message that says so.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

import mpitrain

# Horovod's API level this stands in for, and which mpitrain provides it.
__version__ = f"0.28.1+mpitrain.{mpitrain.__version__}"

# Horovod module (or package, with everything below it) -> mpitrain module.
ALIASES = {
    "horovod.torch": "mpitrain.torch",
    "horovod.tensorflow": "mpitrain.tensorflow",
    "horovod.keras": "mpitrain.keras",
    "horovod.mxnet": "mpitrain.mxnet",
    "horovod.common.exceptions": "mpitrain.core.errors",
}
# Used where the first choice does not exist in this mpitrain (a standalone Keras face).
FALLBACKS = {"mpitrain.keras": "mpitrain.tensorflow.keras"}


def target_of(name: str) -> str | None:
    """The mpitrain module that ``horovod.<...>`` ``name`` stands for, or None."""
    for prefix in sorted(ALIASES, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            target = ALIASES[prefix] + name[len(prefix):]
            head = ALIASES[prefix]
            if head in FALLBACKS and importlib.util.find_spec(head) is None:
                target = FALLBACKS[head] + name[len(prefix):]
            return target
    return None


class _SameModule(importlib.abc.Loader):
    """Loads ``horovod.x`` as the already-importable mpitrain module (no second copy)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Nothing to run: the module is complete.  The import system has just set its
        # __spec__ to the horovod name's; give it back its own (reload, pickle, tools use it).
        module.__spec__ = self.own_spec


class _HorovodNames(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        real = target_of(fullname)
        if real is None:
            own = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
            if own is not None:  # a module of the stand-in itself (horovod.common)
                return own
            raise ModuleNotFoundError(
                f"{fullname} has no counterpart in mpitrain's Horovod compatibility route "
                f"(it maps {', '.join(sorted(ALIASES))})", name=fullname)
        return importlib.util.spec_from_loader(fullname, _SameModule(real))


if not any(isinstance(f, _HorovodNames) for f in sys.meta_path):
    sys.meta_path.insert(0, _HorovodNames())
