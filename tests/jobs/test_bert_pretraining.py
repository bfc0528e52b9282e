"""examples/pytorch/bert_pretraining.py as whole jobs: both phases, resume, DDP, Gloo, presets.

Kept small for CI (tiny preset, a 100-document slice of the corpus, a 2,000-token vocabulary,
a few steps): every launch pays for importing torch and transformers on each rank.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, job_env, run_job

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SCRIPT = ROOT / "examples" / "pytorch" / "bert_pretraining.py"
QUICK = ["--max-documents", "100", "--vocab-size", "2000", "--dupe-factor", "1",
         "--log-every", "1", "--no-progress", "--report-digest"]
DIGEST = re.compile(r"^parameter digest: rank (\d+) step (\d+) (\w+)$", re.M)
STEP_LOG = re.compile(r"^step (\d+): mlm loss ([0-9.]+), nsp loss ([0-9.]+)", re.M)


def _run(np_: int, out: Path, *args: str, timeout: float = 300) -> str:
    argv = [sys.executable, str(SCRIPT), "--output-dir", str(out), *QUICK, *args]
    result = run_job(np_, argv, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _digest(out: str, np_: int, step: int) -> str:
    """The one digest every rank reports (identical parameters everywhere) at ``step``."""
    found = {int(rank): (int(at), digest) for rank, at, digest in DIGEST.findall(out)}
    assert sorted(found) == list(range(np_)), out[-3000:]
    assert {at for at, _ in found.values()} == {step}, found
    digests = {digest for _, digest in found.values()}
    assert len(digests) == 1, f"parameters differ between ranks: {found}"
    return digests.pop()


@pytest.fixture(scope="module")
def phase1(tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 6-step phase 1 at 2 ranks (LAMB, DistributedOptimizer)."""
    out = tmp_path_factory.mktemp("bert")
    stdout = _run(2, out, "--phase", "1", "--max-steps", "6", "--checkpoint-every", "3")
    assert "phase 1: sequence 128, 20 predictions, 2 rank(s) x 32 sequences" in stdout
    assert [int(s) for s, _, _ in STEP_LOG.findall(stdout)] == [1, 2, 3, 4, 5, 6]
    assert re.search(r"^throughput: [0-9.]+ sequences/s in total", stdout, re.M), stdout
    assert sorted(p.name for p in (out / "phase1").iterdir()) == ["step-0000003.pt",
                                                                 "step-0000006.pt"]
    return out, _digest(stdout, 2, 6)


def test_phase1_resumed_from_its_step3_checkpoint_ends_bit_for_bit_where_it_ended(phase1,
                                                                                 tmp_path):
    straight_dir, straight = phase1
    # Step 3's checkpoint as an interrupted run leaves it, with the same tokenizer and
    # instances (tokenizers' WordPiece training breaks ties differently from run to run).
    shutil.copytree(straight_dir / "data", tmp_path / "data")
    (tmp_path / "phase1").mkdir()
    shutil.copy2(straight_dir / "phase1" / "step-0000003.pt", tmp_path / "phase1")
    # Starting afresh over that checkpoint is refused, not silently overwritten.
    refused = run_job(2, [sys.executable, str(SCRIPT), "--output-dir", str(tmp_path), *QUICK,
                          "--max-steps", "6"], timeout=300)
    assert refused.returncode != 0 and "--resume" in refused.stderr, refused.stderr[-3000:]
    assert "step-0000003.pt exists" in refused.stderr
    resumed = _run(2, tmp_path, "--max-steps", "6", "--checkpoint-every", "3", "--resume")
    assert re.search(r"resumed from \S+step-0000003\.pt at step 3", resumed), resumed[-3000:]
    # The step count continues (no step 1 again) and the result is the uninterrupted one.
    assert [int(s) for s, _, _ in STEP_LOG.findall(resumed)] == [4, 5, 6]
    assert _digest(resumed, 2, 6) == straight


def test_phase2_starts_from_phase1_on_the_ddp_drop_in(phase1):
    out, _ = phase1
    # Two ranks, not four: each rank pays ~10 s of CPU importing torch and transformers.
    stdout = _run(2, out, "--phase", "2", "--max-steps", "2", "--wrapper", "ddp",
                  "--optimizer", "adamw", "--batch-size", "2")
    assert re.search(r"phase 2 starts from \S+phase1/step-0000006\.pt \(phase 1 step 6\)",
                     stdout), stdout[-3000:]
    assert "phase 2: sequence 512, 80 predictions, 2 rank(s) x 2 sequences" in stdout
    assert "mpitrain DistributedDataParallel" in stdout
    assert [int(s) for s, _, _ in STEP_LOG.findall(stdout)] == [1, 2]
    _digest(stdout, 2, 2)
    assert sorted(p.name for p in (out / "phase2").iterdir()) == ["step-0000002.pt"]


def test_gloo_backend_trains_the_same_script_on_torch_ddp(phase1, tmp_path):
    shutil.copytree(phase1[0] / "data", tmp_path / "data")
    stdout = _run(2, tmp_path, "--backend", "gloo", "--compression", "fp16", "--max-steps",
                  "4", "--timing-skip", "1", "--baseline-seq-per-s", "1000")
    assert "torch DistributedDataParallel over Gloo, compression fp16" in stdout
    _digest(stdout, 2, 4)
    assert re.search(r"^scaling efficiency: \d+% ", stdout, re.M), stdout[-3000:]
    assert not (tmp_path / "phase1").exists()  # the comparison path writes no checkpoints
    assert not list(tmp_path.glob(".gloo-rendezvous-*"))  # its meeting file is gone


def _bert_parameters(hidden: int, layers: int, ffn: int, vocab: int) -> int:
    """BertForPreTraining's size from its architecture (the decoder shares the embedding)."""
    embeddings = vocab * hidden + 512 * hidden + 2 * hidden + 2 * hidden
    layer = (4 * (hidden * hidden + hidden) + 2 * hidden + hidden * ffn + ffn
             + ffn * hidden + hidden + 2 * hidden)
    pooler = hidden * hidden + hidden
    heads = hidden * hidden + hidden + 2 * hidden + vocab + 2 * hidden + 2
    return embeddings + layers * layer + pooler + heads


def test_presets_have_the_sizes_of_the_bert_papers():
    # No MPI: the table is printed before anything starts.
    result = subprocess.run([sys.executable, str(SCRIPT), "--print-presets"], env=job_env(),
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {name: int(count.replace(",", "")) for name, count in
            re.findall(r"^\| (\w+) \| \d+ \| \d+ \| \d+ \| ([0-9,]+) \|$", result.stdout, re.M)}
    assert rows == {"tiny": _bert_parameters(128, 2, 512, 30522),
                    "base": _bert_parameters(768, 12, 3072, 30522),
                    "large": _bert_parameters(1024, 24, 4096, 30522)}
    assert 108e6 < rows["base"] < 112e6 and 330e6 < rows["large"] < 340e6  # "110M", "340M"
