"""One process, one device: bind to a GPU by local rank, or take a fair share of CPU cores.

torch is used when the script has loaded it, or when it is installed on a machine with an
NVIDIA driver (a GPU job binds its device before its first CUDA call, wherever it imports
torch).  A CPU-only job that has not loaded torch -- numpy, TensorFlow, a launcher -- never
pays for importing it: its thread share goes to ``OMP_NUM_THREADS``, which torch's OpenMP
runtime reads when it is loaded later.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

# Where the NVIDIA kernel driver lists the machine's GPUs; absent on machines without one.
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
# Set beside OMP_NUM_THREADS when mpitrain chose it, so a later call (an elastic rebuild with a
# new share) may change it again while a user's own setting is always kept.
_OMP_CHOSEN = "MPITRAIN_OMP_NUM_THREADS_CHOSEN"


def _torch() -> Any | None:
    """torch if loaded, or if installed where a GPU driver is; None otherwise (see above)."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    if not _NVIDIA_GPUS.is_dir() or importlib.util.find_spec("torch") is None:
        return None
    import torch  # optional: a GPU machine binds the device through torch before first use

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
    if "OMP_NUM_THREADS" in os.environ and os.environ.get(_OMP_CHOSEN) != "1":
        return None
    threads = cpu_threads_for(machine_local_size)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    # For torch (and other OpenMP code) loaded later; the marker says it is ours to change.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ[_OMP_CHOSEN] = "1"
    return threads
