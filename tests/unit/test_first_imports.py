"""Modules of the torch face import on their own, first, in a fresh interpreter.

The package root loads the Horovod face lazily (PEP 562), and ``mpitrain.torch`` forwards
unknown attributes to it; an import cycle through that path shows up only when a submodule is
the first thing a program imports (``from mpitrain.torch.optimizer import ...`` did, through
``from . import flat_buckets`` asking the package for the attribute first).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
FIRST_IMPORTS = ["mpitrain.torch.optimizer", "mpitrain.torch.functions",
                 "mpitrain.torch.nn.parallel", "mpitrain.torch.c10d"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_module_imports_first(module):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                            text=True, env=env, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
