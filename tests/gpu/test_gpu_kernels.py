"""The CUDA kernels compiled for the real device (CI runs the same code in the simulator)."""

import numpy as np
import pytest

from mpitrain.core.dtypes import STORAGE, ReduceOp
from mpitrain.ops import reference
from mpitrain.ops.cuda import kernel_steps, kernels, pack
from mpitrain.ops.reduction import Reduction

pytestmark = pytest.mark.world_sizes(1)
N = 1_000_003
RTOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}


def _data(dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        return reference.f32_to_bf16(rng.standard_normal(N).astype(np.float32))
    if dtype.startswith("float"):
        return rng.standard_normal(N).astype(dtype)
    return rng.integers(-100, 100, N).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "int32"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_device_reduction_is_the_reference(cupy, dtype, op, count):
    from numba import cuda
    hosts = [_data(dtype, s) for s in range(count)]
    inputs = [cuda.to_device(h) for h in hosts]
    out = cuda.device_array(N, STORAGE[dtype])
    scratch = cuda.device_array(N, kernel_steps.accumulator_dtype(dtype))
    kernels.reduce_buffers(inputs, out, Reduction(dtype, 0.5, 3.0, op), scratch)
    cuda.synchronize()
    want = reference.reduce(hosts, dtype, op, 0.5, 3.0)
    got = out.copy_to_host()
    # Bit for bit, floats included: the PTX checked in CI has an FMA only in floating Sum,
    # fma(a, 0.5, b * 0.5), and a * 0.5 is exact, so fusing it changes nothing.
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_device_sum_with_an_inexact_prescale_agrees_to_rounding(cupy, dtype):
    from numba import cuda
    hosts = [_data(dtype, s) for s in range(3)]
    out = cuda.device_array(N, STORAGE[dtype])
    scratch = cuda.device_array(N, kernel_steps.accumulator_dtype(dtype))
    kernels.reduce_buffers([cuda.to_device(h) for h in hosts], out,
                           Reduction(dtype, 0.3, 1.0, ReduceOp.SUM), scratch)
    want = reference.reduce(hosts, dtype, ReduceOp.SUM, 0.3, 1.0)
    # a * 0.3 + b * 0.3 rounds once in the FMA, twice in the reference.
    np.testing.assert_allclose(reference.widen(out.copy_to_host(), dtype),
                               reference.widen(want, dtype), rtol=RTOL[dtype],
                               atol=RTOL[dtype])


@pytest.mark.parametrize(("src", "dst"), [("float32", "float16"), ("float32", "bfloat16"),
                                          ("bfloat16", "float32")])
def test_device_casts(cupy, src, dst):
    from numba import cuda
    host = _data(src, 9)
    out = cuda.device_array(N, STORAGE[dst])
    kernels.cast(cuda.to_device(host), out, src, dst)
    want = reference.narrow(reference.widen(host, src), dst)
    np.testing.assert_array_equal(out.copy_to_host(), want)


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_batched_pack_and_unpack(cupy, dtype):
    rng = np.random.default_rng(1)
    sizes = [int(s) for s in rng.integers(1, 50_000, 100)]
    tensors = [cupy.asarray(rng.integers(0, 100, s).astype(dtype)) for s in sizes]
    nbytes = [t.nbytes for t in tensors]
    fused = cupy.empty(sum(nbytes), dtype=np.uint8)
    packer = pack.Packer([t.data.ptr for t in tensors], nbytes, fused.data.ptr)
    stream = cupy.cuda.Stream()
    packer.pack(fused, stream)
    stream.synchronize()
    want = cupy.concatenate(tensors)
    assert bool((fused.view(dtype) == want).all())
    fused.view(dtype)[...] *= 2
    packer.unpack(fused, stream)
    stream.synchronize()
    for t, w in zip(tensors, cupy.split(want * 2, np.cumsum(sizes)[:-1].tolist())):
        assert bool((t == w).all())
    if dtype == np.float32:
        assert packer.unit >= 4


def _launchers(cupy):
    """(prepared launches for this GPU, numba's dispatch)."""
    from numba import cuda

    from mpitrain.ops.cuda import launch

    device = cupy.cuda.runtime.getDevice()
    return (launch.Launcher(launch.PreparedKernels(
        cupy, launch.compute_capability(cupy, device)), cuda), launch.Launcher(None, cuda))


def _run_both(cupy, steps, inputs, out_dtype, scratch_dtype):
    """``steps`` run once prepared and once through numba's dispatch, each into its own
    output; (prepared output, dispatched output) on the host.  Fails if any step's variant was
    not really prepared (a silent fallback would make the comparison vacuous)."""
    from mpitrain.ops.cuda import launch

    prepared, dispatched = _launchers(cupy)
    stream = cupy.cuda.Stream()
    outs = []
    for launcher in (prepared, dispatched):
        out = cupy.empty(inputs[0].size, dtype=out_dtype)
        scratch = cupy.empty(inputs[0].size, dtype=scratch_dtype)
        launcher.run(steps, inputs, out, scratch, stream)
        outs.append(out)
        if launcher is prepared:
            for step in steps:
                buffers = kernel_steps.step_buffers(step, inputs, out, scratch)
                assert prepared.prepared.function(launch.variant(step, buffers)) is not None
    stream.synchronize()
    return [cupy.asnumpy(o) for o in outs]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "int32",
                                   "int64", "uint8", "bool"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_prepared_launches_give_numba_dispatchs_bits(cupy, dtype, op, count):
    """numba's kernels launched as cupy RawKernels (mpitrain.ops.cuda.launch, the default on
    a GPU) write exactly what numba's own launch of the same kernel writes, and the reference."""
    kind = "uint8" if dtype == "bool" else dtype
    hosts = [(_data("int8", s) % 2).astype(bool) if dtype == "bool" else _data(dtype, s)
             for s in range(count)]
    inputs = [cupy.asarray(h) for h in hosts]
    pre, post = (1.0, 1.0) if dtype == "bool" else (0.5, 3.0)
    steps = kernel_steps.reduce_steps(count, dtype, op, pre, post)
    got, dispatched = _run_both(cupy, steps, inputs, STORAGE[dtype],
                                kernel_steps.accumulator_dtype(kind))
    np.testing.assert_array_equal(got.view(np.uint8), dispatched.view(np.uint8))
    expect = reference.reduce(hosts, dtype, op, pre, post)
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(expect).view(np.uint8))


@pytest.mark.parametrize(("src", "dst"), [("float32", "float16"), ("float32", "bfloat16"),
                                          ("bfloat16", "float32"), ("float16", "float32")])
def test_prepared_casts_give_numba_dispatchs_bits(cupy, src, dst):
    host = _data(src, 9)
    got, dispatched = _run_both(cupy, [kernel_steps.cast_step(src, dst, 0.25)],
                                [cupy.asarray(host)], STORAGE[dst], np.float32)
    np.testing.assert_array_equal(got.view(np.uint8), dispatched.view(np.uint8))
    want = reference.narrow(reference.widen(host, src) * 0.25, dst)
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))
