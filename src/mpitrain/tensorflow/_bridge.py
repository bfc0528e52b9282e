"""How TensorFlow tensors reach mpitrain's engine: as numpy eagerly, via tf.numpy_function in graphs.

Eagerly a collective is a plain call on the tensors' numpy values.  Inside a graph (a
``tf.function`` or a ``tf.compat.v1`` graph) one collective call becomes one stateful
``tf.numpy_function`` op that calls the same numpy code when the graph runs.

Order across ranks: inside ``tf.function`` TensorFlow runs stateful ops in program order, so
unnamed requests are numbered by the engine at run time, identically on every rank.  A
``tf.compat.v1`` graph has no such ordering; there each op gets a name fixed when the graph is
built (``Graph.unique_name``, the same on every rank that builds the same graph), so the engine
matches requests by name whatever order the session runs them in.  Callers fuse what belongs
to one step into one op (all gradients in one ``grouped_allreduce``).

XLA cannot compile a ``numpy_function``; building one under ``jit_compile=True`` is refused with
a message that says what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

try:  # a private helper: without it XLA is still refused, by TensorFlow's own error
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover - depends on the TensorFlow build
    GraphOrParentsInXlaContext = None

SUPPORTED_DTYPES = (tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
                    tf.float32, tf.float64, tf.bool)

XLA_MESSAGE = ("{what} cannot run inside an XLA-compiled function (jit_compile=True): "
               "mpitrain's collectives run as tf.numpy_function, which XLA cannot compile. "
               "Build the step with jit_compile=False: tf.function(fn, jit_compile=False), or "
               "model.compile(..., jit_compile=False) for Keras (mpitrain's Keras callbacks "
               "set it for you).")


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile."""
    if tf.executing_eagerly() or GraphOrParentsInXlaContext is None:
        return False
    return bool(GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def refuse_xla(what: str) -> None:
    """Raise ValueError when ``what`` is being built into an XLA-compiled function."""
    if in_xla_context():
        raise ValueError(XLA_MESSAGE.format(what=what))


def as_tensor(value: Any, what: str) -> tf.Tensor:
    """``value`` (tensor, variable, numpy array) as a tensor of a dtype mpitrain can move.

    Raises:
        TypeError: the value cannot be a tensor, or its dtype is not supported.
    """
    if isinstance(value, tf.IndexedSlices):
        raise TypeError(f"{what} is a tf.IndexedSlices; this call takes dense tensors")
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be a tensor, got {type(value).__name__}: {exc}") from None
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} has dtype {tensor.dtype.name}; supported: "
                        f"{sorted(d.name for d in SUPPORTED_DTYPES)}")
    return tensor


def op_name(base: str, name: str | None) -> str | None:
    """The engine name for a collective built now (see the module docstring).

    Returns:
        ``name`` if given; ``None`` (the engine numbers the request when it runs) eagerly and
        inside ``tf.function``; a graph-unique name in a ``tf.compat.v1`` graph.
    """
    if name is not None:
        return name
    if tf.executing_eagerly() or tf.inside_function():
        return None
    return "tf." + tf.compat.v1.get_default_graph().unique_name(f"mpitrain_{base}")


def run(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
        touts: Sequence[tf.DType], shapes: Sequence[Any], what: str) -> list[tf.Tensor]:
    """Run ``fn`` (numpy arrays in, a list of numpy arrays out) on ``inputs``.

    Eagerly ``fn`` runs now; in a graph it becomes one stateful ``tf.numpy_function`` whose
    outputs get ``shapes`` (``tf.TensorShape`` or lists with ``None`` for unknown sizes).
    ``what`` is the operation's name (an identifier: it names the graph op).

    Raises:
        ValueError: the graph is being compiled by XLA.
    """
    def call(*arrays: Any) -> list[np.ndarray]:
        # TensorFlow hands 0-d values over as numpy scalars; the collectives want arrays.
        return [np.asarray(r) for r in fn(*[np.asarray(a, order="C") for a in arrays])]

    if tf.executing_eagerly():
        results = call(*[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, touts)]
    refuse_xla(f"mpitrain.tensorflow.{what}")
    outputs = tf.numpy_function(call, list(inputs), list(touts), stateful=True,
                                name=f"mpitrain_{what}")
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    for out, shape in zip(outputs, shapes):
        out.set_shape(shape)
    return outputs
