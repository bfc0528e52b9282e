"""One rank of a Hugging Face Trainer run under mpirun; argv[1] picks how the job is set up.

Routes: ``hvd`` (``mpitrain.init()`` only), ``ddp_backend`` (``mpitrain.init()`` and
``TrainingArguments(ddp_backend="mpitrain")``: GPU machines only), ``dropin``
(``mpitrain.torch.distributed.init_process_group``), ``c10d``
(``torch.distributed.init_process_group("mpitrain")``), and
``gloo`` (no mpitrain: Trainer's own Gloo route with ``use_cpu=True``; the reference).  Each
rank prints one line: the world size Trainer saw and a checksum of the trained parameters.
"""

import hashlib
import sys
import tempfile

import torch

route = sys.argv[1]
if route == "hvd":
    import mpitrain as hvd

    hvd.init()
elif route == "dropin":
    import mpitrain.torch.distributed as mdist

    mdist.init_process_group(backend="nccl")  # any name: mpitrain initialises from MPI
elif route == "c10d":
    import torch.distributed as dist

    import mpitrain.torch  # noqa: F401 - registers the backend

    dist.init_process_group("mpitrain")
elif route == "ddp_backend":
    # hvd.init() exports the layout; Accelerate then creates torch's "mpitrain" group itself
    # (on a GPU machine; on CPU Accelerate refuses every backend name but gloo and mpi).
    import mpitrain as hvd
    import mpitrain.torch  # noqa: F401 - registers the backend

    hvd.init()
elif route != "gloo":
    raise SystemExit(f"unknown route {route!r}")

from transformers import (  # noqa: E402 - after the route set the job up
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)

torch.manual_seed(0)
config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=64, num_labels=2)
model = BertForSequenceClassification(config)
gen = torch.Generator().manual_seed(1)
data = [{"input_ids": torch.randint(0, 100, (16,), generator=gen),
         "attention_mask": torch.ones(16, dtype=torch.long),
         "labels": torch.randint(0, 2, (), generator=gen)} for _ in range(64)]
extra = ({"use_cpu": True, "ddp_backend": "gloo"} if route == "gloo"
         else {"ddp_backend": "mpitrain"} if route == "ddp_backend" else {})
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                         max_steps=5, report_to=[], save_strategy="no", logging_strategy="no",
                         seed=0, disable_tqdm=True, **extra)
Trainer(model=model, args=args, train_dataset=data).train()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
digest = hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]
print(f"RESULT rank={args.process_index} world={args.world_size} "
      f"sum={flat.double().sum().item():.9f} sha={digest} device={args.device}", flush=True)
if route == "gloo":
    # Trainer leaves its Gloo group to the interpreter's exit, where Gloo's threads can race
    # the teardown ("terminate called without an active exception", seen under load): join
    # them first.  This is the reference route; mpitrain's routes end through mpitrain.
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
