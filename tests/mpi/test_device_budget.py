"""The host operations of one device allreduce, counted on the fake device, held to a budget.

Every operation the GPU data plane asks of cupy (kernel launches, stream waits, event records,
host synchronisations, allocations, uploads, copies, IPC calls, cupy objects made) is counted
by the fake cupy's ledger (tests/fake_cuda.py) during one allreduce of a bucket whose layout
was seen before (the steady state of training: the same gradients every step).  The budget is
the design's, written out per transport below, not a measurement: a bucket costs the same
whatever the number of tensors in it (one pack and one unpack launch, one wait for the
producer per framework stream, one event the framework waits on), allocates and uploads
nothing, and synchronises the host only where the transport must (CUDA IPC: once per phase
barrier; CUDA-aware MPI: once before MPI reads device memory; staging: once per chunk
downloaded).  Both launch paths are held to it: numba's dispatch and the prepared launches
(:mod:`mpitrain.ops.cuda.launch`, here through the fake's stand-in PTX).  The negative controls
at the end show the check fails on a deliberate regression (pointer tables uploaded per call;
one wait per request).
"""

import os
import sys
import types
from collections import Counter

import numba
import numpy as np
import pytest
from mpi4py import MPI

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
assert "numba.cuda" not in sys.modules, "numba.cuda was imported before the simulator was set"
numba.config.reload_config()

import fake_cuda  # noqa: E402

cupy = fake_cuda.install_cupy()
fake_cuda.count_simulator_launches()

from numba import cuda as numba_cuda  # noqa: E402

from mpitrain.core.dtypes import STORAGE, ReduceOp  # noqa: E402
from mpitrain.engine import device  # noqa: E402
from mpitrain.ops.cuda import allreduce as device_allreduce  # noqa: E402
from mpitrain.ops.cuda import ipc, kernels, launch, streams, transport  # noqa: E402
from mpitrain.ops.cuda.allreduce import DeviceGroup  # noqa: E402
from mpitrain.ops.cuda.buffers import DeviceBuffers  # noqa: E402
from mpitrain.ops.cuda.pack import Packer  # noqa: E402
from mpitrain.ops.cuda.transport import Transport  # noqa: E402
from mpitrain.ops.reduction import Reduction  # noqa: E402

MPI_CONFIGS = ("np1", "np2", "2x2")
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
# The simulator runs one Python thread per CUDA thread: keep launches and slices small.
kernels.THREADS, kernels.MAX_BLOCKS = 16, 2
streams.MIN_CHUNK_BYTES = 256
ipc.MIN_WINDOW_BYTES = 1024
# Operations that must never happen in the steady state, whatever the transport.
NEVER = ("alloc", "upload", "device_sync", "ipc", "stream")
TENSOR_COUNTS = (1, 2, 24)


def _launcher(kind):
    if kind == "numba":
        return launch.Launcher(None, numba_cuda)
    return launch.Launcher(launch.PreparedKernels(cupy, (9, 0), fake_cuda.prepared_source),
                           numba_cuda)


def _device_group(hvd, launcher, streams_=1, force=None):
    import dataclasses

    group = hvd.session.engine().process_set(0).group
    group = dataclasses.replace(group, config=dataclasses.replace(
        group.config, allreduce_streams=streams_))
    return DeviceGroup(group, cuda_aware=force == Transport.CUDA_AWARE_MPI, force=force,
                       launcher=_launcher(launcher))


def _tensors(count, dtype, total=600):
    """``count`` device tensors of ``total`` elements together (uneven sizes)."""
    sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
    rng = np.random.default_rng(RANK + 100 * count)
    return [cupy.asarray((rng.random(n) + 0.5).astype(dtype)) for n in sizes]


def _call(dg, tensors, dtype, postscale):
    """One bucket as the engine's door hands it down: ordered after one producer event on
    the framework's stream, which is made to wait for the result."""
    framework = cupy.cuda.Stream()
    ready = cupy.cuda.Event()
    ready.record(framework)
    fake_cuda.reset_ledger()
    dg.allreduce(tensors, tensors, Reduction(np.dtype(dtype).name, 1.0, postscale, ReduceOp.SUM),
                 [ready], [framework])
    return fake_cuda.ledger()


