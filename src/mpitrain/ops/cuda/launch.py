"""Kernel launches without numba's per-call dispatch: numba's kernels as PTX, launched by cupy.

Launching a numba kernel the usual way (``kernel[blocks, threads, stream](*args)``) types every
argument, looks the overload up, wraps every array as a numba device array and marshals it,
each time: tens of microseconds of Python per launch (on an H100, 2026-11-26, that and the
wrapping of each array, ``from_cuda_array_interface``, dominated every reduction below 16 MiB).
Here each kernel variant is compiled once, by :func:`.ptx.to_ptx` (the very PTX that CI
compiles, assembles and checks for every variant, ``tests/gpu_compile``), loaded once as a
cupy ``RawModule``, and launched as a ``RawKernel`` with its arguments laid out as numba lays
out a kernel's parameters: each one-dimensional C-contiguous array becomes seven (meminfo,
parent, item count, item size, data pointer, shape, stride), an ``int64`` one, a ``float64``
one.  That layout is checked against the PTX's parameter list when a variant is loaded (and
for every variant in CI), so a numba that lays parameters out differently makes this path step
aside for that variant, with a warning, rather than launch with wrong arguments.

:class:`Launcher` runs the steps of :mod:`.kernel_steps` (one plan, so numba's dispatch and this
path launch the same kernels on the same buffers): prepared where it can, numba's dispatch
otherwise (numba's CUDA simulator, a GPU numba cannot compile for, a variant that failed
to load).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...core.errors import MpitrainInternalError
from . import kernel_steps, kernels, ptx

# numba's data model of a one-dimensional array argument: meminfo, parent, nitems, itemsize,
# data, shape[0], strides[0], each one 64-bit parameter.
ARRAY_PARAMETERS = 7
# Argument tuples kept per launcher (layouts repeat every step; new ones replace old ones).
_MAX_CACHED_ARGUMENTS = 1024

_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)")


def variant(step: kernel_steps.Step, buffers: Sequence[Any]) -> ptx.Kernel:
    """The :class:`.ptx.Kernel` that ``step`` launches on ``buffers`` (their dtypes pick it)."""
    arrays = tuple(np.dtype(b.dtype).name for b in buffers)
    return ptx.Kernel(step.family, "", step.kinds, step.op.name if step.op else "", arrays)


def expected_parameters(kernel: ptx.Kernel) -> list[str]:
    """The PTX parameter types numba gives ``kernel``: 64-bit words for every array field and
    for the element count, ``f64`` for each scale."""
    scales = 3 if kernel.family == "combine" else 2
    return ["u64"] * (ARRAY_PARAMETERS * len(kernel.arrays) + 1) + ["f64"] * scales


def entry(ptx_text: str) -> tuple[str, list[str]]:
    """The one kernel entry of a PTX module: its name and its parameters' types, in order.

    Raises:
        MpitrainInternalError: the module has no entry, or several.
    """
    found = _ENTRY.findall(ptx_text)
    if len(found) != 1:
        raise MpitrainInternalError(f"expected one .entry in the PTX, found {len(found)}")
    name, params = found[0]
    return name, _PARAM.findall(params)


def arguments(buffers: Sequence[Any], n: int, scales: Sequence[float]) -> tuple[Any, ...]:
    """The kernel's arguments as numba's ABI lays them out, as fixed-width numpy scalars.

    ``buffers`` are one-dimensional C-contiguous device arrays (cupy's).
    """
    args: list[Any] = []
    for b in buffers:
        count, itemsize = int(b.size), int(b.dtype.itemsize)
        # meminfo and parent are numba's reference-counting fields; kernels never read them.
        args += [np.uint64(0), np.uint64(0), np.int64(count), np.int64(itemsize),
                 np.uint64(int(b.data.ptr)), np.int64(count), np.int64(itemsize)]
    args.append(np.int64(n))
    args += [np.float64(s) for s in scales]
    return tuple(args)


Source = Callable[[ptx.Kernel, tuple[int, int]], str]


class PreparedKernels:
    """numba's kernels loaded into cupy, one module per variant, each loaded at first use."""

    def __init__(self, cupy: Any, cc: tuple[int, int], source: Source = ptx.to_ptx) -> None:
        """Args:
            cc: the compute capability to compile for (this rank's GPU's).
            source: PTX of a variant for a compute capability (tests give a stand-in).
        """
        self.cupy = cupy
        self.cc = cc
        self.source = source
        self._functions: dict[ptx.Kernel, Any] = {}
        self._arguments: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._lock = threading.Lock()
        # cupy loads a RawModule's file when it first launches on a device: keep the files.
        self._files = tempfile.TemporaryDirectory(prefix="mpitrain-ptx-")

    def function(self, kernel: ptx.Kernel) -> Any:
        """The loaded RawKernel of ``kernel``, or None when it cannot be prepared (warned once)."""
        try:
            return self._functions[kernel]
        except KeyError:
            pass  # first use: loaded below, under the lock (None is a stored answer too)
        with self._lock:
            if kernel not in self._functions:
                self._functions[kernel] = self._load(kernel)
        return self._functions[kernel]

    def _load(self, kernel: ptx.Kernel) -> Any:
        try:
            text = self.source(kernel, self.cc)
            name, params = entry(text)
            want = expected_parameters(kernel)
            if params != want:
                raise MpitrainInternalError(
                    f"its PTX takes parameters {params}, numba's layout gives {want}")
            path = Path(self._files.name) / f"kernel{len(self._functions)}.ptx"
            path.write_text(text)
            # get_function loads the module now: a failure here falls back, not a launch.
            function = self.cupy.RawModule(path=str(path)).get_function(name)
        except Exception as exc:  # noqa: BLE001 - any failure means numba's dispatch instead
            warnings.warn(f"mpitrain: {kernel.name or kernel.family} for sm_{self.cc[0]}"
                          f"{self.cc[1]} launches through numba's dispatch, not prepared: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
            return None
        return function

    def launch(self, step: kernel_steps.Step, buffers: Sequence[Any], n: int, stream: Any) -> bool:
        """Launch ``step`` over ``n`` elements of ``buffers`` on ``stream`` (a cupy stream).

        Returns False, launching nothing, when its variant could not be prepared.
        """
        function = self.function(variant(step, buffers))
        if function is None:
            return False
        key = (step, n, *(int(b.data.ptr) for b in buffers))
        args = self._arguments.get(key)
        if args is None:
            if len(self._arguments) >= _MAX_CACHED_ARGUMENTS:
                self._arguments.clear()
            args = self._arguments[key] = arguments(buffers, n, step.scales)
        blocks, threads = kernels.launch_shape(n)
        with stream:
            function((blocks,), (threads,), args)
        return True

    def close(self) -> None:
        self._functions.clear()
        self._arguments.clear()
        with contextlib.suppress(OSError):
            self._files.cleanup()


class Launcher:
    """Runs :class:`.kernel_steps.Step` lists on cupy arrays: prepared, else numba's dispatch."""

    def __init__(self, prepared: PreparedKernels | None, numba_cuda: Any) -> None:
        self.prepared = prepared
        self.numba_cuda = numba_cuda
        self._streams: dict[int, Any] = {}

    def run(self, steps: Sequence[kernel_steps.Step], inputs: Sequence[Any], out: Any,
            scratch: Any, stream: Any) -> None:
        """Launch ``steps`` on ``stream`` (cupy's) over ``out``'s length (see
        :func:`.kernel_steps.step_buffers` for what each reads and writes)."""
        n = int(out.size)
        for step in steps:
            buffers = kernel_steps.step_buffers(step, list(inputs), out, scratch)
            if self.prepared is not None and self.prepared.launch(step, buffers, n, stream):
                continue
            kernels.launch_step(step, [self.numba_array(b) for b in buffers], n,
                                kernels.LaunchConfig(self.numba_stream(stream)))

    def numba_array(self, array: Any) -> Any:
        """``array`` (cupy's) as numba's dispatch takes it, for kernels launched that way."""
        if kernels.simulated():
            # numba's CUDA simulator (CPU tests over a fake device, whose "device" memory is
            # host memory) takes host arrays and has no from_cuda_array_interface.
            return np.asarray(array)
        return self.numba_cuda.from_cuda_array_interface(array.__cuda_array_interface__,
                                                         owner=array, sync=False)

    def numba_stream(self, stream: Any) -> Any:
        """numba's view of ``stream`` (cupy's), made once per stream."""
        if kernels.simulated():
            return 0
        pointer = int(stream.ptr)
        found = self._streams.get(pointer)
        if found is None:  # one wrapper per channel stream, made once
            found = self._streams[pointer] = self.numba_cuda.external_stream(pointer)
        return found

    def close(self) -> None:
        if self.prepared is not None:
            self.prepared.close()
        self._streams.clear()


def compute_capability(cupy: Any, device: int) -> tuple[int, int]:
    """(major, minor) of GPU ``device``, as cupy reports it (``"90"`` for an H100)."""
    digits = str(cupy.cuda.Device(device).compute_capability)
    return int(digits[:-1]), int(digits[-1])


def default_launcher(cupy: Any, numba_cuda: Any, device: int) -> Launcher:
    """Prepared launches on a GPU; numba's dispatch alone in its simulator, which has no PTX."""
    if kernels.simulated():
        return Launcher(None, numba_cuda)
    return Launcher(PreparedKernels(cupy, compute_capability(cupy, device)), numba_cuda)


__all__ = ["ARRAY_PARAMETERS", "Launcher", "PreparedKernels", "arguments", "compute_capability",
           "default_launcher", "entry", "expected_parameters", "variant"]
