"""Horovod's rank and build queries, as every face exports them alike.

The hvd face (:mod:`mpitrain.face.api`) and the TensorFlow faces (through
:mod:`mpitrain.tensorflow.basics`) take these with ``from ..core.queries import *`` and list
``queries.__all__`` in their own ``__all__``, so a query added here reaches every face and
their lists cannot drift apart.  The functions live in :mod:`.runtime`; ``is_homogeneous`` is
left to the faces that export it.
"""

from .runtime import (
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

__all__ = [
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "size",
]
