#!/usr/bin/env python
"""Fine-tune a BERT sentence-pair classifier with Hugging Face's Trainer on mpitrain,
run_glue-style.

The shape of transformers' ``examples/pytorch/text-classification/run_glue.py``:
``HfArgumentParser`` over ``ModelArguments``, ``DataTrainingArguments`` and transformers' own
``TrainingArguments`` (every Trainer flag works: ``--output_dir``, ``--do_train``,
``--do_eval``, ``--max_steps``, ``--per_device_train_batch_size``, ``--learning_rate``,
``--seed``, ...; or one JSON file of them), rank-0 logging, ``Trainer`` with an accuracy
``compute_metrics``, train, save, evaluate, ``*_results.json`` in the output directory.

What differs, so that it runs with nothing downloaded:

- The task is not GLUE (nothing is downloaded) but one of GLUE's kind, built offline:
  next-sentence recognition, MRPC/QNLI-style.  Each example is a pair (``sentence1``,
  ``sentence2``) and a label, 1 (``next``) when sentence 2 is the sentence that follows
  sentence 1 in the text, 0 (``not_next``) when it is a sentence from another document; half of
  each split is either.  The text is English that ships with Python (help topics and
  standard-library docstrings, the corpus of ``bert_data.py``; ``--corpus_file`` for your own).
  Documents, not pairs, are split, so that no validation sentence is seen in training.
- The tokenizer is a WordPiece vocabulary trained on the training documents with
  ``tokenizers``; the model is ``BertForSequenceClassification`` from a ``BertConfig`` preset
  (``--model_preset tiny``, 2 layers of 128, as in ``bert_pretraining.py``), randomly
  initialised, not pretrained: accuracy starts at chance, and stays there in short runs (150
  steps of 32 pairs were not enough on one rank).
- Under ``mpirun``, ``mpitrain.torch.distributed.init_process_group()`` runs before the
  arguments are turned into ``TrainingArguments``: torch's default process group is then an
  mpitrain one, and Trainer wraps the model in torch's DDP over mpitrain's collectives (no
  ``--ddp_backend``: transformers and Accelerate refuse other names than their own on CPU).

Rank 0 builds the task (tokenizer and both splits as JSON lines) once in
``<output_dir>/data`` (or ``--data_dir``); the other ranks wait and read the same files.  At the
end rank 0 prints one line: world size, training loss, validation accuracy and samples/s.

Launch from the repository root (``pip install -e '.[hf]'``; as root add --allow-run-as-root,
with more ranks than cores --oversubscribe)::

    python examples/pytorch/run_glue_mpitrain.py --output_dir /tmp/glue --do_train --do_eval
    mpirun -np 2 python examples/pytorch/run_glue_mpitrain.py --output_dir /tmp/glue \\
        --do_train --do_eval --max_steps 40 --per_device_train_batch_size 32 \\
        --max_seq_length 64 --learning_rate 5e-4 --save_strategy no --seed 42
    python examples/pytorch/run_glue_mpitrain.py --help     # every flag, Trainer's included
"""

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

try:
    import numpy as np
    import torch
    import transformers
    from transformers import (
        BertForSequenceClassification,
        DataCollatorWithPadding,
        EvalPrediction,
        HfArgumentParser,
        PreTrainedTokenizerFast,
        Trainer,
        TrainingArguments,
        default_data_collator,
        set_seed,
    )

    import mpitrain.torch.distributed as mdist
    from mpitrain.face import files

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bert_data  # the example's own modules, beside it
    from bert_pretraining import bert_config, parameter_digest
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[hf]' "
             "(in a checkout: pip install -e '.[hf]')")

logger = logging.getLogger(__name__)
LABELS = ["not_next", "next"]  # label 1: sentence2 follows sentence1
TASK_FILES = ("tokenizer.json", "train.jsonl", "validation.jsonl", "meta.json")


@dataclass
class ModelArguments:
    """Which model to fine-tune: a fresh one from a preset (nothing is downloaded)."""

    model_preset: Literal["tiny", "base", "large"] = field(
        default="tiny",
        metadata={"help": "BERT size (bert_pretraining.py's presets): tiny 2x128, base 12x768, "
                  "large 24x1024; randomly initialised"})
    report_parameter_digest: bool = field(
        default=False,
        metadata={"help": "every rank prints a digest of its trained parameters (replicas "
                  "must agree)"})


