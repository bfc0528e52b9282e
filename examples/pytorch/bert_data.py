"""BERT pretraining data from English text that every Python installation carries.

The corpus (nothing is downloaded): CPython's own documentation, as shipped with the
interpreter, namely the language reference's help topics (``pydoc_data/topics.py``, the text
``help("if")`` prints) and the docstrings of the standard library's modules, classes and
functions, read with ``ast`` from the ``.py`` files (nothing is imported), one document per
topic or file.  On Python 3.11: 534 documents, 15,200 sentences, 220,000 words (1.35 MB) of
English prose once code examples are dropped; enough for a WordPiece vocabulary of ~8,600
tokens (``--vocab-size`` stays BERT's 30,522 rows, so that model sizes are the paper's).
``--corpus-file`` takes any text in BERT's own format instead: one sentence per line, a blank
line between documents.

From it, as in Google's ``create_pretraining_data.py`` (Devlin et al., 2019), written anew:

- a WordPiece vocabulary trained with Hugging Face ``tokenizers`` (lower-cased, BERT's
  normaliser and pre-tokeniser; ``[PAD]`` is id 0);
- sentence-pair instances for next-sentence prediction: segment A is a run of consecutive
  sentences of one document; B is the true continuation or, half the time, sentences from a
  random other document; 10% of instances are shorter than the maximum, to teach short inputs;
  ``dupe_factor`` passes over the corpus with different random cuts;
- masked-LM targets drawn afresh for every (epoch, instance), deterministically from the seed:
  15% of the tokens (at most ``max_predictions``), of which 80% become ``[MASK]``, 10% a random
  token and 10% stay.

Rank 0 builds the tokenizer and the instances once and caches them in the output directory;
every rank then reads the same files.  Training a vocabulary is not reproducible bit for bit
(the ``tokenizers`` trainer breaks ties differently from run to run): runs that must compare
exactly share one output directory's ``data/``.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpitrain.face import files

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(len(SPECIAL_TOKENS))
# Library folders whose docstrings are not prose, or which are tests.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
              "__pycache__", "turtledemo", "ensurepip", "tkinter", "pydoc_data"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z])")
_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _prose_paragraphs(text: str) -> Iterator[str]:
    """The paragraphs of ``text`` that read as prose, each on one line.

    Code examples, signatures, grammar productions and tables are dropped: a paragraph (lines
    between blank lines) indented deeper than the text's prose (more than a list item's 2
    columns), one holding an interpreter prompt or a grammar or table marker, one that does
    not end as a sentence does, or one whose characters are mostly not words.
    """
    blocks = [b for b in re.split(r"\n\s*\n", text.strip("\n")) if b.strip()]
    if not blocks:
        return
    base = min(min(_indent(line) for line in b.splitlines() if line.strip()) for b in blocks)
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        if min(_indent(line) for line in lines) > base + 2:
            continue
        if ">>>" in block or "::=" in block or "+--" in block or "===" in block:
            continue
        flat = " ".join(block.split())
        if not flat.rstrip("\"')]").endswith((".", "!", "?", ":")):
            continue  # a signature, a heading or a fragment, not a sentence
        words = _WORD.findall(flat)
        if len(words) < 6 or sum(map(len, words)) < 0.75 * len(flat.replace(" ", "")):
            continue
        yield flat


def _sentences(text: str) -> list[str]:
    out = []
    for paragraph in _prose_paragraphs(text):
        out.extend(s for s in _SENTENCE_END.split(paragraph) if len(s.split()) >= 3)
    return out


def _stdlib_docstrings() -> Iterator[str]:
    """One text per standard-library file: its docstrings in source order."""
    root = sysconfig.get_paths()["stdlib"]
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            docs = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        docs.append((getattr(node, "lineno", 0), doc))
            if docs:
                yield "\n\n".join(doc for _, doc in sorted(docs))


def python_docs_documents(limit: int | None = None) -> list[list[str]]:
    """CPython's help topics, then standard-library files' docstrings: documents of sentences.

    Args:
        limit: stop after this many documents (a quick run needs no full corpus).
    """
    import pydoc_data.topics

    topics = (pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    out: list[list[str]] = []
    for text in itertools.chain(topics, _stdlib_docstrings()):
        if limit is not None and len(out) >= limit:
            break
        sentences = _sentences(text)
        if sentences:
            out.append(sentences)
    return out


def file_documents(path: str) -> list[list[str]]:
    """BERT's input format: one sentence per line, documents separated by blank lines."""
    docs: list[list[str]] = [[]]
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                docs[-1].append(line)
            elif docs[-1]:
                docs.append([])
    return [d for d in docs if d]


