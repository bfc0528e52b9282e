"""Compile every kernel the GPU data plane can launch, for a chosen GPU, with no GPU or driver.

NVIDIA's compilers install from PyPI and run on a CPU-only machine
(``pip install 'mpitrain[gpu-compile]'``: numba-cuda with libNVVM, NVRTC and ``ptxas``).  This
module lists every kernel variant the data plane launches (:func:`kernels`: each reduction
and cast of :mod:`.kernels`, each copy unit of :mod:`.pack`), compiles it to PTX for an explicit
compute capability (:func:`to_ptx`), assembles that with ``ptxas`` (:func:`assemble`) and reads
back registers and spills, from which :func:`occupancy` follows.  CI runs all of it on every
commit (``tests/unit/test_cuda_ptx.py``); on the command line it prints the README's table::

    python -m mpitrain.ops.cuda.ptx --cc 80 90
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ...core.dtypes import FLOATING, STORAGE, ReduceOp
from ...core.errors import MpitrainInternalError
from . import kernel_steps as _steps
from . import kernels as _kernels
from . import pack as _pack

# Compute capabilities CI compiles for: A100 and H100.
CCS: tuple[tuple[int, int], ...] = ((8, 0), (9, 0))
# Resident threads per SM (the register file is 64K 32-bit registers on all of them).
_MAX_THREADS_PER_SM = {(8, 0): 2048, (8, 6): 1536, (8, 7): 2048, (8, 9): 1536, (9, 0): 2048,
                       (10, 0): 2048, (12, 0): 1536}
_REGISTERS_PER_SM = 65536
_MAX_BLOCKS_PER_SM = 32
_REGISTER_UNIT = 256  # registers are allocated per warp in units of this many
_REDUCE_OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


class Kernel(NamedTuple):
    """One kernel variant as the data plane launches it.

    ``family`` is ``combine`` or ``scale`` (numba, :mod:`.kernels`) or ``pack`` (CUDA C);
    ``kinds`` are the factory's kind arguments (for ``pack``, the copy unit in bytes);
    ``arrays`` the numpy dtypes of the array arguments, in order.
    """

    family: str
    dtype: str
    kinds: tuple[str, ...]
    op: str
    arrays: tuple[str, ...]

    @property
    def name(self) -> str:
        if self.family == "pack":
            return f"pack {self.kinds[0]}B"
        what = f"{self.family}({','.join(self.kinds)}{',' + self.op if self.op else ''})"
        return f"{self.dtype}: {what} on {','.join(self.arrays)}"


class Resources(NamedTuple):
    """What ``ptxas -v`` reports for one entry function."""

    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


def _combine(dtype: str, kinds: tuple[str, str, str], op: ReduceOp,
             arrays: tuple[str, str, str]) -> Kernel:
    return Kernel("combine", dtype, kinds, op.name, arrays)


def numba_kernels() -> list[Kernel]:
    """Every reduction/cast kernel that :func:`.kernels.reduce_buffers` and :func:`.kernels.cast`
    launch, each once: per dtype and op, the single-input scaling and the four steps of
    :func:`.kernel_steps.reduce_plan` (storage or accumulator in, storage or accumulator out), on
    the arrays the device data plane hands them (bool tensors stay bool, reduced as uint8)."""
    found: dict[Kernel, None] = {}
    for dtype, storage in STORAGE.items():
        kind = "uint8" if dtype == "bool" else dtype
        arr, acc_arr = storage.name, _steps.accumulator_dtype(kind).name
        found[Kernel("scale", dtype, (kind, kind), "", (arr, arr))] = None
        ops = dict.fromkeys(_steps.storage_op(dtype, op) for op in _REDUCE_OPS)
        for op in ops:
            for count in (2, 3, 4):
                for a, _b, kind_a, kind_out, last in _steps.reduce_plan(count, kind):
                    arrays = (arr if a >= 0 else acc_arr, arr, arr if last else acc_arr)
                    found[_combine(dtype, (kind_a, kind, kind_out), op, arrays)] = None
    for src in sorted(FLOATING):
        for dst in sorted(FLOATING):
            pair = (STORAGE[src].name, STORAGE[dst].name)
            found[Kernel("scale", f"{src}->{dst}", (src, dst), "", pair)] = None
    return list(found)


def pack_kernels() -> list[Kernel]:
    """The pack/unpack kernel for each copy unit (one entry does both directions)."""
    return [Kernel("pack", f"{unit}B", (str(unit),), "", ()) for unit in _pack.UNITS]


def kernels() -> list[Kernel]:
    """Every kernel variant the GPU data plane can launch."""
    return numba_kernels() + pack_kernels()


def _numba_type(dtype_name: str) -> str:
    return "boolean" if dtype_name == "bool" else dtype_name


def numba_signature(kernel: Kernel) -> str:
    """The signature numba compiles ``kernel`` for at launch: contiguous 1-d arrays, the element
    count as int64 and the scales as float64 (Python ints and floats)."""
    arrays = [f"{_numba_type(a)}[::1]" for a in kernel.arrays]
    scales = ["float64"] * (3 if kernel.family == "combine" else 2)
    return f"void({', '.join([*arrays, 'int64', *scales])})"


def python_function(kernel: Kernel) -> Any:
    """The Python function numba compiles for a ``combine``/``scale`` kernel."""
    if kernel.family == "combine":
        kind_a, kind_b, kind_out = kernel.kinds
        return _kernels.combine_kernel(kind_a, kind_b, kind_out, ReduceOp[kernel.op]).py_func
    if kernel.family == "scale":
        return _kernels.scale_kernel(*kernel.kinds).py_func
    raise ValueError(f"{kernel.name} is not a numba kernel")


def _check_cc(cc: tuple[int, int]) -> None:
    if cc not in _MAX_THREADS_PER_SM:
        raise ValueError(f"unsupported compute capability {cc!r}; "
                         f"known: {sorted(_MAX_THREADS_PER_SM)}")


def to_ptx(kernel: Kernel, cc: tuple[int, int]) -> str:
    """PTX of ``kernel`` for compute capability ``cc`` (e.g. ``(9, 0)``), without a driver.

    Raises:
        MpitrainInternalError: the compiler rejected the kernel (its log is in the message).
    """
    _check_cc(cc)
    if kernel.family == "pack":
        return _nvrtc_ptx(*_pack.kernel_source(int(kernel.kinds[0])), cc)
    function, signature = python_function(kernel), numba_signature(kernel)
    # Kinds that pick the same helpers (float32 and acc32, say) give the same code: compile once.
    key = (function.__code__, tuple(c.cell_contents for c in function.__closure__ or ()),
           signature, cc)
    if key not in _PTX:
        from numba import cuda  # optional numba.cuda (numba-cuda): only to compile a kernel
        try:
            _PTX[key] = str(cuda.compile_ptx(function, signature, cc=cc)[0])
        except Exception as exc:  # noqa: BLE001 - numba raises many types; name the kernel
            raise MpitrainInternalError(f"{kernel.name} does not compile for sm_{cc[0]}{cc[1]}"
                                        f": {type(exc).__name__}: {exc}") from exc
    return _PTX[key]


_PTX: dict[tuple[Any, ...], str] = {}


def _nvrtc_ptx(source: str, name: str, cc: tuple[int, int]) -> str:
    from cuda.bindings import nvrtc  # optional (cuda-python): only the pack kernel needs it

    def check(result: Any, what: str, log: str = "") -> None:
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise MpitrainInternalError(f"NVRTC {what} failed for {name} on compute_{cc[0]}"
                                        f"{cc[1]}: {result!r}\n{log}")

    err, program = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    check(err, "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture=compute_{cc[0]}{cc[1]}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            check(err, "compilation", log.decode(errors="replace"))
        err, size = nvrtc.nvrtcGetPTXSize(program)
        check(err, "nvrtcGetPTXSize")
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetPTX(program, buf)
        check(err, "nvrtcGetPTX")
        return buf.rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(program)


@functools.cache
def ptxas() -> str | None:
    """Path of ``ptxas`` (the nvidia-cuda-nvcc wheel's, else one on PATH), or None."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility  # optional: else PATH
        found = find_nvidia_binary_utility("ptxas")
    except Exception:  # noqa: BLE001 - pathfinder missing or unable: fall back to PATH
        found = None
    return found or shutil.which("ptxas")


_RESOURCES = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
    r"Used (\d+) registers", re.S)


