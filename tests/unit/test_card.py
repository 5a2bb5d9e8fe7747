"""The model card (trainer/outputs/card.py): what huggingface_hub's own parser reads back from it,
for final/ and for an adapter's folder, and what it tells a reader."""

from __future__ import annotations

from huggingface_hub import ModelCard
from support.models import LABEL_NAMES
from support.runs import tiny_overrides

from trainer.cli import run_config
from trainer.data import labels
from trainer.outputs import card

FINAL = {"accuracy": 0.8125, "f1_macro": 0.7, "loss": 0.61}
TEST = {"accuracy": 0.75, "f1_macro": 0.65, "loss": 0.7}


def facts(tmp_path, **overrides) -> card.Facts:
    cfg = run_config.load(None, tiny_overrides("acme/tiny-bert", tmp_path, tmp_path / "sentiment-run", **{
        "data.label_names": f"[{','.join(LABEL_NAMES)}]", "data.test_split": "holdout", **overrides}))
    return card.Facts(cfg, labels.from_config(cfg.data), 40, FINAL, TEST, {"train": 600, "validation": 203, "test": 0},
                      2, "CPU (x86_64)", 95.0, "0123456789abcdef0123456789abcdef01234567")


def test_the_card_is_the_hubs_format_with_final_s_own_results(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(card.render(facts(tmp_path)))
    loaded = ModelCard.load(path)
    data = loaded.data
    assert (data.pipeline_tag, data.library_name, data.base_model) == ("text-classification", "transformers",
                                                                       "acme/tiny-bert")
    assert data.metrics == ["accuracy", "f1_macro"] and data.model_name == "sentiment-run"
    # The model-index: final/'s validation (data.eval_split, "test") and test (data.test_split) results.
    assert [(r.dataset_name, r.dataset_split, r.metric_type, r.metric_value) for r in data.eval_results] == [
        (tmp_path.name, "test", "accuracy", 0.8125), (tmp_path.name, "test", "f1_macro", 0.7),
        (tmp_path.name, "holdout", "accuracy", 0.75), (tmp_path.name, "holdout", "f1_macro", 0.65)]
    text = loaded.text
    assert "at commit `0123456789abcdef0123456789abcdef01234567`" in text
    assert f'AutoModelForSequenceClassification.from_pretrained("{tmp_path}/sentiment-run/final")' in text
    assert "0. 1 star" in text and "4. 5 stars" in text
    assert "rows: train 600, validation 203." in text
    assert "| validation (test) | 0.8125 | 0.7000 | 0.6100 |" in text
    assert "| test (holdout) | 0.7500 | 0.6500 | 0.7000 |" in text
    assert "2 rank(s) on CPU (x86_64), 1.6 minutes of training" in text
    assert "model:\n  name: acme/tiny-bert" in text  # the resolved config


def test_an_adapter_s_card_is_peft_s(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(card.render(facts(tmp_path, **{"model.lora.r": 4}), adapter=True))
    loaded = ModelCard.load(path)
    assert loaded.data.library_name == "peft" and "lora" in loaded.data.tags
    assert ('PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained("acme/tiny-bert"), '
            f'"{tmp_path}/sentiment-run/final/adapter")') in loaded.text