def corpus_key(corpus_file: str | None, limit: int | None) -> str:
    """Names the corpus in cache file names: changes when the text can have changed."""
    cut = "" if limit is None else f"-first{limit}"
    if corpus_file is None:
        return f"pydocs-py{sys.version_info[0]}{sys.version_info[1]}{cut}"
    stat = os.stat(corpus_file)
    digest = hashlib.sha256(f"{os.path.abspath(corpus_file)}:{stat.st_size}:"
                            f"{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"file-{digest}{cut}"


def load_documents(corpus_file: str | None, limit: int | None = None) -> list[list[str]]:
    docs = (python_docs_documents(limit) if corpus_file is None
            else file_documents(corpus_file)[:limit])
    if not docs:
        raise ValueError(f"no sentences found in {corpus_file or 'the Python documentation'}")
    return docs


def train_tokenizer(docs: list[list[str]], vocab_size: int, path: Path) -> None:
    """Train a lower-cased WordPiece vocabulary on ``docs`` and save it (tokenizer.json)."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator((s for d in docs for s in d), vocab_size=vocab_size,
                                  min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  show_progress=False)
    files.write_atomic(path, tokenizer.to_str().encode())


def load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    for i, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise ValueError(f"{path}: {token} is not id {i}; delete it to train it again")
    return tokenizer


def _random_next(docs: list[np.ndarray], skip: int, want: int,
                 rng: np.random.Generator) -> list[np.ndarray]:
    """Sentences from a random document other than ``skip``, about ``want`` tokens."""
    other = skip
    for _ in range(10):
        other = int(rng.integers(len(docs)))
        if other != skip:
            break
    doc = docs[other]
    out, length = [], 0
    for sentence in doc[int(rng.integers(len(doc))):]:
        out.append(sentence)
        length += len(sentence)
        if length >= want:
            break
    return out


def _truncate(a: np.ndarray, b: np.ndarray, limit: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Drop tokens from the longer segment, at its front or back at random, to fit ``limit``."""
    bounds = [[0, len(a)], [0, len(b)]]
    while (bounds[0][1] - bounds[0][0]) + (bounds[1][1] - bounds[1][0]) > limit:
        longer = bounds[0] if bounds[0][1] - bounds[0][0] > bounds[1][1] - bounds[1][0] \
            else bounds[1]
        if rng.random() < 0.5:
            longer[0] += 1
        else:
            longer[1] -= 1
    return a[bounds[0][0]:bounds[0][1]], b[bounds[1][0]:bounds[1][1]]


def _join(sentences: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(sentences) if sentences else np.zeros(0, dtype=np.int32)


def document_instances(docs: list[list[np.ndarray]], index: int, seq_len: int,
                       short_seq_prob: float, rng: np.random.Generator,
                       ) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Sentence pairs (A, B, is_random_next) cut from one document of token-id sentences."""
    doc, limit = docs[index], seq_len - 3  # [CLS] A [SEP] B [SEP]
    target = limit if rng.random() >= short_seq_prob else int(rng.integers(2, limit + 1))
    out = []
    chunk: list[np.ndarray] = []
    length, i = 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            a_end = 1 if len(chunk) < 2 else int(rng.integers(1, len(chunk)))
            a = _join(chunk[:a_end])
            if len(chunk) == 1 or rng.random() < 0.5:
                random_next = 1
                b = _join(_random_next(docs, index, max(1, target - len(a)), rng))
                i -= len(chunk) - a_end  # the unused sentences start the next chunk
            else:
                random_next = 0
                b = _join(chunk[a_end:])
            a, b = _truncate(a, b, limit, rng)
            if len(a) and len(b):
                out.append((a, b, random_next))
            chunk, length = [], 0
        i += 1
    return out


def build_instances(docs: list[list[str]], tokenizer: Any, seq_len: int, dupe_factor: int,
                    seed: int, short_seq_prob: float = 0.1) -> dict[str, np.ndarray]:
    """Every instance as flat token arrays: A+B tokens, A lengths, B lengths, NSP labels."""
    encoded = [[np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(
        d, add_special_tokens=False)] for d in docs]
    encoded = [[s for s in d if len(s)] for d in encoded]
    encoded = [d for d in encoded if d]
    rng = np.random.default_rng(seed)
    pairs = [pair for _ in range(dupe_factor) for index in range(len(encoded))
             for pair in document_instances(encoded, index, seq_len, short_seq_prob, rng)]
    pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    return {"tokens": _join([t for a, b, _ in pairs for t in (a, b)]),
            "a_len": np.asarray([len(a) for a, _, _ in pairs], dtype=np.int32),
            "b_len": np.asarray([len(b) for _, b, _ in pairs], dtype=np.int32),
            "labels": np.asarray([label for _, _, label in pairs], dtype=np.int64)}


def prepare(cache_dir: Path, corpus_file: str | None, limit: int | None, vocab_size: int,
            seq_len: int, dupe_factor: int, seed: int, is_root: bool,
            barrier: Callable[[], None]) -> tuple[Path, Path]:
    """Build (rank 0) or wait for (others) the tokenizer and instance files; return them.

    Collective: every rank must call it (``barrier`` is the job's barrier).
    """
    key = corpus_key(corpus_file, limit)
    vocab_path = cache_dir / f"tokenizer-{key}-v{vocab_size}.json"
    data_path = cache_dir / f"instances-{key}-v{vocab_size}-seq{seq_len}-dupe{dupe_factor}-" \
        f"seed{seed}.npz"
    if is_root and not (vocab_path.exists() and data_path.exists()):
        docs = load_documents(corpus_file, limit)
        if not vocab_path.exists():
            train_tokenizer(docs, vocab_size, vocab_path)
        if not data_path.exists():
            arrays = build_instances(docs, load_tokenizer(vocab_path), seq_len, dupe_factor,
                                     seed)
            files.write_atomic(data_path, lambda f: np.savez(f, **arrays))
            meta = {"documents": len(docs), "sentences": sum(map(len, docs)),
                    "instances": len(arrays["labels"]), "tokens": len(arrays["tokens"])}
            files.write_atomic(data_path.with_suffix(".json"), json.dumps(meta).encode())
    barrier()
    return vocab_path, data_path


class PretrainingDataset(torch.utils.data.Dataset):
    """Instances with masked-LM targets drawn per (seed, epoch, index): resumable exactly.

    Each item: ``input_ids``, ``token_type_ids``, ``attention_mask`` (all ``seq_len``),
    ``masked_positions``, ``masked_ids``, ``masked_weights`` (``max_predictions``; weight 0
    marks padding) and ``next_sentence_label`` (1 when B is a random sentence).
    """

    def __init__(self, data_path: Path, seq_len: int, max_predictions: int, vocab_size: int,
                 seed: int, mask_prob: float = 0.15) -> None:
        with np.load(data_path) as data:
            self.tokens, self.labels = data["tokens"], data["labels"]
            self.a_len, self.b_len = data["a_len"], data["b_len"]
        self.offsets = np.concatenate([[0], np.cumsum(self.a_len + self.b_len)])
        longest = int((self.a_len + self.b_len).max()) + 3
        if longest > seq_len:
            raise ValueError(f"{data_path} holds instances of {longest} tokens, longer than "
                             f"--seq-len {seq_len}")
        self.seq_len, self.max_predictions = seq_len, max_predictions
        self.vocab_size, self.seed, self.mask_prob = vocab_size, seed, mask_prob
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        a, b = int(self.a_len[index]), int(self.b_len[index])
        start = int(self.offsets[index])
        body = self.tokens[start:start + a + b]
        ids = np.full(self.seq_len, PAD, dtype=np.int64)
        ids[0], ids[1:a + 1], ids[a + 1] = CLS, body[:a], SEP
        ids[a + 2:a + b + 2], ids[a + b + 2] = body[a:], SEP
        types = np.zeros(self.seq_len, dtype=np.int64)
        types[a + 2:a + b + 3] = 1
        mask = np.zeros(self.seq_len, dtype=np.int64)
        mask[:a + b + 3] = 1

        rng = np.random.default_rng([self.seed, self.epoch, index])
        candidates = np.concatenate([np.arange(1, a + 1), np.arange(a + 2, a + b + 2)])
        count = min(self.max_predictions, max(1, round(len(candidates) * self.mask_prob)))
        positions = np.sort(rng.choice(candidates, size=count, replace=False))
        originals = ids[positions].copy()
        roll = rng.random(count)
        ids[positions[roll < 0.8]] = MASK
        swapped = positions[roll >= 0.9]
        ids[swapped] = rng.integers(len(SPECIAL_TOKENS), self.vocab_size, size=len(swapped))

        pad = self.max_predictions - count
        return {"input_ids": torch.from_numpy(ids), "token_type_ids": torch.from_numpy(types),
                "attention_mask": torch.from_numpy(mask),
                "masked_positions": torch.from_numpy(np.pad(positions, (0, pad))),
                "masked_ids": torch.from_numpy(np.pad(originals, (0, pad))),
                "masked_weights": torch.from_numpy(
                    np.pad(np.ones(count, dtype=np.float32), (0, pad))),
                "next_sentence_label": torch.tensor(int(self.labels[index]))}
