"""The TensorFlow face as Horovod 0.28.1's own TensorFlow tests see it (issue 37).

One test per kind of behaviour Horovod's ``test/parallel/test_tensorflow.py`` checks and
mpitrain got wrong: the dtypes each collective takes, the error classes of a mismatch between
ranks and of an alltoall whose rows do not divide, ``tf.IndexedSlices`` averaging and refusals,
``Compression.fp16`` on TensorFlow tensors, SyncBatchNormalization's arguments, local sources
(PartialDistributedGradientTape, the model-parallel pattern), ``hvd.util``, and the error of
``op=Adasum`` on integers.  Each runs eagerly, in a ``tf.function`` and in a ``tf.compat.v1``
graph where Horovod's test does (its tests run in graph and eager mode), at 2 ranks and at 3,
where rows split unevenly (the cases with nothing of their own beyond two ranks run at two only).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

try:
    import keras
    import tensorflow as tf

    import mpitrain
    import mpitrain.tensorflow as htf
    from mpitrain.core.errors import CollectiveMismatchError, MpitrainInternalError
except ModuleNotFoundError:  # collected and skipped (a module skip would collect nothing)
    keras = tf = htf = None

pytestmark = pytest.mark.skipif(tf is None, reason="needs pip install 'mpitrain[tensorflow]'")
MPI_CONFIGS = ("np2", "np3")
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MODES = ["eager", "function", "v1"]

# Horovod 0.28.1's op registrations (horovod/tensorflow/mpi_ops.cc).
MOVED = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32",
         "float64", "bool"]
REDUCED = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
SCATTERED = ["int32", "int64", "float16", "float32", "float64"]


# What a third rank adds is uneven splits and a third voice in a mismatch; the rest runs at
# two ranks only (TensorFlow tests are slow: each case builds graphs and sessions on every rank).
two_ranks_suffice = pytest.mark.skipif(SIZE != 2, reason="no path of its own beyond 2 ranks")


@pytest.fixture(autouse=True)
def _init(hvd):
    htf.init()


@pytest.fixture
def fresh_keras():
    """Keras' global state (layer names, seeds) reset for a test that builds models."""
    keras.backend.clear_session()


def run(mode, build):
    """``build()``'s tensors as numpy: eagerly, from a tf.function, or from a v1 session."""
    if mode == "eager":
        return tf.nest.map_structure(lambda t: t.numpy(), build())
    if mode == "function":
        return tf.nest.map_structure(lambda t: t.numpy(), tf.function(build)())
    with tf.Graph().as_default():
        out = build()
        with tf.compat.v1.Session() as sess:
            return sess.run(out)


def values(rank, rows, dtype, cols=3):
    """Rank ``rank``'s rows, distinct per rank and row, small enough that sums over three
    ranks fit int8 (uint16 near its top, so that a signed reinterpretation would show)."""
    base = np.arange(rows * cols).reshape(rows, cols) + 10 * rank
    if dtype == "bool":
        return (base % 2 == 0)
    if dtype == "uint16":
        return (60000 + base).astype(np.uint16)
    return (base % 40).astype(dtype)


def alive():
    """A collective after a failed one still works: no rank is left waiting."""
    out = htf.allreduce(tf.constant([float(RANK)]), op=htf.Sum, name=f"alive.{next(_count)}")
    assert out.numpy()[0] == sum(range(SIZE))


_count = iter(range(1_000_000))