def assemble(ptx: str, cc: tuple[int, int], name: str = "kernel") -> Resources:
    """Assemble ``ptx`` for ``sm_<cc>`` with ``ptxas -v``; the one entry's resources.

    Raises:
        MpitrainInternalError: ptxas is missing, rejects the PTX, or reports no entry.
    """
    _check_cc(cc)
    tool = ptxas()
    if tool is None:
        raise MpitrainInternalError("ptxas not found: pip install 'mpitrain[gpu-compile]'")
    with tempfile.TemporaryDirectory(prefix="mpitrain-ptx-") as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run([tool, f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(source), "-o",
                                 str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True, timeout=120)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise MpitrainInternalError(f"ptxas rejected {name} for sm_{cc[0]}{cc[1]}:\n{log}")
    found = _RESOURCES.findall(log)
    if len(found) != 1:
        raise MpitrainInternalError(f"expected one entry function in {name}, ptxas said:\n{log}")
    stack, stores, loads, registers = (int(v) for v in found[0])
    return Resources(registers, stack, stores, loads)


def occupancy(registers: int, cc: tuple[int, int], threads: int = _kernels.THREADS) -> float:
    """Fraction of an SM's thread slots filled by blocks of ``threads`` using ``registers``
    each (registers are the only limit these kernels have: no shared memory)."""
    _check_cc(cc)
    max_threads = _MAX_THREADS_PER_SM[cc]
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // _REGISTER_UNIT) * _REGISTER_UNIT
    blocks = min(_REGISTERS_PER_SM // (per_warp * warps), max_threads // threads,
                 _MAX_BLOCKS_PER_SM)
    return blocks * threads / max_threads


def missing_toolchain() -> str:
    """What is missing to compile offline ('' when nothing is), without importing it."""
    missing = [pkg for module, pkg in (("numba_cuda", "numba-cuda"),
                                       ("cuda.bindings", "cuda-bindings"))
               if _find_spec(module) is None]
    if ptxas() is None:
        missing.append("ptxas (nvidia-cuda-nvcc-cu12)")
    if missing:
        return (f"missing {', '.join(missing)}: pip install 'mpitrain[gpu-compile]'")
    return ""


def _find_spec(module: str) -> Any:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _group(kernel: Kernel) -> str:
    if kernel.family == "pack":
        return "pack (copy units 1-16 B)"
    if kernel.family == "scale" and "->" in kernel.dtype:
        return "casts (float16/bfloat16/float32/float64 pairs)"
    return f"{kernel.dtype} {'reduce' if kernel.family == 'combine' else 'scale'}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print a markdown table of registers, spills and occupancy of every kernel."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cc", nargs="+", default=["80", "90"],
                        help="compute capabilities as digits, e.g. 80 90")
    parser.add_argument("--all", action="store_true",
                        help="one row per kernel variant (default: one per dtype and family)")
    args = parser.parse_args(argv)
    ccs = [(int(c[:-1]), int(c[-1])) for c in args.cc]
    for cc in ccs:
        _check_cc(cc)
    problem = missing_toolchain()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    rows: dict[str, dict[tuple[int, int], list[Resources]]] = {}
    for kernel in kernels():
        row = rows.setdefault(kernel.name if args.all else _group(kernel), {})
        for cc in ccs:
            row.setdefault(cc, []).append(assemble(to_ptx(kernel, cc), cc, kernel.name))
    header = " | ".join(f"sm_{a}{b} registers | sm_{a}{b} occupancy" for a, b in ccs)
    print(f"| kernels | variants | {header} | spilled bytes |")
    print("| --- | ---: |" + " ---: | ---: |" * len(ccs) + " ---: |")
    for name, by_cc in rows.items():
        cells, spilled = [], 0
        for cc in ccs:
            regs = sorted(r.registers for r in by_cc[cc])
            spilled += sum(r.spill_stores + r.spill_loads for r in by_cc[cc])
            span = f"{regs[0]}" if regs[0] == regs[-1] else f"{regs[0]}-{regs[-1]}"
            cells += [span, f"{occupancy(regs[-1], cc):.0%}"]
        print(f"| {name} | {len(by_cc[ccs[0]])} | {' | '.join(cells)} | {spilled} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
