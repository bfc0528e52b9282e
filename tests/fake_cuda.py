"""Fake CUDA for the tests that run the GPU code on a CPU; two fakes for two kinds of test.

**A fake device for ordering** (:class:`FakeDevice`, tests/unit): work enqueued on a stream
runs only when the device is stepped, stream heads are taken in an adversarial order (the
framework's stream last, so a read before the producer's write shows, or with
``framework_first`` first, so a use before the channels' results shows), and a wait blocks its
stream until the event's record has run.  ``ignore_waits=True`` makes the device disregard
waits, for the negative controls that prove a test can fail.

**A fake cupy for data** (:func:`install_cupy`, tests/mpi/test_device_fake.py), whose "device"
is host memory, to run the GPU data plane end to end.  ``install_cupy()`` puts ``cupy`` and
``cupyx`` modules in ``sys.modules`` before mpitrain looks for them.  Device pointers are real
host addresses, so MPI reads "device" buffers directly (as a CUDA-aware MPI would),
``memcpyAsync`` is ``memmove``, and every enqueued operation runs at once (stream ordering is
what the fake device above is for) with one exception that the GPU taught us: an upload from
host memory (``asarray`` of a numpy array) stays *in flight* on the current stream until that
stream (or the device) is synchronised, and the pack kernel refuses to read in-flight memory
from another stream (on an H100 it read a half-written pointer table: an illegal address).
IPC memory is POSIX shared memory: ``ipcGetMemHandle`` gives its name and
``ipcOpenMemHandle`` maps it in another process, so ranks really read each other's windows.
``RawKernel`` runs the pack kernel through
:func:`mpitrain.ops.cuda.pack.emulate`; numba kernels run in numba's CUDA simulator, whether
numba's dispatch launches them or a ``RawModule`` loaded from :func:`prepared_source`'s
stand-in PTX does (the prepared launches of :mod:`mpitrain.ops.cuda.launch`: the fake decodes
their arguments as numba lays them out, so a wrong pointer, length or scale shows as a wrong
result).  Only what mpitrain calls is implemented.

**The ledger** (:data:`LEDGER`): every operation that on a GPU reaches the CUDA driver or
runtime, allocates, or makes a cupy object, counted by kind as the fake cupy sees it
(``launch``, ``wait``, ``record``, ``stream_sync``, ``event_sync``, ``device_sync``,
``alloc``, ``upload``, ``memcpy``, ``d2h``, ``h2d``, ``ipc``, ``array``, ``stream``,
``event``); :func:`count_simulator_launches` adds numba's own launches in the simulator.
tests/mpi/test_device_budget.py holds the data plane to a budget with it.

Nothing here imports numba or mpitrain at import time: test_device_fake.py must switch numba
to its simulator first.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import sys
import threading
import types
from collections import Counter, deque
from multiprocessing import resource_tracker, shared_memory

import numpy as np


# ====================================================================== the ordering device
class FakeEvent:
    def __init__(self):
        self.done = False


class FakeStream:
    def __init__(self, name, priority):
        self.name = name
        self.priority = priority
        self.queue = deque()


class FakeDevice:
    def __init__(self, ignore_waits=False, framework_first=False):
        self.lock = threading.RLock()
        self.streams = []
        self.ignore_waits = ignore_waits
        self.log = []  # (stream name, label) in execution order
        self.framework = self._stream("framework", priority=1000 if framework_first else -1)

    def _stream(self, name, priority):
        with self.lock:
            s = FakeStream(name, priority)
            self.streams.append(s)
            return s

    # ------------------------------------------------------- StreamBackend
    def new_stream(self):
        return self._stream(f"channel{len(self.streams) - 1}", priority=len(self.streams))

    def record(self, stream):
        event = FakeEvent()
        with self.lock:
            stream.queue.append(("record", event, None))
        return event

    def wait(self, stream, event):
        with self.lock:
            stream.queue.append(("wait", event, None))

    def synchronize(self, stream):
        while True:
            with self.lock:
                if not stream.queue:
                    return
                if not self._step():
                    raise AssertionError(f"deadlock: {stream.name} waits on an event never "
                                         "recorded")

    def host_wait(self, event):
        while True:
            with self.lock:
                if event.done:
                    return
                if not self._step():
                    raise AssertionError("deadlock: waiting for an event never recorded")

    # ------------------------------------------------------------- device work
    def launch(self, stream, label, fn):
        with self.lock:
            stream.queue.append(("run", fn, label))

    def drain(self):
        with self.lock:
            while any(s.queue for s in self.streams):
                if not self._step():
                    raise AssertionError("deadlock among the fake streams")

    def _runnable(self, stream):
        if not stream.queue:
            return False
        kind, obj, _ = stream.queue[0]
        return kind != "wait" or obj.done or self.ignore_waits

    def _step(self):
        ready = [s for s in self.streams if self._runnable(s)]
        if not ready:
            return False
        stream = max(ready, key=lambda s: s.priority)
        kind, obj, label = stream.queue.popleft()
        if kind == "record":
            obj.done = True
        elif kind == "run":
            obj()
            self.log.append((stream.name, label))
        return True


# ========================================================================= the fake cupy
LEDGER: Counter = Counter()
_ledger_lock = threading.Lock()
# Kernels counted but not run (benchmarks/gpu_host_overhead.py --fake times the host's work
# alone); results are then meaningless.
NULL_KERNELS = False


def _count(kind):
    with _ledger_lock:  # the channels' threads count too
        LEDGER[kind] += 1


def ledger():
    """A copy of the counts so far."""
    with _ledger_lock:
        return Counter(LEDGER)


def reset_ledger():
    with _ledger_lock:
        LEDGER.clear()


_stream_ids = itertools.count(0x1000)
_shared: dict[int, shared_memory.SharedMemory] = {}  # address -> segment (own or opened)


def _at(address, nbytes):
    """A uint8 numpy view of raw memory (no owner: the caller keeps the memory alive)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _address_of(shm):
    holder = ctypes.c_char.from_buffer(shm.buf)
    address = ctypes.addressof(holder)
    del holder  # no lasting export, so the segment can be closed later
    return address