# --------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("mode", MODES)
def test_every_dtype_horovod_moves_reduces_and_scatters(mode):
    def send(r, q):
        return (r + 2 * q) % 3 + 1  # rows rank r sends to rank q (not symmetric)

    splits = [send(RANK, q) for q in range(SIZE)]

    def build():
        out = {}
        for d in MOVED:
            mine = tf.constant(values(RANK, RANK + 1, d))  # rows differ between ranks
            out[d, "allgather"] = htf.allgather(mine)
            out[d, "grouped"] = htf.grouped_allgather([mine, mine[:1]])
            out[d, "broadcast"] = htf.broadcast(tf.constant(values(RANK, 2, d)), SIZE - 1)
            out[d, "alltoall"] = htf.alltoall(tf.constant(values(RANK, 2 * SIZE, d)))
            out[d, "alltoallv"] = htf.alltoall(tf.constant(values(RANK, sum(splits), d)),
                                               splits=splits)
        for d in REDUCED:
            out[d, "allreduce"] = htf.allreduce(tf.constant(values(RANK, 2, d)), op=htf.Sum)
        for d in SCATTERED:
            out[d, "reducescatter"] = htf.reducescatter(tf.constant(values(RANK, SIZE + 1, d)),
                                                        op=htf.Sum)
        return out

    got = run(mode, build)
    for d in MOVED:
        every = [values(r, r + 1, d) for r in range(SIZE)]
        np.testing.assert_array_equal(got[d, "allgather"], np.concatenate(every))
        np.testing.assert_array_equal(got[d, "grouped"][1],
                                      np.concatenate([e[:1] for e in every]))
        np.testing.assert_array_equal(got[d, "broadcast"], values(SIZE - 1, 2, d))
        blocks = [values(r, 2 * SIZE, d)[2 * RANK:2 * RANK + 2] for r in range(SIZE)]
        np.testing.assert_array_equal(got[d, "alltoall"], np.concatenate(blocks))
        rows, received = got[d, "alltoallv"]
        want = []
        for r in range(SIZE):
            start = sum(send(r, q) for q in range(RANK))
            sent_by_r = values(r, sum(send(r, q) for q in range(SIZE)), d)
            want.append(sent_by_r[start:start + send(r, RANK)])
        np.testing.assert_array_equal(rows, np.concatenate(want))
        np.testing.assert_array_equal(received, [send(r, RANK) for r in range(SIZE)])
        for key in ("allgather", "broadcast", "alltoall"):
            assert got[d, key].dtype == np.dtype(d), (d, key)
    for d in REDUCED:
        want = sum(values(r, 2, d).astype(np.int64 if d != "float16" else np.float32)
                   for r in range(SIZE))
        np.testing.assert_array_equal(got[d, "allreduce"], want.astype(d))
    for d in SCATTERED:
        total = sum(values(r, SIZE + 1, d).astype(np.float64) for r in range(SIZE))
        first = 2 if RANK == 0 else 1  # SIZE + 1 rows: rank 0 keeps one more
        start = 0 if RANK == 0 else 2 + (RANK - 1)
        np.testing.assert_array_equal(got[d, "reducescatter"],
                                      total[start:start + first].astype(d))


@two_ranks_suffice
def test_uint16_is_refused_by_reductions_as_by_horovod():
    with pytest.raises(TypeError, match="uint16"):
        htf.allreduce(tf.constant([1], tf.uint16))
    with pytest.raises(TypeError, match="uint16"):
        htf.reducescatter(tf.constant([1, 2, 3], tf.uint16))


# ------------------------------------------------------------------------- mismatches
def _mismatched(kind):
    """One collective whose arguments differ between ranks (Horovod's *_error tests)."""
    if kind == "allreduce_shape":
        return htf.allreduce(tf.ones([17 + RANK]))
    if kind == "allreduce_dtype":
        return htf.allreduce(tf.ones([4], tf.int32 if RANK % 2 else tf.float32))
    if kind == "allgather_dims":
        return htf.allgather(tf.ones([2, 3 + RANK]))
    if kind == "broadcast_root":
        return htf.broadcast(tf.ones([3]), root_rank=RANK)
    if kind == "alltoall_dtype":
        return htf.alltoall(tf.ones([SIZE], tf.int32 if RANK % 2 else tf.float32))
    if kind == "reducescatter_shape":
        return htf.reducescatter(tf.ones([SIZE, 2 + RANK]))
    raise AssertionError(kind)


