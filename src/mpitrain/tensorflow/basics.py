"""``mpitrain.tensorflow.init``: mpitrain's init, plus TensorFlow's share of the CPU cores."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .. import runtime, session
from ..process_sets import ProcessSet


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
