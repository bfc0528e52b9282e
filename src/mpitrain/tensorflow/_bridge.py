"""How TensorFlow tensors reach mpitrain's engine: as numpy eagerly, as graph ops otherwise.

Eagerly a collective is a plain call on the tensors' numpy values.  Inside a graph, one
collective call becomes ops that call the same numpy code when the graph runs; what matters is
that every rank submits the same requests and that no rank waits while holding a thread that
another of its collectives needs:

* ``tf.function`` traced from eager code: one stateful ``tf.numpy_function``.  Automatic control
  dependencies run stateful ops in program order, so collectives run one at a time, in the same
  order on every rank, and unnamed requests are numbered by the engine at run time.  Functions
  that TensorFlow builds without them (the backward function of a ``tf.function`` whose
  gradient is taken outside it) get the same order from control dependencies added here, in
  build order: a function runs all its stateful ops anyway, so the chain adds no work.
* ``tf.compat.v1`` graphs (and ``tf.cond``/``tf.while_loop`` bodies inside them): a session
  runs whatever subset of the graph a fetch needs, in any order, so each op gets a name fixed
  when the graph is built (the same on every rank that builds the same graph) and waits for its
  collective without holding an inter-op thread (see :mod:`._graph_async`), so no thread count
  or scheduling order can deadlock it.

XLA cannot compile a ``numpy_function``; building one under ``jit_compile=True`` is refused with
a message that says what to change.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.errors import CollectiveMismatchError
from . import _graph_async
from .errors import as_tensorflow_error

try:  # a private helper: without it XLA is still refused, by TensorFlow's own error
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover - depends on the TensorFlow build
    GraphOrParentsInXlaContext = None

SUPPORTED_DTYPES = (tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
                    tf.float32, tf.float64, tf.bool)
# Types that collectives which only move data (allgather, broadcast, alltoall) also take, as
# Horovod's do, though the engine has no element type for them: they travel as the bits of a
# type of the same width, which moving leaves intact.
CARRIED_AS = {tf.uint16: tf.int16}
MOVED_DTYPES = SUPPORTED_DTYPES + tuple(CARRIED_AS)

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


def as_tensor(value: Any, what: str, moved_only: bool = False) -> tf.Tensor:
    """``value`` (tensor, variable, numpy array) as a tensor of a dtype mpitrain can handle.

    ``moved_only``: for a collective that only moves data, which also takes the
    :data:`CARRIED_AS` types.

    Raises:
        TypeError: the value cannot be a tensor, or its dtype is not supported.
    """
    if isinstance(value, tf.IndexedSlices):
        raise TypeError(f"{what} is a tf.IndexedSlices; this call takes dense tensors")
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be a tensor, got {type(value).__name__}: {exc}") from None
    supported = MOVED_DTYPES if moved_only else SUPPORTED_DTYPES
    if tensor.dtype not in supported:
        raise TypeError(f"{what} has dtype {tensor.dtype.name}; supported: "
                        f"{sorted(d.name for d in supported)}")
    return tensor


def carried(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor`` as the engine carries it (see :data:`CARRIED_AS`); most are unchanged."""
    carrier = CARRIED_AS.get(tensor.dtype)
    return tensor if carrier is None else tf.bitcast(tensor, carrier)


def restored(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """Undo :func:`carried` on a result that should be of ``dtype``."""
    return tensor if tensor.dtype == dtype else tf.bitcast(tensor, dtype)


def in_v1_graph() -> bool:
    """True while building a ``tf.compat.v1`` graph (or a control-flow body inside one)."""
    return not tf.executing_eagerly() and not tf.compat.v1.executing_eagerly_outside_functions()


def _root_graph() -> Any:
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    return graph


def op_name(base: str, name: str | None) -> str | None:
    """The engine name for a collective built now (see the module docstring).

    Returns:
        ``name`` if given; ``None`` (the engine numbers the request when it runs) eagerly and
        inside functions traced from eager code; in a ``tf.compat.v1`` graph a name unique in
        the outermost graph, fixed now.
    """
    if name is not None:
        return name
    if not in_v1_graph():
        return None
    return "tf." + _root_graph().unique_name(f"mpitrain_{base}")


# A function graph built without automatic control dependencies -> its last collective op.
_last_in_function: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _in_build_order(build: Callable[[], Any]) -> Any:
    """Build an op that runs after the previous collective of this function graph."""
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "_add_control_dependencies", False):
        return build()  # tf.function's automatic control dependencies order it already
    previous = _last_in_function.get(graph)
    with tf.control_dependencies([] if previous is None else [previous]):
        outputs = build()
    first = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    _last_in_function[graph] = first.op
    return outputs


def run(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
        touts: Sequence[tf.DType], shapes: Sequence[Any], what: str) -> list[tf.Tensor]:
    """Run ``fn`` (numpy arrays in, a list of numpy arrays out) on ``inputs``.

    Eagerly ``fn`` runs now; in a graph it becomes ops that run it (see the module docstring)
    whose outputs get ``shapes`` (``tf.TensorShape`` or lists with ``None`` for unknown sizes).
    ``what`` is the operation's name (an identifier: it names the graph op).

    Raises:
        ValueError: the graph is being compiled by XLA.
        mpitrain.tensorflow.errors.FailedPreconditionError: (eagerly) ranks disagree about
            the collective; :class:`.errors.InvalidArgumentError`: (eagerly) ``fn`` found an
            argument invalid (see :mod:`.errors` for what graphs raise).
    """
    def call(*arrays: Any) -> list[np.ndarray]:
        # TensorFlow hands 0-d values over as numpy scalars; the collectives want arrays.
        return [np.asarray(r) for r in fn(*[np.asarray(a, order="C") for a in arrays])]

    if tf.executing_eagerly():
        try:
            results = call(*[t.numpy() for t in inputs])
        except (CollectiveMismatchError, ValueError) as exc:
            converted = as_tensorflow_error(exc)
            if converted is None:
                raise
            raise converted from exc
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, touts)]
    refuse_xla(f"mpitrain.tensorflow.{what}")
    if in_v1_graph():
        outputs = _graph_async.run(call, inputs, touts, what)
    else:
        built = _in_build_order(lambda: tf.numpy_function(
            call, list(inputs), list(touts), stateful=True, name=f"mpitrain_{what}"))
        outputs = list(built) if isinstance(built, (list, tuple)) else [built]
    for out, shape in zip(outputs, shapes):
        out.set_shape(shape)
    return outputs
