"""Horovod 0.28.1's own elastic example, unchanged, on mpitrain with ULFM: a rank killed from
outside mid-benchmark, the survivors finish.

``examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py`` (``hvd.elastic.run``,
``TorchState`` with plain values, a reset callback rescaling the learning rate) runs through
the shipped compatibility route, ``python -m mpitrain.horovod_compat`` (``import horovod.torch
as hvd`` is ``mpitrain.torch``; ``tiny_cnn`` from tests/torchvision_stub stands in for
torchvision's models) under
``mpirun --with-ft ulfm -np 3``.  Once it reports its third benchmark iteration, the test
SIGKILLs world rank 0 (the rank that prints): the new rank 0 must finish and report the total
over 2 CPUs.

As for the Adasum examples, point ``MPITRAIN_HOROVOD_EXAMPLES`` at the ``examples`` directory
of a Horovod 0.28.1 checkout; without it the test skips.  About 15 s on a 2-core machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support import ROOT, job_env, mpirun_command

EXAMPLES = os.environ.get("MPITRAIN_HOROVOD_EXAMPLES", "")
SCRIPT = Path(EXAMPLES, "elastic", "pytorch", "pytorch_synthetic_benchmark_elastic.py")
TORCHVISION_STUB = ROOT / "tests" / "torchvision_stub"

pytestmark = [
    pytest.mark.skipif(not (EXAMPLES and SCRIPT.is_file()),
                       reason="set MPITRAIN_HOROVOD_EXAMPLES to a Horovod 0.28.1 examples/ "
                              "directory"),
    pytest.mark.timeout(200),
]


def _world_rank_pid(root: int, rank: int) -> int | None:
    """The pid of the process below ``root`` whose MPI world rank is ``rank``."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry))
        except OSError:
            continue
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and b"python" in cmdline:
                return pid
    return None


def _run_killing(script_args: list[str], when: str, world_rank: int,
                 cwd: Path) -> tuple[int, str, str]:
    """Run Horovod's example under ``mpirun --with-ft ulfm -np 3`` with the shims, SIGKILL
    ``world_rank`` once a stdout line starts with ``when``; return (status, stdout, stderr)."""
    path = os.pathsep.join(str(p) for p in (ROOT / "src", TORCHVISION_STUB))
    cmd = mpirun_command(3, ["--with-ft", "ulfm", sys.executable, "-m", "mpitrain.horovod_compat",
                             *script_args])
    proc = subprocess.Popen(cmd, env=job_env({"PYTHONPATH": path}), cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(150, proc.kill)  # a hang fails the test instead of blocking it
    watchdog.start()
    lines: list[str] = []
    killed = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith(when):
                killed = _world_rank_pid(proc.pid, world_rank)
                assert killed is not None, f"world rank {world_rank} not found below mpirun"
                os.kill(killed, signal.SIGKILL)
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait()
    finally:
        watchdog.cancel()
    out = "".join(lines)
    assert killed is not None, f"never saw {when!r}:\n{out[-3000:]}\n{err[-5000:]}"
    return proc.returncode, out, err


def test_synthetic_benchmark_survives_losing_rank_0():
    code, out, err = _run_killing([str(SCRIPT), "--model", "tiny_cnn", "--batch-size", "4",
                                   "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                                   "--num-iters", "30"], "Iter #2:", 0, ROOT)
    report = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    assert code == 0, report
    assert "lost world rank(s) [0] on host(s)" in err, report
    assert "continuing on 2 of 3 ranks" in err, report
    assert "Total img/sec on 2 CPU(s):" in out, report


MNIST_SCRIPT = Path(EXAMPLES, "elastic", "pytorch", "pytorch_mnist_elastic.py")


@pytest.mark.skipif(not MNIST_SCRIPT.is_file(), reason="no pytorch_mnist_elastic.py there")
def test_mnist_example_survives_losing_a_rank(tmp_path):
    """Horovod's ``pytorch_mnist_elastic.py`` unchanged (its MNIST is the torchvision stub's:
    scikit-learn's digits at 28x28): world rank 2 of 3 is killed once training has logged
    its first batches; the survivors finish every epoch and the test set is evaluated."""
    code, out, err = _run_killing([str(MNIST_SCRIPT), "--epochs", "3", "--batch-size", "32",
                                   "--log-interval", "5", "--data-dir", str(tmp_path)],
                                  "Train Epoch: 1 [160/", 2, tmp_path)
    report = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    assert code == 0, report
    assert "lost world rank(s) [2] on host(s)" in err, report
    assert "continuing on 2 of 3 ranks" in err, report
    assert "Train Epoch: 3" in out and "Test set: Average loss:" in out, report
