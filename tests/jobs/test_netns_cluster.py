"""A real multi-host job: 2 network-namespace hosts x 2 ranks, launched by mpitrainrun.

Needs root, ``ip``, ``tc`` and ``unshare`` (tools/netns_cluster.py); without them every test
here skips saying which is missing, unless ``MPITRAIN_TEST_REQUIRE_NETNS=1`` makes that a
failure (as CI, which is root, should).  The cluster is always removed again: namespaces,
links, /etc/hosts lines and state, also when a test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpitrain.core import config
from support import (
    ROOT,
    again_if_the_launcher_failed_to_start,
    job_env,
    netns_tool,
    require_namespace_cluster,
)

pytestmark = pytest.mark.netns

netns = netns_tool()

HOSTS, SLOTS = 2, 2
JOB_TIMEOUT = 240



@pytest.fixture(scope="module")
def cluster():
    require_namespace_cluster()
    c = netns.Cluster(f"mt{os.getpid() % 100000}", HOSTS, SLOTS)
    try:
        c.create()
        yield c
    finally:
        c.destroy()


def traces(name: str) -> list[str]:
    """Whatever a cluster called ``name`` left on this machine."""
    found = []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {n}" for n in out.split() if n.startswith(f"{name}-")]
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in out.splitlines()
              if line.split(":")[1].strip().startswith(f"{name}-")]
    found += [f"/etc/hosts: {line}" for line in Path("/etc/hosts").read_text().splitlines()
              if line.endswith(f"mpitrain-netns:{name}")]
    if (netns.STATE_BASE / f"mpitrain-netns-{name}").exists():
        found.append("state directory")
    return found


def launch(c, command: list[str], launcher_args: list[str] = (), np: int = HOSTS * SLOTS,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = job_env(extra_env)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    argv = c.launch_argv(np, command, launcher_args)
    try:
        return again_if_the_launcher_failed_to_start(lambda: subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=ROOT))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"job across the namespace hosts hung for {JOB_TIMEOUT} s: "
                    f"{(exc.stdout or '')!s:.4000}")


def test_cluster_is_removed_even_when_the_body_fails():
    require_namespace_cluster()
    name = f"mz{os.getpid() % 100000}"
    with pytest.raises(RuntimeError, match="on purpose"), netns.Cluster(name, hosts=2) as c:
        assert c.exists() and traces(name)
        raise RuntimeError("on purpose")
    assert traces(name) == []
    # A crashed run's leftovers: built, never destroyed; a fresh object clears them by name.
    netns.Cluster(name, hosts=1).create()
    assert traces(name)
    netns.Cluster(name).destroy()
    assert traces(name) == []


def test_autogroup_scheduling_is_off_while_the_cluster_exists(cluster):
    # Each host's daemon runs in a session of its own; with autogroups the kernel starved one
    # rank for seconds at a time (tools/netns_cluster.py's docstring).
    if not netns.AUTOGROUP.exists():
        pytest.skip("this kernel has no autogroup scheduling")
    assert netns.AUTOGROUP.read_text().strip() == "0"


def test_layout_is_detected_per_host(cluster):
    result = launch(cluster, [sys.executable, "-m", "mpitrain.face.info", "--json"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    info = json.loads(result.stdout[result.stdout.index("{"):])
    assert info["size"] == 4 and info["nodes"] == 2 and not info["emulated_nodes"]
    rows = sorted(info["ranks"], key=lambda r: r["rank"])
    assert [r["host"] for r in rows] == [cluster.hostnames[0]] * 2 + [cluster.hostnames[1]] * 2
    assert [(r["local_rank"], r["local_size"]) for r in rows] == [(0, 2), (1, 2)] * 2
    assert [(r["cross_rank"], r["cross_size"]) for r in rows] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r["node"] for r in rows] == [0, 0, 1, 1]
    assert info["allreduce_check"]["got"] == info["allreduce_check"]["expected"]


# "shm" across hosts falls back to hierarchical (the same code as the row below; the fallback
# itself is checked by test_data_plane's choice test at 2x2), so it is not run again here.
VARIANTS = [pytest.param(["--allreduce-algorithm", name], name, id=name)
            for name in config.ALLREDUCE_ALGORITHMS if name != "shm"]
VARIANTS.append(pytest.param(["--hierarchical-allreduce"], "hierarchical",
                             id="horovod-hierarchical-flag"))
PIPELINED = ["--allreduce-algorithm", "hierarchical", "-x", "MPITRAIN_HIERARCHICAL_PIPELINE=4"]
VARIANTS.append(pytest.param(PIPELINED, "hierarchical", id="hierarchical-pipelined"))


@pytest.mark.parametrize(("launcher_args", "algorithm"), VARIANTS)
def test_every_collective_across_hosts(cluster, launcher_args, algorithm):
    result = launch(cluster, [sys.executable, str(ROOT / "tests" / "jobs" /
                                                  "netns_collectives.py")], launcher_args)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    # The setting reached every rank on every host through the launcher.
    assert {r["algorithm"] for r in rows} == {algorithm}
    assert {r["pipeline"] for r in rows} == {4 if launcher_args is PIPELINED else 0}
    assert [r["host"] for r in rows] == [cluster.hostnames[0]] * 2 + [cluster.hostnames[1]] * 2
    # local_rank, local_size, cross_rank, cross_size, node, ranks really sharing the host
    assert [r["layout"] for r in rows] == [[0, 2, 0, 2, 0, 2], [1, 2, 0, 2, 0, 2],
                                           [0, 2, 1, 2, 1, 2], [1, 2, 1, 2, 1, 2]]
    assert all(r["checks"] >= 100 for r in rows)


def test_uneven_hosts(cluster):
    """3 ranks on hosts of 2 and 1: heterogeneous layout, hierarchical allreduce forced."""
    result = launch(cluster, [sys.executable, str(ROOT / "tests" / "jobs" /
                                                  "netns_collectives.py")],
                    ["--allreduce-algorithm", "hierarchical"], np=3)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert [r["host"] for r in rows] == [cluster.hostnames[0]] * 2 + [cluster.hostnames[1]]
    assert [r["layout"] for r in rows] == [[0, 2, 0, 2, 0, 2], [1, 2, 0, 1, 0, 2],
                                           [0, 1, 1, 2, 1, 1]]
    assert {r["algorithm"] for r in rows} == {"hierarchical"}


def test_shaped_link_benchmark_runs(cluster):
    """The benchmark's worker runs across shaped links and reports every contender.

    Which algorithm is faster is not asserted here: that waits for the data plane's own
    algorithms (see benchmarks/netns_allreduce.py).
    """
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import netns_allreduce
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cluster.shape("1gbit", "128kb", "10ms")
    try:
        result = launch(cluster, [sys.executable, str(ROOT / "benchmarks" /
                                                      "netns_allreduce.py"), "--worker",
                                  "--sizes-mib", "0.25", "--rounds", "1", "--iters", "1"])
    finally:
        cluster.unshape()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("BENCH "))
    data = json.loads(line[len("BENCH "):])
    assert set(data["results"]) == {"mpi", "ring", "hierarchical", "auto", "engine-mpi"}
    assert 0 < data["link_Bps"] < 10e9
    text = netns_allreduce.report(data, {"rate": "1gbit"})
    assert "0.25 MiB:" in text and "auto takes" in text
    assert "MPI's own through the engine takes" in text


def test_a_whole_host_dying_ends_in_place_or_reported_never_hung(cluster, tmp_path):
    """mpitrainrun --min-np 2 (ULFM): rank 2 kills every process of its host in epoch 1,
    Open MPI's daemon included.  Open MPI 5.0.11 (PRRTE 3.0) ends the whole job when it loses a
    daemon (its errmgr aborts on a daemon's comm failure, ULFM or not), unless the survivors
    finish first: both happen, by timing (CI has seen each), and Open MPI may report the lost
    daemon after the survivors finished (seen 2026-11-28).  So either ranks 0 and 1 on the
    other host shrank the job to 2 ranks and finished with equal parameters, every sample of
    every epoch seen, and mpitrainrun exits 0; or mpitrainrun exits non-zero naming the lost
    node (it cannot tell whether the survivors had finished, so it never claims success
    then); never a hang, never an exit 0 with the survivors unfinished.  (Open MPI stops
    forwarding the survivors' output once a daemon is gone, so the evidence is their log
    files, not their stdout.)"""
    script = ROOT / "tests" / "jobs" / "elastic_train.py"
    result = launch(cluster, [sys.executable, str(script), str(tmp_path),
                              json.dumps({"2": [1, 2, "host"]})],
                    ["--min-np", "2", "-x", "ELASTIC_TRAIN_NETNS_HOST=1"])
    output = result.stdout[-4000:] + result.stderr[-4000:]
    logs = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(logs) == [0, 1, 2, 3], output
    survivors = [logs[0], logs[1]]
    assert "params" not in logs[2] and "params" not in logs[3]
    finished = [log.get("final_size") == 2 for log in survivors]
    if result.returncode != 0:
        print("whole host lost: Open MPI ended the job, mpitrainrun reported it "
              f"(survivors finished: {all(finished)})")
        node = f"{cluster.name}-node2"
        assert f"Open MPI lost the daemon of node {node}" in result.stderr, output
        return
    assert all(finished), ([log["sizes"] for log in survivors], output)
    for log in survivors:
        assert log["sizes"] == [4, 2], (log["sizes"], output)
    assert logs[0]["params"] == logs[1]["params"]
    recovery = max(log["recovered_at"][0] for log in survivors) - logs[2]["died_at"]
    print(f"whole host lost: the survivors finished in place, recovery {recovery:.3f} s")
    assert 0 < recovery < 30, recovery
    for epoch in range(3):
        seen = {i for log in logs.values() for e, batch in log["batches"] if e == epoch
                for i in batch}
        assert seen == set(range(96)), f"epoch {epoch} skipped samples"


@pytest.fixture(scope="module")
def cluster3():
    require_namespace_cluster()
    c = netns.Cluster(f"m3{os.getpid() % 100000}", 3, SLOTS)
    try:
        c.create()
        yield c
    finally:
        c.destroy()


@pytest.mark.parametrize("launcher_args", [
    pytest.param(["--allreduce-algorithm", "ring"], id="ring"),
    pytest.param(PIPELINED, id="hierarchical-pipelined"),
])
def test_three_hosts(cluster3, launcher_args):
    """3 hosts x 2 ranks: an odd number of nodes for the cross-node step (the pipelined
    hierarchical allreduce and the flat ring), every collective against the reference and
    the same bits on every rank."""
    result = launch(cluster3, [sys.executable, str(ROOT / "tests" / "jobs" /
                                                   "netns_collectives.py")], launcher_args,
                    np=3 * SLOTS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert [r["host"] for r in rows] == [h for h in cluster3.hostnames for _ in range(SLOTS)]
    assert [r["layout"][2:4] for r in rows] == [[c, 3] for c in range(3) for _ in range(SLOTS)]
    assert all(r["checks"] >= 100 for r in rows)
