"""Pretrain BERT (masked LM + next-sentence prediction) data-parallel on mpitrain.

transformers' ``BertForPreTraining``, randomly initialised from a ``BertConfig`` preset (tiny:
2 layers of 128; base: 12 of 768; large: 24 of 1024; nothing is downloaded), on English text
that ships with Python itself (its help topics and standard-library docstrings, see
``bert_data.py``; ``--corpus-file`` for your own), with a WordPiece vocabulary trained on it.
The two phases of the BERT paper: phase 1 at sequence length 128 (20 predictions per
sequence), then phase 2 at 512 (80), starting from phase 1's last checkpoint.  LAMB (as in
NVIDIA's recipe) or AdamW, linear warm-up then linear decay, gradient clipping at 1.0.

Gradients are averaged by ``hvd.DistributedOptimizer`` (``--wrapper optimizer``, Horovod's
way) or by mpitrain's drop-in for torch's DDP (``--wrapper ddp``); ``--compression fp16`` or
``bf16`` halves the bytes sent (DistributedOptimizer only); ``--compression powersgd`` sends
rank-4 PowerSGD factors with error feedback (both wrappers; torch's own hook with Gloo).
``--backend gloo`` runs the same training on stock torch ``DistributedDataParallel`` over
Gloo instead (rank and size from
mpirun's environment, no MPI and no mpitrain collectives), for comparison; that path writes no
checkpoints.  Rank 0 logs, shows the progress bar, and writes checkpoints atomically every
``--checkpoint-every`` steps; ``--resume`` continues bit for bit.  At the end rank 0 prints the
throughput in sequences per second for the whole job, and the scaling efficiency against a
one-rank figure given with ``--baseline-seq-per-s``.

Launch from the repository root (``pip install -e '.[hf]'``; as root add
--allow-run-as-root, with more ranks than cores --oversubscribe)::

    python examples/pytorch/bert_pretraining.py --max-steps 50            # one process
    mpirun -np 4 python examples/pytorch/bert_pretraining.py --phase 1    # tiny, 900 steps
    mpirun -np 4 python examples/pytorch/bert_pretraining.py --phase 2    # from phase 1
    mpirun -np 4 python examples/pytorch/bert_pretraining.py --phase 2 --resume  # after a stop
    mpirun -np 4 python examples/pytorch/bert_pretraining.py --wrapper ddp --compression none
    mpirun -np 4 python examples/pytorch/bert_pretraining.py --backend gloo  # torch DDP/Gloo
    python examples/pytorch/bert_pretraining.py --print-presets     # parameter counts only

    # Throughput and scaling: a one-rank figure first, then N ranks against it.
    python examples/pytorch/bert_pretraining.py --max-steps 30 --checkpoint-every 0
    mpirun -np 4 python examples/pytorch/bert_pretraining.py --max-steps 30 \\
        --checkpoint-every 0 --baseline-seq-per-s 41.5

    # BERT-Large as in the paper, on a real cluster and your own text (one sentence a line):
    mpirun -np 64 python examples/pytorch/bert_pretraining.py --preset large --phase 1 \\
        --corpus-file wiki.txt --batch-size 64 --max-steps 7038 --output-dir runs/large
    mpirun -np 64 python examples/pytorch/bert_pretraining.py --preset large --phase 2 \\
        --corpus-file wiki.txt --batch-size 16 --max-steps 1563 --output-dir runs/large

The output directory holds ``data/`` (the tokenizer and the instances, built once by rank 0),
``phase1/`` and ``phase2/`` (checkpoints, the newest two kept).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from tqdm import tqdm

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bert_data  # the example's own modules, beside it
    from bert_backends import HorovodJob, MpitrainJob, TorchDDPJob
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[hf,examples]' "
             "(in a checkout: pip install -e '.[hf,examples]')")

# hidden size, layers, attention heads, feed-forward size (Devlin et al.; Turc et al. for tiny)
PRESETS = {"tiny": (128, 2, 2, 512), "base": (768, 12, 12, 3072), "large": (1024, 24, 16, 4096)}
# Per phase: sequence length, predictions per sequence, batch per rank, steps, warm-up share,
# LAMB's peak learning rate (NVIDIA's BERT recipe); AdamW uses the paper's 1e-4.
PHASES = {1: {"seq_len": 128, "max_predictions": 20, "batch_size": 32, "max_steps": 900,
              "warmup": 0.2843, "lamb_lr": 6e-3},
          2: {"seq_len": 512, "max_predictions": 80, "batch_size": 8, "max_steps": 100,
              "warmup": 0.128, "lamb_lr": 4e-3}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--phase", type=int, choices=(1, 2), default=1,
                   help="1: sequence length 128; 2: 512, from phase 1's last checkpoint")
    p.add_argument("--seq-len", type=int, default=None, help="default: 128 / 512 by phase")
    p.add_argument("--max-predictions", type=int, default=None,
                   help="masked positions per sequence at most; default: 20 / 80 by phase")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per rank per step; default: 32 / 8 by phase")
    p.add_argument("--max-steps", type=int, default=None, help="default: 900 / 100 by phase")
    p.add_argument("--optimizer", choices=("lamb", "adamw"), default="lamb")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate of the job (not scaled by size); default: LAMB "
                   "6e-3 / 4e-3 by phase, AdamW 1e-4")
    p.add_argument("--warmup", type=float, default=None,
                   help="share of --max-steps spent warming up; default: 0.2843 / 0.128")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--backend", choices=("mpitrain", "horovod", "gloo", "nccl"),
                   default="mpitrain",
                   help="horovod: Horovod itself (run from the environment "
                   "benchmarks/horovod_peer.sh builds); gloo / nccl: stock torch DDP over Gloo "
                   "or NCCL; all three for comparison")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: each rank trains on GPU local_rank %% device count")
    p.add_argument("--wrapper", choices=("optimizer", "ddp"), default=None,
                   help="mpitrain: hvd.DistributedOptimizer (default) or the DDP drop-in; "
                   "gloo / nccl: ddp only")
    p.add_argument("--compression", choices=("none", "fp16", "bf16", "powersgd"),
                   default="none",
                   help="gradients on the wire (DistributedOptimizer, or DDP comm hooks); "
                   "powersgd: rank 4 with error feedback (mpitrain's, or torch's hook on Gloo)")
    p.add_argument("--output-dir", default=None, help="default: runs/bert-<preset>")
    p.add_argument("--checkpoint-every", type=int, default=200,
                   help="steps between checkpoints (and one at the end); 0: none")
    p.add_argument("--resume", action="store_true",
                   help="continue this phase from its newest checkpoint (without it, an "
                   "existing one is an error, never overwritten)")
    p.add_argument("--stop-after-step", type=int, default=None,
                   help="checkpoint and stop here, as an interruption would")
    p.add_argument("--corpus-file", default=None,
                   help="your own text: a sentence per line, blank lines between documents "
                   "(default: Python's documentation)")
    p.add_argument("--max-documents", type=int, default=None,
                   help="use only the corpus' first documents (quick runs)")
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--dupe-factor", type=int, default=5,
                   help="passes over the corpus with different cuts when building instances")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timing-skip", type=int, default=3,
                   help="first steps of this run left out of the throughput")
    p.add_argument("--baseline-seq-per-s", type=float, default=None,
                   help="one rank's sequences/s, for the scaling efficiency")
    p.add_argument("--report-digest", action="store_true",
                   help="every rank prints a digest of its parameters at the end")
    p.add_argument("--print-presets", action="store_true",
                   help="print each preset's parameter count and exit")
    args = p.parse_args(argv)
    phase = PHASES[args.phase]
    for name in ("seq_len", "max_predictions", "batch_size", "max_steps", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, phase[name])
    if args.lr is None:
        args.lr = phase["lamb_lr"] if args.optimizer == "lamb" else 1e-4
    if args.wrapper is None:
        args.wrapper = "optimizer" if args.backend in ("mpitrain", "horovod") else "ddp"
    if args.output_dir is None:
        args.output_dir = f"runs/bert-{args.preset}"
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 8 <= args.seq_len <= 512:
        p.error(f"--seq-len must be within 8..512 (BERT's positions), got {args.seq_len}")
    if not 1 <= args.max_predictions <= args.seq_len - 3:
        p.error(f"--max-predictions must be within 1..seq-len - 3, got {args.max_predictions}")
    for name in ("batch_size", "max_steps", "vocab_size", "dupe_factor", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.max_documents is not None and args.max_documents < 2:
        p.error(f"--max-documents must be at least 2 (next-sentence prediction draws random "
                f"documents), got {args.max_documents}")
    if not 0 <= args.warmup < 1:
        p.error(f"--warmup must be a share of the steps in [0, 1), got {args.warmup}")
    torch_ddp = args.backend in ("gloo", "nccl")
    if torch_ddp and args.wrapper != "ddp":
        p.error(f"--backend {args.backend} trains with torch's DistributedDataParallel: "
                "--wrapper ddp")
    if args.backend == "gloo" and args.compression == "bf16":
        p.error("torch's bf16 communication hook needs NCCL: --backend gloo takes --compression "
                "none or fp16")
    if torch_ddp and args.resume:
        p.error(f"--backend {args.backend} is for measurement and writes no checkpoints: "
                "no --resume")
    horovod_unsupported = (args.wrapper != "optimizer" or args.compression in ("bf16", "powersgd")
                           or args.resume or args.phase != 1)
    if args.backend == "horovod" and horovod_unsupported:
        p.error("--backend horovod measures phase 1 with Horovod's DistributedOptimizer: "
                "--wrapper optimizer, --compression none or fp16, no --resume, --phase 1")
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl runs on GPUs: add --device cuda")
    if args.backend == "mpitrain" and args.wrapper == "ddp" and \
            args.compression not in ("none", "powersgd"):
        p.error("with the DDP drop-in this script compresses with powersgd only: --compression "
                f"{args.compression} needs --wrapper optimizer")


def bert_config(preset: str, vocab_size: int) -> Any:
    from transformers import BertConfig

    hidden, layers, heads, ffn = PRESETS[preset]
    return BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=ffn,
                      max_position_embeddings=512, pad_token_id=bert_data.PAD)


def print_presets(vocab_size: int) -> None:
    from transformers import BertForPreTraining

    print(f"| preset | layers | hidden | heads | parameters (vocabulary {vocab_size}) |")
    print("| --- | --- | --- | --- | --- |")
    for name, (hidden, layers, heads, _) in PRESETS.items():
        with torch.device("meta"):
            model = BertForPreTraining(bert_config(name, vocab_size))
        count = sum(p.numel() for p in model.parameters())  # tied weights counted once
        print(f"| {name} | {layers} | {hidden} | {heads} | {count:,} |")


class PretrainingLoss(nn.Module):
    """BERT's pretraining loss, with the vocabulary projection at masked positions only.

    ``BertForPreTraining.forward`` projects every position onto the vocabulary (a
    batch x 512 x 30522 tensor in phase 2) although only 80 of 512 have targets; gathering the
    masked positions first, as Google's and NVIDIA's code do, gives the same loss for ~6x less
    work in the head.  One module, so that a DDP wrapper sees the whole forward pass.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = self.model.bert(input_ids=batch["input_ids"],
                              attention_mask=batch["attention_mask"],
                              token_type_ids=batch["token_type_ids"])
        hidden = out.last_hidden_state
        positions = batch["masked_positions"].unsqueeze(-1).expand(-1, -1, hidden.size(-1))
        logits = self.model.cls.predictions(hidden.gather(1, positions))
        weights = batch["masked_weights"].flatten()
        per_token = F.cross_entropy(logits.flatten(0, 1).float(),
                                    batch["masked_ids"].flatten(), reduction="none")
        mlm = (per_token * weights).sum() / weights.sum().clamp_min(1.0)
        nsp = F.cross_entropy(self.model.cls.seq_relationship(out.pooler_output).float(),
                              batch["next_sentence_label"])
        return mlm + nsp, mlm.detach(), nsp.detach()


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up to --lr, then linear decay to 0 at --max-steps (a function of step)."""
    warmup = args.warmup * args.max_steps
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * max(0.0, (args.max_steps - step) / max(1.0, args.max_steps - warmup))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """BERT's rule: no weight decay on biases and LayerNorm weights."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (plain if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


