"""README.md and the getting-started page, run as a new user pastes them.

Each page's shell blocks run in order in one bash (``set -euo pipefail``), from the repository
root, with the virtual environment not activated: the commands name ``.venv/bin/...``
themselves.  A block marked ``<!-- test: skip REASON -->`` is left out (tools/docs/snippets.py);
the README's command 1 is run by scripts/test.sh itself, as the first thing it does, and its
command 2 is scripts/test.sh.  The pages handle running as root once (mpitrainrun adds
Open MPI's flag; a plain mpirun is preceded by the page's one ``export`` of Open MPI's
variables), so what passes here as root passes for any user.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

sys.path.insert(0, str(ROOT / "tools" / "docs"))
import snippets  # noqa: E402 - tools/docs is not a package


def _script(page: str) -> str:
    parts = ["set -euo pipefail"]
    for block in snippets.blocks(ROOT / page):
        if block.lang in snippets.SHELLS and block.action != "skip":
            parts.append(f"echo \"### {block.where} (at ${{SECONDS}} s)\" >&2")
            parts.append(block.text)
    return "\n".join(parts) + "\n"


def _user_env() -> dict[str, str]:
    """This environment as a fresh shell has it: no venv activated, no mpitrain settings."""
    venv_bin = str(ROOT / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
           and not k.startswith(("MPITRAIN_", "HOROVOD_", "OMPI_", "PMIX_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and p != venv_bin)
    return env


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", snippets.PASTED)
def test_the_pages_shell_commands_run_as_pasted(page):
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"the pages name .venv/bin/...; this pytest runs from {sys.prefix}")
    script = _script(page)
    assert script.count("### ") >= 1, f"{page} has no shell block to run"
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=_user_env(),
                            capture_output=True, text=True, timeout=840)
    last = [line for line in result.stderr.splitlines() if line.startswith("### ")][-1:]
    assert result.returncode == 0, (f"{page}: the block at {last} failed (exit "
                                    f"{result.returncode}):\n{result.stdout[-2500:]}\n"
                                    f"{result.stderr[-4000:]}")
