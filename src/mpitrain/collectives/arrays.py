"""The bridge between users' arrays (torch tensors, numpy/cupy arrays) and the engine's buffers.

The engine moves flat arrays of a storage type plus a logical type name (see
:mod:`mpitrain.core.dtypes`).  Here a torch CPU tensor or a numpy array becomes a numpy view with
no copy; a CUDA tensor, a cupy array or any ``__cuda_array_interface__`` array becomes a cupy
view of the same device memory (DLPack for torch), again with no copy.  Results are allocated
in the caller's framework, on the caller's device, so that what comes back is the same kind of
object that went in.  The device kind (``cpu``/``cuda``) is part of what ranks negotiate.

torch is never imported here: a torch tensor can exist only once its caller imported torch, so
``sys.modules`` tells whether an argument can be one.  A numpy or TensorFlow user neither needs
torch installed nor pays for loading it.
"""

from __future__ import annotations

import functools
import math
import reprlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import runtime
from ..core.memory import RECYCLER
from ..engine.device import cuda_available, require_cupy

if TYPE_CHECKING:
    import torch

# torch's element types by their names in mpitrain.core.dtypes, with the numpy type torch.from_numpy
# accepts for each (bfloat16 travels as int16 bits).
_TORCH_STORAGE_BY_NAME = {
    "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
    "int64": np.int64, "float16": np.float16, "bfloat16": np.int16, "float32": np.float32,
    "float64": np.float64, "bool": np.bool_,
}
_NUMPY_NAMES = {
    "uint8": "uint8", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "float16": "float16", "float32": "float32", "float64": "float64", "bool": "bool",
    "bfloat16": "bfloat16",  # ml_dtypes' bfloat16, if the caller uses it
}


