"""The chaos soak's short version (benchmarks/chaos_soak.py; the hour-long run is in
docs/guide/reliability.md): 90 s of elastic training on 2 namespace hosts x 2 ranks, a rank
killed from outside and a rank killed inside a commit.  Every check of the soak must pass: no
hang, every fault recovered, identical final parameters, nothing left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import ROOT, netns_tool, require_namespace_cluster

netns = netns_tool()


@pytest.mark.timeout(900)
def test_short_chaos_soak_recovers_every_fault_and_leaves_nothing(tmp_path):
    require_namespace_cluster()
    rundir = tmp_path / "soak"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos_soak.py"), "--minutes", "1.5",
         "--fault-every", "0.4", "--faults", "kill,commit", "--rundir", str(rundir),
         "--name", f"ms{os.getpid() % 100000}"],
        capture_output=True, text=True, timeout=840)
    output = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    summary = json.loads((rundir / "chaos_soak.json").read_text())["summary"]
    print(json.dumps(summary, indent=1))
    assert result.returncode == 0, output
    assert summary["hang"] is None and summary["final_params_identical"], summary
    assert summary["faults_injected"] >= 2, summary
    assert summary["faults_recovered"] == summary["faults_injected"], summary
    assert summary["shm_left"] == [] and summary["processes_left"] == [], summary
