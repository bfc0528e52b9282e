"""examples/pytorch/run_glue_mpitrain.py as a whole job: Trainer fine-tuning on mpitrain.

One 2-rank run, kept small (tiny BERT, a 60-document slice of the corpus, a 1,000-token
vocabulary, 4 steps): it must report the world size of 2 over mpitrain's torch backend, finish
training and evaluation, count every validation pair once (75 pairs over 2 ranks: Trainer's
padded last batch must not count twice), and end with identical parameters on every rank.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, job_env, run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("tokenizers")

SCRIPT = str(ROOT / "examples" / "pytorch" / "run_glue_mpitrain.py")
QUICK = ["--do_train", "--do_eval", "--max_documents", "60", "--vocab_size", "1000",
         "--max_seq_length", "64", "--max_steps", "4", "--per_device_train_batch_size", "8",
         "--per_device_eval_batch_size", "32", "--max_eval_samples", "75",
         "--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true",
         "--seed", "0", "--report_parameter_digest"]
RESULT = re.compile(r"^RESULT world size (\d+), backend (\w+), train loss ([0-9.]+), "
                    r"train samples/s ([0-9.]+), eval accuracy ([0-9.]+), "
                    r"eval samples/s ([0-9.]+)$", re.M)
DIGEST = re.compile(r"^parameter digest: rank (\d+) (\w+)$", re.M)


@pytest.mark.timeout(300)
def test_two_ranks_fine_tune_one_model_and_evaluate_every_pair_once(tmp_path: Path) -> None:
    result = run_job(2, [sys.executable, SCRIPT, "--output_dir", str(tmp_path), *QUICK],
                     timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    found = RESULT.findall(result.stdout)
    assert len(found) == 1, f"rank 0 alone prints one summary:\n{result.stdout[-3000:]}"
    world, backend, loss, _, accuracy, _ = found[0]
    assert (int(world), backend) == (2, "mpitrain")
    assert 0.3 < float(loss) < 1.5  # a two-class cross-entropy near log 2, not 2 x log 2
    assert 0.0 <= float(accuracy) <= 1.0

    digests = {int(rank): digest for rank, digest in DIGEST.findall(result.stdout)}
    assert sorted(digests) == [0, 1], result.stdout[-3000:]
    assert len(set(digests.values())) == 1, f"replicas diverged: {digests}"

    # Rank 0 wrote Trainer's results, the model and the tokenizer; the task is balanced.
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert results["eval_samples"] == 75
    assert round(results["eval_accuracy"] * 75, 6).is_integer()
    assert (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "tokenizer.json").exists()
    (meta_path,) = tmp_path.glob("data/*/meta.json")
    meta = json.loads(meta_path.read_text())
    for split in ("train", "validation"):
        assert meta[split]["next"] == (meta[split]["pairs"] + 1) // 2, meta


def test_help_lists_the_task_and_trainer_flags_without_mpirun() -> None:
    result = subprocess.run([sys.executable, SCRIPT, "--help"], env=job_env(),
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for flag in ("--model_preset", "--max_documents", "--max_seq_length", "--output_dir",
                 "--max_steps", "--per_device_train_batch_size", "--seed"):
        assert flag in result.stdout
