"""The device allreduce of one fused bucket: pack, reduce over the chosen transport, unpack.

One :class:`DeviceGroup` per process set, made at its first CUDA collective (every rank
reaches that point in the same order, so the communicators it duplicates match).  A bucket:

1. the packing stream (channel 0's) waits for the events the adapters recorded on the
   framework's stream at submission, then the batched pack kernel copies every tensor into
   the fusion buffer (the CUDA IPC window when the node shares one) in one launch;
2. the channels reduce their slices over the transport :mod:`.transport` chose: CUDA IPC
   within a node (and around the cross-node step of the hierarchical allreduce), device
   pointers handed to a CUDA-aware MPI, or pipelined pinned host staging through the CPU data
   plane;
3. the packing stream waits for every channel, unpacks in one launch, and the framework's
   streams wait for that: ``step()`` sees the results, the host never waited for the device.

A single tensor that the transport can reduce where it lies skips steps 1 and 3.  A world of
one moves nothing: a bucket with no scaling costs no device work at all, otherwise one launch
(or pack, scale, unpack).  Kernels launch through :mod:`.launch` (prepared, not numba's
per-call dispatch), and every per-layout object (the pack tables and window views of
:mod:`.buffers`, the kernel arguments) is made once per layout: ``tests/mpi/test_device_budget.py``
holds each transport to its count of launches, waits, synchronisations and allocations per
bucket.

With ``MPITRAIN_DETERMINISTIC`` a floating-point reduction gives the CPU data plane's bits:
``fixed-point`` packs a Sum's bucket into scratch, turns it into integers on the device
(:mod:`.fixed_point`), reduces the exponents and the integers through step 2 as it would any
integer bucket (every transport is exact on them) and turns them back, and folds a Min, Max or
Product on host copies; ``rank-order`` stages every bucket through the host, where the CPU's
rank-order fold reduces it (the device kernels would round a prescaled sum differently: see
:mod:`.kernels` on fused multiply-adds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ...core.dtypes import FLOATING, STORAGE, ReduceOp
from .. import fixed_point as fixed_spec
from .. import mpi as mpi_ops
from .. import ordered
from ..algorithms import allreduce as host_allreduce
from ..group import Group
from ..reduction import Overrides, Reduction
from . import fixed_point, ipc, kernel_steps, kernels, launch, streams, transport
from .buffers import DeviceBuffers, addressed
from .probe import require
from .streams import Channel, Channels, CupyStreams

_MPI_REDUCIBLE = ("float32", "float64", "int8", "uint8", "int16", "int32", "int64")
# The process set's own Group reduces staged chunks with one channel: the device channels
# already run in parallel; no nested split.
_ONE_CHANNEL = Overrides(streams=1)


class _Ops:
    """:class:`ipc.DeviceOps` on one channel's stream."""

    def __init__(self, device_group: DeviceGroup, channel: Channel) -> None:
        self.dg = device_group
        self.channel = channel

    def reduce(self, inputs: list[Any], out: Any, how: Reduction) -> None:
        self.dg.reduce(self.channel, inputs, out, how)

    def copy(self, dst: Any, src: Any) -> None:
        if int(dst.data.ptr) == int(src.data.ptr):
            return
        self.dg.memcpy(dst, src, self.channel.stream)

    def synchronize(self) -> None:
        self.channel.stream.synchronize()


