"""The ways bert_pretraining.py distributes: mpitrain, Horovod, or stock torch DDP over Gloo/NCCL.

Each job offers the same few operations to the training loop (``rank``, ``size``,
``barrier``, ``distribute``, ``step``, ``mean``, ``restore``, ``save``, ``describe``,
``shutdown``), so that both are measured by the very same script.

``MpitrainJob``: ``hvd.init()``; Horovod's ``DistributedOptimizer`` (with ``synchronize()``
before gradient clipping, Horovod's documented order) or mpitrain's drop-in for torch's DDP;
rank-0 atomic checkpoints through ``hvd.save_checkpoint``/``hvd.load_checkpoint``.

``HorovodJob``: Horovod 0.28.1 itself (the environment ``benchmarks/horovod_peer.sh`` builds,
with transformers and tokenizers added), the same ``DistributedOptimizer`` calls on
``horovod.torch``, torch's ``DistributedSampler``, the same torch threads per rank as
mpitrain gives; for measurement (no checkpoints, phase 1).

``TorchDDPJob``: ``torch.distributed.init_process_group("gloo" or "nccl")`` with rank and size
read from the
launcher's environment (Open MPI's ``OMPI_COMM_WORLD_*``, MPICH's ``PMI_*``, or torchrun's
``RANK``/``WORLD_SIZE``); the ranks meet through a file in the output directory named after
the mpirun job (or at ``MASTER_ADDR:MASTER_PORT`` when set).  No MPI, no mpitrain collective;
it takes the same share of CPU cores per rank as mpitrain does, and on GPUs the same device
(local rank modulo the device count; NCCL refuses two ranks on one GPU).  It writes no
checkpoints, but phase 2 starts from phase 1's mpitrain checkpoint as on the mpitrain path.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mpitrain as hvd
from mpitrain.face import files


def _clip(args: argparse.Namespace, net: nn.Module) -> None:
    if args.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm)


def _template(out: Path, phase: int) -> str:
    return str(out / f"phase{phase}" / "step-{step:07d}.pt")


class MpitrainJob:
    """Training on mpitrain's collectives (the natural path)."""

    def __init__(self) -> None:
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.compressor: Any = None  # a DDP comm hook's state, checkpointed with the model

    def barrier(self) -> None:
        hvd.barrier()

    def device(self, args: argparse.Namespace) -> torch.device:
        """The GPU hvd.init() bound this rank to, or the CPU."""
        if args.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def describe(self, args: argparse.Namespace) -> str:
        wrapper = ("hvd.DistributedOptimizer" if args.wrapper == "optimizer"
                   else "mpitrain DistributedDataParallel")
        return f"mpitrain {wrapper}, compression {args.compression}"

    def distribute(self, args: argparse.Namespace, net: nn.Module,
                   optimizer: torch.optim.Optimizer, dataset: Any) -> tuple[Any, Any, Any]:
        sampler = hvd.DistributedSampler(dataset, shuffle=True, seed=args.seed)
        if args.compression == "powersgd":
            compression: Any = hvd.Compression.powersgd(rank=4, start_iter=powersgd_start(args))
        else:
            compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                           "bf16": hvd.Compression.bf16}[args.compression]
        if args.wrapper == "ddp":
            from mpitrain.torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(net)
            if args.compression == "powersgd":
                self.compressor = compression
                ddp.register_comm_hook(None, compression)
            return ddp, optimizer, sampler
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                             compression=compression)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        return net, optimizer, sampler

    def step(self, args: argparse.Namespace, net: nn.Module,
             optimizer: torch.optim.Optimizer) -> None:
        if args.wrapper == "optimizer" and args.max_grad_norm > 0:
            # Clip the averaged gradients, then step without reducing them a second time.
            optimizer.synchronize()  # type: ignore[attr-defined]
            _clip(args, net)
            with optimizer.skip_synchronize():  # type: ignore[attr-defined]
                optimizer.step()
            return
        _clip(args, net)
        optimizer.step()

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(tensor, op=hvd.Average, name="bert.log")

    def _latest(self, out: Path, phase: int) -> str | None:
        """Rank 0 looks at the directory; every rank acts on its answer."""
        return hvd.broadcast_object(hvd.latest_checkpoint(_template(out, phase))
                                    if self.rank == 0 else None, root_rank=0)

    def check_fresh(self, args: argparse.Namespace, out: Path) -> None:
        """Refuse to train afresh over an earlier run's checkpoints (never overwrite them)."""
        found = self._latest(out, args.phase)
        if found is not None and not args.resume:
            raise SystemExit(f"{found} exists from an earlier run: pass --resume to continue "
                             "it, or another --output-dir")

    def restore(self, args: argparse.Namespace, out: Path, model: nn.Module,
                optimizer: torch.optim.Optimizer, sampler: Any) -> tuple[int, int]:
        """Resume this phase, or start phase 2 from phase 1's weights: (step, epoch)."""
        template = _template(out, args.phase)
        if self._latest(out, args.phase) is not None:
            extra = hvd.load_checkpoint(template, model=model, optimizer=optimizer,
                                        sampler=sampler, compressor=self.compressor)
            for key in ("preset", "seq_len"):
                if extra[key] != getattr(args, key):
                    raise SystemExit(f"{extra['path']} was written with --{key.replace('_', '-')}"
                                     f" {extra[key]}, not {getattr(args, key)}")
            if self.rank == 0:
                print(f"resumed from {extra['path']} at step {extra['step']}", flush=True)
            return extra["step"], extra["epoch"]
        if args.resume and self.rank == 0:
            print(f"nothing to resume in {Path(template).parent}: starting phase {args.phase}")
        if args.phase == 2:
            first = _template(out, 1)
            if self._latest(out, 1) is None:
                if self.rank == 0:
                    print(f"no phase 1 checkpoint in {Path(first).parent}: phase 2 starts from "
                          "random weights", flush=True)
            else:
                extra = hvd.load_checkpoint(first, model=model, restore_rng=False)
                if self.rank == 0:
                    print(f"phase 2 starts from {extra['path']} (phase 1 step {extra['step']})",
                          flush=True)
        return 0, 0

    def save(self, out: Path, args: argparse.Namespace, model: nn.Module,
             optimizer: torch.optim.Optimizer, sampler: Any, step: int, epoch: int) -> None:
        hvd.save_checkpoint(_template(out, args.phase), model=model, optimizer=optimizer,
                            compressor=self.compressor,
                            sampler=sampler, keep_last=2, step=step, epoch=epoch,
                            preset=args.preset, seq_len=args.seq_len, phase=args.phase)

    def shutdown(self) -> None:
        hvd.shutdown()


