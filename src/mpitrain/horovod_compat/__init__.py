"""Run a Horovod script unchanged: ``import horovod.torch as hvd`` resolves to mpitrain.

Two ways to ask for it (mpitrain never installs a top-level ``horovod`` package, so without
asking nothing shadows a real Horovod):

    mpitrainrun --horovod-compat -np 4 python train.py           # the launcher's flag
    mpirun -np 4 python -m mpitrain.horovod_compat train.py        # any launcher

Both put :data:`SHIM_PATH` first on the ranks' module path; the ``horovod`` package there
(``shim/horovod/__init__.py``) maps every ``horovod.*`` module its table knows to mpitrain's
(the same module objects, not copies).  When a real Horovod is installed, both say that this
run uses mpitrain in its place.  This module stays light (no torch, numba or MPI): the
launcher imports it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# The directory holding the ``horovod`` stand-in package.
SHIM_PATH = str(Path(__file__).resolve().parent / "shim")


def real_horovod() -> str | None:
    """Where a real Horovod is installed (its package directory), or None.

    Looked up before the stand-in is on the path; the stand-in itself is never reported.
    """
    spec = importlib.util.find_spec("horovod")
    if spec is None or spec.origin is None:
        return None
    where = str(Path(spec.origin).resolve().parent)
    return None if where.startswith(SHIM_PATH) else where


def shadowing_note(horovod_dir: str) -> str:
    return (f"mpitrain: a real Horovod is installed at {horovod_dir}; this run uses mpitrain in "
            "its place, as the Horovod compatibility route asked")


def with_shim_first(pythonpath: str | None) -> str:
    """A ``PYTHONPATH`` value with the stand-in first (and not twice)."""
    parts = [p for p in (pythonpath or "").split(os.pathsep) if p and p != SHIM_PATH]
    return os.pathsep.join([SHIM_PATH, *parts])
