"""train_digits.py at 1, 2 and 4 ranks (briefly), its exact resume, and the synthetic benchmark."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from mpitrain.horovod_compat import SHIM_PATH
from support import ROOT, run_job

EXAMPLES = ROOT / "examples" / "pytorch"
FINAL = re.compile(r"final: test accuracy ([0-9.]+), test loss (\S+), step (\d+)")


def _digits(np_: int, checkpoint_dir: Path, *args: str) -> str:
    argv = [sys.executable, str(EXAMPLES / "train_digits.py"), "--epochs", "3",
            "--checkpoint-dir", str(checkpoint_dir), *args]
    result = run_job(np_, argv, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


# One rank (and its resume) and two (and resuming an interrupted run bit for bit); four ranks
# run the same code in the MPI suites, so the example itself runs at these two sizes in CI.
@pytest.mark.parametrize("np_", [1, 2])
def test_digits_learns_at_every_world_size(tmp_path, np_):
    out = _digits(np_, tmp_path)
    final = FINAL.search(out)
    assert final, out[-3000:]
    assert float(final.group(1)) > 0.85, out[-3000:]
    assert f"{np_} rank(s)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-002.pt", "epoch-003.pt"]
    if np_ == 1:
        # The README's "run it again": a finished run is only evaluated again, and says so.
        again = _digits(1, tmp_path, "--resume")
        assert "nothing left to train" in again and "epoch 3:" not in again, again[-3000:]
        assert FINAL.search(again).groups() == final.groups()
    if np_ == 2:
        # Interrupted after epoch 1, resumed: the very same final loss, to the last bit.
        resumed_dir = tmp_path / "resumed"
        stopped = _digits(2, resumed_dir, "--stop-after-epoch", "1")
        assert "stopped after epoch 1" in stopped and not FINAL.search(stopped)
        resumed = _digits(2, resumed_dir, "--resume")
        assert "at epoch 1" in resumed
        assert FINAL.search(resumed).groups() == final.groups()
        # Starting afresh over those checkpoints is refused, naming them; nothing is touched.
        before = {p.name: p.read_bytes() for p in resumed_dir.iterdir()}
        argv = [sys.executable, str(EXAMPLES / "train_digits.py"), "--epochs", "3",
                "--checkpoint-dir", str(resumed_dir)]
        refused = run_job(2, argv, timeout=240)
        assert refused.returncode != 0
        assert "epoch-003.pt" in refused.stderr and "--resume" in refused.stderr, refused.stderr
        assert {p.name: p.read_bytes() for p in resumed_dir.iterdir()} == before


def test_synthetic_benchmark_compares_frameworks_in_one_run():
    # Horovod is not installed here: the shipped compatibility route stands in for it, so the
    # Horovod column runs the example's Horovod calls (on mpitrain).
    frameworks = ("mpitrain", "mpitrain-copy", "ddp-gloo", "horovod")
    argv = [sys.executable, str(EXAMPLES / "pytorch_synthetic_benchmark.py"), "--model", "cnn",
            "--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
            "--num-iters", "2", "--frameworks", ",".join(frameworks)]
    shim = os.pathsep.join([str(ROOT / "src"), SHIM_PATH])
    result = run_job(2, argv, env={"PYTHONPATH": shim}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^\| (\S+) \| (\d) \| ([0-9.]+) \| ([0-9.]+) \| (\S+) \|$",
                      result.stdout, re.M)
    assert {(r[0], r[1]) for r in rows} == {(f, n) for f in frameworks for n in "12"}
    for _framework, ranks, per_rank, total, efficiency in rows:
        assert float(per_rank) > 0
        assert float(total) == pytest.approx(float(per_rank) * int(ranks), rel=1e-3, abs=0.2)
        assert efficiency == "100%" if ranks == "1" else re.fullmatch(r"\d+%", efficiency)
