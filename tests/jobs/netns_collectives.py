"""Runs on every rank of a job across namespace hosts (launched by test_netns_cluster.py).

Checks, on each rank, that the layout is per host (not per machine) and that every collective
gives the numpy reference's answer across hosts, and the same bits on every rank, for whichever
allreduce algorithm (and hierarchical pipelining) the launcher selected; prints one JSON line
per rank: {"rank", "host", "layout", "algorithm", "pipeline", "checks"}.
Any failed check raises, which aborts the job with a non-zero exit.
"""

import hashlib
import json
import socket
import sys

import numpy as np
import torch

import mpitrain as hvd
from mpitrain.core import runtime
from mpitrain.core.dtypes import ReduceOp
from mpitrain.ops import reference

TORCH = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
         "float16": torch.float16, "bfloat16": torch.bfloat16}
# Sizes around the algorithms' natural cut points: empty, tiny, odd, not divisible by the
# world size, and large enough (4 MiB and 16 MiB of float32) for bandwidth algorithms.
LENGTHS = [0, 1, 7, 1003, (1 << 20) + 3]
LARGE_CASES = {("float32", ReduceOp.SUM), ("float32", ReduceOp.AVERAGE),
               ("float32", ReduceOp.MAX), ("bfloat16", ReduceOp.SUM)}


def values(rank, n, dtype, op=ReduceOp.SUM):
    gen = np.random.default_rng(7919 * rank + n)
    if dtype == "int32":
        low, high = (-2, 3) if op == ReduceOp.PRODUCT else (-50, 50)
        return torch.from_numpy(gen.integers(low, high, n).astype(np.int32))
    data = gen.normal(size=n).astype(np.float32)
    if op == ReduceOp.PRODUCT:
        data = 0.5 + np.abs(data) / 2
    return torch.from_numpy(data).to(TORCH[dtype])


