"""mpitrain-hostfile: validate, convert, expand-slurm, generate and check from the command line."""

import subprocess
import sys

import pytest

from mpitrain.runner import hostfile_cli
from support import ROOT


def run(capsys, *argv):
    code = hostfile_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_reports_hosts_and_slots(capsys, tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# two nodes\nnode1 slots=4\nnode2:2\n")
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0
    assert out.splitlines() == [f"{path}: ok, 2 host(s), 6 slot(s)", "  node1  4", "  node2  2"]


def test_validate_names_line_of_duplicate(capsys, tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1 slots=4\nnode2 slots=4\nnode1 slots=2\n")
    code, _, err = run(capsys, "validate", str(path))
    assert code == 2
    assert f"{path}:3: host 'node1' is already listed on line 1" in err


def test_convert_between_forms(capsys, tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=1\n")
    assert run(capsys, "convert", str(path), "--to", "mpich")[1] == "a:2\nb:1\n"
    assert run(capsys, "convert", str(path), "--to", "horovod")[1] == "a:2,b:1\n"
    assert run(capsys, "convert", str(path), "--to", "plain")[1] == "a\na\nb\n"
    assert run(capsys, "convert", "-H", "x:3,y", "--to", "openmpi")[1] == \
        "x slots=3\ny slots=1\n"
    assert run(capsys, "convert", "-H", "x:3,y", "--slots-per-host", "8", "--to", "mpich")[1] \
        == "x:8\ny:8\n"
    out_file = tmp_path / "converted"
    assert run(capsys, "convert", str(path), "--to", "openmpi", "-o", str(out_file))[0] == 0
    assert out_file.read_text() == "a slots=2\nb slots=1\n"


def test_convert_pbs_nodefile(capsys, tmp_path):
    path = tmp_path / "nodefile"
    path.write_text("cn01\ncn01\ncn02\ncn01\n")  # PBS lists a host once per slot
    assert run(capsys, "convert", str(path), "--per-slot", "--to", "openmpi")[1] == \
        "cn01 slots=3\ncn02 slots=1\n"


def test_needs_exactly_one_source(capsys):
    code, _, err = run(capsys, "validate")
    assert code == 2 and "give exactly one of FILE or -H" in err


def test_expand_slurm(capsys):
    code, out, _ = run(capsys, "expand-slurm", "node[01-03],gpu-[1-2]")
    assert code == 0 and out.split() == ["node01", "node02", "node03", "gpu-1", "gpu-2"]
    code, out, _ = run(capsys, "expand-slurm", "node[01-03],gpu-[1-2]", "--tasks-per-node",
                       "2(x3),1(x2)", "--to", "openmpi")
    assert out == ("node01 slots=2\nnode02 slots=2\nnode03 slots=2\ngpu-1 slots=1\n"
                   "gpu-2 slots=1\n")
    code, _, err = run(capsys, "expand-slurm", "node[1-3", "--to", "mpich")
    assert code == 2 and "unclosed '['" in err


def test_generate_from_slurm(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "c[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2)")
    code, out, err = run(capsys, "generate", "--to", "mpich")
    assert code == 0 and out == "c1:4\nc2:4\n"
    assert "slurm allocation: 2 host(s), 8 slot(s)" in err


def test_generate_outside_an_allocation(capsys, monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "PBS_NODEFILE", "LSB_JOBID"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = run(capsys, "generate")
    assert code == 2 and "not inside a Slurm, PBS or LSF allocation" in err


def test_check_resolves_hosts(capsys):
    code, out, _ = run(capsys, "check", "-H", "localhost:2,no-such-host.invalid:1")
    assert code == 1
    assert "localhost: resolves to" in out
    assert "no-such-host.invalid: does not resolve" in out
    assert "1 of 2 host(s) ok" in out


def test_check_ssh_reports_why_a_host_does_not_answer(capsys, monkeypatch, tmp_path):
    # An ssh that refuses, standing in for a host without our key.
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\necho 'Permission denied (publickey).' >&2\nexit 255\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    code, out, _ = run(capsys, "check", "-H", "localhost", "--ssh", "--timeout", "2")
    assert code == 1
    assert "ssh fails: Permission denied (publickey)." in out


@pytest.mark.parametrize("action", ["validate", "convert", "expand-slurm", "generate", "check"])
def test_every_action_has_help(capsys, action):
    with pytest.raises(SystemExit) as info:
        hostfile_cli.main([action, "--help"])
    assert info.value.code == 0
    assert "usage: mpitrain-hostfile " + action in capsys.readouterr().out


def test_tools_script_runs_from_the_checkout(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a:2\n")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "hostfile" /
                                                 "mpitrain-hostfile"), "convert", str(path),
                             "--to", "openmpi"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a slots=2\n"
