"""Runtime queries before init() raise ValueError; build facts answer (as in Horovod)."""

import pytest

import mpitrain as hvd

QUERIES = ["rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "gloo_enabled"]


@pytest.mark.parametrize("name", QUERIES)
def test_query_before_init_raises_value_error(name):
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match=r"call mpitrain\.init\(\) first"):
        getattr(hvd, name)()


def test_collective_before_init_raises_value_error():
    import numpy as np

    with pytest.raises(ValueError, match="init"):
        hvd.allreduce(np.ones(3))


def test_build_facts_answer_without_init():
    assert hvd.mpi_built() is True
    assert hvd.gloo_built() is False
    assert hvd.nccl_built() is False
    assert hvd.rocm_built() is False
    assert isinstance(hvd.cuda_built(), bool)


def test_shutdown_before_init_is_harmless():
    hvd.shutdown()
    assert not hvd.is_initialized()


def test_horovod_error_name_is_the_same_type():
    assert hvd.HorovodInternalError is hvd.MpitrainInternalError
    assert issubclass(hvd.MpitrainInternalError, RuntimeError)


def test_mpitrain_torch_is_the_same_face():
    import mpitrain.torch as hvd_torch

    assert hvd_torch.allreduce is hvd.allreduce
    assert hvd_torch.init is hvd.init
    with pytest.raises(AttributeError):
        hvd_torch.no_such_function  # noqa: B018
