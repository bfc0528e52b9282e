"""mpitrain.tensorflow at 2 ranks: collectives, gradients, training equal to one big batch.

Skipped as a whole when TensorFlow is not installed (``pip install 'mpitrain[tensorflow]'``).
Each rank also trains a plain single-process reference on the union of all ranks' batches
(no mpitrain involved) and the distributed weights must match it.
"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain import Compression

try:
    import keras
    import tensorflow as tf

    import mpitrain.tensorflow as htf
    from mpitrain.tensorflow.keras import callbacks as hcb
except ModuleNotFoundError:  # collected and skipped (a module skip would collect nothing)
    keras = tf = htf = hcb = None

pytestmark = pytest.mark.skipif(tf is None, reason="needs pip install 'mpitrain[tensorflow]'")
MPI_CONFIGS = ("np2",)
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture(autouse=True)
def _init(hvd):
    htf.init()
    keras.backend.clear_session()


def digits(n):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:n] / 16.0).astype(np.float32), y[:n].astype(np.int64)


def mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(10)])


def same_on_all_ranks(arrays):
    """Every rank's arrays, bit for bit equal to rank 0's."""
    theirs = WORLD.bcast([np.asarray(a) for a in arrays], root=0)
    return all(np.array_equal(np.asarray(a), b) for a, b in zip(arrays, theirs))


# ----------------------------------------------------------------------------- collectives
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_collectives(mode):
    def run():
        x = tf.fill([3, 2], float(RANK + 1))
        total = htf.allreduce(x, op=htf.Sum)
        mean = htf.allreduce(x)
        scalar = htf.allreduce(tf.constant(RANK, tf.int64), op=htf.Max)
        a, b = htf.grouped_allreduce([x, tf.ones([4], tf.bfloat16)], op=htf.Sum)
        rows = htf.allgather(tf.fill([RANK + 1, 2], RANK))
        root = htf.broadcast(tf.fill([2], float(RANK + 5)), root_rank=SIZE - 1)
        return total, mean, scalar, a, b, rows, root

    total, mean, scalar, a, b, rows, root = run() if mode == "eager" else tf.function(run)()
    want = sum(range(1, SIZE + 1))
    np.testing.assert_allclose(total.numpy(), np.full([3, 2], want))
    np.testing.assert_allclose(mean.numpy(), np.full([3, 2], want / SIZE))
    assert scalar.shape == () and int(scalar) == SIZE - 1
    np.testing.assert_allclose(a.numpy(), total.numpy())
    assert b.dtype == tf.bfloat16 and np.all(b.numpy().astype(np.float32) == SIZE)
    assert rows.shape == (SIZE * (SIZE + 1) // 2, 2)
    np.testing.assert_array_equal(rows.numpy()[:, 0], np.repeat(np.arange(SIZE),
                                                                np.arange(1, SIZE + 1)))
    np.testing.assert_allclose(root.numpy(), [SIZE + 4] * 2)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_adasum_allreduce(mode):
    from mpitrain import Adasum
    from mpitrain.ops import reference

    def data(r):
        return np.random.default_rng(r).normal(size=(5, 3)).astype(np.float32)

    def run():
        return htf.allreduce(tf.constant(data(RANK)), op=Adasum, name=f"tf.adasum.{mode}")

    got = run() if mode == "eager" else tf.function(run)()
    want = reference.adasum([[data(r)] for r in range(SIZE)], "float32")[0]
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_collectives_in_a_compat_v1_graph():
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None])
        # Two independent ops: the session may run them in any order on each rank; their
        # build-time names keep them matched.
        s = htf.allreduce(x, op=htf.Sum)
        g = htf.allgather(x * 2)
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([float(RANK)] * 3))
        bcast = htf.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(3):
                got_s, got_g = sess.run([s, g], {x: np.full(2, RANK + 1, np.float32)})
                np.testing.assert_allclose(got_s, [SIZE * (SIZE + 1) / 2] * 2)
                assert got_g.shape == (2 * SIZE,)
            sess.run(bcast)
            np.testing.assert_array_equal(sess.run(v), [0.0] * 3)


def test_gradients_of_collectives():
    x = tf.Variable(tf.fill([2, 3], float(RANK + 1)))
    with tf.GradientTape(persistent=True) as tape:
        reduced = tf.reduce_sum(htf.allreduce(x, op=htf.Sum) * 2.0)
        gathered = tf.reduce_sum(htf.allgather(x) * tf.cast(tf.range(2 * SIZE)[:, None],
                                                            tf.float32))
        bcast = tf.reduce_sum(htf.broadcast(x, root_rank=0) * 3.0)
    # d/dx of sum(allreduce_sum(x) * 2) is allreduce_sum(2) = 2 * size.
    np.testing.assert_allclose(tape.gradient(reduced, x).numpy(), np.full([2, 3], 2.0 * SIZE))
    # allgather: averaged upstream rows of this rank; the upstream is the same everywhere.
    np.testing.assert_allclose(tape.gradient(gathered, x).numpy(),
                               np.repeat([[2 * RANK], [2 * RANK + 1]], 3, axis=1))
    want = np.full([2, 3], 3.0) if RANK == 0 else np.zeros([2, 3])
    np.testing.assert_allclose(tape.gradient(bcast, x).numpy(), want)


def test_xla_is_refused_with_a_clear_message():
    @tf.function(jit_compile=True)
    def step(x):
        return htf.allreduce(x)

    with pytest.raises(ValueError, match="jit_compile=False"):
        step(tf.ones([2]))


def test_bad_input():
    with pytest.raises(TypeError, match="tf.GradientTape"):
        htf.DistributedGradientTape(object())
    with pytest.raises(ValueError, match="Average or op=Sum"):
        htf.DistributedGradientTape(tf.GradientTape(), op=htf.Max)
    with pytest.raises(ValueError, match="predivide"):
        htf.DistributedGradientTape(tf.GradientTape(), op=htf.Sum, gradient_predivide_factor=2)
    with pytest.raises(TypeError, match="complex64"):
        htf.allreduce(tf.zeros([2], tf.complex64))
    with pytest.raises(ValueError, match="root_rank"):
        htf.broadcast(tf.zeros([2]), root_rank=SIZE)
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        htf.DistributedOptimizer("sgd")
    tape = htf.DistributedGradientTape(tf.GradientTape())
    with pytest.raises(ValueError, match="already"):
        htf.DistributedGradientTape(tape)
    # Horovod's local aggregation: one pass per update is accepted, several point to Keras'.
    htf.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=1,
                             average_aggregated_gradients=True, num_groups=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        htf.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)


# ------------------------------------------------------------------- training: custom loop
def _reference_loop(x, y, seed, steps, batch, lr):
    """One process, the global batch: what the distributed run must reproduce."""
    model = mlp(seed)
    opt = keras.optimizers.SGD(lr, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for i in range(steps):
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables]


def _distributed_loop(x, y, seed, steps, batch, lr, **tape_args):
    model = mlp(seed)
    opt = keras.optimizers.SGD(lr, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        tape = htf.DistributedGradientTape(tape, **tape_args)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            htf.broadcast_variables(model.variables, root_rank=0)
            htf.broadcast_variables(opt.variables, root_rank=0)

    mine = batch // SIZE
    for i in range(steps):
        lo = i * batch + RANK * mine  # this rank's slice of the global batch i
        step(x[lo:lo + mine], y[lo:lo + mine], i == 0)
    return [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("tape_args", [{}, {"gradient_predivide_factor": float(SIZE)},
                                       {"compression": Compression.fp16}],
                         ids=["plain", "predivide", "fp16"])
def test_custom_loop_equals_single_process_large_batch(tape_args):
    x, y = digits(640)
    want = _reference_loop(x, y, seed=3, steps=10, batch=64, lr=0.1)
    got = _distributed_loop(x, y, seed=3, steps=10, batch=64, lr=0.1, **tape_args)
    tol = 2e-3 if "compression" in tape_args else 1e-5
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    assert same_on_all_ranks(got)


def test_custom_loop_ranks_end_identical_from_different_inits():
    x, y = digits(640)
    got = _distributed_loop(x, y, seed=100 + RANK, steps=6, batch=64, lr=0.1)
    assert same_on_all_ranks(got)


def test_sparse_gradients_gathered_equal_dense():
    def train(sparse_as_dense):
        keras.utils.set_random_seed(7)
        emb = keras.layers.Embedding(20, 4)
        emb.build((None,))
        opt = keras.optimizers.SGD(0.5)
        ids = tf.constant([[RANK, RANK + 3, 5]])
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(emb(ids) ** 2)
            tape = htf.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
            (grad,) = tape.gradient(loss, emb.trainable_variables)
            assert isinstance(grad, tf.IndexedSlices) != sparse_as_dense
            opt.apply_gradients([(grad, emb.embeddings)])
        return emb.embeddings.numpy()

    np.testing.assert_allclose(train(False), train(True), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------- training: Keras
def _keras_reference(x, y, seed, epochs, batch, lr):
    model = mlp(seed)
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return [v.numpy() for v in model.trainable_variables]


def _keras_distributed(x, y, seed, epochs, batch, lr, jit_compile=False, callbacks=None):
    model = mlp(seed)
    opt = htf.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9))
    model.compile(optimizer=opt, jit_compile=jit_compile,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    mine = batch // SIZE
    # Global batch i is rank 0's batch i, then rank 1's, ...: one block of rows per rank.
    rows = np.concatenate([np.arange(i * batch + RANK * mine, i * batch + (RANK + 1) * mine)
                           for i in range(len(x) // batch)])
    cbs = [hcb.BroadcastGlobalVariablesCallback(0)] if callbacks is None else callbacks
    model.fit(x[rows], y[rows], batch_size=mine, epochs=epochs, shuffle=False, verbose=0,
              callbacks=cbs)
    return model, [v.numpy() for v in model.trainable_variables]


def test_keras_fit_equals_single_process_large_batch():
    x, y = digits(512)
    want = _keras_reference(x, y, seed=5, epochs=2, batch=64, lr=0.1)
    _, got = _keras_distributed(x, y, seed=5, epochs=2, batch=64, lr=0.1)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert same_on_all_ranks(got)


def test_keras_fit_ranks_end_identical_from_different_inits():
    x, y = digits(256)
    _, got = _keras_distributed(x, y, seed=50 + RANK, epochs=1, batch=32, lr=0.1)
    assert same_on_all_ranks(got)


def test_keras_xla_is_turned_off_by_the_callbacks_and_refused_without_them():
    x, y = digits(128)
    with pytest.warns(UserWarning, match="jit_compile=False"):
        model, _ = _keras_distributed(x, y, seed=1, epochs=1, batch=32, lr=0.1,
                                      jit_compile=True)
    assert model.jit_compile is False
    with pytest.raises(ValueError, match="jit_compile=False"):
        _keras_distributed(x, y, seed=1, epochs=1, batch=32, lr=0.1, jit_compile=True,
                           callbacks=[])


def test_broadcast_callback_waits_for_a_model_built_by_its_first_batch():
    """A Sequential without an Input has no weights when training begins (Horovod's keras
    mnist example): the state goes out after the first batch, and the ranks end identical."""
    keras.utils.set_random_seed(70 + RANK)
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=htf.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    x, y = digits(64)
    model.fit(x[RANK::SIZE], y[RANK::SIZE], batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[hcb.BroadcastGlobalVariablesCallback(0)])
    assert same_on_all_ranks([v.numpy() for v in model.variables])
    assert same_on_all_ranks([np.asarray(v) for v in model.optimizer.variables])


def test_metric_average_callback():
    cb = hcb.MetricAverageCallback()
    logs = {"loss": float(RANK), "accuracy": 2.0 * RANK}
    cb.on_epoch_end(0, logs)
    assert logs == pytest.approx({"loss": (SIZE - 1) / 2, "accuracy": float(SIZE - 1)})


def test_warmup_and_schedule_callbacks():
    class LrRecorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.lrs = []

        def on_train_batch_begin(self, batch, logs=None):
            self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    x, y = digits(128)
    recorder = LrRecorder()
    warmup = hcb.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    schedule = hcb.LearningRateScheduleCallback(0.4, multiplier=0.5, start_epoch=3)
    # Horovod's attribute names, which its users' subclasses read.
    assert (schedule.start_epoch, schedule.end_epoch, schedule.staircase,
            schedule.momentum_correction, schedule.multiplier(7)) == (3, None, True, True, 0.5)
    with pytest.raises(AttributeError, match="no_such"):
        schedule.no_such  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _keras_distributed(x, y, seed=1, epochs=4, batch=32 * SIZE, lr=0.4,
                           callbacks=[warmup, schedule, recorder])
    steps = 128 // (32 * SIZE)
    ramp = [0.4 / SIZE * ((b / steps) * (SIZE - 1) / 2 + 1) for b in range(2 * steps)]
    want = ramp + [0.4] * steps + [0.2] * steps
    np.testing.assert_allclose(recorder.lrs, want, rtol=1e-6)


def test_momentum_correction_scales_sgd_velocity():
    model = mlp(0)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    for m in opt.momentums:
        m.assign(tf.ones_like(m))
    model.compile(optimizer=opt, jit_compile=False, loss="mse")
    cb = hcb.LearningRateScheduleCallback(0.1, multiplier=0.5)
    cb.set_model(model)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    assert float(np.asarray(opt.learning_rate)) == pytest.approx(0.05)
    assert all(np.allclose(m.numpy(), 0.5) for m in opt.momentums)


# ----------------------------------------------------------------- training: tf.compat.v1
def test_compat_v1_optimizer_and_hook_equal_single_process(tmp_path):
    x, y = digits(256)
    batch, steps = 64, 4

    def build(seed, distributed):
        xs = tf.compat.v1.placeholder(tf.float32, [None, 64])
        ys = tf.compat.v1.placeholder(tf.int64, [None])
        w = tf.compat.v1.get_variable(
            "w", [64, 10], initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=ys, logits=tf.matmul(xs, w)))
        opt = tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9)
        if distributed:
            opt = htf.DistributedOptimizer(opt)
        step = tf.compat.v1.train.get_or_create_global_step()
        return xs, ys, w, opt.minimize(loss, global_step=step)

    with tf.Graph().as_default():
        xs, ys, w, train = build(11, False)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for i in range(steps):
                sess.run(train, {xs: x[i * batch:(i + 1) * batch],
                                 ys: y[i * batch:(i + 1) * batch]})
            want = sess.run(w)

    mine = batch // SIZE
    with tf.Graph().as_default():
        xs, ys, w, train = build(11 + 13 * RANK, True)  # the hook must equalise the start
        final = tf.compat.v1.train.FinalOpsHook(w)
        hooks = [htf.BroadcastGlobalVariablesHook(0), final,
                 tf.compat.v1.train.StopAtStepHook(last_step=steps)]
        checkpoint_dir = str(tmp_path / "ckpt") if RANK == 0 else None
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir, hooks=hooks, save_summaries_steps=None,
                save_checkpoint_secs=None, log_step_count_steps=None) as sess:
            i = 0
            while not sess.should_stop():
                lo = i * batch + RANK * mine
                sess.run(train, {xs: x[lo:lo + mine], ys: y[lo:lo + mine]})
                i += 1
    got = final.final_ops_values
    assert i == steps
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert same_on_all_ranks([got])


def test_keras_state_commits_restores_and_syncs_from_rank_zero():
    import mpitrain.tensorflow.keras as hk

    rank = MPI.COMM_WORLD.Get_rank()
    tf.random.set_seed(rank)  # different weights on every rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    state = hk.elastic.KerasState(model, epoch=0, batch=0)
    state.sync()  # rank 0's weights everywhere (and committed)
    mine = np.concatenate([w.ravel() for w in model.get_weights()])
    assert np.array_equal(mine, MPI.COMM_WORLD.bcast(mine, root=0))
    committed = model.get_weights()
    model.set_weights([w + 1.0 for w in committed])
    state.epoch = 5
    state.restore()
    for a, b in zip(model.get_weights(), committed):
        np.testing.assert_array_equal(a, b)
    assert state.epoch == 0
    with pytest.raises(ValueError, match="batches_per_commit"):
        hk.elastic.CommitStateCallback(state, batches_per_commit=0)
    with pytest.raises(ValueError, match="graph sessions"):
        htf.elastic.TensorFlowState([tf.Variable(1.0)], session=object())
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="built"):
        hk.elastic.KerasState(unbuilt)
