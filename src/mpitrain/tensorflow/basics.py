"""What every TensorFlow face (``mpitrain.tensorflow``, ``.tensorflow.keras``, ``mpitrain.keras``)
exports alike: ``init`` (mpitrain's, plus TensorFlow's share of the CPU cores), ``shutdown``,
the global process set and Horovod's rank and build queries.

Each face takes these with ``from .basics import *`` and lists ``basics.__all__`` in its own
``__all__``, so a query added here reaches all three faces and they cannot drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import session
from ..core import runtime
from ..core.process_sets import ProcessSet, global_process_set
from ..core.runtime import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from ..session import shutdown


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialise mpitrain (see :func:`mpitrain.init`; collective over ``comm``).

    Where mpitrain gives each rank a share of the cores (no ``OMP_NUM_THREADS`` set), TensorFlow
    gets the same share for its intra-op pool, so ranks on one machine do not oversubscribe
    it.  That is only possible before TensorFlow runs its first op; later it is left alone.
    """
    session.init(comm, process_sets)
    threads = runtime.state().cpu_threads
    if threads:
        # Once TensorFlow has run an op its pools are fixed (RuntimeError): leave them be.
        with contextlib.suppress(RuntimeError):
            tf.config.threading.set_intra_op_parallelism_threads(threads)


__all__ = [
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
]