def loaded_torch() -> Any:
    """The torch module if this process has imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


@functools.cache
def _torch_names() -> dict[Any, str]:
    """torch dtype -> mpitrain dtype name; called only once a torch tensor was seen."""
    torch = sys.modules["torch"]
    return {getattr(torch, name): name for name in _TORCH_STORAGE_BY_NAME}


def is_cuda(x: Any) -> bool:
    """A CUDA torch tensor, or a device array exposing ``__cuda_array_interface__``."""
    if is_torch(x):
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")


def _cupy(what: str) -> Any:
    return require_cupy(what)


def reduced_in_place(tensor: torch.Tensor) -> bool:
    """Whether the data plane reduces ``tensor`` where it lives: CPU memory always, a CUDA
    tensor when the GPU data plane can run here; anything else goes through a host copy."""
    if tensor.device.type == "cpu":
        return True
    return tensor.device.type == "cuda" and cuda_available()


def dtype_name(x: Any, what: str = "tensor") -> str:
    """The logical element type of ``x``; ``what`` names the argument in errors.

    Raises:
        TypeError: ``x`` is not a tensor/array, or its element type is unsupported.
    """
    if is_torch(x):
        name = _torch_names().get(x.dtype)
        if name is None:
            raise TypeError(f"{what} has unsupported dtype {x.dtype}; supported: "
                            f"{sorted(str(d) for d in _torch_names())}")
        return name
    if isinstance(x, np.ndarray):
        name = _NUMPY_NAMES.get(x.dtype.name)
        if name is None:
            raise TypeError(f"{what} has unsupported dtype {x.dtype}; supported: "
                            f"{sorted(_NUMPY_NAMES)}")
        return name
    if hasattr(x, "__cuda_array_interface__"):
        name = _NUMPY_NAMES.get(np.dtype(x.dtype).name)
        if name is None:
            raise TypeError(f"{what} has unsupported dtype {x.dtype}; supported: "
                            f"{sorted(_NUMPY_NAMES)}")
        return name
    raise TypeError(f"{what} must be a torch.Tensor, numpy.ndarray or CUDA array (cupy), got "
                    f"{type(x).__name__} {reprlib.repr(x)}")


def device_of(x: Any) -> str:
    """The device kind ranks negotiate: ``cpu`` or ``cuda`` (the index is each rank's own)."""
    return "cuda" if is_cuda(x) else "cpu"


def device_index(x: Any) -> int | None:
    """The CUDA device ``x`` lives on, or None for host memory."""
    if is_torch(x):
        return x.device.index if x.is_cuda else None
    if hasattr(x, "__cuda_array_interface__"):
        device = getattr(x, "device", None)
        index = getattr(device, "id", None)
        if index is not None:
            return int(index)
        return int(_cupy("a CUDA array").asarray(x).device.id)
    return None


def current_stream(x: Any) -> int:
    """The stream the caller's framework is using for ``x`` now (a raw cudaStream_t)."""
    if is_torch(x):
        return int(sys.modules["torch"].cuda.current_stream(x.device).cuda_stream)
    return int(_cupy("a CUDA array").cuda.get_current_stream().ptr)


def _check_bound_device(x: Any, what: str) -> None:
    """A CUDA tensor must be on the device this rank was bound to at init()."""
    bound = runtime.state().device if runtime.is_initialized() else None
    index = device_index(x)
    if bound is not None and index != bound:
        raise ValueError(f"{what} is on cuda:{index}, but this rank is bound to cuda:{bound} "
                         f"(local rank % device count); move it with .to('cuda:{bound}'), or "
                         "set MPITRAIN_BIND_DEVICE=0 to manage devices yourself")


def check_tensor(x: Any, what: str = "tensor") -> str:
    """Validate ``x`` for a collective; return its logical dtype.

    Raises:
        TypeError: not a tensor/array, unsupported dtype, or a device mpitrain cannot serve.
        ValueError: ``x`` is not contiguous.
    """
    name = dtype_name(x, what)
    if not is_torch(x):  # (once: every submission of a collective comes through here)
        if hasattr(x, "__cuda_array_interface__"):
            _cupy(f"a collective on {what} (on CUDA)")  # a clear error without cupy or a GPU
            _check_bound_device(x, what)
        if not x.flags.c_contiguous:
            raise ValueError(f"{what} is not C-contiguous (shape {x.shape}, strides "
                             f"{x.strides}); call numpy.ascontiguousarray first")
        return name
    if x.is_cuda:
        _cupy(f"a collective on {what} (on CUDA)")
        _check_bound_device(x, what)
    elif not x.is_cpu:
        raise TypeError(f"{what} is on {x.device}; mpitrain's data plane handles CPU and CUDA "
                        "tensors")
    if x.is_sparse:
        raise TypeError(f"{what} is sparse; allreduce sparse gradients through allgather "
                        "(DistributedOptimizer does this) or densify with .to_dense()")
    if not x.is_contiguous():
        raise ValueError(f"{what} is not contiguous (shape {tuple(x.shape)}, strides "
                         f"{x.stride()}); call .contiguous() first")
    return name


def plain_host_tensor(x: Any) -> tuple[str, np.ndarray] | None:
    """``(dtype name, storage view)`` of a dense, contiguous CPU torch tensor of a supported
    dtype, in one pass; None for anything else.

    Nearly every submission is such a tensor: :func:`check_tensor`, :func:`storage_view` and
    :func:`device_of` would ask torch the same questions again, a microsecond of a call whose
    whole engine budget is about fifteen.  For anything else the caller takes the general
    path, whose errors say what is wrong with the argument.
    """
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(x, torch.Tensor) or not x.is_cpu or x.is_sparse
            or not x.is_contiguous()):
        return None
    name = _torch_names().get(x.dtype)
    if name is None:
        return None
    if x.requires_grad:
        x = x.detach()
    if name == "bfloat16":
        return name, x.view(torch.int16).numpy().view(np.uint16)
    return name, x.numpy()


