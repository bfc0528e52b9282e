"""The kernel launches of a device reduction or cast, as data: which kernel variant each
launch is, what it reads and writes, and with which scales.

A reduction over k buffers is k-1 launches of the two-input ``combine`` kernel: the first reads
two inputs, the middle ones update an accumulator (float32 for 16-bit and float32 types,
float64 for float64, an integer's own width otherwise), the last writes the output.  One
buffer alone is one ``scale`` launch, and so is a cast.

Separate from :mod:`.kernels` (numba's kernels, and launching them through numba's dispatch)
because it is the one plan that numba's dispatch, the prepared launches of :mod:`.launch` and
the PTX list of :mod:`.ptx` all follow: plain Python that needs no numba, so every one of them
launches (or compiles) exactly the same kernels on the same buffers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ...core.dtypes import FLOATING, STORAGE, ReduceOp


def accumulator_kind(dtype: str) -> str:
    """The kind an intermediate result of ``dtype`` is kept in between launches."""
    if dtype in ("float16", "bfloat16", "float32"):
        return "acc32"
    if dtype == "float64":
        return "acc64"
    return dtype  # integers (and bool, as uint8) accumulate in their own width


def accumulator_dtype(dtype: str) -> np.dtype:
    kind = accumulator_kind(dtype)
    if kind == "acc32":
        return np.dtype(np.float32)
    if kind == "acc64":
        return np.dtype(np.float64)
    return STORAGE[dtype]


def reduce_plan(count: int, dtype: str) -> list[tuple[int, int, str, str, bool]]:
    """The launches reducing ``count`` buffers: (input a, input b, kind a, kind out, last).

    Inputs are numbered 0..count-1; -1 means the accumulator.  The first launch reads two
    inputs, later ones the accumulator and the next input; the last writes the output (the
    logical dtype, postscaled), the others the accumulator.
    """
    if count < 2:
        raise ValueError(f"a reduction needs at least 2 buffers, got {count}")
    acc = accumulator_kind(dtype)
    plan = []
    for step in range(1, count):
        a, kind_a = (0, dtype) if step == 1 else (-1, acc)
        last = step == count - 1
        plan.append((a, step, kind_a, dtype if last else acc, last))
    return plan


def storage_op(dtype: str, op: ReduceOp) -> ReduceOp:
    """bool reduces as uint8 0/1: or is max, and is min."""
    if dtype == "bool":
        return ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
    return op


# Where a step reads or writes, besides the inputs (numbered from 0).
SCRATCH = -1
OUT = -2


class Step(NamedTuple):
    """One kernel launch of a reduction or cast: the variant, and what it reads and writes.

    ``family`` is ``combine`` (two inputs) or ``scale`` (one); ``kinds`` the factory's kind
    arguments; ``reads`` input indices (or :data:`SCRATCH`); ``writes`` :data:`OUT` or
    :data:`SCRATCH`; ``scales`` the kernel's scale arguments, in order.  numba's dispatch
    (:func:`.kernels.launch_step`) and the prepared path (:mod:`.launch`) run the same steps, so
    both launch exactly the kernels that :mod:`.ptx` compiles and CI checks.
    """

    family: str
    kinds: tuple[str, ...]
    op: ReduceOp | None
    reads: tuple[int, ...]
    writes: int
    scales: tuple[float, ...]


def reduce_steps(count: int, dtype: str, op: ReduceOp, prescale: float,
                 postscale: float) -> list[Step]:
    """The launches reducing ``count`` equally long buffers of ``dtype`` into the output.

    Raises:
        ValueError: ``op`` is not Sum/Min/Max/Product, or ``count`` is below 1.
    """
    if op not in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        raise ValueError(f"reduce_buffers takes Sum/Min/Max/Product, not {op!r}")
    if count < 1:
        raise ValueError(f"a reduction needs at least 1 buffer, got {count}")
    kind = "uint8" if dtype == "bool" else dtype
    op = storage_op(dtype, op)
    if dtype == "bool":
        prescale = postscale = 1.0
    if count == 1:
        return [Step("scale", (kind, kind), None, (0,), OUT, (prescale, postscale))]
    steps = []
    for a, b, kind_a, kind_out, last in reduce_plan(count, kind):
        first = a >= 0
        steps.append(Step("combine", (kind_a, kind, kind_out), op,
                          (a if first else SCRATCH, b), OUT if last else SCRATCH,
                          (prescale if first else 1.0, prescale, postscale if last else 1.0)))
    return steps


def cast_step(dtype_in: str, dtype_out: str, scale: float = 1.0) -> Step:
    """The launch converting a buffer of ``dtype_in`` into ``dtype_out``, times ``scale``.

    Raises:
        TypeError: either type is not floating.
    """
    for name in (dtype_in, dtype_out):
        if name not in FLOATING:
            raise TypeError(f"cast converts floating types, got {name!r}")
    return Step("scale", (dtype_in, dtype_out), None, (0,), OUT, (scale, 1.0))


def step_buffers(step: Step, inputs: list[Any], out: Any, scratch: Any) -> list[Any]:
    """The arrays ``step`` takes, in the kernel's order: what it reads, then what it writes."""
    def pick(index: int) -> Any:
        return scratch if index == SCRATCH else out if index == OUT else inputs[index]

    return [pick(i) for i in (*step.reads, step.writes)]


__all__ = ["OUT", "SCRATCH", "Step", "accumulator_dtype", "accumulator_kind", "cast_step",
           "reduce_plan", "reduce_steps", "step_buffers", "storage_op"]
