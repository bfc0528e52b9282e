"""The BERT example's data: sentence pairs for next-sentence prediction, and masking."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from support import ROOT

sys.path.insert(0, str(ROOT / "examples" / "pytorch"))
import bert_data  # noqa: E402

FIRST = len(bert_data.SPECIAL_TOKENS)


def _documents(count: int, rng: np.random.Generator) -> list[list[np.ndarray]]:
    """Documents of sentences whose tokens are unique increasing numbers (easy to trace)."""
    docs, token = [], FIRST
    for _ in range(count):
        doc = []
        for _ in range(int(rng.integers(1, 12))):
            n = int(rng.integers(3, 30))
            doc.append(np.arange(token, token + n, dtype=np.int32))
            token += n
        docs.append(doc)
    return docs


def test_pairs_fit_and_true_continuations_are_contiguous():
    rng = np.random.default_rng(0)
    docs = _documents(60, rng)
    flat = [np.concatenate(d) for d in docs]
    labels = []
    for index in range(len(docs)):
        for a, b, random_next in bert_data.document_instances(docs, index, 64, 0.1, rng):
            assert len(a) and len(b) and len(a) + len(b) <= 64 - 3
            assert np.all(np.diff(a) == 1)  # A is a run of one document (truncation trims ends)
            assert a[0] >= flat[index][0] and a[-1] <= flat[index][-1]
            assert np.all(np.diff(b) == 1)
            if not random_next:  # B continues A in A's document (truncation trims the seam)
                assert a[-1] < b[0] <= flat[index][-1]
            else:  # B comes from another document
                assert b[0] < flat[index][0] or b[0] > flat[index][-1]
            labels.append(random_next)
    # Single-sentence chunks can only get a random B, so a little over half are random.
    assert 0.45 < np.mean(labels) < 0.75 and len(labels) > 100


def _dataset(tmp_path, seq_len=32, max_predictions=5):
    rng = np.random.default_rng(1)
    a_len = rng.integers(1, 14, size=50).astype(np.int32)
    b_len = rng.integers(1, 14, size=50).astype(np.int32)
    tokens = rng.integers(FIRST, 100, size=int((a_len + b_len).sum())).astype(np.int32)
    path = tmp_path / "instances.npz"
    np.savez(path, tokens=tokens, a_len=a_len, b_len=b_len,
             labels=rng.integers(0, 2, size=50).astype(np.int64))
    return bert_data.PretrainingDataset(path, seq_len, max_predictions, 100, seed=7), tokens


def test_items_are_laid_out_as_bert_expects_and_masked_within_limits(tmp_path):
    ds, tokens = _dataset(tmp_path)
    start, masked, kept, counts = 0, 0, 0, []
    for i in range(len(ds)):
        item = ds[i]
        a, b = int(ds.a_len[i]), int(ds.b_len[i])
        ids, types = item["input_ids"].numpy(), item["token_type_ids"].numpy()
        length = a + b + 3
        assert ids[0] == bert_data.CLS and ids[a + 1] == bert_data.SEP
        assert ids[length - 1] == bert_data.SEP and np.all(ids[length:] == bert_data.PAD)
        assert item["attention_mask"].numpy().tolist() == [1] * length + [0] * (32 - length)
        assert np.all(types[:a + 2] == 0) and np.all(types[a + 2:length] == 1)
        assert np.all(types[length:] == 0)
        weights = item["masked_weights"].numpy()
        count = int(weights.sum())
        assert count == min(5, max(1, round((a + b) * 0.15)))
        assert np.all(weights[:count] == 1) and np.all(weights[count:] == 0)
        positions = item["masked_positions"].numpy()[:count]
        original = np.concatenate([[bert_data.CLS], tokens[start:start + a], [bert_data.SEP],
                                   tokens[start + a:start + a + b], [bert_data.SEP]])
        assert np.all(np.diff(positions) > 0)  # distinct
        assert not set(positions) & {0, a + 1, length - 1}  # never [CLS] or [SEP]
        assert np.all(item["masked_ids"].numpy()[:count] == original[positions])
        # Unmasked positions are untouched.
        untouched = np.setdiff1d(np.arange(length), positions)
        assert np.all(ids[untouched] == original[untouched])
        masked += int(np.sum(ids[positions] == bert_data.MASK))
        kept += int(np.sum(ids[positions] == original[positions]))
        counts.append(count)
        start += a + b
    total = sum(counts)
    assert 0.6 < masked / total < 0.95 and kept / total < 0.3


def test_masks_are_fixed_per_epoch_and_index_and_change_between_epochs(tmp_path):
    ds, _ = _dataset(tmp_path, seq_len=64, max_predictions=20)
    first = [ds[i]["masked_positions"] for i in range(len(ds))]
    again = [ds[i]["masked_positions"] for i in range(len(ds))]
    ds.epoch = 1
    later = [ds[i]["masked_positions"] for i in range(len(ds))]
    assert all((x == y).all() for x, y in zip(first, again))
    assert sum(not (x == y).all() for x, y in zip(first, later)) > len(ds) // 2


def test_an_instance_longer_than_the_sequence_is_refused(tmp_path):
    _dataset(tmp_path)
    with pytest.raises(ValueError, match="longer than --seq-len 16"):
        bert_data.PretrainingDataset(tmp_path / "instances.npz", 16, 5, 100, seed=0)


def test_corpus_file_format_and_python_docs_are_english_documents(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("First sentence here.\nSecond one follows.\n\n\nAnother document.\n")
    assert bert_data.file_documents(str(path)) == [
        ["First sentence here.", "Second one follows."], ["Another document."]]
    docs = bert_data.python_docs_documents(limit=20)
    sentences = [s for d in docs for s in d]
    assert len(docs) == 20 and len(sentences) > 300
    # Prose, not code: sentences start as sentences do (a few continue a list item's "a
    # class object: A new instance..."), and no interpreter session or code line got in.
    starts = sum(s[0].isupper() or not s[0].isalpha() for s in sentences)
    assert starts > 0.95 * len(sentences)
    assert not [s for s in sentences if ">>>" in s]
    assert not [s for s in sentences if s.rstrip("\"')]")[-1] not in ".!?:"]
