"""Whether the CUDA data plane can run here, and the clear error when it cannot."""

from __future__ import annotations

import functools
from typing import Any


class CudaUnavailableError(RuntimeError):
    """A GPU-only entry point was called where there is no usable GPU or cupy."""


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[Any, str]:
    """Import cupy and count devices once; returns (cupy or None, reason it is unusable)."""
    try:
        import cupy  # optional: this probe is what tells whether it is there
    except Exception as exc:  # noqa: BLE001 - missing or broken cupy: both mean no GPU path
        return None, (f"cupy is not importable ({type(exc).__name__}: {exc}); install the "
                      "wheel matching your CUDA, e.g. pip install cupy-cuda12x")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - no driver raises a CUDARuntimeError
        return None, f"cupy sees no CUDA driver ({type(exc).__name__}: {exc})"
    if count == 0:
        return None, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
    return cupy, ""


def available() -> bool:
    """True when cupy imports and at least one GPU is visible."""
    return _probe()[0] is not None


def require(what: str) -> Any:
    """Return the cupy module, or raise naming ``what`` needed it and why it cannot run.

    Raises:
        CudaUnavailableError: no cupy, no driver, or no device.
    """
    cupy, reason = _probe()
    if cupy is None:
        raise CudaUnavailableError(f"{what} needs a CUDA GPU: {reason}")
    return cupy
