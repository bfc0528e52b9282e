"""Every mpitrain.tensorflow collective and its gradient, eagerly, in tf.function and in v1 graphs.

(Also the ops built on them that need several ranks to test: rank_op and friends, and
SyncBatchNormalization against Keras' BatchNormalization over the union of the ranks' batches.)

Graphs hold 1, 10 and 50 collectives (forward and gradient ops of every kind, mixed) and every
result is compared with a numpy reference computed from all ranks' inputs.  Nothing here may
hang, whatever TensorFlow's thread counts:

* each rank runs TensorFlow's runtime with different inter-op threads (``TF_NUM_INTEROP_THREADS``
  = 1 on rank 0, 2 on rank 1, unset on rank 2), so the ranks' schedulers differ;
* every v1 graph runs in sessions with 1 and 2 inter-op threads of their own and with the
  default, and the inputs of its collectives pass through rank-dependent delays, so each rank's
  session starts a different collective first;
* a watchdog thread (faulthandler's, which runs while the main thread is inside TensorFlow's
  C++, where a signal-based timeout never fires) dumps every stack and ends the rank if a test
  runs past its deadline; the job then fails instead of blocking CI.

Gradients follow Horovod 0.28.1's TensorFlow ops: see mpitrain/tensorflow/_support.py.
"""

import faulthandler
import os
import sys
import time

from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
_THREADS = {0: "1", 1: "2"}  # rank 2 keeps TensorFlow's default
if RANK in _THREADS:
    os.environ["TF_NUM_INTEROP_THREADS"] = _THREADS[RANK]
else:
    os.environ.pop("TF_NUM_INTEROP_THREADS", None)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

try:
    import keras
    import tensorflow as tf
    from tf_cases import KINDS, case, cases

    import mpitrain.tensorflow as htf
except ModuleNotFoundError:  # collected and skipped (a module skip would collect nothing)
    keras = tf = htf = None
    KINDS = 9  # as in tf_cases, so that collection works without TensorFlow

pytestmark = pytest.mark.skipif(tf is None, reason="needs pip install 'mpitrain[tensorflow]'")
# Three ranks, three TensorFlow schedulers (see above): the strongest test of ordering, and
# the suite is heavy (TensorFlow starts on every rank), so it runs at this size only; two
# ranks run TensorFlow in test_tensorflow.py.
MPI_CONFIGS = ("np3",)
WATCHDOG_S = 100.0
SESSION_THREADS = (1, 2, 0)  # 0: the default pool


def _watchdog_file():
    """Where a dump goes: pytest captures stderr into a file that dies with the process, so
    into the job's log directory (the driver shows every ``*.log`` there on failure)."""
    logdir = os.environ.get("MPITRAIN_TEST_LOGDIR")
    if not logdir:
        return sys.__stderr__
    return open(os.path.join(logdir, f"{RANK}.watchdog.log"), "a")  # noqa: SIM115


@pytest.fixture(scope="module")
def _watchdog_out():
    out = _watchdog_file()
    yield out
    if out is not sys.__stderr__:
        out.close()


@pytest.fixture(autouse=True)
def _watchdog(hvd, _watchdog_out):
    htf.init()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=_watchdog_out)
    yield
    faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------------- modes
def _build(cs, inputs):
    return [c.build(xs) for c, xs in zip(cs, inputs)]


def _grads(cs, inputs, outs, gradient):
    """Each case's input gradients for its upstream; ``gradient(ys, xs, upstream)``."""
    grads = []
    for c, xs, ys in zip(cs, inputs, outs):
        if c.upstream is None:
            grads.append(None)
            continue
        pairs = [(y, tf.constant(u)) for y, u in zip(ys, c.upstream) if u is not None]
        grads.append(gradient([y for y, _ in pairs], xs, [u for _, u in pairs]))
    return grads


def _on_tape(cs, inputs):
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(inputs)
        outs = _build(cs, inputs)
    return outs, _grads(cs, inputs, outs,
                        lambda ys, xs, us: tape.gradient(ys, xs, output_gradients=us))


