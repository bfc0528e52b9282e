"""torch.distributed with backend="mpitrain": every collective against values every rank can
compute, Work/Future semantics, errors, subgroups, point-to-point messages, and stock DDP on
backend="mpitrain" training step for step like stock DDP on Gloo.

The default group comes from a plain ``init_process_group("mpitrain")`` under mpirun: no
MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE in the environment (the env:// fallback); the Gloo
group over the same ranks uses the TCP store that fallback served from rank 0.
"""

import os
import struct
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_common import make_model, train_lockstep
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import mpitrain
from mpitrain import session
from mpitrain.torch.c10d import ProcessGroupMpitrain

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MPI_CONFIGS = ("np2", "np4")
R = dist.ReduceOp


@pytest.fixture(scope="module")
def pg(hvd):
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        assert var not in os.environ
    # mpirun set no RANK/WORLD_SIZE; init() exported MPI's (mpitrain.core.job_env).
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(RANK), str(SIZE))
    dist.init_process_group(backend="mpitrain")
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo(pg):
    return dist.new_group(backend="gloo")


def per_rank(rank: int, n: int = 5, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=gen) + 0.5).to(dtype)
    return torch.randint(0, 64, (n,), generator=gen).to(dtype)


def test_default_group_is_mpitrain(pg):
    assert dist.get_backend() == "mpitrain"
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    assert isinstance(dist.distributed_c10d._get_default_group(), ProcessGroupMpitrain)
    assert pg._get_backend_name() == "mpitrain"


FLOAT_OPS = {"SUM": R.SUM, "AVG": R.AVG, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX}
INT_OPS = {"SUM": R.SUM, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX, "BAND": R.BAND,
           "BOR": R.BOR, "BXOR": R.BXOR}


