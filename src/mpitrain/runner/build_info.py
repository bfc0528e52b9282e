"""``mpitrainrun --check-build``: what this installation can do, checked, not assumed.

It starts MPI as a singleton (no launcher needed) to read the library's own version string and
the thread level it grants, probes the optional GPU stack (torch CUDA, cupy, numba CUDA), and
asks the MPI library whether it was built CUDA-aware: Open MPI through ``ompi_info``, MPICH
through the configure line in its version string; where neither says, it reports "unknown".
"""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path
from typing import Any

from ..core import _mpi, runtime
from ..core.version import __version__
from .mpi_command import Flavor, detect_flavor, find_launcher


def _module_version(name: str) -> str | None:
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent or broken: both mean "not usable"
        return None
    return str(getattr(module, "__version__", "?"))


def _torch_cuda() -> bool:
    try:
        import torch  # optional and heavy: only the build report asks

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _numba_cuda() -> bool:
    try:
        from numba import cuda  # optional and heavy: only the build report asks

        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - numba without its CUDA part, or no driver
        return False


def _cuda_aware(library: str, launcher: str | None) -> str:
    """'yes', 'no' or 'unknown': was the MPI library built with CUDA buffer support?"""
    if "Open MPI" in library and launcher is not None:
        ompi_info = Path(launcher).with_name("ompi_info")
        try:
            out = subprocess.run([str(ompi_info), "--parsable", "--all"], capture_output=True,
                                 text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        for line in out.splitlines():
            if "built_with_cuda_support:value:" in line:
                return "yes" if line.rsplit(":", 1)[1].strip() == "true" else "no"
        return "unknown"
    if "MPICH" in library:
        return "yes" if "--with-cuda" in library else "no"
    return "unknown"


def collect() -> dict[str, Any]:
    """Return the build report as a dict (starts MPI in this process if it is not yet)."""
    MPI = _mpi.load()
    library = MPI.Get_library_version().strip()
    try:
        launcher: str | None = find_launcher()
    except FileNotFoundError:
        launcher = None
    try:
        flavor: str | None = detect_flavor(launcher).value if launcher else None
    except ValueError:
        flavor = None
    return {
        "mpitrain": __version__,
        "mpi_library": library.splitlines()[0],
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": _mpi.thread_level_name(MPI.Query_thread()),
        "thread_multiple": MPI.Query_thread() >= MPI.THREAD_MULTIPLE,
        "launcher": launcher,
        "launcher_flavor": flavor,
        "mpi4py": _module_version("mpi4py"),
        "numpy": _module_version("numpy"),
        "numba": _module_version("numba"),
        "torch": _module_version("torch"),
        "cupy": _module_version("cupy"),
        "torch_cuda": _torch_cuda(),
        "numba_cuda": _numba_cuda(),
        "cuda_data_plane": runtime.cuda_built(),
        "cuda_aware_mpi": _cuda_aware(library, launcher),
    }


def _mark(ok: Any) -> str:
    return "[X]" if ok else "[ ]"


def render(info: dict[str, Any]) -> str:
    """Format the report as Horovod-style check boxes."""
    flavor_names = {Flavor.OPENMPI.value: "Open MPI", Flavor.MPICH.value: "MPICH",
                    Flavor.INTEL.value: "Intel MPI"}
    lines = [
        f"mpitrain v{info['mpitrain']}:",
        "",
        "MPI:",
        f"    library:       {info['mpi_library']}",
        f"    standard:      {info['mpi_standard']}",
        f"    {_mark(info['thread_multiple'])} {info['thread_level']}",
        f"    launcher:      {info['launcher'] or 'none found'}"
        + (f" ({flavor_names.get(info['launcher_flavor'], 'unrecognised')})"
           if info["launcher"] else ""),
        f"    CUDA-aware:    {info['cuda_aware_mpi']}",
        "",
        "Frameworks and kernels:",
    ]
    for name in ("mpi4py", "numpy", "numba", "torch", "cupy"):
        version = info[name]
        lines.append(f"    {_mark(version)} {name}" + (f" {version}" if version else ""))
    lines += [
        "",
        "GPU:",
        f"    {_mark(info['torch_cuda'])} torch CUDA device",
        f"    {_mark(info['numba_cuda'])} numba CUDA",
        f"    {_mark(info['cuda_data_plane'])} mpitrain CUDA data plane (cupy and a GPU)",
    ]
    return "\n".join(lines)