def run_eager(cs):
    outs, grads = _on_tape(cs, [[tf.constant(x) for x in c.inputs] for c in cs])
    return _numpy(outs), _numpy(grads)


def run_function(cs):
    outs, grads = tf.function(lambda inputs: _on_tape(cs, inputs))(
        [[tf.constant(x) for x in c.inputs] for c in cs])
    return _numpy(outs), _numpy(grads)


def run_function_taped_outside(cs):
    """The forward pass is a tf.function, its gradient is taken outside it: TensorFlow then
    builds a backward function without automatic control dependencies (one call for all)."""
    inputs = [[tf.constant(x) for x in c.inputs] for c in cs]
    forward = tf.function(lambda inputs: _build(cs, inputs))
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        outs = forward(inputs)
    wanted = [(k, i) for k, c in enumerate(cs) if c.upstream is not None
              for i, u in enumerate(c.upstream) if u is not None]
    sources = [k for k, c in enumerate(cs) if c.upstream is not None]
    flat = tape.gradient([outs[k][i] for k, i in wanted], [inputs[k] for k in sources],
                         output_gradients=[tf.constant(cs[k].upstream[i]) for k, i in wanted])
    grads = [None] * len(cs)
    for k, g in zip(sources, flat):
        grads[k] = g
    return _numpy(outs), _numpy(grads)


def _delayed(x, k):
    """``x``, after a rank-dependent pause: each rank's session starts different ops first."""
    pause = 0.004 * ((k + RANK * 7) % 5)

    def wait(a):
        time.sleep(pause)
        return a

    out = tf.numpy_function(wait, [x], x.dtype, stateful=True)
    out.set_shape(x.shape)
    return out


def run_v1(cs, threads):
    """Build the graph once, then evaluate it in one session.run per session thread count."""
    with tf.Graph().as_default():
        inputs = [[_delayed(tf.constant(x), k) for x in c.inputs] for k, c in enumerate(cs)]
        outs = _build(cs, inputs)
        grads = _grads(cs, inputs, outs, lambda ys, xs, us: tf.gradients(ys, xs, grad_ys=us))
        results = []
        for n in threads:
            config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=n,
                                              use_per_session_threads=n > 0)
            with tf.compat.v1.Session(config=config) as sess:
                results.append(sess.run([outs, [g or [] for g in grads]]))
    return [(got_outs, [g or None for g in got_grads]) for got_outs, got_grads in results]


def _numpy(nested):
    return [None if x is None else [np.asarray(t) for t in x] for x in nested]


def check(cs, outs, grads):
    for k, (c, got, got_grads) in enumerate(zip(cs, outs, grads)):
        for i, (g, w) in enumerate(zip(got, c.want)):
            assert np.asarray(g).dtype == np.asarray(w).dtype, (k, i, g, w)
            np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"case {k} output {i}")
        if c.want_grads is not None:
            for i, (g, w) in enumerate(zip(got_grads, c.want_grads)):
                np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"case {k} grad {i}")


# ------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", range(KINDS))
def test_one_collective_in_each_mode(kind):
    cs = [case(kind, kind + KINDS)]  # the second variant: the first is in the mixed graphs
    check(cs, *run_eager(cs))
    check(cs, *run_function(cs))
    for outs, grads in run_v1(cs, SESSION_THREADS):
        check(cs, outs, grads)


@pytest.mark.parametrize("n", [10, 50])
@pytest.mark.parametrize("mode", ["eager", "function", "function_taped_outside", "v1"])
def test_many_collectives_in_one_graph(mode, n):
    cs = cases(n)
    if mode == "eager":
        check(cs, *run_eager(cs))
    elif mode == "function":
        check(cs, *run_function(cs))
    elif mode == "function_taped_outside":
        check(cs, *run_function_taped_outside(cs))
    else:
        for outs, grads in run_v1(cs, SESSION_THREADS):
            check(cs, outs, grads)