@dataclass
class DataTrainingArguments:
    """The offline next-sentence task: where its text comes from and how it is cut."""

    corpus_file: str | None = field(
        default=None,
        metadata={"help": "your own English text: one sentence per line, a blank line between "
                  "documents (default: Python's own documentation)"})
    max_documents: int | None = field(
        default=None, metadata={"help": "use only the corpus' first documents (quick runs)"})
    validation_split_percentage: int = field(
        default=10, metadata={"help": "share of the documents held out for validation"})
    vocab_size: int = field(
        default=8000, metadata={"help": "WordPiece vocabulary to train, at most"})
    data_dir: str | None = field(
        default=None, metadata={"help": "where the task is built (default: <output_dir>/data)"})
    overwrite_cache: bool = field(
        default=False, metadata={"help": "build the task again even if it is there"})
    max_seq_length: int = field(
        default=128,
        metadata={"help": "tokens per pair after tokenization; longer pairs are truncated"})
    pad_to_max_length: bool = field(
        default=True,
        metadata={"help": "pad every pair to max_seq_length (else per batch, dynamically)"})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "use only this many training pairs"})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "use only this many validation pairs"})

    def __post_init__(self) -> None:
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(f"validation_split_percentage must be within 1..99, got "
                             f"{self.validation_split_percentage}")
        if not 8 <= self.max_seq_length <= 512:
            raise ValueError(f"max_seq_length must be within 8..512 (BERT's positions), got "
                             f"{self.max_seq_length}")
        if self.max_documents is not None and self.max_documents < 4:
            raise ValueError(f"max_documents must be at least 4 (two per split), got "
                             f"{self.max_documents}")


