"""Which Python the ranks run when the command says ``python``.

A bare interpreter name means "Python": the ranks get the one ``mpitrainrun`` runs on (the
virtual environment mpitrain is installed in), not whichever comes first on the PATH of a
shell that never activated it -- that one usually lacks torch and mpitrain, and every rank
would fail with ``ModuleNotFoundError``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence

_PYTHON_NAMES = ("python", "python3", f"python3.{sys.version_info.minor}")


def ranks_command(command: Sequence[str]) -> list[str]:
    """``command`` with a bare ``python``/``python3`` replaced by this interpreter's path."""
    out = list(command)
    if out and out[0] in _PYTHON_NAMES:
        out[0] = sys.executable
    return out


def python_note(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """A note when a bare ``python`` would have meant another interpreter on PATH."""
    if not command or command[0] not in _PYTHON_NAMES:
        return None
    on_path = shutil.which(command[0], path=environ.get("PATH"))
    if on_path is not None and os.path.realpath(on_path) == os.path.realpath(sys.executable):
        return None
    return (f"mpitrainrun: the ranks run {sys.executable} (the Python mpitrainrun runs on) for "
            f"'{command[0]}', not {on_path or 'nothing'} found on PATH; give a path to run "
            "another interpreter")