def fold(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(tensors)
    if name == "SUM":
        return stacked.sum(0).to(stacked.dtype)
    if name == "AVG":
        return stacked.mean(0)
    if name == "PRODUCT":
        return stacked.prod(0).to(stacked.dtype)
    if name in ("MIN", "MAX"):
        return getattr(stacked, name.lower())(0).values
    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[name]
    out = tensors[0]
    for t in tensors[1:]:
        out = fn(out, t)
    return out


@pytest.mark.parametrize("name", list(FLOAT_OPS))
def test_all_reduce_float_ops(pg, name):
    t = per_rank(RANK)
    dist.all_reduce(t, op=FLOAT_OPS[name])
    torch.testing.assert_close(t, fold(name, [per_rank(r) for r in range(SIZE)]))


@pytest.mark.parametrize("name", list(INT_OPS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_all_reduce_int_ops(pg, name, dtype):
    t = per_rank(RANK, dtype=dtype)
    dist.all_reduce(t, op=INT_OPS[name])
    torch.testing.assert_close(t, fold(name, [per_rank(r, dtype=dtype) for r in range(SIZE)]))


def test_all_reduce_bool_and_premul_sum(pg):
    flags = torch.tensor([RANK == 0, False, True])
    dist.all_reduce(flags, op=R.BOR)
    assert flags.tolist() == [True, False, True]
    t = torch.full((3,), float(RANK + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert t.tolist() == [0.5 * SIZE * (SIZE + 1) / 2] * 3


def test_bad_reductions_raise_at_the_call(pg):
    with pytest.raises(TypeError, match="AVG needs a floating"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG)
    with pytest.raises(TypeError, match="BXOR needs an integer"):
        dist.all_reduce(torch.ones(2), op=R.BXOR)


def test_all_reduce_coalesced_and_async_future(pg):
    a, b = per_rank(RANK, 3), per_rank(RANK, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the name, not the op
        work = dist.all_reduce_coalesced([a, b], async_op=True)
    work.wait()
    torch.testing.assert_close(a, fold("SUM", [per_rank(r, 3) for r in range(SIZE)]))
    torch.testing.assert_close(b, fold("SUM", [per_rank(r, 7) for r in range(SIZE)]))
    t = torch.ones(4)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    assert doubled.wait().tolist() == [2.0 * SIZE] * 4
    assert t.tolist() == [float(SIZE)] * 4


def test_a_failed_collective_under_torch_ddp_raises_instead_of_crashing(pg):
    """Stock DDP reads a failed allreduce's future in C++: it must raise there (a Python-level
    set_exception would hand it the exception object as the result, and it would segfault)."""
    from mpitrain.torch.c10d.process_group import ProcessGroupMpitrain
    from mpitrain.torch.c10d.work import Work

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))

    def fail() -> None:
        raise mpitrain.MpitrainInternalError("injected failure")

    def failing_allreduce(self, tensors, opts=None):  # a failure, on every rank alike
        work = Work(tensors, finish=fail)
        work.complete()()  # finish, then resolve the future, here
        return work

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(ProcessGroupMpitrain, "allreduce", failing_allreduce)
    try:
        with pytest.raises(RuntimeError, match="MpitrainInternalError: injected failure"):
            model(torch.ones(2, 3)).sum().backward()
    finally:
        monkeypatch.undo()


def test_work_completes_without_wait(pg):
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True)
    work.get_future().wait()
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.result()[0] is t


def test_mismatch_fails_every_rank(pg):
    t = torch.ones(3 + RANK % 2)
    work = dist.all_reduce(t, async_op=True)
    with pytest.raises(mpitrain.MpitrainInternalError, match="mismatched"):
        work.wait()
    # The future's error is a C++ one (what torch's DDP reducer needs, or it would read tensors
    # out of an exception object), so Python sees torch's RuntimeError naming ours.
    with pytest.raises(RuntimeError, match="CollectiveMismatchError: mismatched"):
        work.get_future().wait()


@pytest.mark.parametrize("root", range(4))
def test_broadcast(pg, root):
    root = root % SIZE
    t = per_rank(RANK)
    dist.broadcast(t, src=root)
    torch.testing.assert_close(t, per_rank(root))


def test_all_gather_list_and_tensor(pg):
    out = [torch.empty(5) for _ in range(SIZE)]
    dist.all_gather(out, per_rank(RANK))
    for r in range(SIZE):
        torch.testing.assert_close(out[r], per_rank(r))
    flat = torch.empty(SIZE * 5)
    dist.all_gather_single(flat, per_rank(RANK))
    torch.testing.assert_close(flat, torch.cat([per_rank(r) for r in range(SIZE)]))
    grid = torch.empty(SIZE, 2, 3)
    dist.all_gather_single(grid, torch.full((2, 3), float(RANK)))
    assert grid[:, 0, 0].tolist() == [float(r) for r in range(SIZE)]


def test_all_gather_into_tensor_and_the_coalesced_forms(pg):
    # The flat and stacked outputs of all_gather_into_tensor ...
    flat = torch.empty(SIZE * 5)
    dist.all_gather_into_tensor(flat, per_rank(RANK))
    torch.testing.assert_close(flat, torch.cat([per_rank(r) for r in range(SIZE)]))
    stacked = torch.empty(SIZE, 5)
    dist.all_gather_into_tensor(stacked, per_rank(RANK))
    for r in range(SIZE):
        torch.testing.assert_close(stacked[r], per_rank(r))
    # ... several inputs of other sizes in one request (torch wants one dtype there):
    # outputs[rank][input] ...
    inputs = [per_rank(RANK), per_rank(RANK, n=3)]
    outputs = [[torch.empty_like(t) for t in inputs] for _ in range(SIZE)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates all_gather_coalesced
        dist.all_gather_coalesced(outputs, inputs)
    for r in range(SIZE):
        for got, want in zip(outputs[r], [per_rank(r), per_rank(r, n=3)]):
            torch.testing.assert_close(got, want)
    # ... and one output tensor per input, of any types, as torch's coalescing manager asks
    # the backend.
    inputs = [per_rank(RANK), per_rank(RANK, n=3, dtype=torch.float64)]
    backend = dist.distributed_c10d._get_default_group()
    into = [torch.empty(SIZE * 5), torch.empty(SIZE * 3, dtype=torch.float64)]
    backend.allgather_into_tensor_coalesced(into, inputs).wait()
    torch.testing.assert_close(into[0], torch.cat([per_rank(r) for r in range(SIZE)]))
    torch.testing.assert_close(into[1], torch.cat([per_rank(r, n=3, dtype=torch.float64)
                                                   for r in range(SIZE)]))


def test_objects_ride_on_the_backend(pg):
    got = [None] * SIZE
    dist.all_gather_object(got, {"rank": RANK, "tag": "x" * RANK})
    assert got == [{"rank": r, "tag": "x" * r} for r in range(SIZE)]
    objs = [("hello", RANK)] if RANK == 1 % SIZE else [None]
    dist.broadcast_object_list(objs, src=1 % SIZE)
    assert objs == [("hello", 1 % SIZE)]


@pytest.mark.parametrize("name", ["SUM", "MAX", "AVG", "BAND"])
def test_reduce_scatter_list_and_tensor(pg, name):
    dtype = torch.int64 if name == "BAND" else torch.float32
    op = INT_OPS.get(name) or FLOAT_OPS[name]

    def piece(rank, dest):
        return per_rank(10 * rank + dest, 4, dtype)

    out = torch.empty(4, dtype=dtype)
    dist.reduce_scatter(out, [piece(RANK, d) for d in range(SIZE)], op=op)
    want = fold(name, [piece(r, RANK) for r in range(SIZE)])
    torch.testing.assert_close(out, want)
    out2 = torch.empty(4, dtype=dtype)
    dist.reduce_scatter_single(out2, torch.cat([piece(RANK, d) for d in range(SIZE)]), op=op)
    torch.testing.assert_close(out2, want)


def test_all_to_all_single_even_and_uneven(pg):
    inp = torch.arange(SIZE * 2, dtype=torch.float32) + 100 * RANK
    out = torch.empty(SIZE * 2)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(2 * RANK, 2 * RANK + 2, dtype=torch.float32) + 100 * r
                      for r in range(SIZE)])
    torch.testing.assert_close(out, want)
    # Rank r sends d+1 rows of width 3 to rank d.
    send = [d + 1 for d in range(SIZE)]
    rows = torch.cat([torch.full((d + 1, 3), float(10 * RANK + d)) for d in range(SIZE)])
    recv = [RANK + 1] * SIZE
    got = torch.empty(sum(recv), 3)
    dist.all_to_all_single(got, rows, output_split_sizes=recv, input_split_sizes=send)
    want = torch.cat([torch.full((RANK + 1, 3), float(10 * r + RANK)) for r in range(SIZE)])
    torch.testing.assert_close(got, want)


def test_all_to_all_list(pg):
    inputs = [torch.full((d + 1,), float(10 * RANK + d)) for d in range(SIZE)]
    outputs = [torch.empty(RANK + 1) for _ in range(SIZE)]
    dist.all_to_all(outputs, inputs)
    for r in range(SIZE):
        assert outputs[r].tolist() == [float(10 * r + RANK)] * (RANK + 1)


def test_reduce_gather_scatter(pg):
    root = SIZE - 1
    t = per_rank(RANK)
    dist.reduce(t, dst=root)
    want = fold("SUM", [per_rank(r) for r in range(SIZE)]) if root == RANK else per_rank(RANK)
    torch.testing.assert_close(t, want)
    gathered = [torch.empty(5) for _ in range(SIZE)] if root == RANK else None
    dist.gather(per_rank(RANK), gathered, dst=root)
    if root == RANK:
        for r in range(SIZE):
            torch.testing.assert_close(gathered[r], per_rank(r))
    out = torch.empty(5)
    pieces = [per_rank(50 + r) for r in range(SIZE)] if root == RANK else None
    dist.scatter(out, pieces, src=root)
    torch.testing.assert_close(out, per_rank(50 + RANK))


def test_barrier(pg):
    dist.barrier()
    work = dist.barrier(async_op=True)
    work.wait()
    assert work.is_completed()


def test_send_recv_ring_and_any_source(pg):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.empty(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(RANK)), right),
           dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert got.tolist() == [float(left)] * 3
    if RANK == 0:
        senders = set()
        for _ in range(SIZE - 1):
            buf = torch.empty(2, dtype=torch.int64)
            src = dist.recv(buf, tag=7)
            assert buf.tolist() == [src, src * src]
            senders.add(src)
        assert senders == set(range(1, SIZE))
    else:
        dist.send(torch.tensor([RANK, RANK * RANK]), dst=0, tag=7)
    # A future on a receive completes without anyone calling wait().
    if RANK == 0:
        dist.isend(torch.tensor([42.0]), dst=SIZE - 1).wait()
    elif RANK == SIZE - 1:
        buf = torch.empty(1)
        assert dist.irecv(buf, src=0).get_future().wait()[0].tolist() == [42.0]


def test_new_group_whole_world_and_registered_subset(pg, hvd):
    everyone = dist.new_group(backend="mpitrain")
    t = torch.ones(2)
    dist.all_reduce(t, group=everyone)
    assert t.tolist() == [float(SIZE)] * 2
    members = [0, SIZE - 1]
    ps = hvd.add_process_set(members)
    try:
        sub = dist.new_group(members, backend="mpitrain")
        if RANK in members:
            t = torch.full((2,), float(RANK))
            dist.all_reduce(t, group=sub)
            assert t.tolist() == [float(sum(members))] * 2
            x = torch.full((1,), float(RANK))
            if RANK == 0:
                dist.send(x, dst=SIZE - 1, group=sub)
            else:
                dist.recv(x, src=0, group=sub)
                assert x.tolist() == [0.0]
    finally:
        hvd.remove_process_set(ps)


def _listening(port: int) -> list[str]:
    """The addresses on which some socket of this machine listens on ``port`` (from
    /proc/net/tcp and tcp6: what the kernel says, not what our code believes)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    found.append(".".join(str(b) for b in raw[::-1]))
                else:
                    found.append(":".join(f"{w:08x}" for w in struct.unpack("<4I", raw)))
    return found


def test_the_rendezvous_store_is_the_jobs_own_bound_to_loopback_and_keyed(pg):
    """The env:// rendezvous served the job's store: on this one-host job it listens on
    127.0.0.1 only (no wildcard), and a connection without the job's key is refused, whether
    it comes from torch's own TCPStore client or from a store holding another key."""
    import datetime

    from mpitrain.torch.c10d import store as job_store

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    assert isinstance(store, job_store.JobStore)
    assert store.address == "127.0.0.1"
    addresses = WORLD.bcast(_listening(store.port) if RANK == 0 else None, root=0)
    assert addresses == ["127.0.0.1"], addresses
    if RANK == 0:
        with pytest.raises(job_store.AuthenticationError, match="refused this process"):
            job_store.JobStore("127.0.0.1", store.port, job_store.new_key(),
                               datetime.timedelta(seconds=5))
        with pytest.raises(Exception):  # noqa: B017 - torch's DistNetworkError or a timeout
            dist.TCPStore("127.0.0.1", store.port, 2, False,
                          timeout=datetime.timedelta(seconds=2))
    store.set(f"still.served.{RANK}", b"yes")  # the job's own connections are unaffected
    store.wait([f"still.served.{r}" for r in range(SIZE)], datetime.timedelta(seconds=30))
    assert os.environ.get("MASTER_ADDR") == "127.0.0.1" and "MASTER_PORT" not in os.environ


# --------------------------------------------------------------------- stock DDP
def assert_same_on_every_rank(module: torch.nn.Module) -> None:
    mine = [p.detach().numpy().tobytes() for p in module.parameters()]
    assert WORLD.allgather(mine) == [mine] * SIZE


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0005], ids=["one_bucket", "many_buckets"])
def test_stock_ddp_mpitrain_equals_stock_ddp_gloo(pg, gloo, bucket_cap_mb):
    mpi_group, gloo_group = pg, gloo
    engine = session.engine()
    before = engine.stats()["collectives"]
    a = DDP(make_model(seed=RANK), process_group=mpi_group, bucket_cap_mb=bucket_cap_mb)
    b = DDP(make_model(seed=RANK), process_group=gloo_group, bucket_cap_mb=bucket_cap_mb)
    train_lockstep(a, b, RANK, steps=4)
    assert_same_on_every_rank(a.module)
    # The mpitrain DDP really went through the engine: start-up checks, buffer broadcasts and
    # one allreduce per bucket per step.
    assert engine.stats()["collectives"] - before >= 4