class _Data:
    def __init__(self, ptr):
        self.ptr = ptr


class _Device:
    compute_capability = "90"

    def __init__(self, index=0):
        self.id = index

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ndarray:  # noqa: N801 - cupy's name
    """A "device" array: a numpy array standing for device memory."""

    def __init__(self, shape=None, dtype=np.float32, memptr=None, _array=None):
        _count("array")
        if _array is None:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape))
            _array = _at(memptr.ptr, count * dtype.itemsize).view(dtype).reshape(shape)
            self._owner = memptr
        self.a = _array

    # array protocol
    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "strides": None,
                "data": (self.a.ctypes.data, False), "version": 3}

    def __array__(self, dtype=None, copy=None):
        return self.a if dtype is None else self.a.astype(dtype)

    data = property(lambda self: _Data(self.a.ctypes.data))
    shape = property(lambda self: self.a.shape)
    size = property(lambda self: self.a.size)
    nbytes = property(lambda self: self.a.nbytes)
    dtype = property(lambda self: self.a.dtype)
    ndim = property(lambda self: self.a.ndim)
    flags = property(lambda self: self.a.flags)
    device = property(lambda self: _Device(0))

    def __len__(self):
        return len(self.a)

    def __getitem__(self, key):
        out = self.a[key]
        return ndarray(_array=out) if isinstance(out, np.ndarray) else out

    def __setitem__(self, key, value):
        self.a[key] = np.asarray(value)

    def view(self, dtype):
        return ndarray(_array=self.a.view(dtype))

    def reshape(self, *shape):
        return ndarray(_array=self.a.reshape(*shape))

    def copy(self):
        return ndarray(_array=self.a.copy())

    def get(self, stream=None, out=None):
        _count("d2h")
        if out is None:
            return self.a.copy()
        out[...] = self.a
        return out

    def set(self, array, stream=None):
        _count("h2d")
        self.a[...] = np.asarray(array)


def empty(shape, dtype=np.float32):
    _count("alloc")
    return ndarray(_array=np.empty(shape, dtype=dtype))