def _pairs(docs: list[list[str]], rng: np.random.Generator) -> list[dict[str, Any]]:
    """Every adjacent sentence pair of ``docs`` once, in random order; for a random half of
    them (rounded up) B is kept, for the others B is a sentence of another document."""
    places = [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - 1)]
    keep = rng.permutation(np.arange(len(places)) < (len(places) + 1) // 2)
    out = []
    for index in rng.permutation(len(places)):
        d, i = places[index]
        if keep[index]:
            label, second = 1, docs[d][i + 1]
        else:
            other = (d + int(rng.integers(1, len(docs)))) % len(docs)  # never d itself
            label, second = 0, docs[other][int(rng.integers(len(docs[other])))]
        out.append({"sentence1": docs[d][i], "sentence2": second, "label": label})
    return out


def build_task(task_dir: Path, data_args: DataTrainingArguments, seed: int) -> None:
    """Split the corpus by document, train the tokenizer on the training side, write pairs."""
    docs = [d for d in bert_data.load_documents(data_args.corpus_file, data_args.max_documents)
            if len(d) >= 2]  # a one-sentence document has no next sentence
    if len(docs) < 4:
        raise ValueError(f"{len(docs)} documents of two sentences or more are too few")
    rng = np.random.default_rng(seed)
    docs = [docs[i] for i in rng.permutation(len(docs))]
    held = max(2, round(len(docs) * data_args.validation_split_percentage / 100))
    splits = {"train": docs[held:], "validation": docs[:held]}
    bert_data.train_tokenizer(splits["train"], data_args.vocab_size, task_dir / TASK_FILES[0])
    meta: dict[str, Any] = {"labels": LABELS}
    for name, split_docs in splits.items():
        rows = _pairs(split_docs, rng)
        text = "".join(json.dumps(row) + "\n" for row in rows)
        files.write_atomic(task_dir / f"{name}.jsonl", text.encode())
        meta[name] = {"documents": len(split_docs), "pairs": len(rows),
                      "next": sum(r["label"] for r in rows)}
    # Written last: its presence means the task is complete.
    files.write_atomic(task_dir / "meta.json", json.dumps(meta, indent=1).encode())


def prepare_task(data_args: DataTrainingArguments, training_args: TrainingArguments) -> Path:
    """Rank 0 builds the task unless it is there; every rank returns its folder (collective).

    One rank builds for the whole job, not one per node, because two trainings of a WordPiece
    vocabulary can differ (``tokenizers`` breaks ties differently): on several nodes the folder
    must be shared.
    """
    key = bert_data.corpus_key(data_args.corpus_file, data_args.max_documents)
    root = Path(data_args.data_dir or Path(training_args.output_dir) / "data")
    task_dir = root / (f"next-sentence-{key}-v{data_args.vocab_size}-"
                       f"val{data_args.validation_split_percentage}-seed{training_args.seed}")
    with training_args.main_process_first(local=False, desc="building the next-sentence task"):
        if training_args.process_index == 0 and (data_args.overwrite_cache
                                                  or not (task_dir / "meta.json").exists()):
            logger.info(f"Building the next-sentence task in {task_dir}")
            task_dir.mkdir(parents=True, exist_ok=True)
            build_task(task_dir, data_args, training_args.seed)
    if not (task_dir / "meta.json").exists():
        raise FileNotFoundError(f"{task_dir} is not there: rank 0 failed to build it, or the "
                                f"ranks do not share this folder (--data_dir)")
    return task_dir


def load_tokenizer(task_dir: Path) -> PreTrainedTokenizerFast:
    from tokenizers.processors import TemplateProcessing

    wordpiece = bert_data.load_tokenizer(task_dir / TASK_FILES[0])
    # BERT's pair layout, [CLS] A [SEP] B [SEP], with segment ids 0 then 1.
    wordpiece.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", bert_data.CLS), ("[SEP]", bert_data.SEP)])
    return PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def load_split(task_dir: Path, name: str, tokenizer: PreTrainedTokenizerFast,
               data_args: DataTrainingArguments, limit: int | None) -> list[dict[str, Any]]:
    with open(task_dir / f"{name}.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    rows = rows[:limit]
    encoded = tokenizer([r["sentence1"] for r in rows], [r["sentence2"] for r in rows],
                        padding="max_length" if data_args.pad_to_max_length else False,
                        max_length=data_args.max_seq_length, truncation=True)
    return [{**{k: v[i] for k, v in encoded.items()}, "labels": r["label"]}
            for i, r in enumerate(rows)]


def compute_metrics(p: EvalPrediction) -> dict[str, float]:
    logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
    return {"accuracy": float((np.argmax(logits, axis=1) == p.label_ids).mean())}


def setup_logging(training_args: TrainingArguments) -> None:
    """Info on rank 0, warnings only on the others (``--log_level_replica``)."""
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()


def main(argv: list[str] | None = None) -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    args = sys.argv[1:] if argv is None else argv
    json_file = len(args) == 1 and args[0].endswith(".json")
    if not json_file:
        parser.parse_args(args)  # --help and unknown flags are answered before MPI work
    # Before TrainingArguments exist: building them fixes the world Trainer and Accelerate see.
    mdist.init_process_group()
    if json_file:
        model_args, data_args, training_args = parser.parse_json_file(os.path.abspath(args[0]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args)
    setup_logging(training_args)
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    logger.info(f"world size {training_args.world_size}, parallel mode "
                f"{training_args.parallel_mode.value}, device {training_args.device}, "
                f"torch.distributed backend {backend}")
    logger.info(f"Training/evaluation parameters {training_args}")
    if not (training_args.do_train or training_args.do_eval):
        raise SystemExit("nothing to do: pass --do_train and/or --do_eval")

    task_dir = prepare_task(data_args, training_args)
    tokenizer = load_tokenizer(task_dir)
    train_dataset = load_split(task_dir, "train", tokenizer, data_args,
                               data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = load_split(task_dir, "validation", tokenizer, data_args,
                              data_args.max_eval_samples) if training_args.do_eval else None
    meta = json.loads((task_dir / "meta.json").read_text())
    logger.info(f"Next-sentence task from {task_dir}: " + ", ".join(
        f"{name} {meta[name]['pairs']} pairs ({meta[name]['next']} next) from "
        f"{meta[name]['documents']} documents" for name in ("train", "validation"))
        + f", a vocabulary of {len(tokenizer)} WordPiece tokens")

    set_seed(training_args.seed)  # the same initial weights on every rank
    config = bert_config(model_args.model_preset, len(tokenizer))
    config.num_labels = len(LABELS)
    config.id2label = dict(enumerate(LABELS))
    config.label2id = {label: i for i, label in enumerate(LABELS)}
    model = BertForSequenceClassification(config)
    # Its forward takes **kwargs, so Trainer (transformers 5, average_tokens_across_devices on
    # by default) takes it for a loss normalised by the job's item count and multiplies the loss
    # by the world size; but its loss is a plain batch mean, so at N ranks the loss logged and
    # the gradients would be N times too large.  DDP's gradient averaging is what is wanted.
    model.accepts_loss_kwargs = False
    if training_args.ddp_find_unused_parameters is None:
        # Every parameter takes part (the pooler feeds the classifier); Trainer's default of
        # True would cost a graph traversal per step and a warning on every rank.
        training_args.ddp_find_unused_parameters = False
    collator = (default_data_collator if data_args.pad_to_max_length
                else DataCollatorWithPadding(tokenizer))
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                      eval_dataset=eval_dataset, compute_metrics=compute_metrics,
                      processing_class=tokenizer, data_collator=collator)

    summary = [f"world size {training_args.world_size}", f"backend {backend}"]
    if training_args.do_train:
        assert train_dataset is not None
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = dict(result.metrics, train_samples=len(train_dataset))
        trainer.save_model()  # rank 0 writes the model and the tokenizer
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        summary += [f"train loss {metrics['train_loss']:.4f}",
                    f"train samples/s {metrics['train_samples_per_second']:.1f}"]
    if training_args.do_eval:
        assert eval_dataset is not None
        metrics = dict(trainer.evaluate(), eval_samples=len(eval_dataset))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        summary += [f"eval accuracy {metrics['eval_accuracy']:.4f}",
                    f"eval samples/s {metrics['eval_samples_per_second']:.1f}"]
    if trainer.is_world_process_zero():
        print("RESULT " + ", ".join(summary), flush=True)
    if model_args.report_parameter_digest:
        print(f"parameter digest: rank {training_args.process_index} "
              f"{parameter_digest(trainer.model)}", flush=True)


if __name__ == "__main__":
    main()
