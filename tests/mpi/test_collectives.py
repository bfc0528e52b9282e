"""Every collective x dtype x reduce op against a numpy reference, at every world size."""

import warnings

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpitrain.core.dtypes import ReduceOp
from mpitrain.ops import reference

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool"]
OPS = [ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
LENGTHS = [0, 1, 7, 1003]
TORCH = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
         "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
         "float32": torch.float32, "float64": torch.float64, "bool": torch.bool}


def values(rank: int, n: int, dtype: str, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Deterministic per-rank input that every rank can recompute for any other rank."""
    gen = np.random.default_rng(1000 * rank + n)
    if dtype == "bool":
        return torch.from_numpy(gen.random(n) > 0.5)
    if dtype in ("uint8",):
        return torch.from_numpy(gen.integers(0, 4, n).astype(np.uint8))
    if dtype.startswith("int"):
        low, high = (-2, 3) if op == ReduceOp.PRODUCT else (-50, 50)
        return torch.from_numpy(gen.integers(low, high, n)).to(TORCH[dtype])
    data = gen.normal(size=n).astype(np.float32)
    if op == ReduceOp.PRODUCT:
        data = 0.5 + np.abs(data)
    return torch.from_numpy(data).to(TORCH[dtype])


def storage(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def expected_allreduce(n, dtype, op, pre=1.0, post=1.0, size=SIZE, ranks=None):
    ranks = list(range(size)) if ranks is None else ranks
    inputs = [storage(values(r, n, dtype, op)) for r in ranks]
    ref_op = op
    if op == ReduceOp.AVERAGE:
        ref_op, post = ReduceOp.SUM, post / len(ranks)
    return reference.reduce(inputs, dtype, ref_op, pre, post)


def assert_close(got: torch.Tensor, want: np.ndarray, dtype: str) -> None:
    got_np = storage(got)
    if dtype == "bfloat16":
        np.testing.assert_allclose(reference.bf16_to_f32(got_np), reference.bf16_to_f32(want),
                                   rtol=2e-2, atol=2e-2)
    elif dtype == "float16":
        np.testing.assert_allclose(got_np.astype(np.float32), want.astype(np.float32),
                                   rtol=2e-3, atol=2e-3)
    elif dtype == "float32":
        np.testing.assert_allclose(got_np, want, rtol=1e-5, atol=1e-6)
    elif dtype == "float64":
        np.testing.assert_allclose(got_np, want, rtol=1e-12, atol=1e-12)
    else:
        np.testing.assert_array_equal(got_np, want)


def assert_identical_everywhere(t: torch.Tensor) -> None:
    mine = storage(t).tobytes()
    assert WORLD.allgather(mine) == [mine] * SIZE, "ranks disagree bitwise"


# --------------------------------------------------------------------------- allreduce
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name.lower())
def test_allreduce_every_dtype_and_op(hvd, dtype, op):
    if dtype == "bool" and op == ReduceOp.AVERAGE:
        with pytest.raises(TypeError, match="bool"):
            hvd.allreduce(values(RANK, 3, dtype), op=op)
        return
    for n in LENGTHS:
        got = hvd.allreduce(values(RANK, n, dtype, op), op=op, name=f"ar.{dtype}.{op}.{n}")
        assert got.dtype == TORCH[dtype] and got.shape == (n,)
        assert_close(got, expected_allreduce(n, dtype, op), dtype)
        assert_identical_everywhere(got)


@pytest.mark.parametrize("dtype", ["int32", "float32", "float16", "bfloat16"])
def test_allreduce_scale_factors(hvd, dtype):
    got = hvd.allreduce(values(RANK, 33, dtype), op=hvd.Sum, prescale_factor=0.5,
                        postscale_factor=3.0)
    assert_close(got, expected_allreduce(33, dtype, ReduceOp.SUM, 0.5, 3.0), dtype)


def test_allreduce_numpy_arrays_and_shapes(hvd):
    x = np.full((2, 3, 4), RANK + 1, dtype=np.float64)
    got = hvd.allreduce(x, op=hvd.Sum)
    assert isinstance(got, np.ndarray) and got.shape == (2, 3, 4)
    assert np.all(got == SIZE * (SIZE + 1) / 2)
    scalar = hvd.allreduce(torch.tensor(float(RANK)))
    assert scalar.shape == () and scalar.item() == pytest.approx((SIZE - 1) / 2)


def test_allreduce_in_place(hvd):
    x = torch.full((5,), float(RANK))
    out = hvd.allreduce_(x, op=hvd.Sum)
    assert out is x and torch.all(x == sum(range(SIZE)))
    h = hvd.allreduce_async_(x, op=hvd.Max)
    assert hvd.synchronize(h) is x


def test_async_completed_out_of_order(hvd):
    handles = [hvd.allreduce_async(torch.full((i + 1,), float(RANK * i)), name=f"ooo.{i}",
                                   op=hvd.Sum) for i in range(20)]
    for i in reversed(range(20)):
        out = hvd.synchronize(handles[i])
        assert torch.all(out == i * sum(range(SIZE)))
        assert hvd.poll(handles[i])


def test_grouped_allreduce_mixed_dtypes(hvd):
    tensors = [values(RANK, 10, "float32"), values(RANK, 4, "int64"), values(RANK, 3, "float64")]
    outs = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    for out, t, dtype in zip(outs, tensors, ["float32", "int64", "float64"]):
        assert out.dtype == t.dtype
        assert_close(out, expected_allreduce(t.numel(), dtype, ReduceOp.SUM), dtype)
    inplace = [torch.ones(3) * RANK, torch.ones(2) * RANK]
    assert hvd.grouped_allreduce_(inplace, op=hvd.Sum)[0] is inplace[0]
    assert torch.all(inplace[1] == sum(range(SIZE)))
    assert hvd.grouped_allreduce([]) == []


def test_average_flag_is_deprecated(hvd):
    with pytest.warns(DeprecationWarning, match="average"):
        out = hvd.allreduce(torch.ones(2) * RANK, average=False)
    assert torch.all(out == sum(range(SIZE)))
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)


def test_bad_arguments_fail_at_the_call(hvd):
    with pytest.raises(TypeError, match="Adasum needs floating-point tensors"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(ValueError, match="not contiguous"):
        hvd.allreduce(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="complex"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="list"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="unknown reduce op 42"):
        hvd.allreduce(torch.ones(2), op=42)
    with pytest.raises(TypeError, match="prescale_factor"):
        hvd.allreduce(torch.ones(2), prescale_factor="2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd.barrier()  # the engine is still healthy after all that


# --------------------------------------------------------------------------- allgather
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_uneven_first_dimension(hvd, dtype):
    rows = [(r % 3) for r in range(SIZE)]  # includes ranks with zero rows
    mine = values(RANK, rows[RANK] * 2, dtype).reshape(rows[RANK], 2)
    got = hvd.allgather(mine)
    want = np.concatenate([storage(values(r, rows[r] * 2, dtype)).reshape(rows[r], 2)
                           for r in range(SIZE)])
    assert got.shape == (sum(rows), 2)
    np.testing.assert_array_equal(storage(got), want)


def test_allgather_scalar_and_grouped(hvd):
    assert torch.equal(hvd.allgather(torch.tensor(RANK)), torch.arange(SIZE))
    a, b = hvd.grouped_allgather([torch.full((1,), RANK), torch.full((2, 2), float(RANK))])
    assert torch.equal(a, torch.arange(SIZE))
    assert b.shape == (2 * SIZE, 2)


def test_allgather_object_and_broadcast_object(hvd):
    objs = hvd.allgather_object({"rank": RANK, "payload": "x" * RANK})
    assert objs == [{"rank": r, "payload": "x" * r} for r in range(SIZE)]
    root = SIZE - 1
    got = hvd.broadcast_object({"from": RANK} if root == RANK else None, root_rank=root)
    assert got == {"from": root}


# --------------------------------------------------------------------------- broadcast
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_every_root(hvd, dtype):
    for root in range(SIZE):
        mine = values(RANK, 9, dtype)
        got = hvd.broadcast(mine, root_rank=root)
        np.testing.assert_array_equal(storage(got), storage(values(root, 9, dtype)))
        if root != RANK:
            np.testing.assert_array_equal(storage(mine), storage(values(RANK, 9, dtype)))


def test_broadcast_in_place_and_fused(hvd):
    tensors = [torch.full((i + 1,), float(RANK)) for i in range(10)]
    handles = [hvd.broadcast_async_(t, 0, name=f"bc.{i}") for i, t in enumerate(tensors)]
    for h, t in zip(handles, tensors):
        assert hvd.synchronize(h) is t and torch.all(t == 0)


def test_broadcast_bad_root(hvd):
    with pytest.raises(ValueError, match=f"root_rank={SIZE}"):
        hvd.broadcast(torch.ones(1), root_rank=SIZE)
    with pytest.raises(TypeError, match="root_rank"):
        hvd.broadcast(torch.ones(1), root_rank=0.5)


# ---------------------------------------------------------------------------- alltoall
def test_alltoall_even_split(hvd):
    x = torch.arange(2 * SIZE) + 100 * RANK
    out = hvd.alltoall(x)
    want = torch.cat([torch.arange(2 * RANK, 2 * RANK + 2) + 100 * r for r in range(SIZE)])
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool"])
def test_alltoall_with_splits(hvd, dtype):
    # rank r sends (r + j) % 3 rows to rank j
    splits = [(RANK + j) % 3 for j in range(SIZE)]
    x = values(RANK, sum(splits) * 2, dtype).reshape(sum(splits), 2)
    out, received = hvd.alltoall(x, splits=splits)
    assert received.tolist() == [(r + RANK) % 3 for r in range(SIZE)]
    parts = []
    for r in range(SIZE):
        their = [(r + j) % 3 for j in range(SIZE)]
        start = sum(their[:RANK])
        parts.append(storage(values(r, sum(their) * 2, dtype)).reshape(-1, 2)[
            start:start + their[RANK]])
    np.testing.assert_array_equal(storage(out), np.concatenate(parts))


def test_alltoall_bad_splits(hvd):
    with pytest.raises(ValueError, match="splits="):
        hvd.alltoall(torch.ones(SIZE), splits=[1] * (SIZE + 1))
    if SIZE > 1:
        with pytest.raises(ValueError, match="divisible"):
            hvd.alltoall(torch.ones(SIZE + 1))


# ----------------------------------------------------------------------- reducescatter
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 5, 2 * 4 + 3])
def test_reducescatter_uneven_rows(hvd, dtype, n):
    x = values(RANK, n * 3, dtype).reshape(n, 3)
    got = hvd.reducescatter(x, op=hvd.Sum)
    rows = [n // SIZE + (1 if r < n % SIZE else 0) for r in range(SIZE)]
    start = sum(rows[:RANK])
    full = expected_allreduce(n * 3, dtype, ReduceOp.SUM).reshape(n, 3)
    assert got.shape == (rows[RANK], 3)
    assert_close(got, full[start:start + rows[RANK]], dtype)


def test_reducescatter_average_grouped_and_errors(hvd):
    outs = hvd.grouped_reducescatter([torch.ones(SIZE * 2) * RANK, torch.ones(SIZE)])
    assert torch.allclose(outs[0], torch.full((2,), (SIZE - 1) / 2))
    assert torch.allclose(outs[1], torch.ones(1))
    with pytest.raises(ValueError, match="scalar"):
        hvd.reducescatter(torch.tensor(1.0))


# ------------------------------------------------------------------------ barrier/join
def test_barrier(hvd):
    hvd.barrier()
    hvd.barrier()


def test_join_contributes_zeros_and_returns_last_rank(hvd):
    # Rank r runs r + 1 steps of allreduce, then joins: the last rank joins last.
    for step in range(RANK + 1):
        out = hvd.allreduce(torch.ones(3), name=f"join.step.{step}", op=hvd.Sum)
        active = SIZE - step  # ranks with more than `step` steps
        assert torch.all(out == active), (step, out)
    last = hvd.join()
    assert last == SIZE - 1
    out = hvd.allreduce(torch.ones(1), name="after.join", op=hvd.Average)
    assert out.item() == 1.0


def test_join_average_divides_by_full_size(hvd):
    if RANK == 0:
        out = hvd.allreduce(torch.full((2,), float(SIZE)), name="avg.joined")
        assert torch.all(out == 1.0)
    hvd.join()


# ------------------------------------------------ allreduce(..., compression=fp16/bf16)
@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE])
def test_compressed_allreduce_casts_into_reused_buffers_with_the_bits_of_compress(
        hvd, monkeypatch, kind, wire, op):
    """The functional call casts into a pooled 16-bit buffer, reduces it in place and widens
    once: the same bits as compress -> allreduce of a new tensor -> decompress, the caller's
    tensors untouched, and no new wire buffer from the second call on (the mechanism: three
    fresh allocations per call cost more than a 1 Gbit/s link's 16 MiB on 2 cores)."""
    from mpitrain.collectives import wire as wire_buffers

    if kind == "numpy" and wire == "bf16":
        pytest.importorskip("ml_dtypes")
    compression = getattr(hvd.Compression, wire)
    monkeypatch.setattr(wire_buffers, "_POOL", wire_buffers._Pool())  # none from other tests
    made = []
    real_new = wire_buffers._new_buffer
    monkeypatch.setattr(wire_buffers, "_new_buffer",
                        lambda *a: made.append(a[2]) or real_new(*a))
    shapes = [(5, 7), (33,), (5, 7)]  # two of one shape: each takes a buffer of its own
    gen = np.random.default_rng(7 + RANK)
    host = [gen.standard_normal(s).astype(np.float32 if i != 1 else np.float64)
            for i, s in enumerate(shapes)]
    tensors = [torch.from_numpy(v.copy()) if kind == "torch" else v.copy() for v in host]

    def before(t):  # compress into a new tensor, reduce out of place, decompress
        compressed, ctx = compression.compress(t)
        return compression.decompress(hvd.allreduce(compressed, op=op), ctx)

    def as_numpy(t):
        return t.numpy() if kind == "torch" else t

    for call in range(3):
        got = [hvd.allreduce(t, op=op, compression=compression) for t in tensors]
        grouped = hvd.grouped_allreduce(tensors, op=op, compression=compression)
        for t, g, gg, h in zip(tensors, got, grouped, host):
            want = as_numpy(before(t))
            assert as_numpy(g).dtype == h.dtype and as_numpy(g).shape == h.shape
            np.testing.assert_array_equal(as_numpy(g), want)
            np.testing.assert_array_equal(as_numpy(gg), want)
            np.testing.assert_array_equal(as_numpy(t), h)  # the input is left as it was
        if call == 0:
            assert sorted(made) == [33, 35, 35], made
    assert len(made) == 3, f"a wire buffer was allocated again after the first call: {made}"


def test_compressed_allreduce_of_a_large_tensor_returns_recycled_memory(hvd, monkeypatch):
    """The widened result of a large call comes from the recycler that every collective's
    large output uses, so a loop dropping last step's result touches mapped pages (a fresh
    32 MiB result cost 20 ms of page faults a call on this machine)."""
    from mpitrain.collectives import arrays

    taken = []
    real_take = arrays.RECYCLER.take
    monkeypatch.setattr(arrays.RECYCLER, "take", lambda n: taken.append(n) or real_take(n))
    numel = arrays.RECYCLER.min_bytes // 4 + 8
    values = torch.full((numel,), float(RANK + 1))
    out = hvd.allreduce(values, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32 and out.shape == values.shape
    assert torch.all(out == SIZE * (SIZE + 1) / 2)
    assert numel * 4 in taken, taken


def test_compressed_allreduce_of_what_a_cast_cannot_pool_compresses_as_before(hvd):
    """Integers, a non-contiguous tensor and a user's own compressor take compress()."""

    class Halve(hvd.Compression.fp16):
        calls = 0

        @staticmethod
        def compress(tensor):
            Halve.calls += 1
            return hvd.Compression.fp16.compress(tensor)

    ints = torch.arange(6, dtype=torch.int32)
    assert torch.equal(hvd.allreduce(ints, op=hvd.Sum, compression=hvd.Compression.fp16),
                       ints * SIZE)
    strided = torch.ones(4, 6)[:, ::2]
    assert torch.equal(hvd.allreduce(strided, op=hvd.Sum, compression=hvd.Compression.fp16),
                       torch.full((4, 3), float(SIZE)))
    out = hvd.allreduce(torch.ones(3), op=hvd.Sum, compression=Halve)
    assert Halve.calls == 1 and out.dtype == torch.float32
    assert torch.equal(out, torch.full((3,), float(SIZE)))