def asarray(x):
    if isinstance(x, ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"])
        count = int(np.prod(cai["shape"]))
        return ndarray(_array=_at(cai["data"][0], count * dtype.itemsize).view(dtype)
                       .reshape(cai["shape"]))
    _count("upload")
    uploaded = ndarray(_array=np.array(x))
    # From pageable host memory the copy returns once the bytes are staged; the device has
    # them only when the stream it ran on is synchronised (see the module docstring).
    _in_flight[uploaded.a.ctypes.data] = _current_stream()
    return uploaded


# Uploads not yet known to have landed: address -> the stream they were enqueued on.
_in_flight = {}
_local = threading.local()


def _current_stream():
    stack = getattr(_local, "streams", None)
    return stack[-1] if stack else Stream.null


def asnumpy(x):
    return np.array(np.asarray(x))


# -------------------------------------------------------------------------- cupy.cuda
class Stream:
    null = None  # set below

    def __init__(self, non_blocking=False, ptr=None):
        _count("stream")
        self.ptr = next(_stream_ids) if ptr is None else ptr

    def synchronize(self):
        _count("stream_sync")
        for address in [a for a, s in _in_flight.items() if s is self]:
            del _in_flight[address]

    def wait_event(self, event):
        _count("wait")

    def __enter__(self):
        if not hasattr(_local, "streams"):
            _local.streams = []
        _local.streams.append(self)
        return self

    def __exit__(self, *exc):
        _local.streams.pop()
        return False


Stream.null = Stream(ptr=0)


def ExternalStream(ptr):  # noqa: N802 - cupy's name
    return Stream(ptr=ptr)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        _count("event")
        self.recorded = False

    def record(self, stream=None):
        _count("record")
        self.recorded = True

    def synchronize(self):
        _count("event_sync")
        assert self.recorded, "waiting for an event that was never recorded"


class Memory:
    """cudaMalloc: POSIX shared memory here, so that another process can open it."""

    def __init__(self, size):
        _count("alloc")
        self.size = size
        self.shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
        self.ptr = _address_of(self.shm)
        _shared[self.ptr] = self.shm

    def __del__(self):
        _shared.pop(self.ptr, None)
        try:
            self.shm.close()
            self.shm.unlink()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


class UnownedMemory:
    def __init__(self, ptr, size, owner):
        self.ptr, self.size, self.owner = ptr, size, owner


class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem = mem
        self.ptr = mem.ptr + offset


class _Runtime:
    memcpyDeviceToDevice = 3
    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self):
        self.opened = 0
        self.closed = 0

    def getDeviceCount(self):
        return 1

    def getDevice(self):
        return 0

    def deviceSynchronize(self):
        _count("device_sync")
        _in_flight.clear()  # every other operation ran when it was enqueued

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        _count("memcpy")
        ctypes.memmove(dst, src, nbytes)

    def ipcGetMemHandle(self, ptr):
        _count("ipc")
        return _shared[ptr].name.encode().ljust(64, b"\0")

    def ipcOpenMemHandle(self, handle, flags=1):
        _count("ipc")
        name = bytes(handle).rstrip(b"\0").decode()
        shm = shared_memory.SharedMemory(name=name)
        # The exporting process owns (and unlinks) the segment; do not let this process's
        # resource tracker unlink it too.
        resource_tracker.unregister(shm._name, "shared_memory")
        ptr = _address_of(shm)
        _shared[ptr] = shm
        self.opened += 1
        return ptr

    def ipcCloseMemHandle(self, ptr):
        _count("ipc")
        _shared.pop(ptr).close()
        self.closed += 1


class RawKernel:
    """The pack kernel, run by the emulator of its loop order."""

    def __init__(self, source, name):
        assert name.startswith("mpitrain_pack_"), name
        self.unit = int(name.rsplit("_", 1)[1])

    def __call__(self, grid, block, args):
        from mpitrain.ops.cuda import pack

        _count("launch")
        pointers, table, chunks, fused, unpack = args
        launch = _current_stream()
        for name, array in (("pointer table", pointers), ("chunk table", table)):
            upload = _in_flight.get(array.a.ctypes.data)
            if upload is not None and upload is not launch:
                raise RuntimeError(f"pack kernel on stream {launch.ptr} reads its {name} while "
                                   f"its upload on stream {upload.ptr} may not have landed")
        if NULL_KERNELS:
            return
        rows = np.asarray(table).reshape(-1, 4)[:int(chunks)].copy()
        rows[:, 1:] *= self.unit  # to bytes
        ptrs = np.asarray(pointers)
        extents = {}
        for t, src, _dst, n in rows:
            extents[int(t)] = max(extents.get(int(t), 0), int(src + n))
        tensors = [_at(int(ptrs[t]), extents.get(t, 0)) for t in range(len(ptrs))]
        pack.emulate(rows, tensors, np.asarray(fused).view(np.uint8), bool(unpack),
                     blocks=int(grid[0]))


# ------------------------------------------------------------- prepared numba kernels
_prepared = {}  # stand-in entry name -> the mpitrain.ops.cuda.ptx.Kernel it stands for
_prepared_names = {}
_inside_prepared = threading.local()