class DeviceGroup:
    """The GPU data plane of one process set on this rank."""

    def __init__(self, group: Group, cuda_aware: bool,
                 force: transport.Transport | None = None, device: int | None = None,
                 launcher: launch.Launcher | None = None) -> None:
        """Args:
            cuda_aware: whether MPI takes device pointers (detected at init).
            force: one transport for the whole allreduce instead of the topology's choice
                (benchmarks compare host staging with the chosen path this way).
            device: the GPU this rank drives (default: the calling thread's current one).
            launcher: how kernels launch (default :func:`.launch.default_launcher`; tests
                and benchmarks compare numba's dispatch with prepared launches this way).
        """
        self.cupy = require("allreduce of CUDA tensors")
        import cupyx  # optional: CPU-only installs have no cupy; require() vouched for it
        from numba import cuda as numba_cuda  # optional (numba-cuda), like cupy

        self.numba_cuda = numba_cuda
        self.device = int(self.cupy.cuda.runtime.getDevice()) if device is None else device
        self.group = group
        self.backend = CupyStreams(self.cupy)
        topo = group.topology
        channels = max(1, group.config.allreduce_streams)
        self.channels = Channels(self.backend, [group.comm.Dup() for _ in range(channels)])
        self.local_comms = [group.comms.local.Dup() for _ in range(channels)]
        self.cross_comms = [group.comms.cross.Dup() for _ in range(channels)]
        # What mpi_ops needs of each channel's communicators, asked of MPI once, not per call.
        self._channel_groups = [_CommGroup(c.comm) for c in self.channels.channels]
        self._cross_groups = [_CommGroup(c) for c in self.cross_comms]
        ipc_usable = topo.local_size > 1 and topo.is_homogeneous
        self.phases = transport.choose(cuda_aware, topo.local_size, topo.num_nodes, ipc_usable,
                                       group.config.allreduce_algorithm)
        if force is not None:
            self.phases = [("allreduce", force)]
        self.rank_order = group.config.deterministic == "rank-order"
        if self.rank_order:  # the CPU folds every bucket, whatever was forced (module docs)
            self.phases = [("allreduce", transport.Transport.HOST_STAGING)]
        self.alone = self.phases[0][1] == transport.Transport.LOCAL
        self.uses_ipc = self.phases[0][1] == transport.Transport.CUDA_IPC
        # How data crosses MPI: the cross-node phase of the hierarchical allreduce, or the
        # whole allreduce (staging/CUDA-aware); None when IPC alone does the job.
        self.cross = self.phases[1][1] if len(self.phases) == 3 else None
        self.across = self.cross if self.cross is not None else self.phases[0][1]
        self.window = (ipc.Window(ipc.CupyIpc(self.cupy), self.local_comms[0])
                       if self.uses_ipc else None)
        self.launcher = (launch.default_launcher(self.cupy, numba_cuda, self.device)
                         if launcher is None else launcher)
        self.buffers = DeviceBuffers(self.cupy, cupyx, self.window)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Make this rank's GPU current for cupy and numba on the calling thread (the engine's
        and the channels' threads start on device 0 otherwise)."""
        with self.cupy.cuda.Device(self.device):
            if kernels.simulated():
                yield
            else:
                with self.numba_cuda.gpus[self.device]:
                    yield

    # ------------------------------------------------------------------ device work
    def reduce(self, channel: Channel, inputs: list[Any], out: Any, how: Reduction) -> None:
        steps = kernel_steps.reduce_steps(len(inputs), how.dtype, how.op, how.prescale,
                                          how.postscale)
        scratch = None
        if len(inputs) > 2:  # only then does a step keep an accumulator between launches
            kind = "uint8" if how.dtype == "bool" else how.dtype
            scratch = self.buffers.scratch(channel.index, kernel_steps.accumulator_dtype(kind),
                                           int(out.size))
        self.launcher.run(steps, inputs, out, scratch, channel.stream)

    def memcpy(self, dst: Any, src: Any, stream: Any) -> None:
        runtime = self.cupy.cuda.runtime
        runtime.memcpyAsync(int(dst.data.ptr), int(src.data.ptr), int(src.nbytes),
                            runtime.memcpyDeviceToDevice, stream.ptr)

    # -------------------------------------------------------------------- transports
    def _over_mpi(self, channel: Channel, comm: Any, host_group: Any, buf: Any,
                  how: Reduction) -> None:
        """Allreduce the device slice ``buf`` in place across ``comm``'s ranks.

        ``host_group`` reduces staged chunks: the process set's own Group on channel 0 (the
        whole CPU data plane, shared memory and rings included), MPI on a channel's own
        communicator otherwise.
        """
        if buf.size == 0:
            return
        if self.across == transport.Transport.CUDA_AWARE_MPI:
            self._cuda_aware(channel, comm, buf, how)
            return
        count = int(buf.size)
        itemsize = buf.dtype.itemsize
        chunk = max(1, transport.STAGING_CHUNK_BYTES // itemsize)
        hosts = [h.view(buf.dtype)
                 for h in self.buffers.pinned(channel.index, min(count, chunk) * itemsize)]

        def copy(stream: Any, dst: Any, src: Any) -> None:
            if isinstance(dst, np.ndarray):
                src.get(stream=stream, out=dst)
            else:
                dst.set(src, stream=stream)

        def reduce_host(host: np.ndarray) -> None:
            if host_group is self.group:
                host_allreduce(self.group, host, host, how, overrides=_ONE_CHANNEL)
            elif self.rank_order and how.dtype in FLOATING:
                ws = self.buffers.host_scratch(channel.index)
                ordered.allreduce(ordered.Ranks(comm, None, ws), host, host, how)
            else:
                mpi_ops.allreduce(host_group, host, host, how)

        transport.staged_allreduce(self.backend, channel.stream, buf, count,
                                   transport.Staging(hosts, chunk, copy, reduce_host))

    def _cuda_aware(self, channel: Channel, comm: Any, buf: Any, how: Reduction) -> None:
        dtype, op, prescale, postscale = how.dtype, how.op, how.prescale, how.postscale
        mpi_op = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                  ReduceOp.PRODUCT: MPI.PROD}[op]
        if dtype == "bool":
            buf = buf.view(np.uint8)
            mpi_op = MPI.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else MPI.MIN
        wide = dtype not in _MPI_REDUCIBLE and dtype != "bool"
        # float16/bfloat16: MPI has no such types; reduce a float32 copy (the same float32
        # accumulation as everywhere else), narrowing with the postscale fused in.
        work = (self.buffers.scratch(channel.index, np.dtype(np.float32), int(buf.size)) if wide
                else buf)
        if wide:
            self.launcher.run([kernel_steps.cast_step(dtype, "float32", prescale)], [buf], work,
                              None, channel.stream)
        elif prescale != 1.0:
            self.reduce(channel, [buf], buf, Reduction(dtype, prescale=prescale))
        channel.stream.synchronize()  # MPI reads device memory outside any stream
        comm.Allreduce(MPI.IN_PLACE, work, op=mpi_op)
        if wide:
            self.launcher.run([kernel_steps.cast_step("float32", dtype, postscale)], [work], buf,
                              None, channel.stream)
        elif postscale != 1.0:
            self.reduce(channel, [buf], buf, Reduction(dtype, postscale=postscale))

    # ------------------------------------------------------------------- the bucket
    def allreduce(self, inputs: Sequence[Any], outputs: Sequence[Any], how: Reduction,
                  ready: Sequence[Any], framework_streams: Sequence[Any]) -> None:
        """Allreduce flat device arrays ``inputs`` into ``outputs`` (which may be them).

        Args:
            ready: events recorded on the framework's streams after the inputs were written.
            framework_streams: streams that must see the outputs (they are made to wait).
        """
        count = sum(int(x.size) for x in inputs)
        if count == 0:
            return
        with self.on_device():
            if self.group.config.deterministic == "fixed-point" and how.dtype in FLOATING:
                if how.op == ReduceOp.SUM:
                    fixed_spec.check_world(self.group.size)
                    self._fixed_point(inputs, outputs, how, ready, framework_streams)
                else:
                    self._folded_on_host(inputs, outputs, how, ready)
                return
            self._allreduce(inputs, outputs, count, how, ready, framework_streams)

    def _folded_on_host(self, inputs: Sequence[Any], outputs: Sequence[Any], how: Reduction,
                        ready: Sequence[Any]) -> None:
        """A floating Min, Max or Product in fixed-point mode: the CPU's rank-order fold on
        host copies (rare buckets; the device kernels' order would depend on the transport)."""
        for event in ready:
            self.backend.host_wait(event)  # the producer's writes, before the download
        hosts = [self.cupy.asnumpy(x).reshape(-1) for x in inputs]
        fused = np.concatenate(hosts)
        host_allreduce(self.group, fused, fused, how)
        offset = 0
        for out, host in zip(outputs, hosts):
            out.set(fused[offset:offset + host.size].reshape(out.shape))
            offset += host.size
        self.cupy.cuda.get_current_stream().synchronize()  # the uploads, before step() reads

    def _fixed_point(self, inputs: Sequence[Any], outputs: Sequence[Any], how: Reduction,
                     ready: Sequence[Any], framework_streams: Sequence[Any]) -> None:
        """The fixed-point sum of a bucket: encoded on the device, its exponents and integers
        reduced as integer buckets, decoded (see the module docstring)."""
        count = sum(int(x.size) for x in inputs)
        storage, lay = STORAGE[how.dtype], fixed_spec.LAYOUTS[how.dtype]
        stream = self.channels.channels[0].stream
        for event in ready:
            self.backend.wait(stream, event)
        in_place_single = (len(inputs) == 1
                           and int(inputs[0].data.ptr) == int(outputs[0].data.ptr))
        if in_place_single:
            values = inputs[0]
        else:  # not the IPC window: the integer buckets below go through it
            values = self.buffers.scratch("fixed.values", storage, count)
            self.buffers.packer(addressed(inputs), values.view(np.uint8)).pack(
                values.view(np.uint8), stream)
        exps = self.buffers.scratch("fixed.exps", STORAGE[lay.exps], count)
        words = self.buffers.scratch("fixed.words", STORAGE[lay.word], count * lay.words)
        # The codec's kernels launch through numba's dispatch (few launches per bucket).
        on = self.launcher.numba_stream(stream)
        v, e, w = (self.launcher.numba_array(a) for a in (values, exps, words))
        kernels.launch(fixed_point.exponents_kernel(how.dtype), count, on, v, e, count,
                       how.prescale)
        self._allreduce([exps], [exps], count, Reduction(lay.exps, op=ReduceOp.MAX), (), ())
        kernels.launch(fixed_point.encode_kernel(how.dtype), count, on, v, e, w, count,
                       how.prescale)
        self._allreduce([words], [words], count * lay.words, Reduction(lay.word), (), ())
        kernels.launch(fixed_point.decode_kernel(how.dtype), count, on, w, e, v, count,
                       how.postscale)
        if not in_place_single:
            self.buffers.packer(addressed(outputs), values.view(np.uint8)).unpack(
                values.view(np.uint8), stream)
        done = self.backend.record(stream)
        for framework_stream in framework_streams:
            self.backend.wait(framework_stream, done)

    def _allreduce(self, inputs: Sequence[Any], outputs: Sequence[Any], count: int,
                   how: Reduction, ready: Sequence[Any],
                   framework_streams: Sequence[Any]) -> None:
        # Each tensor's address is read once per call (the pack tables are keyed by them).
        ins = tuple([int(x.data.ptr) for x in inputs])
        outs = ins if outputs is inputs else tuple([int(y.data.ptr) for y in outputs])
        in_place = ins == outs
        if self.alone and in_place and (how.dtype == "bool"
                                        or how.prescale == how.postscale == 1.0):
            return  # a world of one, nothing to scale: the result is the input already
        pack_channel = self.channels.channels[0]
        pack_stream = pack_channel.stream
        for event in ready:
            self.backend.wait(pack_stream, event)
        if self.alone and len(inputs) == 1:
            # One launch, input to output, on the stream that waited for the producer.
            self.reduce(pack_channel, [inputs[0]], outputs[0], how)
        else:
            self._fused((inputs, ins), (outputs, outs), count, how)
        done = self.backend.record(pack_stream)
        for stream in framework_streams:
            self.backend.wait(stream, done)

    def _fused(self, inputs: tuple[Sequence[Any], tuple[int, ...]],
               outputs: tuple[Sequence[Any], tuple[int, ...]], count: int,
               how: Reduction) -> None:
        """Pack (unless one tensor can be reduced where it lies), reduce on the channels,
        unpack; all ordered on channel 0's stream, which waited for the producer.

        ``inputs`` and ``outputs`` are the arrays with their addresses."""
        storage = STORAGE[how.dtype]
        pack_stream = self.channels.channels[0].stream
        in_place_single = (len(inputs[0]) == 1 and self.window is None
                           and inputs[1] == outputs[1])
        if in_place_single:
            fused = inputs[0][0]
        else:
            fused = self.buffers.fusion(count * storage.itemsize, storage)
            self.buffers.packer(inputs, fused).pack(fused, pack_stream)
        align = max(1, 256 // storage.itemsize)

        def work(channel: Channel, start: int, stop: int) -> None:
            with self.on_device():
                self._slice(channel, fused, how, start, stop, align)

        min_chunk = max(1, streams.MIN_CHUNK_BYTES // storage.itemsize)
        # ready=None: Channels records one only if a channel runs on another stream.
        self.channels.run(pack_stream, None, count, work, streams.Slicing(align, min_chunk),
                          join=[pack_stream])
        if not in_place_single:
            self.buffers.packer(outputs, fused).unpack(fused, pack_stream)

    def _slice(self, channel: Channel, fused: Any, how: Reduction, start: int, stop: int,
               align: int) -> None:
        i = channel.index
        if self.alone:  # a fused bucket at a world of one: only its scaling
            part = fused[start:stop]
            self.reduce(channel, [part], part, how)
            return
        if self.window is None:
            host_group = self.group if i == 0 else self._channel_groups[i]
            self._over_mpi(channel, channel.comm, host_group, fused[start:stop], how)
            return
        cross = None
        if self.cross is not None:
            cross_comm, cross_group = self.cross_comms[i], self._cross_groups[i]

            def cross(lo: int, hi: int) -> None:
                self._over_mpi(channel, cross_comm, cross_group, fused[lo:hi], how.unscaled())
        ipc.allreduce(self.window, _Ops(self, channel), how,
                      ipc.Part(start, stop, align, self.local_comms[i]),
                      lambda lo, hi: fused[lo:hi], cross=cross)

    def close(self) -> None:
        """Release everything; not collective (safe at shutdown with a dead peer)."""
        if self.window is not None:  # before its communicator is freed below
            self.window.close(collective=False)
        self.channels.close()
        for comm in (*self.local_comms, *self.cross_comms):
            with contextlib.suppress(Exception):  # best effort at teardown
                comm.Free()
        self.buffers.clear()
        self.launcher.close()


class _CommGroup:
    """Just enough of a Group for :mod:`mpitrain.ops.mpi` on a channel's communicator."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.size = int(comm.Get_size())
        self.rank = int(comm.Get_rank())
