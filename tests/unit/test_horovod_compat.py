"""The shipped Horovod compatibility route: ``horovod.*`` names resolve to mpitrain's modules.

Each check runs a script through ``python -m mpitrain.horovod_compat`` in a fresh interpreter
(one rank, no launcher), as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mpitrain.horovod_compat import SHIM_PATH, real_horovod, with_shim_first
from support import ROOT

pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, body: str, env_extra: dict[str, str] | None = None):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "mpitrain.horovod_compat", str(script),
                           "--flag", "x"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=240)


def test_horovod_modules_are_mpitraines_own_objects(tmp_path):
    result = _run(tmp_path, """\
        import sys
        import horovod, horovod.torch as hvd, horovod.torch.elastic
        from horovod.torch.mpi_ops import allreduce
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
        import mpitrain, mpitrain.torch, mpitrain.core.errors
        assert hvd is mpitrain.torch
        assert horovod.torch.elastic is mpitrain.torch.elastic
        assert hvd.DistributedOptimizer is mpitrain.DistributedOptimizer
        assert allreduce is mpitrain.allreduce
        assert HorovodInternalError is mpitrain.core.errors.HorovodInternalError
        # Not a second copy: the module keeps its own spec and name.
        assert mpitrain.torch.__spec__.name == "mpitrain.torch"
        assert horovod.__version__.startswith("0.28.1+mpitrain.")
        assert sys.argv[1:] == ["--flag", "x"] and __name__ == "__main__"
        hvd.init()
        assert (hvd.rank(), hvd.size()) == (0, 1)
        print("ok")
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_keras_and_tensorflow_names_resolve(tmp_path):
    result = _run(tmp_path, """\
        import horovod.tensorflow as hvd, horovod.tensorflow.keras as hk, horovod.keras as hkk
        import mpitrain.tensorflow, mpitrain.tensorflow.keras
        assert hvd is mpitrain.tensorflow and hk is mpitrain.tensorflow.keras
        assert hkk.DistributedOptimizer is not None
        print("ok")
        """)
    assert result.returncode == 0, result.stderr


def test_a_module_without_counterpart_says_so(tmp_path):
    result = _run(tmp_path, "import horovod.runner\n")
    assert result.returncode != 0
    assert "horovod.runner has no counterpart in mpitrain's Horovod compatibility" in \
        result.stderr


def test_a_real_horovod_is_named_and_shadowed_only_when_asked(tmp_path):
    real = tmp_path / "site" / "horovod"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path / "site")])}
    result = _run(tmp_path, "import horovod\nassert not hasattr(horovod, 'REAL')\n", env)
    assert result.returncode == 0, result.stderr
    assert f"a real Horovod is installed at {real}" in result.stderr
    # Without the route, the real one is what `import horovod` finds.
    plain = subprocess.run([sys.executable, "-c", "import horovod; print(horovod.REAL)"],
                           capture_output=True, text=True, env=dict(os.environ, **env),
                           timeout=60)
    assert plain.stdout.strip() == "True", plain.stderr


def test_the_stand_in_is_never_reported_as_a_real_horovod(monkeypatch):
    monkeypatch.syspath_prepend(SHIM_PATH)
    assert real_horovod() is None


def test_usage_and_a_missing_script():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    help_text = subprocess.run([sys.executable, "-m", "mpitrain.horovod_compat", "--help"],
                               capture_output=True, text=True, env=env, timeout=60)
    assert help_text.returncode == 0 and "mpirun -np 4 python -m mpitrain.horovod_compat" in \
        help_text.stdout
    missing = subprocess.run([sys.executable, "-m", "mpitrain.horovod_compat", "nope.py"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 2 and "no such script: 'nope.py'" in missing.stderr


def test_pythonpath_gets_the_stand_in_once_and_first():
    assert with_shim_first(None) == SHIM_PATH
    assert with_shim_first(f"/a{os.pathsep}{SHIM_PATH}") == f"{SHIM_PATH}{os.pathsep}/a"