def make_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, args.weight_decay)
    if args.optimizer == "lamb":
        from mpitrain.torch.lamb import Lamb

        return Lamb(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-6)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-6)


def parameter_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.print_presets:
        print_presets(args.vocab_size)
        return
    job = (MpitrainJob() if args.backend == "mpitrain"
           else HorovodJob() if args.backend == "horovod"
           else TorchDDPJob(Path(args.output_dir), args.backend))
    job.check_fresh(args, Path(args.output_dir))  # before the slow imports and data
    train(args, job)
    job.shutdown()


def train(args: argparse.Namespace, job: Any) -> None:
    from transformers import BertForPreTraining

    out = Path(args.output_dir)
    vocab_path, data_path = bert_data.prepare(
        out / "data", args.corpus_file, args.max_documents, args.vocab_size, args.seq_len,
        args.dupe_factor, args.seed, job.rank == 0, job.barrier)
    tokens_in_vocab = bert_data.load_tokenizer(vocab_path).get_vocab_size()
    dataset = bert_data.PretrainingDataset(data_path, args.seq_len, args.max_predictions,
                                           tokens_in_vocab, args.seed)

    torch.manual_seed(args.seed)  # the same initial weights everywhere (and broadcast anyway)
    model = BertForPreTraining(bert_config(args.preset, args.vocab_size)).to(job.device(args))
    model.train()
    optimizer = make_optimizer(args, model)
    net, optimizer, sampler = job.distribute(args, PretrainingLoss(model), optimizer, dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                         drop_last=True, generator=torch.Generator())
    if len(loader) == 0:
        raise SystemExit(f"{len(dataset)} instances are too few for {job.size} rank(s) x "
                         f"--batch-size {args.batch_size}: use more of the corpus")
    torch.manual_seed(args.seed + job.rank)  # each rank its own dropout masks
    step, epoch = job.restore(args, out, model, optimizer, sampler)

    log = job.rank == 0
    if log:
        params = sum(p.numel() for p in model.parameters())
        print(f"BERT-{args.preset} ({params:,} parameters), phase {args.phase}: sequence "
              f"{args.seq_len}, {args.max_predictions} predictions, {job.size} rank(s) x "
              f"{args.batch_size} sequences, {len(dataset):,} instances, a vocabulary of "
              f"{tokens_in_vocab:,} WordPiece tokens, {args.optimizer} "
              f"lr {args.lr:g}, {job.describe(args)}", flush=True)
    bar = tqdm(total=args.max_steps, initial=step, desc=f"phase {args.phase}",
               disable=not log or args.no_progress, leave=False)
    timed_from: tuple[int, float, float] | None = None
    first = step
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        dataset.epoch = epoch
        for batch in loader:
            batch = {k: v.to(model.device, non_blocking=True) for k, v in batch.items()}
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step)
            optimizer.zero_grad()
            loss, mlm, nsp = net(batch)
            loss.backward()
            job.step(args, net, optimizer)
            step += 1
            bar.update(1)
            if step - first == args.timing_skip:
                _wait_for_device(model.device)
                timed_from = (step, time.perf_counter(), time.process_time())
            if step % args.log_every == 0 or step == args.max_steps:
                mean = job.mean(torch.stack([mlm, nsp]))
                if log:
                    bar.write(f"step {step}: mlm loss {mean[0]:.4f}, nsp loss {mean[1]:.4f}, "
                              f"lr {learning_rate(args, step - 1):.3g}")
            if args.checkpoint_every and (step % args.checkpoint_every == 0
                                          or step == args.max_steps
                                          or step == args.stop_after_step):
                job.save(out, args, model, optimizer, sampler, step=step, epoch=epoch)
            if step == args.max_steps or step == args.stop_after_step:
                break
        else:
            epoch += 1
            continue
        break
    _wait_for_device(model.device)
    bar.close()
    if step == args.stop_after_step and step < args.max_steps and log:
        print(f"stopped after step {step}; continue with --resume")
    # Every rank's CPU seconds (all its threads) over the timed steps: on a shared machine
    # the wall-clock rate follows the other tenants' load, the work per sequence does not.
    cpu = job.mean(torch.tensor([time.process_time() - timed_from[2] if timed_from else 0.0],
                                dtype=torch.float64)).item() * job.size
    if log:
        report_throughput(args, job.size, step, timed_from, cpu)
    if args.report_digest:
        print(f"parameter digest: rank {job.rank} step {step} {parameter_digest(model)}",
              flush=True)


def _wait_for_device(device: torch.device) -> None:
    """GPU work is asynchronous: finish it before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def report_throughput(args: argparse.Namespace, size: int, step: int,
                      timed_from: tuple[int, float, float] | None, cpu_seconds: float) -> None:
    if timed_from is None or step == timed_from[0]:
        print(f"throughput: too few steps to time (the first {args.timing_skip} are left out)")
        return
    steps, seconds = step - timed_from[0], time.perf_counter() - timed_from[1]
    sequences = steps * args.batch_size * size
    rate = sequences / seconds
    print(f"throughput: {rate:.1f} sequences/s in total ({rate / size:.1f} per rank) over "
          f"{steps} steps, {size} rank(s), sequence {args.seq_len}; "
          f"{sequences / cpu_seconds:.1f} sequences per CPU-second")
    if args.baseline_seq_per_s:
        print(f"scaling efficiency: {100 * rate / (size * args.baseline_seq_per_s):.0f}% "
              f"({rate:.1f} / ({size} x {args.baseline_seq_per_s:g}))")


if __name__ == "__main__":
    main()
