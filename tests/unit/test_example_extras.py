"""Every example, run without an extra it needs, says which ``pip install`` brings it.

Each example script imports its third-party packages in one ``try`` block; here the first
package an extra provides is made unimportable (``sys.modules[name] = None``, as if it were not
installed) and the script must exit naming that extra, without a traceback.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRA = {"torch": "torch", "sklearn": "examples", "tqdm": "examples", "keras": "tensorflow",
         "tensorflow": "tensorflow", "transformers": "hf", "accelerate": "hf"}
HELPERS = {"bert_data.py", "bert_backends.py"}  # modules the BERT examples import
SCRIPTS = sorted(p for p in (ROOT / "examples").rglob("*.py") if p.name not in HELPERS)


def first_extra_import(path: Path) -> str:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            name = node.names[0].name if isinstance(node, ast.Import) else node.module or ""
            if name.split(".")[0] in EXTRA:
                return name.split(".")[0]
    raise AssertionError(f"{path} imports nothing an extra provides")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_a_missing_extra_is_named(script):
    blocked = first_extra_import(script)
    code = ("import runpy, sys\n"
            f"sys.modules[{blocked!r}] = None\n"
            f"sys.argv = [{str(script)!r}, '--help']\n"
            f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=100, cwd=ROOT)
    assert result.returncode == 1, result.stdout[-1000:] + result.stderr[-2000:]
    named = result.stderr.split("mpitrain[", 1)[1].split("]", 1)[0].split(",")
    assert EXTRA[blocked] in named or (blocked == "torch" and "hf" in named), result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_keras_fit_names_the_tensorflow_extra():
    script = ROOT / "examples" / "tensorflow_style" / "keras_fit.py"
    code = ("import runpy, sys\nsys.modules['keras'] = None\n"
            f"sys.argv = [{str(script)!r}]\nrunpy.run_path({str(script)!r}, run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=100, cwd=ROOT)
    assert "pip install 'mpitrain[tensorflow,examples]'" in result.stderr, result.stderr
