"""Horovod behaviours the parity audit (issue 13) found missing or different, each as Horovod's
own scripts and tests use them: alltoall's ValueError for non-integer splits, and
reducescatter's parameter order.

The names and signatures themselves are checked without MPI in tests/unit/test_horovod_parity.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

MPI_CONFIGS = ("np2", "np3")
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


# ---------------------------------------------------------------------------- alltoall
@pytest.mark.parametrize("make", [
    lambda: torch.ones(SIZE, dtype=torch.float32),
    lambda: np.ones(SIZE, dtype=np.float64),
    lambda: [1.0] * SIZE,
], ids=["torch-float", "numpy-float", "list-float"])
def test_alltoall_with_float_splits_raises_value_error(hvd, make):
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.arange(SIZE, dtype=torch.float32), splits=make())
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall_async(torch.arange(SIZE, dtype=torch.float32), splits=make())


# ------------------------------------------------------------------------ reducescatter
def test_reducescatter_takes_horovods_positional_order(hvd):
    x = torch.arange(SIZE * 2, dtype=torch.float32).reshape(SIZE, 2) + RANK
    want = (torch.arange(SIZE * 2, dtype=torch.float32).reshape(SIZE, 2) * SIZE
            + sum(range(SIZE)))[RANK:RANK + 1]
    # (tensor, name, compression, op, process_set, prescale_factor, postscale_factor)
    got = hvd.reducescatter(x, "rs.positional", hvd.Compression.none, hvd.Sum,
                            hvd.global_process_set, 2.0, 0.5)
    torch.testing.assert_close(got, want)
    # (tensor, name, op, process_set, prescale_factor, postscale_factor)
    got = hvd.synchronize(hvd.reducescatter_async(x, "rs.async", hvd.Sum, hvd.global_process_set,
                                                  3.0, 1.0))
    torch.testing.assert_close(got, want * 3)
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([x, x], "rs.grouped", hvd.Sum,
                                                           hvd.global_process_set, 1.0, 2.0))
    for out in outs:
        torch.testing.assert_close(out, want * 2)


def test_reducescatter_with_fp16_compression_keeps_the_dtype(hvd):
    x = torch.full((SIZE, 4), float(RANK + 1))
    got = hvd.reducescatter(x, compression=hvd.Compression.fp16, op=hvd.Sum)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.full((1, 4), float(SIZE * (SIZE + 1) // 2)))
    x.requires_grad_(True)
    outs = hvd.grouped_reducescatter([x], compression=hvd.Compression.fp16, op=hvd.Average)
    outs[0].sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
