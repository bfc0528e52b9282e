"""Horovod scripts, unchanged, on mpitrain through the shipped compatibility route.

``tests/jobs/horovod_scripts`` holds a PyTorch and a TensorFlow 2 script written against
Horovod's API only (``import horovod.torch as hvd``, ``horovod.tensorflow``,
``horovod.tensorflow.keras``).  Each runs at two ranks with ``mpitrainrun --horovod-compat``
(and the PyTorch one also with ``python -m mpitrain.horovod_compat`` under plain mpirun), must
learn, and must end with the same parameters on every rank.  About 1.5 minutes on 2 cores,
most of it TensorFlow's import and tracing.
"""

from __future__ import annotations

import re
import sys

import pytest

from support import ROOT, mpirun_command, run_command

SCRIPTS = ROOT / "tests" / "jobs" / "horovod_scripts"
LAUNCH = [sys.executable, "-m", "mpitrain.runner.launch"]


def test_horovod_pytorch_script_through_mpitrainrun():
    result = run_command([*LAUNCH, "--horovod-compat", "-np", "2", "python",
                          str(SCRIPTS / "pytorch_digits.py"), "--fp16-allreduce"], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = re.search(r"ranks 2 parameters identical True final accuracy ([0-9.]+)",
                      result.stdout)
    assert found, result.stdout[-2000:]
    assert float(found.group(1)) > 0.9


def test_horovod_pytorch_script_through_plain_mpirun():
    result = run_command(mpirun_command(2, [sys.executable, "-m", "mpitrain.horovod_compat",
                                            str(SCRIPTS / "pytorch_digits.py"), "--epochs",
                                            "1"]), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "ranks 2 parameters identical True" in result.stdout


@pytest.mark.timeout(600)
def test_horovod_tensorflow2_script_through_mpitrainrun():
    pytest.importorskip("tensorflow")
    result = run_command([*LAUNCH, "--horovod-compat", "-np", "2", "python",
                          str(SCRIPTS / "tensorflow2_digits.py"), "--steps", "30"],
                         timeout=500)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    tape = re.search(r"tape: ranks 2 parameters identical True accuracy ([0-9.]+)",
                     result.stdout)
    fit = re.search(r"fit: ranks 2 parameters identical True accuracy ([0-9.]+)",
                    result.stdout)
    assert tape and fit, result.stdout[-2000:]
    assert float(tape.group(1)) > 0.8 and float(fit.group(1)) > 0.8