def _steady(dg, tensors, dtype="float32", postscale=1.0):
    """The ledger of the second allreduce of the same layout."""
    _call(dg, tensors, dtype, postscale)  # the first sees a new layout: tables, windows
    return _call(dg, tensors, dtype, postscale)


def budget(dg, tensors, dtype="float32", postscale=1.0):
    """The operations one steady-state allreduce of ``tensors`` may cost on ``dg``.

    Written from the design (module docstring), per transport; the number of tensors enters
    only through whether a lone tensor can be reduced where it lies.
    """
    want = Counter()
    count = sum(int(t.size) for t in tensors)
    storage = STORAGE[dtype]
    if dg.alone and postscale == 1.0:
        return want  # a world of one with nothing to scale: nothing at all
    want["wait"], want["record"] = 2, 1  # the producer's event; the result the framework waits on
    if dg.alone and len(tensors) == 1:
        want["launch"] = 1  # the scaling, input to output
        want["event"] = want["record"]
        return want
    align = max(1, 256 // storage.itemsize)
    lanes = len(streams.split(count, len(dg.channels), align,
                              max(1, streams.MIN_CHUNK_BYTES // storage.itemsize)))
    if lanes > 1:
        # channels 1.. wait for the packed bucket (one event) and are waited for (one each)
        want["record"] += 1 + (lanes - 1)
        want["wait"] += 2 * (lanes - 1)
    fused = not (len(tensors) == 1 and dg.window is None)
    want["launch"] = 2 if fused else 0  # pack and unpack: one launch each, any tensor count
    local = dg.window.size if dg.window is not None else 1
    wide = dtype not in device_allreduce._MPI_REDUCIBLE
    for _ in range(lanes):
        if dg.alone:
            want["launch"] += 1  # the scaling of the channel's slice
        elif dg.uses_ipc:
            want["launch"] += local - 1  # a two-input kernel per peer after the first
            want["memcpy"] += local - 1  # the allgather of the peers' reduced slices
            want["stream_sync"] += 3  # before each of the three phase barriers
            if dg.cross is not None:  # hierarchical: this rank's slice across nodes, staged
                want["stream_sync"] += 1
                want["launch"] += int(postscale != 1.0)  # applied after the cross step
                for key in ("d2h", "h2d", "record", "event_sync"):
                    want[key] += 1
        elif dg.across == Transport.CUDA_AWARE_MPI:
            want["stream_sync"] += 1  # MPI reads device memory outside any stream
            # float16/bfloat16 widen for MPI and narrow back (the postscale fused into the
            # narrowing); other types scale after MPI only when asked to
            want["launch"] += 2 if wide else int(postscale != 1.0)
        else:  # host staging: one chunk (the slices are far below STAGING_CHUNK_BYTES)
            for key in ("d2h", "h2d", "record", "event_sync"):
                want[key] += 1
    want["event"] = want["record"]
    return +want


def violations(got, want):
    """What ``got`` spends beyond or short of ``want`` (cupy objects apart), by kind."""
    kinds = (set(got) | set(want) | set(NEVER)) - {"array"}
    return {k: (got[k], want[k]) for k in sorted(kinds) if got[k] != want[k]}


def _check(dg, dtype="float32", postscale=1.0):
    objects = {}
    for n in TENSOR_COUNTS:
        tensors = _tensors(n, dtype)
        got = _steady(dg, tensors, dtype, postscale)
        assert violations(got, budget(dg, tensors, dtype, postscale)) == {}, (n, dict(got))
        objects[n] = got["array"]
    # cupy objects made per call (views of buffers and slices) do not grow with the tensors.
    assert objects[2] == objects[TENSOR_COUNTS[-1]], objects


@pytest.mark.parametrize("launcher", ["numba", "prepared"])
@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("force", [None, Transport.HOST_STAGING, Transport.CUDA_AWARE_MPI],
                         ids=["chosen", "staging", "cuda-aware"])
def test_a_bucket_costs_a_fixed_budget_whatever_its_tensor_count(hvd, launcher, channels, force):
    dg = _device_group(hvd, launcher, channels, force)
    try:
        _check(dg)
        if dg.alone or force == Transport.CUDA_AWARE_MPI:
            _check(dg, postscale=0.5)  # the scaling launches a world of one / MPI needs
        if force == Transport.CUDA_AWARE_MPI:
            _check(dg, dtype="float16")  # widened for MPI and narrowed back: two launches
    finally:
        dg.close()


def test_the_world_of_one_moves_nothing_and_the_result_is_right(hvd):
    dg = _device_group(hvd, "prepared")
    try:
        if not dg.alone:
            pytest.skip("a world of one only")
        assert dg.phases == [("allreduce", Transport.LOCAL)]
        for n in (1, 5):
            tensors = _tensors(n, np.float32)
            before = [np.asarray(t).copy() for t in tensors]
            assert _call(dg, tensors, "float32", 1.0) == Counter()  # nothing to do: nothing
            for t, b in zip(tensors, before):
                np.testing.assert_array_equal(np.asarray(t), b)
            _call(dg, tensors, "float32", 0.5)
            for t, b in zip(tensors, before):
                np.testing.assert_array_equal(np.asarray(t), b * np.float32(0.5))
    finally:
        dg.close()


def _requests(tensors, stream_pointers):
    """Requests as the front door makes them: one ready mark per tensor, recorded at submit."""
    return [types.SimpleNamespace(ready=device.mark_ready([stream_pointers[i % len(
        stream_pointers)]])) for i in range(len(tensors))]


@pytest.mark.parametrize("framework_streams", [1, 2])
def test_the_engine_door_waits_once_per_framework_stream_not_per_request(hvd, framework_streams):
    layer = device.DeviceLayer(hvd.session.engine().process_set(0).group)
    pointers = [0, cupy.cuda.Stream().ptr][:framework_streams]
    try:
        for n in (2, 24):
            tensors = _tensors(n, np.float32)
            for _ in range(2):  # the second call is the steady state
                requests = _requests(tensors, pointers)
                fake_cuda.reset_ledger()
                layer.allreduce(tensors, tensors, requests,
                                Reduction("float32", 1.0, 0.5, ReduceOp.SUM))
            got = fake_cuda.ledger()
            dg = layer._device_group
            want = budget(dg, tensors, postscale=0.5)
            # one producer event and one result wait per framework stream
            want["wait"] += 2 * (framework_streams - 1)
            assert violations(got, want) == {}, (n, dict(got))
    finally:
        layer.close()


# ------------------------------------------------------------------ negative controls
def test_negative_control_pointer_tables_uploaded_per_call_break_the_budget(hvd, monkeypatch):
    def uncached(self, arrays, fused):  # (tensors, their addresses) as DeviceGroup passes
        tensors, addresses = arrays
        return Packer(addresses, tuple(int(a.nbytes) for a in tensors), int(fused.data.ptr))

    monkeypatch.setattr(DeviceBuffers, "packer", uncached)
    dg = _device_group(hvd, "prepared")
    try:
        tensors = _tensors(24, np.float32)
        got = _steady(dg, tensors, postscale=0.5)
        bad = violations(got, budget(dg, tensors, postscale=0.5))
        assert bad["upload"] == (4, 0) and "stream_sync" in bad, bad
    finally:
        dg.close()


def test_negative_control_one_wait_per_request_breaks_the_budget(hvd, monkeypatch):
    def every_mark(requests):
        return [mark for r in requests for mark in r.ready]

    monkeypatch.setattr(device, "latest_marks", every_mark)
    layer = device.DeviceLayer(hvd.session.engine().process_set(0).group)
    try:
        tensors = _tensors(24, np.float32)
        for _ in range(2):
            requests = _requests(tensors, [0])
            fake_cuda.reset_ledger()
            layer.allreduce(tensors, tensors, requests,
                            Reduction("float32", 1.0, 0.5, ReduceOp.SUM))
        got = fake_cuda.ledger()
        bad = violations(got, budget(layer._device_group, tensors, postscale=0.5))
        assert bad["wait"][0] >= 24, bad
    finally:
        layer.close()


def test_transport_of_each_configuration_is_the_one_budgeted(hvd):
    """The budget's branches cover what each MPI configuration of this file chooses."""
    dg = _device_group(hvd, "numba")
    try:
        topo = hvd.core.runtime.state().topology
        kinds = [t for _, t in dg.phases]
        expected = transport.choose(False, topo.local_size, topo.num_nodes,
                                    topo.local_size > 1 and topo.is_homogeneous)
        assert kinds == [t for _, t in expected]
    finally:
        dg.close()
