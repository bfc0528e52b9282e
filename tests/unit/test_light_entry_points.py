"""The launcher and the hostfile tool start without torch, numba, numpy or MPI.

They run on login nodes that may have no torch at all, and ``mpitrainrun --help`` should answer
at once (it took seconds when the package root imported the torch face eagerly).  Each check
runs in a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import ROOT

HEAVY = ("torch", "numba", "numpy", "mpi4py", "tensorflow", "keras", "cupy")
pytestmark = pytest.mark.timeout(300)


def _python(args: list[str], *, cwd=ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def _heavy_modules_after(statement: str) -> list[str]:
    code = (f"import json, sys\n{statement}\n"
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}}"
            f" & set({HEAVY!r}))))\n")
    result = _python(["-c", code])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_runner_and_hostfile_cli_import_nothing_heavy():
    loaded = _heavy_modules_after(
        "import mpitrain.runner, mpitrain.runner.launch, mpitrain.runner.hostfile_cli")
    assert loaded == []


def test_package_root_alone_imports_nothing_heavy():
    assert _heavy_modules_after("import mpitrain; mpitrain.__version__") == []


def test_the_face_loads_on_first_use_without_torch():
    # Negative control for the two tests above: the same probe sees the engine's imports once a
    # name of the Horovod face is used -- but not torch, which a numpy user need not have.
    assert _heavy_modules_after("import mpitrain as hvd; hvd.allreduce") == [
        "mpi4py", "numba", "numpy"]


def test_numpy_collectives_and_init_leave_torch_unloaded():
    statement = ("import numpy as np, mpitrain as hvd\nhvd.init()\n"
                 "assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [1.0, 1.0]\n"
                 "hvd.shutdown()")
    assert "torch" not in _heavy_modules_after(statement)


def test_torch_only_names_load_the_torch_face():
    assert "torch" in _heavy_modules_after("import mpitrain as hvd; hvd.DistributedOptimizer")


def test_launcher_help_and_hostfile_tool_run_without_site_packages(tmp_path):
    # -S drops site-packages: no torch, numpy or mpi4py can be found, as on a bare login node.
    help_text = _python(["-S", "-m", "mpitrain.runner.launch", "--help"])
    assert help_text.returncode == 0, help_text.stderr
    assert "usage: mpitrainrun" in help_text.stdout
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=2\nnode2:2\n")
    tool = str(ROOT / "tools" / "hostfile" / "mpitrain-hostfile")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's own path
    result = subprocess.run([sys.executable, "-S", tool, "convert", str(hosts), "--to", "mpich"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "node1:2\nnode2:2\n"


def test_face_names_and_submodules_through_the_root():
    import mpitrain
    from mpitrain.face import api as _face

    assert mpitrain.__all__ == sorted([*_face.__all__, *_face.TORCH_NAMES])
    assert set(mpitrain.__all__) <= set(dir(mpitrain))
    for name in _face.__all__:
        assert getattr(mpitrain, name) is getattr(_face, name), name
    from mpitrain.torch import optimizer

    assert mpitrain.DistributedOptimizer is optimizer.DistributedOptimizer
    assert mpitrain.core.__name__ == "mpitrain.core"  # a submodule, imported on access
    with pytest.raises(AttributeError, match="no_such_name"):
        mpitrain.no_such_name  # noqa: B018
    namespace: dict[str, object] = {}
    exec("from mpitrain import *", namespace)
    assert namespace["DistributedOptimizer"] is optimizer.DistributedOptimizer
