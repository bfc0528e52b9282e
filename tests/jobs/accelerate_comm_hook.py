"""One rank of an Accelerate training loop with a DDP communication hook, under mpirun.

What an Accelerate user writes to compress gradients: ``Accelerator(kwargs_handlers=
[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD, ...)])``, then
``prepare`` and the usual loop.  argv[1] picks the process group: ``mpitrain``
(``torch.distributed.init_process_group("mpitrain")`` first, so torch's DDP and torch's
PowerSGD hook run over mpitrain's collectives) or ``gloo`` (no mpitrain: Accelerate's own CPU
route; the reference).  argv[2] is the hook's name in ``DDPCommunicationHookType``.  Each rank
prints the world size Accelerate saw, whether the hook's state advanced, and a checksum of the
trained parameters.
"""

import hashlib
import os
import sys

import torch

route, hook = sys.argv[1], sys.argv[2]
if route == "mpitrain":
    import torch.distributed as dist

    import mpitrain.torch  # noqa: F401 - registers the backend

    dist.init_process_group("mpitrain")
elif route != "gloo":
    raise SystemExit(f"unknown route {route!r}")

from accelerate import Accelerator  # noqa: E402 - after the route set the job up
from accelerate.utils import (  # noqa: E402
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
)

handler = DistributedDataParallelKwargs(
    comm_hook=DDPCommunicationHookType(hook),
    comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
    if "power_sgd" in hook else {})
accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                            torch.nn.ReLU(), torch.nn.Linear(64, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = accelerator.prepare(model, optimizer)
rank = accelerator.process_index
for step in range(6):  # two uncompressed warm-up steps, then four compressed ones
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

# torch's DDP keeps (hook, state) pairs; PowerSGD's state counts the steps it has seen.
hooks = getattr(model, "_comm_hooks", [])
iters = getattr(hooks[0][1], "iter", -1) if hooks else -1
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
digest = hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]
print(f"RESULT rank={rank} world={accelerator.num_processes} ddp={type(model).__name__} "
      f"hook_iter={iters} sha={digest}", flush=True)
accelerator.wait_for_everyone()
if route == "gloo":
    # The reference route's own teardown (torch's Gloo process group) aborted the process
    # with "terminate called without an active exception" in 3 of 25 runs, after its result
    # was printed (2026-11-30): end it here; what it computed is already out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
torch.distributed.destroy_process_group()