def prepared_source(kernel, cc):
    """Stands in for :func:`mpitrain.ops.cuda.ptx.to_ptx` (the simulator compiles nothing): a
    PTX-like module whose one entry names ``kernel`` and lists numba's parameters as the fake
    knows numba's ABI (seven 64-bit words per array, the element count, a double per scale)."""
    name = _prepared_names.get(kernel)
    if name is None:
        name = _prepared_names[kernel] = f"mpitrain_sim_{len(_prepared_names)}"
        _prepared[name] = kernel
    scales = 3 if kernel.family == "combine" else 2
    types_ = ["u64"] * (7 * len(kernel.arrays) + 1) + ["f64"] * scales
    params = ",\n".join(f"\t.param .{t} {name}_param_{i}" for i, t in enumerate(types_))
    return f"//\n// stand-in for sm_{cc[0]}{cc[1]}\n.visible .entry {name}(\n{params}\n)\n{{\n}}\n"


class RawModule:
    """A module loaded from :func:`prepared_source`'s text, or refused like a bad PTX file."""

    def __init__(self, path=None, code=None):
        with open(path) as f:
            found = re.findall(r"\.entry\s+(\w+)\(", f.read())
        if len(found) != 1 or found[0] not in _prepared:
            raise RuntimeError(f"fake RawModule: {path} is no stand-in PTX")
        self.name = found[0]

    def get_function(self, name):
        if name != self.name:
            raise RuntimeError(f"fake RawModule: no entry {name!r}")
        return _PreparedKernel(_prepared[name])


class _PreparedKernel:
    """A numba kernel launched as a RawKernel: its arguments decoded, then run in numba's
    simulator on views of the memory they point at."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, grid, block, args):
        from mpitrain.core.dtypes import ReduceOp
        from mpitrain.ops.cuda import kernels

        _count("launch")
        k = self.kernel
        arrays, rest = [], list(args)
        for dtype in k.arrays:
            meminfo, parent, nitems, itemsize, data, shape, stride = rest[:7]
            del rest[:7]
            want = np.dtype(dtype).itemsize
            assert all(isinstance(v, (np.uint64, np.int64)) for v in args[:7 * len(k.arrays)])
            assert meminfo == parent == 0 and itemsize == want and stride == want, args
            assert shape == nitems, args
            arrays.append(_at(int(data), int(nitems) * want).view(dtype))
        n, *scales = rest
        assert isinstance(n, np.int64) and all(isinstance(v, np.float64) for v in scales)
        if NULL_KERNELS:
            return
        _inside_prepared.on = True
        try:
            # The simulator runs one kernel at a time, and swaps kernels.py's `cuda` while it
            # does: compile under the same lock.
            with kernels._launching:
                if k.family == "combine":
                    fn = kernels.combine_kernel(*k.kinds, ReduceOp[k.op])
                else:
                    fn = kernels.scale_kernel(*k.kinds)
                fn[int(grid[0]), int(block[0])](*arrays, int(n), *(float(v) for v in scales))
        finally:
            _inside_prepared.on = False


def count_simulator_launches():
    """Count numba's own kernel launches in its CUDA simulator as ``launch`` in the ledger
    (call once, after numba was switched to the simulator; not the launches the prepared
    stand-ins make, which count themselves)."""
    from numba.cuda.simulator import kernel as sim

    original = sim.FakeCUDAKernel.__call__
    if getattr(original, "_counted", False):
        return

    def counted(self, *args):
        if not self._device and not getattr(_inside_prepared, "on", False):
            _count("launch")
            if NULL_KERNELS:
                return None
        return original(self, *args)

    counted._counted = True
    sim.FakeCUDAKernel.__call__ = counted


def install_cupy():
    """Register the fake as ``cupy``/``cupyx``; returns the cupy module."""
    cuda = types.SimpleNamespace(
        Stream=Stream, ExternalStream=ExternalStream, Event=Event, Memory=Memory,
        UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer, runtime=_Runtime(),
        Device=_Device, get_current_stream=_current_stream)
    cupy = types.ModuleType("cupy")
    cupy.__dict__.update(ndarray=ndarray, empty=empty, asarray=asarray, asnumpy=asnumpy,
                         RawKernel=RawKernel, RawModule=RawModule, cuda=cuda,
                         __version__="fake")
    cupyx = types.ModuleType("cupyx")

    def empty_pinned(shape, dtype=np.float32):
        _count("alloc")
        return np.empty(shape, dtype=dtype)

    cupyx.empty_pinned = empty_pinned
    sys.modules["cupy"] = cupy
    sys.modules["cupyx"] = cupyx
    return cupy