class HorovodJob:
    """Training on Horovod 0.28.1: the live peer mpitrain's API is taken from."""

    def __init__(self) -> None:
        import horovod.torch as horovod  # only in the environment horovod_peer.sh builds

        self.hv = horovod
        horovod.init()
        self.rank, self.size = horovod.rank(), horovod.size()
        # mpitrain gives each rank cores // ranks-on-this-host torch threads; so does this.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // horovod.local_size()))

    def barrier(self) -> None:
        self.hv.barrier()

    def device(self, args: argparse.Namespace) -> torch.device:
        if args.device == "cuda":
            torch.cuda.set_device(self.hv.local_rank() % torch.cuda.device_count())
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check_fresh(self, args: argparse.Namespace, out: Path) -> None:
        """Nothing to check: this path writes no checkpoints."""

    def describe(self, args: argparse.Namespace) -> str:
        import horovod  # the package, for its version

        return f"Horovod {horovod.__version__} DistributedOptimizer, compression {args.compression}"

    def distribute(self, args: argparse.Namespace, net: nn.Module,
                   optimizer: torch.optim.Optimizer, dataset: Any) -> tuple[Any, Any, Any]:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(dataset, num_replicas=self.size, rank=self.rank,
                                     shuffle=True, seed=args.seed)
        compression = {"none": self.hv.Compression.none,
                       "fp16": self.hv.Compression.fp16}[args.compression]
        optimizer = self.hv.DistributedOptimizer(optimizer,
                                                 named_parameters=net.named_parameters(),
                                                 compression=compression)
        self.hv.broadcast_parameters(net.state_dict(), root_rank=0)
        return net, optimizer, sampler

    def step(self, args: argparse.Namespace, net: nn.Module,
             optimizer: torch.optim.Optimizer) -> None:
        if args.max_grad_norm > 0:  # Horovod's documented order, as on the mpitrain path
            optimizer.synchronize()  # type: ignore[attr-defined]
            _clip(args, net)
            with optimizer.skip_synchronize():  # type: ignore[attr-defined]
                optimizer.step()
            return
        optimizer.step()

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hv.allreduce(tensor, op=self.hv.Average, name="bert.log")

    def restore(self, args: argparse.Namespace, out: Path, model: nn.Module,
                optimizer: torch.optim.Optimizer, sampler: Any) -> tuple[int, int]:
        return 0, 0

    def save(self, *args: Any, **kwargs: Any) -> None:
        """No checkpoints on the comparison path."""

    def shutdown(self) -> None:
        self.hv.shutdown()


