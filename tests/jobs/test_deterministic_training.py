"""MPITRAIN_DETERMINISTIC end to end: two full runs of examples/pytorch/train_digits.py with
different fusion thresholds, cycle times and allreduce algorithms end with the same parameters,
bit for bit.

Three ranks: two ranks add two numbers, which commute, so every algorithm already agrees there.
In the default mode these two runs end with different parameters (checked by hand on
2026-11-28 with two epochs; the engine-level negative control runs in CI, in
tests/mpi/test_deterministic.py).  One epoch each (30 steps at 3 ranks): two runs of 30-45 s
on the shared 2-core machine.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from support import ROOT, run_job

EXAMPLE = ROOT / "examples" / "pytorch" / "train_digits.py"
FINAL = re.compile(r"final: test accuracy ([0-9.]+), test loss (\S+), step (\d+)")
# Fused into one bucket and left to auto; or cut into 16 KiB buckets and forced onto the ring.
SETTINGS = ({"MPITRAIN_FUSION_THRESHOLD": str(64 << 20), "MPITRAIN_CYCLE_TIME": "1"},
            {"MPITRAIN_FUSION_THRESHOLD": str(16 << 10), "MPITRAIN_CYCLE_TIME": "0.2",
             "MPITRAIN_ALLREDUCE_ALGORITHM": "ring"})


def _train(checkpoints: Path, env: dict[str, str]) -> tuple[dict[str, torch.Tensor], str]:
    argv = [sys.executable, str(EXAMPLE), "--epochs", "1", "--no-progress",
            "--checkpoint-dir", str(checkpoints)]
    result = run_job(3, argv, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    final = FINAL.search(result.stdout)
    assert final, result.stdout[-3000:]
    state = torch.load(checkpoints / "epoch-001.pt", weights_only=False)["model"]
    return state, final.group(2)


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()}


def test_two_runs_with_other_fusion_and_algorithm_end_bit_for_bit_alike(tmp_path):
    (a, loss_a), (b, loss_b) = (_train(tmp_path / str(i), dict(s, MPITRAIN_DETERMINISTIC="1"))
                                for i, s in enumerate(SETTINGS))
    assert set(a) == set(b) and len(a) == 6  # three Linear layers' weights and biases
    assert _bits(a) == _bits(b)
    assert loss_a == loss_b
