"""Without a GPU (or cupy), everything imports and the GPU entry points fail clearly."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from mpitrain.collectives import arrays
from mpitrain.core import config
from mpitrain.ops import cuda as ops_cuda
from mpitrain.ops.cuda import probe as cuda_probe
from support import ROOT

pytestmark = pytest.mark.skipif(ops_cuda.available(), reason="this machine has a usable GPU")


class FakeDeviceArray:
    """Anything exposing __cuda_array_interface__ (a numba or cupy device array)."""

    shape = (4,)
    dtype = np.dtype(np.float32)

    class device:  # noqa: N801 - mimics cupy's array.device
        id = 1

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<f4", "data": (0, False), "version": 3}


def test_every_gpu_module_imports_without_cupy_and_loads_no_cupy():
    code = ("import sys, mpitrain, mpitrain.torch\n"
            "import mpitrain.ops.cuda, mpitrain.ops.cuda.kernels, mpitrain.ops.cuda.pack\n"
            "import mpitrain.ops.cuda.streams, mpitrain.ops.cuda.transport\n"
            "import mpitrain.ops.cuda.ipc, mpitrain.ops.cuda.allreduce, mpitrain.engine.device\n"
            "assert 'cupy' not in sys.modules, 'cupy imported at import time'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr


def test_require_names_the_caller_and_the_reason():
    with pytest.raises(ops_cuda.CudaUnavailableError, match="the widget needs a CUDA GPU"):
        ops_cuda.require("the widget")
    assert isinstance(ops_cuda.CudaUnavailableError("x"), RuntimeError)
    assert cuda_probe._probe()[1]  # a reason is recorded


def test_a_cuda_array_at_a_collective_is_a_clear_error():
    assert arrays.is_cuda(FakeDeviceArray()) and arrays.device_of(FakeDeviceArray()) == "cuda"
    assert arrays.dtype_name(FakeDeviceArray()) == "float32"
    with pytest.raises(ops_cuda.CudaUnavailableError, match="tensor .on CUDA. needs a CUDA GPU"):
        arrays.check_tensor(FakeDeviceArray())
    assert arrays.device_of(torch.zeros(2)) == "cpu" and not arrays.is_cuda(np.zeros(2))


def test_the_device_layer_and_the_kernels_refuse_without_a_gpu():
    from mpitrain.engine import device
    from mpitrain.ops.cuda.allreduce import DeviceGroup
    from mpitrain.ops.cuda.pack import Packer

    with pytest.raises(ops_cuda.CudaUnavailableError):
        device.mark_ready([0])
    with pytest.raises(ops_cuda.CudaUnavailableError):
        DeviceGroup(None, cuda_aware=False)
    with pytest.raises(ops_cuda.CudaUnavailableError):
        Packer([0], [4], 0)


def test_a_tensor_on_another_device_than_the_bound_one(monkeypatch):
    from mpitrain.core import runtime

    class State:
        device = 0

    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "state", lambda: State())
    with pytest.raises(ValueError, match=r"grad is on cuda:1, but this rank is bound to cuda:0"):
        arrays._check_bound_device(FakeDeviceArray(), "grad")
    State.device = 1
    arrays._check_bound_device(FakeDeviceArray(), "grad")  # the bound device: fine
    State.device = None  # MPITRAIN_BIND_DEVICE=0: the user's choice stands
    arrays._check_bound_device(FakeDeviceArray(), "grad")


def test_grouped_tensors_on_two_kinds_of_device_are_refused():
    from mpitrain.collectives import requests
    with pytest.raises(ValueError, match=r"share a device, got \['cpu', 'cuda:1'\]"):
        requests.device_kind([torch.zeros(4), FakeDeviceArray()])


def test_cuda_aware_setting_parses_and_warns_on_nonsense():
    assert config.load({}).cuda_aware_mpi == "auto"
    assert config.load({"MPITRAIN_CUDA_AWARE_MPI": "yes"}).cuda_aware_mpi == "1"
    assert config.load({"MPITRAIN_CUDA_AWARE_MPI": "0"}).cuda_aware_mpi == "0"
    with pytest.warns(RuntimeWarning, match="MPITRAIN_CUDA_AWARE_MPI"):
        assert config.load({"MPITRAIN_CUDA_AWARE_MPI": "sometimes"}).cuda_aware_mpi == "auto"


def test_runtime_reports_no_cuda_build():
    from mpitrain.core import runtime
    assert runtime.cuda_built() is False