def powersgd_start(args: argparse.Namespace) -> int:
    """PowerSGD's plain warm-up steps: torch suggests ~100s; a short run gets a fifth of it."""
    return max(2, min(100, args.max_steps // 5))


def _launcher_env(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return default


class TorchDDPJob:
    """Training on stock torch DDP over Gloo or NCCL: the peers mpitrain is measured against."""

    def __init__(self, out: Path, backend: str) -> None:
        from mpitrain.core import binding

        self.backend = backend
        self.rank = _launcher_env(("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"), 0)
        self.size = _launcher_env(("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE"), 1)
        self.local = _launcher_env(("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                    "LOCAL_WORLD_SIZE"), self.size)
        binding.set_cpu_threads(self.local)  # the share of cores mpitrain's init gives a rank
        local_rank = _launcher_env(("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                    "LOCAL_RANK"), 0)
        self.gpu = binding.bind_device(local_rank)  # as hvd.init() binds
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            dist.init_process_group(backend, init_method="env://", rank=self.rank,
                                    world_size=self.size)
        else:
            dist.init_process_group(backend, store=self._store(out), rank=self.rank,
                                    world_size=self.size)
            dist.barrier()  # everyone is connected: the address file has served
            if self.rank == 0:
                self._address_file(out).unlink()

    def _address_file(self, out: Path) -> Path:
        job = os.environ.get("PMIX_NAMESPACE") or os.environ.get("PMI_KVSNAME")
        if job is None and self.size > 1:
            raise SystemExit("--backend gloo needs mpirun's environment (PMIX_NAMESPACE) or "
                             "MASTER_ADDR and MASTER_PORT")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", job or f"single-{os.getpid()}")
        return out / f".gloo-rendezvous-{name}"

    def _store(self, out: Path) -> dist.Store:
        """Rank 0 serves a TCPStore on a free port and leaves its address in a file."""
        path = self._address_file(out)
        if self.rank == 0:
            host = "127.0.0.1" if self.local == self.size else socket.gethostname()
            store = dist.TCPStore(host, 0, self.size, is_master=True, wait_for_workers=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            files.write_atomic(path, f"{host} {store.port}".encode())
            return store
        deadline = time.monotonic() + 300
        while not path.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"--backend gloo: rank 0 left no address in {path} in 300 s")
            time.sleep(0.05)
        host, port = path.read_text().split()
        return dist.TCPStore(host, int(port), self.size, is_master=False)

    def barrier(self) -> None:
        dist.barrier()

    def device(self, args: argparse.Namespace) -> torch.device:
        if args.device == "cuda":
            if self.gpu is None:
                raise SystemExit("--device cuda: torch sees no GPU here")
            return torch.device("cuda", self.gpu)
        return torch.device("cpu")

    def check_fresh(self, args: argparse.Namespace, out: Path) -> None:
        """Nothing to check: this path writes no checkpoints."""

    def describe(self, args: argparse.Namespace) -> str:
        name = {"gloo": "Gloo", "nccl": "NCCL"}[self.backend]
        return f"torch DistributedDataParallel over {name}, compression {args.compression}"

    def distribute(self, args: argparse.Namespace, net: nn.Module,
                   optimizer: torch.optim.Optimizer, dataset: Any) -> tuple[Any, Any, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(dataset, num_replicas=self.size, rank=self.rank,
                                     shuffle=True, seed=args.seed)
        ddp = nn.parallel.DistributedDataParallel(
            net, device_ids=[self.gpu] if args.device == "cuda" else None)
        if args.compression == "powersgd":  # torch's own, beside mpitrain's
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=powersgd_start(args))
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif args.compression == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.compression == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return ddp, optimizer, sampler

    def step(self, args: argparse.Namespace, net: nn.Module,
             optimizer: torch.optim.Optimizer) -> None:
        _clip(args, net)
        optimizer.step()

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        where = tensor.device
        if self.backend == "nccl":  # NCCL reduces GPU tensors only
            tensor = tensor.to(torch.device("cuda", self.gpu))
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return (tensor / self.size).to(where)

    def restore(self, args: argparse.Namespace, out: Path, model: nn.Module,
                optimizer: torch.optim.Optimizer, sampler: Any) -> tuple[int, int]:
        if args.phase == 2:
            found = hvd.latest_checkpoint(_template(out, 1))
            if found is not None:
                # Every rank reads the same file (written by the mpitrain path).
                ckpt = torch.load(found, map_location="cpu", weights_only=False)
                model.load_state_dict(ckpt["model"])
                if self.rank == 0:
                    print(f"phase 2 starts from {found}", flush=True)
        return 0, 0

    def save(self, *args: Any, **kwargs: Any) -> None:
        """No checkpoints on the comparison path."""

    def shutdown(self) -> None:
        dist.destroy_process_group()