@pytest.mark.timeout(120)
def test_stock_ddp_with_torchs_powersgd_hook_mpitrain_equals_gloo(pg, gloo):
    """torch's powerSGD_hook blocks inside a future callback on another allreduce's future
    (the P factors'); over this backend that used to hang every rank: the callback ran on the
    thread that completes futures, so the one it waited for was never completed."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    models = []
    for group in (pg, gloo):
        model = DDP(make_model(seed=RANK), process_group=group)
        model.register_comm_hook(P.PowerSGDState(process_group=group,
                                                 matrix_approximation_rank=1,
                                                 start_powerSGD_iter=2), P.powerSGD_hook)
        models.append(model)
    train_lockstep(*models, RANK, steps=5)  # two plain steps, three compressed
    assert_same_on_every_rank(models[0].module)


def test_stock_ddp_find_unused_parameters_and_no_sync(pg, gloo):
    mpi_group, gloo_group = pg, gloo
    a = DDP(make_model(seed=RANK), process_group=mpi_group, find_unused_parameters=True)
    b = DDP(make_model(seed=RANK), process_group=gloo_group, find_unused_parameters=True)
    train_lockstep(a, b, RANK, steps=4, skip_odd=True)
    a = DDP(make_model(seed=RANK), process_group=mpi_group)
    b = DDP(make_model(seed=RANK), process_group=gloo_group)
    train_lockstep(a, b, RANK, steps=2, accumulate=3, no_sync=True)
    assert_same_on_every_rank(a.module)


# Last: a refused new_group leaves torch's group bookkeeping half-done on the members.
@pytest.mark.world_sizes(4)
def test_unregistered_subset_is_refused_clearly(pg):
    members = [1, 2]
    if RANK in members:
        with pytest.raises(ValueError, match="add_process_set"):
            dist.new_group(members, backend="mpitrain")
    else:
        dist.new_group(members, backend="mpitrain")
