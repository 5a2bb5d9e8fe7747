"""benchmarks/gpu.sh check, issue 58's prepared GPU check, as its CPU dry run: every part runs
(the CUDA tests, skipped here; a benchmark side; the profile; an FSDP save under torchrun;
`score` against the pipeline), every GPU side's overrides pass the config's checks, and the
JSON, the table and the log are written. What a GPU-only session would otherwise find broken
in its few minutes of device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_runs_every_part_and_writes_its_report(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", "benchmarks/gpu.sh", "check", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    summary = json.loads((tmp_path / "check.json").read_text())
    assert summary["dry_run"] is True and summary["device"] == "cpu"
    assert summary["side_problems"] == []  # the GPU sides' overrides, checked as on a GPU
    parts = summary["parts"]
    assert list(parts) == ["variants", "packing", "long-tail", "saves", "profile", "cuda", "scoring"]
    assert all(part["status"] == "ok" for part in parts.values()), {k: v["status"] for k, v in parts.items()}
    variant = parts["variants"]["results"]["runs"]["trainer DDP bf16 + SDPA math"][0]
    assert variant["samples_per_s"] > 0
    for name in ("packing", "long-tail"):  # packed, on the reviews and on the long tail
        assert parts[name]["results"]["runs"]["trainer DDP bf16 + packing"][0]["samples_per_s"] > 0
    assert "long-tail lengths" in parts["long-tail"]["results"]["workload"]
    save = parts["saves"]["results"]["runs"]["trainer FSDP bf16, async save every 5"][0]
    assert save["samples_per_s"] > 0 and save["checkpoint_save_s"], save  # it saved
    assert parts["profile"]["results"]["wall_ms_per_step"] > 0
    scoring = parts["scoring"]["results"]  # score, the pipeline and the model alone, on the same rows
    assert set(scoring["rows_per_s"]) == {"pipeline batch 64", "score, 1 process", "the model alone (forwards only)"}
    assert all(rate > 0 for rate in scoring["rows_per_s"].values())

    table = (tmp_path / "check.md").read_text()
    assert "| trainer DDP bf16 + SDPA math |" in table and "| saves | ok |" in table
    assert "| 32 | score, 1 process |" in table
    log = (tmp_path / "check.log").read_text()
    assert all(f"=== {name}: ok" in log for name in parts)


def test_the_gpu_check_refuses_to_measure_without_a_gpu(tmp_path):
    """Without --dry-run on a host with no GPU: one line, exit 2, nothing measured."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", "benchmarks/gpu.sh", "check"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "benchmarks/gpu.sh check: no CUDA GPU here; --dry-run (or DRY_RUN=1) runs it on CPU"
    assert not (tmp_path / "check.json").exists()
