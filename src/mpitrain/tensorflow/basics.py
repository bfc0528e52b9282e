"""What every TensorFlow face (``mpitrain.tensorflow``, ``.tensorflow.keras``, ``mpitrain.keras``)
exports alike: ``init`` (mpitrain's, plus TensorFlow's share of the CPU cores), ``shutdown``,
the global process set and Horovod's rank and build queries (:mod:`mpitrain.core.queries`,
which the hvd face shares).

Each face takes these with ``from .basics import *`` and lists ``basics.__all__`` in its own
``__all__``, so a name added here reaches all three faces and they cannot drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import session
from ..core import queries, runtime
from ..core.process_sets import ProcessSet, global_process_set
from ..core.queries import *  # noqa: F403 - the rank and build queries: queries.__all__
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
    *queries.__all__,
    "global_process_set",
    "init",
    "shutdown",
]