def new_host_tensor(view: np.ndarray, name: str) -> Any:
    """A new, uninitialised CPU torch tensor shaped like ``view`` (a storage view from
    :func:`plain_host_tensor`), of dtype ``name``; returns ``(tensor, its storage view)``.

    numpy's memory under the tensor, for the reason :func:`empty_like` gives.
    """
    torch = sys.modules["torch"]
    raw: np.ndarray = np.empty(view.shape, dtype=_TORCH_STORAGE_BY_NAME[name])
    if name == "bfloat16":
        return torch.from_numpy(raw).view(torch.bfloat16), raw.view(np.uint16)
    return torch.from_numpy(raw), raw


def storage_view(x: Any) -> Any:
    """A view of ``x``'s memory in its storage type (no copy), same shape: numpy for host
    memory, cupy for device memory."""
    if not is_torch(x):
        if hasattr(x, "__cuda_array_interface__"):
            return _cupy("a collective on CUDA tensors").asarray(x)
        if x.dtype.name == "bfloat16":
            return x.view(np.uint16)
        return x
    torch = sys.modules["torch"]
    if x.is_cuda:
        cupy = _cupy("a collective on CUDA tensors")
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return cupy.from_dlpack(x.view(torch.int16)).view(np.uint16)
        if x.dtype == torch.bool:
            return cupy.from_dlpack(x.view(torch.uint8)).view(np.bool_)
        return cupy.from_dlpack(x)
    if x.requires_grad:
        x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def empty_like(x: Any, shape: tuple[int, ...] | None = None) -> tuple[Any, Any]:
    """A new uninitialised array of ``x``'s kind, dtype and device; (array, storage view)."""
    out: Any
    shape = tuple(x.shape) if shape is None else shape
    torch = sys.modules["torch"] if is_torch(x) else None
    if (x.is_cuda if torch is not None else hasattr(x, "__cuda_array_interface__")):
        if torch is not None:
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        else:
            cupy = _cupy("a collective on CUDA arrays")
            with cupy.cuda.Device(device_index(x)):
                out = cupy.empty(shape, dtype=x.dtype)
        return out, storage_view(out)
    itemsize = x.element_size() if torch is not None else x.dtype.itemsize
    if math.prod(shape) * itemsize >= RECYCLER.min_bytes:
        # Large outputs come from recycled, huge-page memory: a fresh 64 MiB tensor would
        # spend longer in page faults than the allreduce takes (see mpitrain.core.memory).
        raw = RECYCLER.take(math.prod(shape) * itemsize)
        if torch is not None:
            storage = _TORCH_STORAGE_BY_NAME[_torch_names()[x.dtype]]
            out = torch.from_numpy(raw.view(storage)).view(x.dtype).view(shape)
        else:
            out = raw.view(x.dtype).reshape(shape)
        return out, storage_view(out)
    if torch is not None:
        # numpy's memory under a torch tensor, not torch.empty: a torch call lets go of the
        # GIL, and a thread submitting a burst of requests then waits for the engine thread
        # to hand it back (an async allreduce of a small tensor took 30 us at 2 ranks with
        # torch.empty_like here, 24 us without).  Its storage cannot be resized, as the
        # recycled large outputs' above cannot.
        name = _torch_names()[x.dtype]
        raw = np.empty(shape, dtype=_TORCH_STORAGE_BY_NAME[name])
        if name == "bfloat16":
            return torch.from_numpy(raw).view(torch.bfloat16), raw.view(np.uint16)
        return torch.from_numpy(raw), raw
    out = np.empty(shape, dtype=x.dtype)
    return out, storage_view(out)


def allocator_like(x: Any, keep: list[Any]) -> Callable[[tuple[int, ...]], Any]:
    """An allocator for outputs whose shape is known only after negotiation.

    The framework array is appended to ``keep`` so the caller can return it.
    """

    def allocate(shape: tuple[int, ...]) -> Any:
        out, view = empty_like(x, shape)
        keep.append(out)
        return view

    return allocate
