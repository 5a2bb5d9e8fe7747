"""Text pairs (the seeds' multi_nli shape: premise + hypothesis, 3 labels), from a csv file."""

import csv

import torch
from support.outputs import read_summary
from support.runs import train
from support.weights import weights


def test_premise_hypothesis_pairs_train_and_evaluate(tiny_model, tmp_path):
    rows = [("The cat sleeps on the mat.", "An animal is resting.", 0),
            ("The cat sleeps on the mat.", "The cat is running.", 2),
            ("A man buys bread.", "Someone is shopping.", 0),
            ("A man buys bread.", "The man likes bread.", 1)] * 20
    data = tmp_path / "nli.csv"
    with data.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["premise", "hypothesis", "label"])
        writer.writerows(rows)
    out = tmp_path / "run"
    overrides = [f"model.name={tiny_model}", f"data.path={data}", "data.text_field=premise",
                 "data.text_pair_field=hypothesis", "data.num_labels=3", "data.train_split=train[:60]",
                 "data.eval_split=train[60:]", "data.num_workers=0", "train.precision=fp32", "train.batch_size=8",
                 "train.max_steps=3", "wandb.mode=disabled", f"output_dir={out}"]
    train(overrides, nproc=None)
    summary = read_summary(out)
    assert summary["steps"] == 3 and 0 <= summary["final_eval"]["accuracy"] <= 1

    # The hypothesis reaches the model: without it, the same run trains on other tokens.
    single = tmp_path / "single"
    train([o for o in overrides if not o.startswith(("data.text_pair_field", "output_dir"))]
          + [f"output_dir={single}"], nproc=None)
    with_pairs, without = weights(out, 3), weights(single, 3)
    assert any(not torch.equal(with_pairs[k], without[k]) for k in with_pairs)