def storage(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def check_close(got, want, dtype, what):
    got_np = storage(got)
    if dtype == "bfloat16":
        got_np, want = reference.bf16_to_f32(got_np), reference.bf16_to_f32(want)
    tol = {"float16": 3e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12, "int32": 0}
    scale = 1.0
    if dtype in ("float16", "bfloat16"):
        # 16-bit values travel as 16 bits and are rounded at every hop of a ring (as NCCL's
        # are): the error grows with the number of ranks, as cancellation shows near zero.
        scale = max(1.0, (hvd.size() - 1) / 3)
    np.testing.assert_allclose(got_np.astype(np.float64), np.asarray(want, np.float64),
                               rtol=tol[dtype] * scale, atol=tol[dtype] * scale, err_msg=what)


def expected(n, dtype, op, ranks):
    inputs = [storage(values(r, n, dtype, op)) for r in ranks]
    if op == ReduceOp.AVERAGE:
        return reference.reduce(inputs, dtype, ReduceOp.SUM, 1.0, 1.0 / len(ranks))
    return reference.reduce(inputs, dtype, op, 1.0, 1.0)


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    topo = runtime.state().topology
    checks = 0
    everyone = list(range(size))
    digest = hashlib.sha256()  # of every allreduce result: must be the same on every rank

    for dtype in TORCH:
        for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX,
                   ReduceOp.PRODUCT):
            if dtype == "int32" and op == ReduceOp.AVERAGE:
                continue
            # The large size exercises the bandwidth paths; a few dtype/op pairs suffice and
            # keep the numpy reference cheap.
            large = (dtype, op) in LARGE_CASES
            lengths = LENGTHS if large else LENGTHS[:-1]
            for n in lengths:
                got = hvd.allreduce(values(rank, n, dtype, op), op=op,
                                    name=f"ar.{dtype}.{op.name}.{n}")
                check_close(got, expected(n, dtype, op, everyone), dtype,
                            f"allreduce {dtype} {op.name} n={n}")
                digest.update(storage(got).tobytes())
                checks += 1

    big = torch.full((4 << 20,), float(rank + 1))  # 16 MiB float32
    out = hvd.allreduce(big, op=hvd.Sum, name="ar.16MiB")
    assert torch.all(out == size * (size + 1) / 2), "16 MiB allreduce"
    digests = hvd.allgather_object(digest.hexdigest())
    assert len(set(digests)) == 1, f"allreduce results differ between ranks: {digests}"
    outs = hvd.grouped_allreduce([values(rank, 5, "float32"), values(rank, 300, "float64")],
                                 op=hvd.Sum, name="grouped")
    check_close(outs[0], expected(5, "float32", ReduceOp.SUM, everyone), "float32", "grouped 0")
    check_close(outs[1], expected(300, "float64", ReduceOp.SUM, everyone), "float64",
                "grouped 1")
    checks += 2

    rows = [(r % 3) + 1 for r in everyone]
    got = hvd.allgather(values(rank, rows[rank] * 2, "float32").reshape(rows[rank], 2))
    want = np.concatenate([storage(values(r, rows[r] * 2, "float32")).reshape(-1, 2)
                           for r in everyone])
    np.testing.assert_array_equal(storage(got), want, err_msg="allgather")
    for root in everyone:
        got = hvd.broadcast(values(rank, 1001, "float64"), root_rank=root, name=f"bc.{root}")
        np.testing.assert_array_equal(storage(got), storage(values(root, 1001, "float64")))
    splits = [(rank + j) % 3 for j in everyone]
    out, received = hvd.alltoall(torch.arange(sum(splits)) + 1000 * rank, splits=splits)
    parts = []
    for r in everyone:
        theirs = [(r + j) % 3 for j in everyone]
        start = sum(theirs[:rank])
        parts.append(np.arange(start, start + theirs[rank]) + 1000 * r)
    assert received.tolist() == [(r + rank) % 3 for r in everyone], "alltoall splits"
    np.testing.assert_array_equal(out.numpy(), np.concatenate(parts), err_msg="alltoall")
    n = 2 * size + 1
    got = hvd.reducescatter(values(rank, n * 3, "float32").reshape(n, 3), op=hvd.Sum)
    full = expected(n * 3, "float32", ReduceOp.SUM, everyone).reshape(n, 3)
    counts = [n // size + (1 if r < n % size else 0) for r in everyone]
    check_close(got, full[sum(counts[:rank]):sum(counts[:rank + 1])], "float32",
                "reducescatter")
    hvd.barrier()
    # MPI's processor name is the namespace host's, as the kernel's host name is.
    assert hvd.allgather_object(socket.gethostname()) == hvd.allgather_object(topo.hostname)
    assert hvd.broadcast_object({"r": rank}, root_rank=size - 1) == {"r": size - 1}
    checks += 6

    # join: rank r runs r + 1 steps, then joins; the joined contribute zeros.
    for step in range(rank + 1):
        out = hvd.allreduce(torch.ones(3), name=f"join.step.{step}", op=hvd.Sum)
        assert torch.all(out == size - step), f"join step {step}: {out}"
    assert hvd.join() == size - 1, "join returns the last rank to join"
    checks += 1

    # Process sets that cut across hosts: one rank per host, and an uneven 1 + 2 layout.
    for members in ([0, size // 2], list(range(1, size))):
        ps = hvd.add_process_set(members)
        if rank in members:
            for n_ in (7, (1 << 18) + 1):
                got = hvd.allreduce(values(rank, n_, "float32"), op=hvd.Sum, process_set=ps,
                                    name=f"ps.{members}.{n_}")
                check_close(got, expected(n_, "float32", ReduceOp.SUM, members), "float32",
                            f"process set {members} n={n_}")
                checks += 1
        hvd.remove_process_set(ps)

    row = {"rank": rank, "host": socket.gethostname(), "mpi_host": topo.hostname,
           "layout": [topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size,
                      topo.node_index, topo.machine_local_size],
           "algorithm": runtime.state().config.allreduce_algorithm,
           "pipeline": runtime.state().config.hierarchical_pipeline, "checks": checks}
    rows = hvd.allgather_object(row)
    if rank == 0:
        for r in rows:
            print("RESULT " + json.dumps(r), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
