"""The parts of SyncBatchNorm, DDP and the c10d backend that need no MPI."""

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mpitrain
from mpitrain.collectives import buckets as gradient_buckets
from mpitrain.engine import buckets
from mpitrain.engine.request import Completion, Handle, Kind, Request
from mpitrain.face.scopes import check_scope
from mpitrain.torch.c10d import reduce_ops, rendezvous
from mpitrain.torch.c10d.work import Progress, Work
from mpitrain.torch.nn.parallel.reducer import reachable_parameters


def test_backend_registered_at_import_without_starting_mpi():
    assert dist.Backend.MPITRAIN == "mpitrain"
    assert "mpitrain" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # not hijacked
    assert not mpitrain.is_initialized()


def test_check_scope():
    assert check_scope("global") == check_scope(1) == "global"
    assert check_scope("LOCAL") == check_scope(0) == "local"
    with pytest.raises(ValueError, match="'node'"):
        check_scope("node")
    with pytest.raises(TypeError, match="float"):
        check_scope(1.0)


def test_bucket_assignment_caps_and_dtypes():
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(10, dtype=torch.float64),
              torch.zeros(300), torch.zeros(50)]
    items = [((p.dtype, p.device), p.numel() * p.element_size()) for p in params]
    groups = [[params[i] for i in g]
              for g in buckets.plan(items, cap_bytes=800, first_cap_bytes=400)]
    sizes = [[p.numel() for p in g] for g in groups]
    # First bucket holds at most 400 bytes (100 floats), later ones at most 800; float64 on its
    # own; 1200 bytes, over the cap, travel alone (a bucket never exceeds its cap, as fusion's).
    assert sizes == [[100], [100], [10], [300], [50]]
    assert all(len({p.dtype for p in g}) == 1 for g in groups)
    with pytest.raises(ValueError, match=">= 0"):
        buckets.plan(items, cap_bytes=-1)


def test_buckets_are_views_of_one_zeroed_buffer():
    params = [torch.ones(2, 3), torch.ones(4)]
    (bucket,) = gradient_buckets.build([params], lambda n: np.full(n, 0xFF, dtype=np.uint8),
                                       extra_per_param=1)
    assert bucket.flat.numel() == 6 + 4 + 2 and bucket.numel == 10
    assert torch.count_nonzero(bucket.flat) == 0
    bucket.views[1].fill_(7)
    assert bucket.flat[6:10].tolist() == [7.0] * 4 and bucket.views[0].shape == (2, 3)
    assert bucket.extra.numel() == 2


def test_reduce_op_translation():
    assert reduce_ops.resolve(dist.ReduceOp.AVG).engine_op == mpitrain.ReduceOp.AVERAGE
    premul = reduce_ops.resolve(dist._make_nccl_premul_sum(0.25))
    assert (premul.engine_op, premul.prescale) == (mpitrain.ReduceOp.SUM, 0.25)
    band = reduce_ops.resolve(dist.ReduceOp.BAND)
    rows = torch.tensor([[0b1100, 0b1010], [0b0110, 0b0011]])
    assert band.apply_fold(rows).tolist() == [0b0100, 0b0010]
    with pytest.raises(TypeError, match="AVG"):
        reduce_ops.resolve(dist.ReduceOp.AVG).check(torch.ones(1, dtype=torch.int32))


def test_reachable_parameters_follow_the_graph():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    out = {"y": [a(torch.ones(1, 2))], "n": 3}
    found = reachable_parameters(out)
    assert {id(a.weight), id(a.bias)} <= found
    assert id(b.weight) not in found


def test_env_rendezvous_falls_back_only_under_mpi(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_LOCALID",
                "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                "PALS_LOCAL_RANKID", "MV2_COMM_WORLD_RANK", "PALS_RANKID"):
        monkeypatch.delenv(var, raising=False)
    assert not rendezvous.under_mpi_launcher()
    assert not rendezvous._env_complete("env://")
    # Outside MPI torch's own handler answers, with its own error.
    with pytest.raises(ValueError, match="RANK"):
        next(dist.rendezvous("env://"))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert rendezvous.under_mpi_launcher()
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost"),
                       ("MASTER_PORT", "1234")):
        monkeypatch.setenv(var, value)
    assert rendezvous._env_complete("env://")


def test_work_future_completes_from_an_engine_callback():
    completion = Completion()
    handle = Handle(completion, Request(name="x", kind=Kind.BARRIER, entries=[]))
    progress = Progress("unit")
    out = [torch.ones(1)]
    work = Work(out, finish=handle.wait, describe="unit")
    handle.add_done_callback(lambda h: progress.ready(work))
    assert not work.is_completed()
    completion.finish([handle])
    assert work.get_future().wait() == out
    assert work.wait(datetime.timedelta(seconds=5)) and work.is_success()


def test_work_errors_reach_wait_and_future():
    failing = Work([], finish=lambda: (_ for _ in ()).throw(mpitrain.MpitrainInternalError("x")))
    progress = Progress("unit-errors")
    progress.ready(failing)
    with pytest.raises(mpitrain.MpitrainInternalError, match="x"):
        failing.wait()
    with pytest.raises(Exception, match="x"):
        failing.get_future().wait()
    slow = Work([])
    with pytest.raises(mpitrain.MpitrainInternalError, match="did not finish"):
        slow.wait(datetime.timedelta(milliseconds=10))


def test_callback_after_completion_runs_at_once():
    completion = Completion()
    handle = Handle(completion, Request(name="y", kind=Kind.BARRIER, entries=[]))
    completion.finish([handle])
    seen = []
    handle.add_done_callback(seen.append)
    assert seen == [handle]