def test_a_fetch_runs_only_the_collectives_it_needs():
    """Fetching a collective built after others needs none of their feeds and runs none of them
    (the BroadcastGlobalVariablesHook pattern: the broadcast is built after the training step)."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None])
        step = htf.allreduce(x, op=htf.Sum)
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([float(RANK)] * 3))
        bcast = htf.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)  # x is not fed: the allreduce must not run
            np.testing.assert_array_equal(sess.run(v), [0.0] * 3)
            got = sess.run(step, {x: np.full(2, RANK + 1, np.float32)})
            np.testing.assert_allclose(got, [SIZE * (SIZE + 1) / 2] * 2)


def test_collectives_inside_v1_cond_and_while_loop():
    """Control-flow bodies are functions inside the v1 graph: their collectives are named in
    the outer graph and wait on their own threads too."""
    with tf.Graph().as_default():
        take = tf.compat.v1.placeholder(tf.bool, [])
        x = tf.fill([3], float(RANK + 1))
        chosen = tf.cond(take, lambda: htf.allreduce(x, op=htf.Sum), lambda: x * 0)
        _, looped = tf.while_loop(lambda i, v: i < 3,
                                  lambda i, v: (i + 1, htf.allreduce(v, op=htf.Sum)),
                                  [tf.constant(0), x])
        other = htf.allgather(x)
        with tf.compat.v1.Session() as sess:
            for flag in (True, False, True):
                got, again, gathered = sess.run([chosen, looped, other], {take: flag})
                total = SIZE * (SIZE + 1) / 2
                np.testing.assert_allclose(got, [total] * 3 if flag else [0.0] * 3)
                # each pass sums over ranks: pass 1 gives total, then SIZE x that, twice
                np.testing.assert_allclose(again, [total * SIZE ** 2] * 3)
                assert gathered.shape == (3 * SIZE,)


@pytest.mark.parametrize("mode", ["eager", "function", "v1"])
def test_rank_and_size_ops(mode):
    def build():
        return [htf.rank_op(), htf.local_rank_op(), htf.size_op(), htf.local_size_op(),
                htf.process_set_included_op(), htf.process_set_included_op(12345)]

    want = [RANK, htf.local_rank(), SIZE, htf.local_size(), 1, -3]
    if mode == "eager":
        got = [int(t) for t in build()]
    elif mode == "function":
        got = [int(t) for t in tf.function(build)()]
    else:
        with tf.Graph().as_default():
            ops = build()
            assert all(t.dtype == tf.int32 and t.shape == () for t in ops)
            with tf.compat.v1.Session() as sess:
                got = [int(t) for t in sess.run(ops)]
    assert got == want


def test_bad_input_is_refused_when_called():
    with pytest.raises(ValueError, match="one per rank"):
        htf.alltoall(tf.ones([SIZE, 2]), splits=[1] * (SIZE + 1))
    with pytest.raises(ValueError, match="non-negative"):
        htf.alltoall(tf.ones([SIZE, 2]), splits=[-1] + [1] * (SIZE - 1))
    with pytest.raises(TypeError, match="integers"):
        htf.alltoall(tf.ones([SIZE, 2]), splits=[0.5] * SIZE)
    with pytest.raises(ValueError, match="scalar"):
        htf.alltoall(tf.constant(1.0))
    with pytest.raises(ValueError, match="scalar"):
        htf.reducescatter(tf.constant(1.0))
    with pytest.raises(TypeError, match="list or tuple"):
        htf.grouped_allgather(tf.ones([2]))
    with pytest.raises(NotImplementedError, match="Sum and Average"):  # Horovod's class
        htf.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2])),
                      op=htf.Max)
    with pytest.raises(TypeError, match="process_set_id"):
        htf.size_op("0")
    with pytest.raises(ValueError, match="fused"):
        htf.SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="synchronized"):
        htf.SyncBatchNormalization(synchronized=True)
    with pytest.raises(ValueError, match="comm_scope|scope"):
        htf.SyncBatchNormalization(comm_scope="galaxy")


# ------------------------------------------------------------------ SyncBatchNormalization
def _bn_data(q, rows):
    rng = np.random.default_rng(100 + q)
    x = (rng.normal(size=(rows, 3, 4)) * (q + 1) + 2 * q).astype(np.float32)
    w = rng.normal(size=(rows, 3, 4)).astype(np.float32)
    return x, w


def _bn_step(layer, x, w, compiled):
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * w)
        return [layer(x, training=False)] + tape.gradient(loss, [x, layer.gamma, layer.beta])

    run = tf.function(step) if compiled else step
    return [t.numpy() for t in run(tf.constant(x), tf.constant(w))]


def _bn_layers(sync_kwargs):
    made = []
    for layer in (htf.SyncBatchNormalization(momentum=0.5, epsilon=1e-3, **sync_kwargs),
                  keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-3)):
        layer.build((None, 3, 4))
        layer.gamma.assign(np.linspace(0.5, 2.0, 4).astype(np.float32))
        layer.beta.assign(np.linspace(-1.0, 1.0, 4).astype(np.float32))
        made.append(layer)
    return made


def _check_against_union(members, sync_kwargs, compiled):
    """SyncBatchNormalization over ``members`` (uneven batches, one empty) equals Keras'
    BatchNormalization over the union of their batches."""
    rows = {q: (0 if q == 1 and len(members) > 1 else 2 + q) for q in members}
    data = {q: _bn_data(q, rows[q]) for q in members}
    sync, ref = _bn_layers(sync_kwargs)
    y, gx, ggamma, gbeta = _bn_step(sync, *data[RANK], compiled)
    union = [np.concatenate([data[q][i] for q in members]) for i in range(2)]
    ref_y, ref_gx, ref_ggamma, ref_gbeta = _bn_step(ref, *union, compiled=False)
    lo = sum(rows[q] for q in members if q < RANK)
    mine = slice(lo, lo + rows[RANK])
    np.testing.assert_allclose(y, ref_y[mine], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gx, ref_gx[mine], rtol=1e-4, atol=1e-4)
    for got, want in ((sync.moving_mean, ref.moving_mean),
                      (sync.moving_variance, ref.moving_variance)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    # gamma's and beta's gradients stay local: their sum over the members is the reference's.
    parts = WORLD.allgather((ggamma, gbeta))
    np.testing.assert_allclose(sum(parts[q][0] for q in members), ref_ggamma, rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(sum(parts[q][1] for q in members), ref_gbeta, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "function"])
def test_sync_batch_norm_equals_batch_norm_over_every_rank(compiled):
    _check_against_union(list(range(SIZE)), {}, compiled)


def test_sync_batch_norm_over_a_process_set():
    first = htf.add_process_set(list(range(SIZE - 1)))
    last = htf.add_process_set([SIZE - 1])
    try:
        mine = last if RANK == SIZE - 1 else first
        _check_against_union(mine.ranks, {"comm_scope": mine}, compiled=True)
    finally:
        htf.remove_process_set(last)
        htf.remove_process_set(first)


def test_sync_batch_norm_in_keras_fit_keeps_one_set_of_statistics():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6),
                              htf.SyncBatchNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer=htf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=False)
    rng = np.random.default_rng(RANK)  # every rank sees different data
    x = (rng.normal(size=(32, 8)) + RANK).astype(np.float32)
    y = rng.normal(size=(32, 3)).astype(np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[htf.keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    bn = model.layers[1]
    stats = [bn.moving_mean.numpy(), bn.moving_variance.numpy()]
    theirs = WORLD.bcast(stats, root=0)
    assert all(np.allclose(a, b, rtol=1e-6) for a, b in zip(stats, theirs))
    assert not np.allclose(stats[0], 0.0)  # the statistics did move
