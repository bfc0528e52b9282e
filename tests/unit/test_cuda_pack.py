"""The batched pack/unpack kernel's chunk table and loop order, emulated in numpy."""

import numpy as np
import pytest

from mpitrain.ops.cuda import pack


def _tensors(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**31, n).astype(np.uint32) for n in lengths]


@pytest.mark.parametrize("lengths", [[5], [1, 2, 3], [0, 7, 0, 9], [100, 1, 64, 65, 0, 33],
                                     [0, 0]])
@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("blocks", [1, 3])
def test_pack_then_unpack_is_concatenate_then_split(lengths, chunk, blocks):
    tensors = _tensors(lengths)
    table = pack.chunk_table(lengths, chunk)
    fused = np.full(sum(lengths), 0xDEAD, dtype=np.uint32)
    pack.emulate(table, tensors, fused, unpack=False, blocks=blocks)
    want = np.concatenate(tensors) if tensors else fused
    np.testing.assert_array_equal(fused, want)
    outs = [np.zeros_like(t) for t in tensors]
    pack.emulate(table, outs, fused * 3, unpack=True, blocks=blocks)
    for out, t in zip(outs, tensors):
        np.testing.assert_array_equal(out, t * 3)


def test_the_table_tiles_every_element_once_and_never_crosses_a_tensor():
    lengths = [10, 0, 3, 25, 8]
    table = pack.chunk_table(lengths, 4)
    cover = np.zeros(sum(lengths), dtype=int)
    for t, src, dst, n in table:
        assert 0 < n <= 4
        assert src + n <= lengths[t]
        assert dst == sum(lengths[:t]) + src
        cover[dst:dst + n] += 1
    assert (cover == 1).all()
    # Chunks come in bucket order, so block b's share is the same on every rank.
    assert list(table[:, pack.DST]) == sorted(table[:, pack.DST])


def test_copy_unit_is_the_widest_dividing_every_address_and_length():
    assert pack.copy_unit([0x1000, 0x2000], [64, 1024]) == 16
    assert pack.copy_unit([0x1000, 0x2008], [64, 1024]) == 8
    assert pack.copy_unit([0x1000], [6]) == 2
    assert pack.copy_unit([0x1001], [16]) == 1


def test_bad_lengths_and_chunks_are_named():
    with pytest.raises(ValueError, match="-1"):
        pack.chunk_table([3, -1])
    with pytest.raises(ValueError, match="chunk_units"):
        pack.chunk_table([3], 0)


_UPLOAD_ORDER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import fake_cuda
cupy = fake_cuda.install_cupy()
from mpitrain.ops.cuda import pack
if {skip_wait!r}:
    cupy.cuda.get_current_stream = lambda: type("S", (), {{"synchronize": lambda self: None}})()
arrays = [cupy.asarray(np.arange(n, dtype=np.float32)) for n in (5, 300, 7)]
fused = cupy.empty(sum(a.nbytes for a in arrays), dtype=np.uint8)
packer = pack.Packer([a.data.ptr for a in arrays], [a.nbytes for a in arrays], fused.data.ptr)
cupy.cuda.runtime.deviceSynchronize = lambda: None  # only the packer's own wait may help
for a in arrays:
    fake_cuda._in_flight.pop(a.a.ctypes.data, None)  # the tensors are the framework's
packer.pack(fused, cupy.cuda.Stream(non_blocking=True))
want = np.concatenate([np.asarray(a) for a in arrays])
assert np.array_equal(np.asarray(fused).view(np.float32), want)
"""


@pytest.mark.parametrize("skip_wait", [False, True], ids=["packer", "negative-control"])
def test_the_tables_land_before_the_kernel_on_another_stream_reads_them(skip_wait):
    """The H100 bug of 2026-11-26: the tables were uploaded on one stream and read by the
    kernel on a non-blocking one with nothing ordering the two.  The fake cupy keeps a host
    upload in flight until its stream is synchronised and makes the kernel refuse it; the
    negative control takes the Packer's wait away and must fail."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    code = _UPLOAD_ORDER.format(tests=tests, skip_wait=skip_wait)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    if skip_wait:
        assert result.returncode != 0 and "may not have landed" in result.stderr, result.stderr
    else:
        assert result.returncode == 0, result.stderr
