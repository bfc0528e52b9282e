"""benchmarks/compression_training.py runs end to end (plain mpirun, 2 ranks, a few seconds).

The full measurement needs the namespace cluster and minutes; this keeps the script itself
working: two seeds of two compressors, each reaching an easy target, and the table printed.
"""

import subprocess
import sys

from support import ROOT


def test_the_compression_benchmark_trains_and_prints_its_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compression_training.py"), "--local",
         "-np", "2", "--models", "mlp", "--compressors", "none", "powersgd4", "--epochs", "2",
         "--batch-size", "32", "--seeds", "2", "--target-mlp", "0.5"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "medians over 2 seeds" in result.stdout
    for compressor in ("none", "powersgd4"):
        line = next(row for row in result.stdout.splitlines()
                    if row.startswith(f"| {compressor} |"))
        assert "| 2/2 |" in line, result.stdout  # both seeds passed 50% on digits
