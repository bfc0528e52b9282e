"""Transport choice: CUDA-aware MPI detection, phase selection, and the staging pipeline."""

import numpy as np
import pytest
from fake_cuda import FakeDevice

from mpitrain.ops.cuda import transport
from mpitrain.ops.cuda.transport import Transport


class Lib:
    def __init__(self, **symbols):
        self.__dict__.update(symbols)


def _detect(setting="auto", version="Open MPI v5.0.11", libs=("/x/libmpi.so.40",),
            lib=None, info=""):
    def load(path):
        if lib is None:
            raise OSError(path)
        return lib
    return transport.detect(setting, version, lambda: list(libs), load, lambda: info)


def test_the_library_query_wins_and_is_named():
    aware = _detect(lib=Lib(MPIX_Query_cuda_support=lambda: 1))
    assert aware.supported and "MPIX_Query_cuda_support" in aware.how
    assert not _detect(lib=Lib(MPIX_Query_cuda_support=lambda: 0)).supported


def test_mpich_gpu_query():
    def query(kind, flag):
        flag._obj.value = 1 if kind == 1 else 0
        return 0
    aware = _detect(version="MPICH 4.2", lib=Lib(MPIX_GPU_query_support=query))
    assert aware.supported and "MPIX_GPU_query_support" in aware.how


def test_ompi_info_when_the_library_does_not_answer():
    info = ("mca:mpi:base:param:mpi_built_with_cuda_support:value:true\n"
            "mca:mpi:base:param:mpi_built_with_cuda_support:source:default\n")
    assert _detect(lib=Lib(), info=info).supported
    assert not _detect(lib=Lib(), info=info.replace("true", "false")).supported
    # The same text from a library that is not Open MPI is not consulted.
    assert not _detect(version="MPICH 4.2", lib=Lib(), info=info).supported


def test_nothing_reported_means_staging():
    aware = _detect(lib=None, info="")
    assert not aware.supported and "no CUDA support" in aware.how


def test_forced_settings_and_a_bad_one():
    assert _detect(setting="1").supported
    assert not _detect(setting="0", lib=Lib(MPIX_Query_cuda_support=lambda: 1)).supported
    with pytest.raises(ValueError, match="'maybe'"):
        _detect(setting="maybe")


def test_parse_ompi_info_reads_the_opal_name_too():
    assert transport.parse_ompi_info("mca:opal:base:param:opal_built_with_cuda_support:value:"
                                     "false") is False
    assert transport.parse_ompi_info("nothing here") is None


def test_the_real_library_of_this_machine_answers():
    # The PyPI Open MPI is built --without-cuda: the query says no, by the library itself.
    from mpi4py import MPI
    aware = transport.detect("auto", MPI.Get_library_version())
    assert aware.supported is False
    assert "MPIX_Query_cuda_support" in aware.how or "ompi_info" in aware.how


@pytest.mark.parametrize(("args", "want"), [
    ((False, 4, 1, True), [("allreduce", Transport.CUDA_IPC)]),
    ((True, 1, 1, False), [("allreduce", Transport.LOCAL)]),
    ((False, 1, 1, True), [("allreduce", Transport.LOCAL)]),
    ((True, 1, 4, True), [("allreduce", Transport.CUDA_AWARE_MPI)]),
    ((False, 1, 4, True), [("allreduce", Transport.HOST_STAGING)]),
    ((True, 4, 2, False), [("allreduce", Transport.CUDA_AWARE_MPI)]),
    ((False, 4, 2, True), [("reducescatter-local", Transport.CUDA_IPC),
                           ("allreduce-cross", Transport.HOST_STAGING),
                           ("allgather-local", Transport.CUDA_IPC)]),
])
def test_choose(args, want):
    assert transport.choose(*args) == want


def test_choose_respects_a_forced_algorithm():
    assert transport.choose(True, 4, 1, True, "mpi") == [("allreduce", Transport.CUDA_AWARE_MPI)]
    assert transport.choose(False, 4, 2, True, "shm") == [("allreduce", Transport.HOST_STAGING)]
    # A world of one moves nothing, whatever algorithm was named (as the CPU's "alone" row).
    assert transport.choose(False, 1, 1, False, "ring") == [("allreduce", Transport.LOCAL)]
    with pytest.raises(ValueError, match="'nccl'"):
        transport.choose(True, 4, 1, True, "nccl")


def test_staging_schedule_overlaps_and_orders_each_chunk():
    steps = transport.staging_schedule(10, 3)
    assert steps[:4] == [("down", 0), ("down", 1), ("reduce", 0), ("up", 0)]
    position = {s: k for k, s in enumerate(steps)}
    for i in range(4):
        assert position[("down", i)] < position[("reduce", i)] < position[("up", i)]
        if i + 1 < 4:
            assert position[("down", i + 1)] < position[("reduce", i)]  # overlap
        if i >= 2:  # buffer i % 2 reused: chunk i-2 went up before chunk i comes down
            assert position[("up", i - 2)] < position[("down", i)]
    assert transport.staging_schedule(0, 3) == []
    with pytest.raises(ValueError, match="chunk"):
        transport.staging_schedule(10, 0)


@pytest.mark.parametrize("count", [1, 7, 8, 23])
def test_staged_allreduce_on_a_fake_device(count):
    device = FakeDevice()
    stream = device.new_stream()
    buf = np.arange(count, dtype=np.float64) + 1
    hosts = [np.full(4, np.nan), np.full(4, np.nan)]
    reduced = []

    def copy(s, dst, src):
        device.launch(s, "copy", lambda: dst.__setitem__(slice(None), src))

    def reduce_host(host):
        reduced.append(host.size)
        host *= 3  # stands for the sum over 3 equal ranks

    transport.staged_allreduce(device, stream, buf, count,
                               transport.Staging(hosts, 4, copy, reduce_host))
    device.drain()
    np.testing.assert_array_equal(buf, (np.arange(count) + 1) * 3.0)
    assert sum(reduced) == count and all(n <= 4 for n in reduced)
    with pytest.raises(ValueError, match="two host buffers"):
        transport.staged_allreduce(device, stream, buf, count,
                                   transport.Staging(hosts[:1], 4, copy, reduce_host))
