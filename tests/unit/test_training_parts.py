"""Parts of the training path that need no MPI: atomic files, the resumable sampler, globs."""

from __future__ import annotations

import os

import pytest
import torch

from mpitrain.face import files
from mpitrain.torch.checkpoint import checkpoint_glob, latest_checkpoint
from mpitrain.torch.sampler import DistributedSampler


def test_write_atomic_replaces_and_a_failing_writer_leaves_the_old_file(tmp_path):
    target = tmp_path / "sub" / "state.bin"
    files.write_atomic(target, b"old")

    def failing(f):
        f.write(b"half of the new")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        files.write_atomic(target, failing)
    assert target.read_bytes() == b"old"
    assert os.listdir(target.parent) == ["state.bin"]  # no temporary file left behind
    files.write_atomic(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new"


def test_write_atomic_removes_orphans_of_crashed_writes(tmp_path):
    target = tmp_path / "ck.pt"
    orphan = tmp_path / (files.temp_prefix(target) + "abc123")
    orphan.write_bytes(b"partial")
    (tmp_path / ".other.pt.tmp-x").write_bytes(b"someone else's")
    files.write_atomic(target, b"x")
    assert sorted(os.listdir(tmp_path)) == [".other.pt.tmp-x", "ck.pt"]


def test_sampler_resumes_in_the_middle_of_an_epoch():
    data = list(range(23))
    full = DistributedSampler(data, num_replicas=2, rank=1, seed=5)
    full.set_epoch(3)
    want = list(full)
    first = DistributedSampler(data, num_replicas=2, rank=1, seed=5)
    first.set_epoch(3)
    it = iter(first)
    taken = [next(it) for _ in range(4)]
    state = first.state_dict()
    assert state == {"epoch": 3, "yielded": 4}
    resumed = DistributedSampler(data, num_replicas=2, rank=1, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the same epoch: the position holds
    assert len(resumed) == len(want) - 4
    assert taken + list(resumed) == want
    assert list(resumed) == want  # the next pass of that epoch is whole again
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # another epoch: the position is dropped
    assert len(list(resumed)) == len(want)


def test_loader_over_resumed_sampler_gives_the_remaining_batches():
    data = torch.utils.data.TensorDataset(torch.arange(16.0))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
    sampler.load_state_dict({"epoch": 0, "yielded": 8})
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    assert [b[0].tolist() for b in loader] == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_templates_and_latest(tmp_path):
    assert checkpoint_glob(tmp_path / "ck-{step:04d}-{epoch}.pt") == str(tmp_path / "ck-*-*.pt")
    template = tmp_path / "ck-{step}.pt"
    assert latest_checkpoint(template) is None
    for step, mtime in ((1, 100), (2, 300), (10, 200)):
        path = tmp_path / f"ck-{step}.pt"
        path.write_bytes(b"")
        os.utime(path, ns=(mtime * 10**9, mtime * 10**9))
    assert latest_checkpoint(template) == str(tmp_path / "ck-2.pt")  # newest, not largest
