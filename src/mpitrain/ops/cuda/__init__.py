"""The GPU data plane: CUDA kernels, channels on CUDA streams, and the transports between GPUs.

Everything here imports without a GPU, cupy or a CUDA driver; what needs one calls
:func:`require` first and raises :class:`CudaUnavailableError` naming what is missing.
The engine reaches this package only through :mod:`mpitrain.engine.device`.
"""

from .probe import CudaUnavailableError, available, require

__all__ = ["CudaUnavailableError", "available", "require"]
