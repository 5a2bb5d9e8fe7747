"""Distributed eval counts every sample once: it equals a plain single-process evaluation.

203 eval samples over 2 ranks: the shards are 101 and 102, so a padding sampler (the
seeds' DistributedSampler) would count one sample twice. The reference here is independent
of the trainer: plain transformers loads `final/`, and scikit-learn scores its predictions.
"""

import datasets
import numpy as np
import torch
from sklearn.metrics import accuracy_score, f1_score
from support.outputs import read_summary
from support.runs import tiny_overrides, train
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def test_two_rank_eval_equals_single_process(tiny_model, reviews, tmp_path):
    overrides = {"train.batch_size": 8, "train.max_steps": 60, "train.lr": 5e-3, "train.eval_batch_size": 16}
    train(tiny_overrides(tiny_model, reviews, tmp_path, **overrides), nproc=2)
    reported = read_summary(tmp_path)["final_eval"]

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    test = datasets.load_dataset(str(reviews), split="test")
    assert len(test) == 203
    predictions = []
    with torch.no_grad():
        for text in test["text"]:  # one by one: no padding at all
            encoded = tokenizer(text, truncation=True, max_length=64, return_tensors="pt")
            predictions.append(model(**encoded).logits.argmax(-1).item())
    labels = np.asarray(test["label"])
    assert len(set(predictions)) >= 2, "a model predicting one class would make this test weak"
    assert reported["accuracy"] == accuracy_score(labels, predictions)
    assert abs(reported["f1_macro"] - f1_score(labels, predictions, average="macro")) < 1e-12
