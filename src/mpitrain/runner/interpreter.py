"""Which Python the ranks run when the command says ``python``, and whether its script exists.

A bare interpreter name means "Python": the ranks get the one ``mpitrainrun`` runs on (the
virtual environment mpitrain is installed in), not whichever comes first on the PATH of a
shell that never activated it -- that one usually lacks torch and mpitrain, and every rank
would fail with ``ModuleNotFoundError``.  A script that does not exist is reported once,
before anything starts, instead of once per rank by every rank's interpreter.
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


# Interpreter options that take the next argument as their value.
_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")
# Options after which Python runs no script.
_NO_SCRIPT = ("-h", "--help", "-V", "--version", "--help-env", "--help-xoptions", "--help-all")


def _is_python(program: str) -> bool:
    name = os.path.basename(program)
    return name in _PYTHON_NAMES or (name.startswith("python3.") and name[8:].isdigit())


def missing_script(command: Sequence[str], cwd: str) -> str | None:
    """What to say when ``command`` runs Python on a script that is not there, else None.

    Only ``python [options] SCRIPT ...`` is judged; ``-m``, ``-c`` and ``-`` (stdin) run no
    file, and any other program is the user's business.
    """
    if not command or not _is_python(command[0]):
        return None
    args = iter(command[1:])
    for arg in args:
        if arg in _OPTIONS_WITH_VALUE:
            next(args, None)
        elif arg == "-" or arg.startswith(("-m", "-c")) or arg in _NO_SCRIPT:
            return None
        elif not arg.startswith("-"):
            if os.path.exists(os.path.join(cwd, arg)):
                return None
            return (f"{arg}: no such file (looked in {cwd}); every rank would fail to start. "
                    "Give the script's path from the directory you launch in")
    return None


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
