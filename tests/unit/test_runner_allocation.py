"""Scheduler allocations: Slurm node lists and task counts, PBS and LSF node files."""

import pytest

from mpitrain.runner.allocation import (
    detect,
    expand_counts,
    expand_nodelist,
    lsf_mcpu_hosts,
    slurm_hosts,
)
from mpitrain.runner.hosts import HostfileError, HostSlots


@pytest.mark.parametrize(("text", "expected"), [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[01-04,07],gpu-[1-2]",
     ["node01", "node02", "node03", "node04", "node07", "gpu-1", "gpu-2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: widths grow
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("cn[1-2]-ib", ["cn1-ib", "cn2-ib"]),  # suffix after the brackets
    ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
    ("a,b[3],c", ["a", "b3", "c"]),
    ("nid[00012-00013,00020]", ["nid00012", "nid00013", "nid00020"]),  # Cray form
    ("login1.cluster,compute[1-2].cluster",
     ["login1.cluster", "compute1.cluster", "compute2.cluster"]),
])
def test_expand_nodelist(text, expected):
    assert expand_nodelist(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("node[01-04", "unclosed '['"),
    ("node01-04]", "unmatched ']'"),
    ("node[[1-2]]", "nested '['"),
    ("node[4-1]", "range '4-1' runs backwards"),
    ("node[a-c]", "bad range 'a-c'"),
    ("node[1-2],,x", "empty entry"),
    ("", "empty"),
])
def test_bad_nodelist(text, message):
    with pytest.raises(HostfileError, match=None) as info:
        expand_nodelist(text)
    assert message in str(info.value)


@pytest.mark.parametrize(("text", "expected"), [
    ("4", [4]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("8(x2),4,2(x2)", [8, 8, 4, 2, 2]),
])
def test_expand_counts(text, expected):
    assert expand_counts(text) == expected


@pytest.mark.parametrize("text", ["2x3", "2(x0)", "0", "a", "2(3)"])
def test_bad_counts(text):
    with pytest.raises(HostfileError, match="SLURM_TASKS_PER_NODE"):
        expand_counts(text)


def test_slurm_hosts_pairs_names_and_counts():
    assert slurm_hosts("node[01-03],gpu1", "2(x3),1") == [
        HostSlots("node01", 2), HostSlots("node02", 2), HostSlots("node03", 2),
        HostSlots("gpu1", 1)]
    with pytest.raises(HostfileError, match="gives 2 counts for the 3 nodes"):
        slurm_hosts("n[1-3]", "2(x2)")


def test_detect_slurm_prefers_tasks_over_cpus():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_CPUS_PER_NODE": "64(x2)"}
    found = detect(env)
    assert found is not None and found.scheduler == "slurm"
    assert found.hosts == (HostSlots("n1", 2), HostSlots("n2", 2))
    del env["SLURM_TASKS_PER_NODE"]
    assert detect(env).hosts == (HostSlots("n1", 64), HostSlots("n2", 64))


def test_detect_pbs_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn001.hpc\ncn001.hpc\ncn002.hpc\ncn002.hpc\n")
    found = detect({"PBS_JOBID": "7.server", "PBS_NODEFILE": str(nodefile)})
    assert found.scheduler == "pbs"
    assert found.hosts == (HostSlots("cn001.hpc", 2), HostSlots("cn002.hpc", 2))
    with pytest.raises(HostfileError, match="PBS_NODEFILE=.* cannot be read"):
        detect({"PBS_NODEFILE": str(tmp_path / "gone")})


def test_detect_lsf(tmp_path):
    found = detect({"LSB_JOBID": "9", "LSB_MCPU_HOSTS": "hostA 4 hostB 2"})
    assert found.scheduler == "lsf"
    assert found.hosts == (HostSlots("hostA", 4), HostSlots("hostB", 2))
    djob = tmp_path / "djob"
    djob.write_text("hostA\nhostA\nhostB\n")
    found = detect({"LSB_JOBID": "9", "LSB_DJOB_HOSTFILE": str(djob)})
    assert found.hosts == (HostSlots("hostA", 2), HostSlots("hostB", 1))
    with pytest.raises(HostfileError, match="pairs"):
        lsf_mcpu_hosts("hostA 4 hostB")
    with pytest.raises(HostfileError, match="bad count 'x'"):
        lsf_mcpu_hosts("hostA x")


def test_detect_nothing_outside_a_scheduler():
    assert detect({"HOME": "/root"}) is None
