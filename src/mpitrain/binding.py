"""One process, one device: bind to a GPU by local rank, or take a fair share of CPU cores."""

from __future__ import annotations

import os
import sys
from typing import Any


def _torch() -> Any | None:
    try:
        import torch  # optional here: numpy-only code binds devices without torch
    except ImportError:  # torch is a dependency, but numpy-only code must still run
        return None
    return torch


def cuda_device_count() -> int:
    """GPUs this process can see (0 without CUDA), without creating a CUDA context."""
    torch = _torch()
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.device_count())
    if "cupy" in sys.modules:
        try:
            return int(sys.modules["cupy"].cuda.runtime.getDeviceCount())
        except Exception:  # noqa: BLE001 - a cupy without a driver
            return 0
    return 0


def bind_device(local_rank: int) -> int | None:
    """Make GPU ``local_rank % device_count`` current for torch (and cupy, if imported).

    Returns:
        The device index, or None when there is no GPU.
    """
    count = cuda_device_count()
    if count == 0:
        return None
    device = local_rank % count
    torch = _torch()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    if "cupy" in sys.modules:
        sys.modules["cupy"].cuda.Device(device).use()
    return device


def cpu_threads_for(machine_local_size: int) -> int:
    """Threads one rank should use when ``machine_local_size`` ranks share this machine."""
    try:
        mine = len(os.sched_getaffinity(0))
    except AttributeError:
        mine = os.cpu_count() or 1
    total = os.cpu_count() or mine
    if mine < total:
        # The launcher already bound us to a subset of cores: that subset is our share.
        return max(1, mine)
    return max(1, total // max(1, machine_local_size))


def set_cpu_threads(machine_local_size: int) -> int | None:
    """Give torch this rank's share of cores unless the user chose (OMP_NUM_THREADS).

    Returns:
        The number of threads set, or None when the user's choice was kept.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return None
    threads = cpu_threads_for(machine_local_size)
    torch = _torch()
    if torch is not None:
        torch.set_num_threads(threads)
    return threads