KINDS = ["allreduce_shape", "allreduce_dtype", "allgather_dims", "broadcast_root",
         "alltoall_dtype", "reducescatter_shape"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_mismatch_is_a_failed_precondition_eagerly(kind):
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatched") as caught:
        _mismatched(kind)
    # Still what mpitrain raised before, and what elastic code catches.
    assert isinstance(caught.value, CollectiveMismatchError)
    assert isinstance(caught.value, MpitrainInternalError)
    assert isinstance(caught.value, mpitrain.HorovodInternalError)
    alive()


@two_ranks_suffice
@pytest.mark.parametrize("mode", ["function", "v1"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_mismatch_in_a_graph_is_an_unknown_error_with_mpitrain_message(kind, mode):
    # TensorFlow maps a numpy_function's Python error to UnknownError (see
    # mpitrain.tensorflow.errors): the class differs from Horovod's, the message is ours.
    with pytest.raises(tf.errors.UnknownError, match=r"(?s)CollectiveMismatchError.*mismatched"):
        run(mode, lambda: _mismatched(kind))
    alive()


# ------------------------------------------------------------ alltoall rows do not divide
@pytest.mark.parametrize("mode", MODES)
def test_alltoall_without_splits_that_do_not_divide_is_an_invalid_argument(mode):
    # SIZE + 1 rows: 3 over 2 ranks, 4 over 3 (Horovod's equal_split_length_error test).
    with pytest.raises(tf.errors.InvalidArgumentError, match="divisible") as caught:
        run(mode, lambda: htf.alltoall(tf.ones([SIZE + 1, 2])))
    if mode == "eager":
        assert isinstance(caught.value, ValueError)  # what mpitrain raised before
    alive()


# ------------------------------------------------------------------------ IndexedSlices
def _slices(dtype):
    """Horovod's test pattern: each rank sends two copies of one row, at rows r and r + 1."""
    row = tf.constant(values(RANK, 1, dtype)[0] % 2 + 1)
    return tf.IndexedSlices(tf.stack([row, row]), tf.constant([RANK, RANK + 1]))


def _dense(slices):
    return tf.math.unsorted_segment_sum(slices.values, slices.indices, SIZE + 1)


@pytest.mark.parametrize("mode", MODES)
def test_indexed_slices_sum_and_average_as_horovod(mode):
    def build():
        out = {}
        for d in REDUCED:
            out[d, "sum"] = _dense(htf.allreduce(_slices(d), op=htf.Sum))
            out[d, "average"] = _dense(htf.allreduce(_slices(d), op=htf.Average))
        return out

    got = run(mode, build)
    for d in REDUCED:
        rows = [values(r, 1, d)[0] % 2 + 1 for r in range(SIZE)]
        dense = np.zeros((SIZE + 1, 3), np.float64)
        for r, row in enumerate(rows):
            dense[r] += row
            dense[r + 1] += row
        np.testing.assert_array_equal(got[d, "sum"], dense.astype(d))
        # TensorFlow's true division, as Horovod's values / size: integers become floats.
        want_dtype = (tf.constant(1, d) / tf.constant(1, d)).dtype.as_numpy_dtype
        assert got[d, "average"].dtype == want_dtype, d
        np.testing.assert_allclose(got[d, "average"], dense / SIZE, rtol=1e-3)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_of_mixed_dense_and_sparse(mode):
    def build():
        sparse = [_slices("float32"), _slices("int32")]
        dense = [tf.constant(values(RANK, 2, "float32")), tf.constant(values(RANK, 1, "int64"))]
        summed = htf.grouped_allreduce([sparse[0], dense[0], sparse[1], dense[1]],
                                       average=False)
        averaged = htf.grouped_allreduce([dense[0], sparse[0]], op=htf.Average)
        return ([_dense(summed[0]), summed[1], _dense(summed[2]), summed[3]],
                [averaged[0], _dense(averaged[1])])

    summed, averaged = run(mode, build)
    dense_f = sum(values(r, 2, "float32") for r in range(SIZE))
    dense_i = sum(values(r, 1, "int64") for r in range(SIZE))
    sparse = np.zeros((SIZE + 1, 3))
    for r in range(SIZE):
        row = values(r, 1, "float32")[0] % 2 + 1
        sparse[r] += row
        sparse[r + 1] += row
    np.testing.assert_array_equal(summed[0], sparse)
    np.testing.assert_array_equal(summed[1], dense_f)
    np.testing.assert_array_equal(summed[2], sparse.astype(np.int32))
    np.testing.assert_array_equal(summed[3], dense_i)
    np.testing.assert_allclose(averaged[0], dense_f / SIZE, rtol=1e-6)
    np.testing.assert_allclose(averaged[1], sparse / SIZE, rtol=1e-6)


@two_ranks_suffice
@pytest.mark.parametrize("mode", MODES)
def test_indexed_slices_refusals_are_horovods_not_implemented(mode):
    def refused(call):
        with pytest.raises(NotImplementedError):
            run(mode, call)

    for op in (htf.Min, htf.Max, htf.Product, htf.Adasum):
        refused(lambda op=op: _dense(htf.allreduce(_slices("float32"), op=op)))
        refused(lambda op=op: htf.grouped_allreduce(
            [tf.ones([2]), _slices("float32")], op=op)[0])
    refused(lambda: _dense(htf.allreduce(_slices("float32"), op=htf.Sum, prescale_factor=0.5)))
    refused(lambda: _dense(htf.allreduce(_slices("float32"), op=htf.Sum,
                                         postscale_factor=0.5)))
    alive()  # refused before anything was sent


# ------------------------------------------------------------------- Compression.fp16
@two_ranks_suffice
def test_fp16_compression_of_tensorflow_tensors_as_horovods():
    for dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
        compressed, ctx = htf.Compression.fp16.compress(tf.ones([17, 17], dtype))
        assert compressed.dtype == tf.float16
        restored = htf.Compression.fp16.decompress(compressed, ctx)
        assert restored.dtype == dtype
        np.testing.assert_array_equal(tf.cast(restored, tf.float64).numpy(), 1.0)
    for dtype in (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.bool):
        compressed, ctx = htf.Compression.fp16.compress(tf.ones([3], dtype))
        assert compressed.dtype == dtype
        assert htf.Compression.fp16.decompress(compressed, ctx).dtype == dtype
    # The shared compressors still compress numpy arrays.
    compressed, ctx = htf.Compression.fp16.compress(np.ones(3, np.float32))
    assert compressed.dtype == np.float16


@two_ranks_suffice
@pytest.mark.parametrize("mode", MODES)
def test_fp16_compression_sends_float16(mode):
    # 1 + 2**-12 is not a float16: sent as one, every rank's sum is exactly SIZE.
    x = np.full([4], 1 + 2.0 ** -12, np.float32)

    def build():
        return [htf.allreduce(tf.constant(x), op=htf.Sum, compression=c)
                for c in (htf.Compression.fp16, mpitrain.Compression.fp16,
                          htf.Compression.none)] + [
            htf.grouped_allreduce([tf.constant(x)], op=htf.Sum,
                                  compression=htf.Compression.fp16)[0],
            htf.reducescatter(tf.constant(np.tile(x, (SIZE, 1))), op=htf.Sum,
                              compression=htf.Compression.fp16)]

    fp16, shared, none, grouped, scattered = run(mode, build)
    for got in (fp16, shared, grouped, scattered):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, SIZE)
    np.testing.assert_allclose(none, SIZE * x[0], rtol=1e-7)
    assert not np.any(none == SIZE)


# ----------------------------------------------------------------- SyncBatchNormalization
@two_ranks_suffice
def test_sync_batch_norm_takes_horovods_keyword_arguments(fresh_keras):
    x = np.stack([np.arange(8, dtype=np.float32).reshape(4, 2) * (r + 1) for r in range(SIZE)])
    sync = htf.SyncBatchNormalization(axis=1, fused=False, momentum=0.9, epsilon=1e-3,
                                      virtual_batch_size=None, adjustment=None, renorm=False,
                                      name="sync_bn_kwargs")
    plain = keras.layers.BatchNormalization(axis=1, momentum=0.9, epsilon=1e-3)
    got = sync(tf.constant(x[RANK:RANK + 1]), training=True).numpy()
    want = plain(tf.constant(x), training=True).numpy()[RANK:RANK + 1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sync.moving_mean.numpy(), plain.moving_mean.numpy(), rtol=1e-6)
    for name in ("virtual_batch_size", "adjustment"):
        with pytest.raises(ValueError, match=name):
            htf.SyncBatchNormalization(**{name: 2 if name == "virtual_batch_size" else abs})


# ------------------------------------------------------------------------- local sources
def _layered_model(seed_rank):
    keras.utils.set_random_seed(7)
    init = keras.initializers.Constant(float(seed_rank))
    return keras.Sequential([keras.Input((3,)),
                             keras.layers.Dense(2, kernel_initializer=init,
                                                bias_initializer=init),
                             keras.layers.Dense(3)])


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("local_count", [0, 1, 2])
def test_partial_distributed_gradient_tape_keeps_local_layers(mode, local_count, fresh_keras):
    model = _layered_model(RANK)  # Keras 3 variables: no ref(), unhashable
    x = tf.constant(np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3))

    def step():
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        plain = tape.gradient(loss, model.trainable_weights)
        tape = htf.PartialDistributedGradientTape(tape,
                                                  local_layers=model.layers[:local_count])
        reduced = tape.gradient(loss, model.trainable_weights)
        local, shared = tape.get_local_and_global_gradients(loss, model.trainable_weights)
        return plain, reduced, [g for _, g in local], [g for _, g in shared]

    plain, reduced, local, shared = (step() if mode == "eager" else tf.function(step)())
    local_vars = [id(v) for layer in model.layers[:local_count] for v in layer.trainable_weights]
    assert len(local) == len(local_vars) and len(shared) == 4 - len(local_vars)
    everyone = WORLD.allgather([g.numpy() for g in plain])
    for i, v in enumerate(model.trainable_weights):
        if id(v) in local_vars:
            want = plain[i].numpy() / SIZE
        else:
            want = np.mean([theirs[i] for theirs in everyone], axis=0)
        np.testing.assert_allclose(reduced[i].numpy(), want, rtol=1e-5, atol=1e-6)
    local_plain = [g for g, v in zip(plain, model.trainable_weights) if id(v) in local_vars]
    for got, mine in zip(local, local_plain):
        np.testing.assert_allclose(got.numpy(), mine.numpy() / SIZE, rtol=1e-5)


@two_ranks_suffice
def test_partial_tape_refuses_what_is_not_a_layer():
    with pytest.raises(ValueError, match="keras layers"):
        htf.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[object()])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_model_parallel_model(mode, fresh_keras):
    """Horovod's test_model_parallel_model, for any size: each rank's embedding has its own
    vocabulary (a different shape per rank, registered local); the dense head is shared."""
    keras.utils.set_random_seed(3)
    embedding = keras.layers.Embedding(7 + 2 * RANK, 3,
                                       embeddings_initializer=keras.initializers.Constant(
                                           float(RANK + 1)))
    dense = keras.layers.Dense(1, use_bias=False,
                               kernel_initializer=keras.initializers.Constant(1.0))
    optimizer = keras.optimizers.SGD(0.1)
    inputs = htf.alltoall(tf.constant([RANK % 7] * SIZE, tf.int64))  # data -> model parallel

    def step(ids):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(dense(tf.reshape(embedding(ids), [1, -1])) ** 2)
        weights = [embedding.embeddings, dense.kernel]
        plain = tape.gradient(loss, weights)
        tape = htf.DistributedGradientTape(tape)
        tape.register_local_source(embedding.embeddings)
        grads = tape.gradient(loss, weights)
        optimizer.apply_gradients(zip(grads, weights))
        return [tf.convert_to_tensor(g) for g in plain + grads]

    plain_e, plain_d, g_embedding, g_dense = (step(inputs) if mode == "eager"
                                              else tf.function(step)(inputs))
    assert g_embedding.shape == (7 + 2 * RANK, 3)
    np.testing.assert_allclose(g_embedding.numpy(), plain_e.numpy() / SIZE, rtol=1e-6)
    np.testing.assert_allclose(g_dense.numpy(), np.mean(WORLD.allgather(plain_d.numpy()), 0),
                               rtol=1e-5)
    heads = WORLD.allgather(dense.kernel.numpy())
    assert all(np.array_equal(h, heads[0]) for h in heads)  # the shared head stayed shared


