"""Synthetic training throughput, Horovod-style: mpitrain, torch DDP (Gloo, NCCL) and Horovod.

One invocation measures every framework at every requested size, one after another, on
synthetic data (no input pipeline): for each size s, ranks 0..s-1 train while the others wait
without spinning.  Each measurement reports images per second per rank (mean +- 1.96 std over
the timed iterations, as Horovod's benchmark prints), in total, and the scaling efficiency
against the same framework at one rank.  Horovod runs too when ``horovod.torch`` imports.

With ``--device cuda`` each rank trains on GPU ``local_rank % device count`` (as ``hvd.init()``
binds it) and ``ddp-nccl`` joins the frameworks; NCCL refuses two ranks on one GPU, so it is
measured only at the sizes whose ranks have a GPU each.

``mpitrain-copy`` is mpitrain with ``shared_buckets=False``: gradients as autograd made them
rather than views of flat buckets in the data plane's memory, to measure what the buckets save.

Launch from the repository root (as root add --allow-run-as-root, with more ranks than cores
--oversubscribe)::

    mpirun -np 2 python examples/pytorch/pytorch_synthetic_benchmark.py
    mpirun -np 4 python examples/pytorch/pytorch_synthetic_benchmark.py --sizes 1,2,4 \\
        --model cnn --frameworks mpitrain,ddp-gloo
    mpirun -np 1 python examples/pytorch/pytorch_synthetic_benchmark.py --device cuda \
        --model cnn --frameworks mpitrain,ddp-nccl
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import timeit
from collections.abc import Callable

try:
    import mpitrain as hvd  # isort: skip - before mpi4py, which starts MPI (see mpitrain.core._mpi)
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch import nn
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch]' "
             "(in a checkout: pip install -e '.[torch]')")

FRAMEWORKS = ("mpitrain", "mpitrain-copy", "ddp-gloo", "ddp-nccl", "horovod")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                        help="mlp: 4 x 1024-wide layers (4.3M parameters, communication "
                        "heavy); cnn: a small convolutional net (compute heavy)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=6)
    parser.add_argument("--sizes", default=None,
                        help="comma-separated world sizes to measure (default: 1 and all)")
    parser.add_argument("--frameworks", default="",
                        help=f"comma-separated subset of {','.join(FRAMEWORKS)} (default: "
                        "all; ddp-nccl only with --device cuda)")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="mpitrain and Horovod send float16 gradients")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: train on the GPU hvd.init() binds each rank to")
    args = parser.parse_args()
    default = [f for f in FRAMEWORKS if f != "ddp-nccl" or args.device == "cuda"]
    args.frameworks = args.frameworks or ",".join(default)
    return args


def build_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(),
                             nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                             nn.ReLU(), nn.Linear(1024, 10))
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def wait_quietly(comm: MPI.Comm) -> None:
    """A barrier that sleeps instead of spinning, so waiting ranks leave the cores alone."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def timed(step: Callable[[], None], args: argparse.Namespace) -> list[float]:
    """Images per second of each timed iteration (after warm-up)."""
    device = torch.device(args.device)

    def steps() -> None:
        for _ in range(args.num_batches_per_iter):
            step()
        if device.type == "cuda":  # GPU work is asynchronous: finish it before the clock
            torch.cuda.synchronize()

    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for _ in range(args.num_iters):
        seconds = timeit.timeit(steps, number=1)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
    return rates


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                  batch_size: int, device: str) -> Callable[[], None]:
    data = torch.randn(batch_size, 3, 32, 32, device=device)
    target = torch.randint(0, 10, (batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    return step


def build_on(args: argparse.Namespace) -> nn.Module:
    """The benchmark's model on the device this rank trains on."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else "cpu"
    return build_model(args.model).to(device)


def run_mpitrain(args: argparse.Namespace, process_set: hvd.ProcessSet,
                 shared_buckets: bool) -> list[float]:
    model = build_on(args)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        process_set=process_set, shared_buckets=shared_buckets)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=process_set)
    return timed(training_step(model, optimizer, args.batch_size, args.device), args)


def run_ddp(args: argparse.Namespace, group: dist.ProcessGroup) -> list[float]:
    model = build_on(args)
    device_ids = [torch.cuda.current_device()] if args.device == "cuda" else None
    model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return timed(training_step(model, optimizer, args.batch_size, args.device), args)


def run_horovod(args: argparse.Namespace, horovod: object, process_set: object) -> list[float]:
    model = build_on(args)
    compression = (horovod.Compression.fp16 if args.fp16_allreduce  # type: ignore[attr-defined]
                   else horovod.Compression.none)  # type: ignore[attr-defined]
    optimizer = horovod.DistributedOptimizer(  # type: ignore[attr-defined]
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        compression=compression, process_set=process_set)
    horovod_broadcast_parameters(horovod, model.state_dict(), process_set)
    return timed(training_step(model, optimizer, args.batch_size, args.device), args)


def horovod_broadcast_parameters(horovod: object, state: dict[str, torch.Tensor],
                                 process_set: object) -> None:
    """Rank 0's parameters to the set's other ranks, with Horovod's own calls.

    Horovod 0.28.1's ``broadcast_parameters(params, root_rank)`` takes no process set (mpitrain's
    does), so broadcast each tensor in place within the set, as that function does for all.
    """
    broadcast_async_ = horovod.broadcast_async_  # type: ignore[attr-defined]
    handles = [broadcast_async_(tensor, 0, name=f"broadcast.{name}", process_set=process_set)
               for name, tensor in sorted(state.items())]
    for handle in handles:
        horovod.synchronize(handle)  # type: ignore[attr-defined]


def start_gloo(world: MPI.Comm) -> None:
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())


def own_gpus(world: MPI.Comm, s: int) -> bool:
    """Whether ranks 0..s-1 each drive a GPU of their own (NCCL's condition)."""
    where = (socket.gethostname(), torch.cuda.current_device())
    seen = world.allgather(where)[:s]
    return len(set(seen)) == s


def import_horovod() -> object | None:
    try:
        import horovod.torch as horovod
    except Exception:  # noqa: BLE001 - absent or broken: just not measured
        return None
    return horovod


def main() -> None:
    args = parse_args()
    hvd.init()
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    sizes = sorted({1, size} if args.sizes is None else {int(s) for s in args.sizes.split(",")})
    if any(not 1 <= s <= size for s in sizes):
        raise ValueError(f"--sizes {sizes} must lie within 1..{size} (the ranks launched)")
    wanted = args.frameworks.split(",")
    unknown = set(wanted) - set(FRAMEWORKS)
    if unknown:
        raise ValueError(f"unknown --frameworks {sorted(unknown)}; choose from {FRAMEWORKS}")
    horovod = import_horovod() if "horovod" in wanted else None
    if horovod is None:
        wanted = [f for f in wanted if f != "horovod"]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here")
    if "ddp-nccl" in wanted and args.device != "cuda":
        raise ValueError("--frameworks ddp-nccl needs --device cuda")
    nccl_sizes = ([s for s in sizes if own_gpus(world, s)] if "ddp-nccl" in wanted else [])
    if "ddp-gloo" in wanted or "ddp-nccl" in wanted:
        start_gloo(world)

    # Every rank registers the same sets, in the same order, before any measurement.
    mpitrain_sets = {s: hvd.global_process_set if s == size else hvd.add_process_set(
        list(range(s))) for s in sizes}
    gloo_groups = ({s: dist.new_group(list(range(s))) for s in sizes}
                   if "ddp-gloo" in wanted else {})
    nccl_groups = {s: dist.new_group(list(range(s)), backend="nccl") for s in nccl_sizes}
    horovod_sets: dict[int, object] = {}
    if horovod is not None:
        horovod.init(process_sets="dynamic")  # type: ignore[attr-defined]
        horovod_sets = {s: horovod.global_process_set if s == size  # type: ignore[attr-defined]
                        else horovod.add_process_set(list(range(s)))  # type: ignore[attr-defined]
                        for s in sizes}

    if rank == 0:
        print(f"Model: {args.model} on {args.device}, batch size {args.batch_size} per rank, "
              f"{torch.get_num_threads()} torch thread(s) per rank, world {size}, "
              f"frameworks {', '.join(wanted)}")
    results: dict[tuple[str, int], list[float]] = {}
    for framework in wanted:
        for s in sizes:
            if framework == "ddp-nccl" and s not in nccl_sizes:
                if rank == 0:
                    print(f"ddp-nccl on {s} rank(s): not measured, ranks share a GPU (NCCL "
                          "refuses two ranks on one GPU)", flush=True)
                continue
            world.Barrier()
            rates: list[float] = []
            if rank < s:
                if framework in ("mpitrain", "mpitrain-copy"):
                    rates = run_mpitrain(args, mpitrain_sets[s], framework == "mpitrain")
                elif framework == "ddp-gloo":
                    rates = run_ddp(args, gloo_groups[s])
                elif framework == "ddp-nccl":
                    rates = run_ddp(args, nccl_groups[s])
                else:
                    rates = run_horovod(args, horovod, horovod_sets[s])
            wait_quietly(world)
            everyone = world.gather(rates, root=0)
            if rank == 0:
                results[(framework, s)] = [r for rank_rates in everyone[:s]
                                           for r in rank_rates]
                report(framework, s, results)
    if rank == 0:
        table(wanted, sizes, results)
    if dist.is_initialized():
        dist.destroy_process_group()


def report(framework: str, s: int, results: dict[tuple[str, int], list[float]]) -> None:
    rates = np.array(results[(framework, s)])
    print(f"{framework} on {s} rank(s): {rates.mean():.1f} +- {1.96 * rates.std():.1f} "
          f"img/sec per rank, {rates.mean() * s:.1f} img/sec in total", flush=True)


def table(frameworks: list[str], sizes: list[int],
          results: dict[tuple[str, int], list[float]]) -> None:
    print("\n(medians over the timed iterations)")
    print("| framework | ranks | img/sec per rank | img/sec total | scaling efficiency |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for framework in frameworks:
        measured = [s for s in sizes if (framework, s) in results]
        if not measured:
            continue
        base = (float(np.median(results[(framework, 1)])) if (framework, 1) in results
                else None)
        for s in measured:
            per_rank = float(np.median(results[(framework, s)]))
            efficiency = f"{per_rank / base:.0%}" if base else "-"
            print(f"| {framework} | {s} | {per_rank:.1f} | {per_rank * s:.1f} | {efficiency} |")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
