"""The HF Trainer's workflow, natively: epochs, per-epoch eval and save, the best checkpoint
by a metric (kept, exported, surviving a kill), early stopping, label names, and the
`evaluate` and `score` commands on the trained model, all on 2 ranks.

The data: the test reviews as parquet whose label column is a ClassLabel with names, the
validation split carved out of train as configs/yelp_bert.yaml does, and test held out.
"""

import csv
import json
from pathlib import Path

import pytest
from support.models import LABEL_NAMES
from support.outputs import assert_confusion_shown, assert_picture, read_metrics, read_summary
from support.runs import kill_then_resume, launch, tiny_overrides, train, trainer_command
from support.weights import compare_weights, weights

EPOCHS = 4
# At this rate the tiny model's validation F1 peaks before the last epoch (the test asserts
# it), so choosing the last step instead of the best would fail.
SELECTION = {
    "train.max_steps": "null", "train.epochs": EPOCHS, "train.batch_size": 8, "train.lr": 5e-3,
    "train.eval_every": "epoch", "checkpoint.every": "epoch", "checkpoint.keep": 1,
    "checkpoint.best_metric": "f1_macro", "checkpoint.load_best_at_end": "true",
    "data.train_split": "train[:90%]", "data.eval_split": "train[90%:]", "data.test_split": "test",
}


def selection_overrides(model: Path, data: Path, output_dir: Path, **extra) -> list[str]:
    return tiny_overrides(model, data, output_dir, **{**SELECTION, **extra})


