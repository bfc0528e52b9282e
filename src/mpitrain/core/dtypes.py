"""Reduce operations and element types shared by the data plane and everything above it.

Buffers in the data plane are plain numpy arrays.  numpy has no bfloat16, so a bfloat16
buffer is stored as uint16 and carries its logical type name beside it; every function of
the data plane takes that name (``dtype``) explicitly.
"""

from __future__ import annotations

import enum

import numpy as np

from .errors import AdasumTypeError


class ReduceOp(enum.IntEnum):
    """Reductions, numbered as Horovod numbers them."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


# Logical element type -> numpy storage type.
STORAGE: dict[str, np.dtype] = {
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bool": np.dtype(np.bool_),
}

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
INTEGER = frozenset({"uint8", "int8", "int16", "int32", "int64"})


def itemsize(dtype: str) -> int:
    return STORAGE[dtype].itemsize


def check_reduce_supported(dtype: str, op: ReduceOp) -> None:
    """Raise for reductions that make no sense on ``dtype``.

    Raises:
        TypeError: ``dtype`` is not a supported element type, or the op is meaningless on it
            (Adasum, a combination through dot products, needs floating point: an
            :class:`~mpitrain.core.errors.AdasumTypeError`, also a RuntimeError as in Horovod).
    """
    if dtype not in STORAGE:
        raise TypeError(f"unsupported element type {dtype!r}; supported: {sorted(STORAGE)}")
    if op == ReduceOp.ADASUM and dtype not in FLOATING:
        raise AdasumTypeError(f"op=Adasum needs floating-point tensors "
                              f"({', '.join(sorted(FLOATING))}), got {dtype}")
    if dtype == "bool" and op == ReduceOp.AVERAGE:
        raise TypeError("op=Average is not defined on bool tensors; use Sum (logical or), "
                        "Max, Min or Product")
