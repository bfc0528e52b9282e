"""Runtime queries before init() raise ValueError; build facts answer (as in Horovod)."""

import pytest

import mpitrain as hvd

pytestmark = pytest.mark.timeout(120)

QUERIES = ["rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous", "mpi_threads_supported"]


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
    assert hvd.ddl_built() is False
    assert hvd.ccl_built() is False
    assert hvd.rocm_built() is False
    assert isinstance(hvd.cuda_built(), bool)


def test_controller_questions_answer_false_before_init():
    # Horovod answers these from its controller state, which before init is "not enabled".
    assert hvd.mpi_enabled() is False
    assert hvd.gloo_enabled() is False


@pytest.mark.parametrize("face", ["mpitrain", "mpitrain.torch"])
def test_every_build_fact_of_horovod_is_offered(face):
    import importlib

    module = importlib.import_module(face)
    for name in ("mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
                 "cuda_built", "rocm_built"):
        assert isinstance(getattr(module, name)(), bool), name


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
