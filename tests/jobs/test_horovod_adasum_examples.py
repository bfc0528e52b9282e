"""Horovod 0.28.1's own Adasum examples, unchanged, on mpitrain at 2 and 4 ranks.

``examples/adasum/adasum_small_model.py`` (``hvd.allreduce(grad, op=hvd.Adasum)``) and
``examples/pytorch/pytorch_synthetic_benchmark.py --use-adasum``
(``DistributedOptimizer(op=hvd.Adasum)``, ``broadcast_parameters``,
``broadcast_optimizer_state``) run through the shipped compatibility route
(``python -m mpitrain.horovod_compat``): ``import horovod.torch as hvd`` resolves to
``mpitrain.torch``, and, since torchvision has no CPU build here, a stand-in
``torchvision.models`` (tests/torchvision_stub) provides ``tiny_cnn``, passed as ``--model``.

The scripts are Horovod's, not ours, so they are not in this repository: point
``MPITRAIN_HOROVOD_EXAMPLES`` at the ``examples`` directory of a Horovod 0.28.1 checkout
(``git clone -b v0.28.1 https://github.com/horovod/horovod``) to run these tests; without it
they skip.  The four runs cost about 110 CPU-seconds (mostly four ranks importing torch), about
a minute on an idle 2-core machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from support import ROOT, run_job

EXAMPLES = os.environ.get("MPITRAIN_HOROVOD_EXAMPLES", "")
TORCHVISION_STUB = ROOT / "tests" / "torchvision_stub"
SMALL_MODEL = Path(EXAMPLES, "adasum", "adasum_small_model.py")
BENCHMARK = Path(EXAMPLES, "pytorch", "pytorch_synthetic_benchmark.py")

pytestmark = [
    pytest.mark.skipif(not (EXAMPLES and SMALL_MODEL.is_file() and BENCHMARK.is_file()),
                       reason="set MPITRAIN_HOROVOD_EXAMPLES to a Horovod 0.28.1 examples/ "
                              "directory"),
    pytest.mark.timeout(330),
]


def _run(np_: int, script: Path, args: list[str]) -> str:
    path = os.pathsep.join(str(p) for p in (ROOT / "src", TORCHVISION_STUB))
    result = run_job(np_, [sys.executable, "-m", "mpitrain.horovod_compat", str(script), *args],
                     env={"PYTHONPATH": path},
                     timeout=300)
    assert result.returncode == 0, (f"{script.name} {' '.join(args)} at np={np_} exited "
                                    f"{result.returncode}:\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-5000:]}")
    return result.stdout


@pytest.mark.parametrize("np_", [2, 4])
def test_adasum_small_model(np_):
    out = _run(np_, SMALL_MODEL, ["--op", "Adasum"])
    # Rank 0 prints: x_max, op, learning rate, size, steps taken (100: not converged in 50).
    fields = out.strip().splitlines()[-1].split()
    assert fields[:4] == ["1.0", "Adasum", "0.1", str(np_)], out[-2000:]
    assert int(fields[4]) in (*range(1, 51), 100), out[-2000:]


@pytest.mark.parametrize("np_", [2, 4])
def test_pytorch_synthetic_benchmark_use_adasum(np_):
    out = _run(np_, BENCHMARK, ["--use-adasum", "--model", "tiny_cnn", "--batch-size", "4",
                                "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                                "--num-iters", "2"])
    assert "Model: tiny_cnn" in out and "Iter #1:" in out, out[-2000:]
    assert f"Total img/sec on {np_} CPU(s):" in out, out[-2000:]