@two_ranks_suffice
def test_keras_and_v1_optimizers_keep_registered_local_variables(fresh_keras):
    local = keras.Variable(np.full([2], float(RANK + 1), np.float32))
    shared = keras.Variable(np.zeros([2], np.float32))
    opt = htf.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.register_local_var(local)
    opt.apply([tf.fill([2], float(RANK + 1)), tf.fill([2], float(RANK + 1))], [local, shared])
    np.testing.assert_allclose(local.numpy(), (RANK + 1) * (1 - 1 / SIZE))
    np.testing.assert_allclose(shared.numpy(), -np.mean(np.arange(1, SIZE + 1)))
    with tf.Graph().as_default():
        v_local = tf.compat.v1.Variable(float(RANK + 1))
        v_shared = tf.compat.v1.Variable(float(RANK + 1))
        opt1 = htf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                        scale_local_gradients=False)
        opt1.register_local_var(v_local)
        train = opt1.minimize(v_local * v_local / 2 + v_shared * v_shared / 2)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            got = sess.run([v_local, v_shared])
    np.testing.assert_allclose(got, [0.0, RANK + 1 - np.mean(np.arange(1, SIZE + 1))])


# ---------------------------------------------------------------------------- broadcast_
@two_ranks_suffice
@pytest.mark.parametrize("mode", MODES)
def test_inplace_broadcast_of_variables(mode):
    """Horovod's broadcast_: resource and (in v1 graphs) reference variables take the root's
    values; the returned tensors are those values."""
    root = SIZE - 1
    dtypes = [tf.uint8, tf.int32, tf.float16, tf.float64, tf.bool]

    def initial(d):
        return tf.cast(tf.fill([3, 2], RANK % 2 if d == tf.bool else RANK), d)

    if mode == "v1":
        from tensorflow.python.ops.ref_variable import RefVariable

        with tf.Graph().as_default():
            variables = [RefVariable(initial(d)) for d in dtypes] + \
                [tf.compat.v1.Variable(initial(d), use_resource=True) for d in dtypes]
            out = htf.broadcast_(variables, root)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                got = sess.run(out)
                after = sess.run([tf.convert_to_tensor(v) for v in variables])
    else:
        variables = [tf.Variable(initial(d)) for d in dtypes] + [keras.Variable(
            np.full([3, 2], RANK, np.float32))]
        def call():
            return htf.broadcast_(variables, root)

        got = [t.numpy() for t in (call() if mode == "eager" else tf.function(call)())]
        after = [v.numpy() for v in variables]
    for g, a, v in zip(got, after, variables):
        is_bool = tf.as_dtype(v.dtype).base_dtype == tf.bool  # a RefVariable's is bool_ref
        want = np.full([3, 2], root % 2 if is_bool else root)
        np.testing.assert_array_equal(g, want.astype(g.dtype))
        np.testing.assert_array_equal(a, g)