@pytest.fixture(scope="module")
def selected(tiny_model, labeled_reviews, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run: 4 epochs, best by macro F1, keep 1, best loaded at the end."""
    out = tmp_path_factory.mktemp("selected") / "run"
    train(selection_overrides(tiny_model, labeled_reviews, out))
    return out


def evals(run_dir: Path) -> dict[int, dict]:
    """step: validation metrics, from metrics.jsonl."""
    return {line["step"]: {k[5:]: v for k, v in line.items() if k.startswith("eval/")}
            for line in read_metrics(run_dir) if "eval/f1_macro" in line}


def test_the_best_epoch_is_selected_kept_and_exported(selected):
    summary = read_summary(selected)
    by_step = evals(selected)
    steps_per_epoch = summary["max_steps"] // EPOCHS
    assert sorted(by_step) == [steps_per_epoch * (e + 1) for e in range(EPOCHS)]  # evaluated at each epoch's end
    best_f1 = max(e["f1_macro"] for e in by_step.values())
    best_step = min(step for step, e in by_step.items() if e["f1_macro"] == best_f1)  # earliest on ties
    last_step = max(by_step)
    assert best_step != last_step, "the data no longer make the best epoch differ from the last"
    assert summary["best"] == {"step": best_step, "metric": "f1_macro", "value": best_f1, "eval": by_step[best_step]}
    # final_eval scores what final/ holds, the best step; the last step's is labelled as such
    assert summary["final_model_step"] == best_step and summary["final_eval"] == by_step[best_step]
    assert summary["last_step_eval"] == by_step[last_step] and summary["steps"] == last_step
    # keep=1 keeps the newest checkpoint, and the best one besides
    assert {p.name for p in (selected / "checkpoints").iterdir()} == {f"step-{best_step}", f"step-{last_step}"}
    assert not compare_weights(weights(selected, best_step), selected / "final").differing
    # the test split: evaluated once, at the end, on the final (best) model
    assert summary["test_eval"]["accuracy"] > 0.3 and summary["test_eval"] != summary["best"]["eval"]
    assert read_metrics(selected)[-1].keys() >= {"test/f1_macro"}


def test_a_pipeline_on_final_answers_with_the_dataset_label_names(selected):
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(selected / "final"), device="cpu")
    answers = classify(["The food was outstanding and the staff blew me away.", "It was broken on arrival."])
    assert {answer["label"] for answer in answers} <= set(LABEL_NAMES), answers


def test_early_stopping_ends_every_rank_at_the_same_step_and_exports_the_best(tiny_model, labeled_reviews, tmp_path):
    """Validation loss (lower is better) over 8 epochs, patience 2: it stops improving
    before the end, and the run stops there with exit 0, exporting the best."""
    out = tmp_path / "run"
    result = train(selection_overrides(tiny_model, labeled_reviews, out, **{
        "train.epochs": 8, "checkpoint.best_metric": "loss", "train.early_stopping_patience": 2,
        "train.lr": 2e-2}))  # at this rate the validation loss stops improving well within the 8 epochs
    summary = read_summary(out)
    by_step = evals(out)
    best, stalled, expected_stop = None, 0, None
    for step in sorted(by_step):  # patience 2: the second eval in a row not below the best
        if best is None or by_step[step]["loss"] < by_step[best]["loss"]:
            best, stalled = step, 0
        else:
            stalled += 1
        if stalled == 2:
            expected_stop = step
            break
    assert expected_stop is not None and expected_stop < summary["max_steps"], by_step
    assert summary["steps"] == expected_stop and summary["stopped_early"] and summary["best"]["step"] == best
    assert max(by_step) == expected_stop  # nothing trained or evaluated after it
    for rank in (0, 1):
        assert f"[rank {rank}] WARNING trainer.train.loop: early stopping at step {expected_stop}:" in result.output
    assert not compare_weights(weights(out, best), out / "final").differing


def test_a_kill_after_the_best_checkpoint_keeps_the_choice_and_the_exact_result(selected, tiny_model,
                                                                                labeled_reviews, tmp_path):
    """SIGKILL after the best epoch's checkpoint (keep=1: it is also the newest), resume:
    the resumed run must remember the best so far, or it would pick a later, worse epoch."""
    summary = read_summary(selected)
    best = summary["best"]["step"]
    out = tmp_path / "run"
    kill_then_resume(selection_overrides(tiny_model, labeled_reviews, out), out,
                     {"TRAINER_FAULT_SIGKILL": f"1:{best + 3}"}, resumed_from=best)
    resumed = read_summary(out)
    assert resumed["best"] == summary["best"] and resumed["resumed_from_step"] == best
    assert not compare_weights(selected / "final", out / "final").differing


# --- evaluate and score -------------------------------------------------------------------


def forward_one_process(model_dir: Path, texts: list[str]):
    """Plain transformers, one process, one text at a time: (probabilities, predictions)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        probs = torch.cat([model(**tokenizer(text, truncation=True, max_length=64, return_tensors="pt")).logits
                           .softmax(-1) for text in texts])
    return probs, probs.argmax(-1).tolist()


def test_evaluate_under_torchrun_equals_scikit_learn_on_one_process(selected, tiny_model, labeled_reviews, reviews):
    from sklearn.metrics import accuracy_score, classification_report, confusion_matrix, f1_score

    rows = [json.loads(line) for line in (reviews / "test.jsonl").read_text().splitlines()]
    assert len(rows) % 2 == 1  # 2 ranks get unequal shards
    result = launch(trainer_command([*selection_overrides(tiny_model, labeled_reviews, selected), "split=test"],
                                    nproc=2, command="evaluate"))
    assert result.returncode == 0, result.output[-3000:]
    report = json.loads((selected / "final" / "eval-test.json").read_text())
    # what the training run reported for the test split is what final/ scores on it
    assert {k: report[k] for k in ("accuracy", "f1_macro")} == \
        {k: read_summary(selected)["test_eval"][k] for k in ("accuracy", "f1_macro")}

    _, predicted = forward_one_process(selected / "final", [row["text"] for row in rows])
    labels = [row["label"] for row in rows]
    assert report["samples"] == len(rows)
    assert report["accuracy"] == pytest.approx(accuracy_score(labels, predicted), abs=1e-12)
    assert report["f1_macro"] == pytest.approx(f1_score(labels, predicted, average="macro"), abs=1e-12)
    expected = classification_report(labels, predicted, labels=range(5), target_names=LABEL_NAMES,
                                     output_dict=True, zero_division=0)
    for row in report["per_class"]:
        for key in ("precision", "recall", "f1"):
            assert row[key] == pytest.approx(expected[row["name"]][key if key != "f1" else "f1-score"], abs=1e-12)
        assert row["support"] == expected[row["name"]]["support"]
    assert "confusion matrix" in result.output and "5 stars" in result.output  # the table on stdout
    # eval-test.png: the confusion matrix of one process's predictions, each count in its cells' colour
    assert report["confusion_matrix"] == confusion_matrix(labels, predicted, labels=range(5)).tolist()
    assert_confusion_shown(assert_picture(selected / "final" / "eval-test.png", min_size=(400, 300)),
                           report["confusion_matrix"])


@pytest.mark.parametrize("count", [51, 1], ids=["chunks-for-both-ranks", "fewer-rows-than-ranks"])
def test_score_under_torchrun_gives_each_row_once_in_input_order(selected, tiny_model, labeled_reviews, reviews,
                                                                 tmp_path, count):
    """51 rows in chunks of 16: 4 chunks, the last partial, claimed by either rank, each sorted
    longest first and written back in input order. 1 row: one chunk, rank 1 scores nothing.
    The answers are plain transformers' one row at a time."""
    rows = [json.loads(line) for line in (reviews / "test.jsonl").read_text().splitlines()][:count]
    source = tmp_path / "in.csv"
    with source.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "text"])
        writer.writeheader()
        writer.writerows({"id": f"row-{i}", "text": row["text"]} for i, row in enumerate(rows))
    output = tmp_path / "out"
    settings = [*selection_overrides(tiny_model, labeled_reviews, selected), f"score.input={source}",
                f"score.output={output}", "score.format=jsonl", "score.chunk_rows=16", "score.carry=[id]"]
    result = launch(trainer_command(settings, nproc=2, command="score"))
    assert result.returncode == 0, result.output[-3000:]

    answers = [json.loads(line) for line in (output / "in.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == [f"row-{i}" for i in range(len(rows))]
    probs, labels = forward_one_process(selected / "final", [row["text"] for row in rows])
    for answer, expected, label in zip(answers, probs.tolist(), labels, strict=True):
        assert max(abs(a - b) for a, b in zip(answer["probs"], expected, strict=True)) < 1e-5
        assert answer["label"] == label and answer["label_name"] == LABEL_NAMES[label]


@pytest.mark.parametrize("command, args, expected", [
    ("score", ["score.input={bad}", "score.output={out}"],
     ("score.input: {bad} line 3: not JSON: Unterminated string starting at (column 10) (score.bad_rows=skip leaves "
      "such rows out)")),
    ("score", ["score.output={out}"],
     "score.input: missing: the corpus to score (a file, a folder or a glob of shards)"),
    ("score", ["score.input={bad}", "score.output={out}", "score.model={tmp}/no-such-step"],
     "score.model: {tmp}/no-such-step: no such folder"),
    ("evaluate", ["checkpoint={tmp}/no-such-step"], "checkpoint: {tmp}/no-such-step: no such folder"),
], ids=["malformed-row", "no-input", "no-model", "no-checkpoint"])
def test_evaluate_and_score_refuse_bad_arguments_in_one_line(usage_run, selected, tiny_model, labeled_reviews,
                                                               tmp_path, command, args, expected):
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": "broken\n')
    paths = {"bad": bad, "out": tmp_path / "out", "tmp": tmp_path}
    result = usage_run(selection_overrides(tiny_model, labeled_reviews, selected) +
                       [arg.format(**paths) for arg in args], command=command)
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-3000:]
    assert errors == ["error: " + expected.format(**paths)]
    # Nothing scored: score's ledger (out/.score) may have been started, no output shard.
    assert not paths["out"].exists() or [p.name for p in paths["out"].iterdir()] in ([], [".score"])
