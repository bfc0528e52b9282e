"""The CUDA IPC protocol (handle exchange, reduce-scatter/allgather, growth, hierarchical),
run with ranks as threads over numpy memory standing in for exported device buffers."""

import threading

import numpy as np
import pytest

from mpitrain.core.dtypes import STORAGE, ReduceOp
from mpitrain.ops import reference
from mpitrain.ops.cuda import ipc
from mpitrain.ops.reduction import Reduction


class Registry:
    """What the driver keeps: exported allocations by handle; counts opens and closes."""

    def __init__(self):
        self.memory = {}
        self.lock = threading.Lock()
        self.opened = 0
        self.closed = 0
        self.freed = 0


class FakeIpc:
    def __init__(self, registry):
        self.registry = registry

    def allocate(self, nbytes):
        mem = np.zeros(nbytes, dtype=np.uint8)
        with self.registry.lock:
            self.registry.memory[id(mem).to_bytes(8, "little") * 8] = mem
        return mem

    def handle(self, memory):
        return id(memory).to_bytes(8, "little") * 8  # 64 bytes, as cudaIpcMemHandle_t

    def open(self, handle, nbytes):
        with self.registry.lock:
            self.registry.opened += 1
            mem = self.registry.memory[handle]
        assert mem.nbytes == nbytes
        return mem

    def close(self, opened):
        with self.registry.lock:
            self.registry.closed += 1

    def free(self, memory):
        with self.registry.lock:
            self.registry.freed += 1
            del self.registry.memory[self.handle(memory)]

    def view(self, memory, dtype, offset, count):
        return memory[offset:offset + count * dtype.itemsize].view(dtype)


class ThreadComm:
    """A communicator among threads: allgather and barrier, as the local comm offers."""

    def __init__(self, rank, shared):
        self.rank, self.shared = rank, shared

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.shared["size"]

    def Barrier(self):
        self.shared["barrier"].wait(timeout=20)

    def allgather(self, value):
        slots = self.shared["slots"]
        slots[self.rank] = value
        self.Barrier()
        out = list(slots)
        self.Barrier()
        return out


class NumpyOps:
    def reduce(self, inputs, out, how):
        out[...] = reference.reduce([np.array(x) for x in inputs], how.dtype, how.op,
                                    how.prescale, how.postscale)

    def copy(self, dst, src):
        dst[...] = src

    def synchronize(self):
        pass


def _ranks(size, body):
    shared = {"size": size, "barrier": threading.Barrier(size), "slots": [None] * size}
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = body(r, ThreadComm(r, shared))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def _data(rank, count, dtype):
    rng = np.random.default_rng(rank)
    if dtype == "bfloat16":
        return reference.f32_to_bf16(rng.standard_normal(count).astype(np.float32))
    if dtype == "int32":
        return rng.integers(-50, 50, count).astype(np.int32)
    return rng.standard_normal(count).astype(dtype)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_allreduce_equals_the_reference_on_every_rank(size, dtype):
    registry = Registry()
    count, op = 1001, ReduceOp.SUM
    pre, post = (0.5, 2.0) if dtype != "int32" else (1.0, 1.0)

    def body(rank, comm):
        window = ipc.Window(FakeIpc(registry), comm)
        itemsize = STORAGE[dtype].itemsize
        window.ensure(count * itemsize)
        mine = window.views(dtype, 0, count)[rank]
        mine[...] = _data(rank, count, dtype)  # the pack into the window
        out = np.empty(count, STORAGE[dtype])
        ipc.allreduce(window, NumpyOps(), Reduction(dtype, pre, post, op),
                      ipc.Part(0, count, align=4), lambda a, b: out[a:b])
        window.close()
        return out

    outs = _ranks(size, body)
    want = reference.reduce([_data(r, count, dtype) for r in range(size)], dtype, op, pre, post)
    for out in outs:
        np.testing.assert_array_equal(out, want)
    # Each rank opened every peer's window once, closed each, freed its own.
    assert registry.opened == registry.closed == size * (size - 1)
    assert registry.freed == size and not registry.memory


def test_windows_grow_together_and_reexport():
    registry = Registry()

    def body(rank, comm):
        window = ipc.Window(FakeIpc(registry), comm)
        window.ensure(100)
        window.ensure(50)  # fits: no exchange
        first = window.exchanges
        window.ensure(3 << 20)
        assert window.capacity >= 3 << 20
        result = (first, window.exchanges)
        window.close()
        return result

    assert _ranks(3, body) == [(1, 2)] * 3
    assert registry.opened == registry.closed == 2 * 3 * 2
    assert not registry.memory


def test_ranks_asking_for_different_sizes_fail_everywhere():
    def body(rank, comm):
        window = ipc.Window(FakeIpc(Registry()), comm)
        with pytest.raises(RuntimeError, match="different sizes"):
            window.ensure(100 + rank)
        return True

    assert _ranks(2, body) == [True, True]


def test_hierarchical_runs_the_cross_step_on_the_owned_slice_only():
    # 2 "nodes" x 2 local ranks; the cross step is a sum with the other node, which holds
    # the same data times 10 (so the expected result is 11x the node's sum).
    registry = Registry()
    count = 10
    crossed = [None, None]

    def body(rank, comm):
        window = ipc.Window(FakeIpc(registry), comm)
        window.ensure(count * 4)
        mine = window.views("float32", 0, count)[rank]
        mine[...] = np.arange(count, dtype=np.float32) + rank

        def cross(start, stop):
            crossed[rank] = (start, stop)
            part = window.views("float32", start, stop)[rank]
            part *= 11

        out = np.empty(count, np.float32)
        ipc.allreduce(window, NumpyOps(), Reduction("float32", 1.0, 0.5, ReduceOp.SUM),
                      ipc.Part(0, count), lambda a, b: out[a:b], cross=cross)
        window.close()
        return out

    outs = _ranks(2, body)
    want = (2 * np.arange(count, dtype=np.float32) + 1) * 11 * 0.5
    for out in outs:
        np.testing.assert_array_equal(out, want)
    assert crossed == [(0, 5), (5, 10)]


def test_owner_slices_cover_in_rank_order():
    # ipc cuts windows with the data plane's one rule (ops/slices.py)
    assert ipc.owner_slices(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert ipc.owner_slices(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert ipc.owner_slices(10, 2, 4) == [(0, 8), (8, 10)]
    with pytest.raises(ValueError, match="positive"):
        ipc.owner_slices(10, 0)


def test_slices_reject_negative_counts():
    from mpitrain.ops import slices
    with pytest.raises(ValueError, match="-3"):
        slices.balanced(-3, 2)
    assert slices.balanced(7, 2) == [(0, 4), (4, 7)]
