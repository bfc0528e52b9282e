"""Recycled huge-page buffers and the channel split, without MPI."""

import gc

import torch

from mpitrain.collectives import arrays
from mpitrain.core.memory import Recycler, page_aligned_empty
from mpitrain.ops import channels


def test_large_buffers_are_aligned_to_huge_pages():
    buf = page_aligned_empty(5 << 20)
    assert buf.nbytes == 5 << 20
    assert buf.__array_interface__["data"][0] % (2 << 20) == 0
    buf[:] = 7  # writable
    assert page_aligned_empty(10).nbytes == 10


def test_released_buffers_come_back_and_small_ones_are_plain():
    pool = Recycler(min_bytes=1 << 20, max_free_bytes=16 << 20)
    a = pool.take(3 << 20)
    addr = a.__array_interface__["data"][0]
    del a
    gc.collect()
    b = pool.take((3 << 20) + 5)  # same power-of-two class
    assert b.__array_interface__["data"][0] == addr
    assert b.nbytes == (3 << 20) + 5
    assert pool.take(100).nbytes == 100


def test_pool_keeps_no_more_than_its_limit():
    pool = Recycler(min_bytes=1 << 20, max_free_bytes=4 << 20)
    held = [pool.take(4 << 20) for _ in range(3)]
    del held
    gc.collect()
    assert pool._free_bytes <= 4 << 20


def test_torch_outputs_from_the_pool_keep_shape_dtype_and_memory():
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int8):
        x = torch.zeros((3, 1 << 20), dtype=dtype)
        out, view = arrays.empty_like(x)
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
        assert view.shape == x.shape
        assert out.data_ptr() == view.__array_interface__["data"][0]  # one memory


def test_channel_parts_cover_the_buffer_in_aligned_pieces():
    assert channels.parts(100, 4, 4) == [(0, 100)]  # too small to split
    n = (5 << 20) // 4 + 3
    ranges = channels.parts(n, 4, 3)
    assert len(ranges) == 3
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo % 64 == 0 for lo, _ in ranges)
