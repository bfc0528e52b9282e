"""A collective in a ``tf.compat.v1`` graph as an op that never holds an inter-op thread while it
waits.

Why: a session runs a graph's ops on a fixed pool of inter-op threads (as many as cores by
default, one with ``TF_NUM_INTEROP_THREADS=1``).  A ``tf.numpy_function`` that runs a
collective holds its thread until every rank has submitted the request, and each rank's
scheduler starts independent ops in its own order: with as many collectives ready as threads,
rank 0 waits in A and B for requests that rank 1 never submits because its threads wait in C
and D, and nothing moves.  Chaining the collectives with control dependencies in build order
would fix the order, but a control dependency also makes a fetch run everything it depends on:
``session.run(broadcast_op)`` would then run the training step's allreduce built before it,
needing its feeds or consuming a batch of its input pipeline.

So a collective is built as ``TensorDataset(key, inputs) -> MapDataset(f) ->
DatasetToSingleElement``.  ``DatasetToSingleElement`` is an asynchronous kernel that computes
on an unbounded thread pool of its own, and with ``use_inter_op_parallelism=False`` the map
function ``f`` runs inline on that thread: ``f`` is a ``numpy_function`` that looks the
collective up by ``key`` and runs it (submit, then wait).  Every collective a session runs
then waits on a thread of its own, every rank submits every request whatever the scheduler's
order, and the engine matches them by the names fixed when the graph was built.  The session
runs exactly what the fetches need, as with any other op.

``f`` depends only on the dtypes, so one traced function serves every collective of that
signature.  Measured (2-core machine, allreduces of 1,024 floats per ``session.run``, median
step): 50 per step at 2 ranks with 64 inter-op threads (where blocking ops do not deadlock)
~60 ms against 71-94 ms for one blocking ``numpy_function`` each, as all requests are in flight
together and the engine fuses them; 1 per step 0.8 ms against 0.9 ms.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

_lock = threading.Lock()
_keys = itertools.count(1)
# key -> the collective's numpy function; an entry lives as long as the graph that holds it.
_calls: dict[int, Callable[..., list[np.ndarray]]] = {}
# (input dtypes, output dtypes) -> the map function that dispatches on the key.
_map_fns: dict[tuple[tuple[tf.DType, ...], tuple[tf.DType, ...]], Any] = {}


def _dispatch(key: Any, *arrays: Any) -> list[np.ndarray]:
    return _calls[int(key)](*arrays)


def _map_fn(in_dtypes: tuple[tf.DType, ...], out_dtypes: tuple[tf.DType, ...]) -> Any:
    signature = (in_dtypes, out_dtypes)
    with _lock:
        fn = _map_fns.get(signature)
        if fn is None:
            def body(key: tf.Tensor, *xs: tf.Tensor) -> Any:
                return tf.numpy_function(_dispatch, [key, *xs], list(out_dtypes),
                                         stateful=True, name="mpitrain_collective")

            specs = [tf.TensorSpec([], tf.int64)] + [tf.TensorSpec(None, d) for d in in_dtypes]
            fn = tf.function(body, autograph=False).get_concrete_function(*specs)
            _map_fns[signature] = fn
    return fn


def run(call: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
        touts: Sequence[tf.DType], what: str) -> list[tf.Tensor]:
    """Build ``call`` (numpy arrays in, a list of numpy arrays out) into the current graph.

    Returns the outputs' tensors (shapes unknown; the caller sets them).
    """
    # The outermost graph owns the entry: a tf.cond or tf.while_loop body's own graph may be
    # collected once built, while the session still runs the function made from it.
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    key = next(_keys)
    _calls[key] = call
    weakref.finalize(graph, _calls.pop, key, None)
    in_dtypes = tuple(t.dtype for t in inputs)
    out_dtypes = tuple(touts)
    with tf.name_scope(f"mpitrain_{what}"):
        components = [tf.constant(key, tf.int64), *inputs]
        dataset = tf.raw_ops.TensorDataset(components=components,
                                           output_shapes=[c.shape for c in components])
        dataset = tf.raw_ops.MapDataset(
            input_dataset=dataset, other_arguments=[], f=_map_fn(in_dtypes, out_dtypes),
            output_types=list(out_dtypes), output_shapes=[None] * len(out_dtypes),
            use_inter_op_parallelism=False, preserve_cardinality=True)
        outputs = tf.raw_ops.DatasetToSingleElement(
            dataset=dataset, output_types=list(out_dtypes),
            output_shapes=[None] * len(out_dtypes))
    return list(outputs)