# ------------------------------------------------------------------------ hvd.util & co
@two_ranks_suffice
def test_util_and_executing_eagerly():
    assert htf.util._executing_eagerly() and htf._executing_eagerly()
    inside = tf.function(lambda: tf.constant(htf._executing_eagerly()))()
    assert not bool(inside)
    keras_var, tf_var = keras.Variable(1.0), tf.Variable(2.0)
    refs = htf.util.vars_to_refs([[keras_var, tf_var], [tf_var]])
    assert hash(refs) == hash(htf.util.vars_to_refs([[keras_var, tf_var], [tf_var]]))
    back = htf.util.refs_to_vars(refs)
    assert back[0][0] is keras_var and back[0][1] is tf_var and back[1][0] is tf_var


def test_reducescatter_with_adasum_on_integers_is_a_runtime_error():
    for call in (lambda: htf.reducescatter(tf.ones([SIZE * 2], tf.int32), op=htf.Adasum),
                 lambda: htf.allreduce(tf.ones([2], tf.int64), op=htf.Adasum)):
        with pytest.raises(RuntimeError, match="floating"):
            call()
        with pytest.raises(TypeError, match="floating"):
            call()


# ------------------------------------------------------------------ the horovod.keras face
@two_ranks_suffice
def test_standalone_keras_face(fresh_keras):
    import mpitrain.keras as hk

    mean = np.mean(np.arange(SIZE))
    assert float(hk.allreduce(float(RANK))) == mean  # horovod.keras averages by default
    np.testing.assert_array_equal(hk.allreduce([1, RANK], op=hk.Sum).numpy(),
                                  [SIZE, sum(range(SIZE))])
    np.testing.assert_array_equal(hk.allgather([[RANK]]).numpy(), [[r] for r in range(SIZE)])
    np.testing.assert_array_equal(hk.broadcast(np.array([RANK + 1]), SIZE - 1).numpy(), [SIZE])
    np.testing.assert_array_equal(hk.reducescatter(np.full([SIZE, 2], RANK), op=hk.Sum).numpy(),
                                  np.full([1, 2], sum(range(SIZE))))

    model = _layered_model(RANK)
    x = tf.constant(np.ones([2, 3], np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_weights)
    before = [v.numpy() for v in model.trainable_weights]
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0),
                                         local_layers=model.layers[0])
    opt.apply(grads, model.trainable_weights)
    everyone = WORLD.allgather([g.numpy() for g in grads])
    for i, (v, b) in enumerate(zip(model.trainable_weights, before)):
        step = grads[i].numpy() / SIZE if i < 2 else np.mean([e[i] for e in everyone], 0)
        np.testing.assert_allclose(v.numpy(), b - step, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="keras layers"):
        hk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=["dense"])
    assert hk.callbacks.MetricAverageCallback is htf.keras.callbacks.MetricAverageCallback
    assert hk.elastic.KerasState is htf.keras.elastic.KerasState
