"""Each task (data.problem_type) on data shaped as users bring it, under torchrun, with the
guarantees of the demo's: a CSV of label names with no validation split and class weights
(single_label), JSON lines of label lists (multi_label), numbers (regression).

For each: 2 DDP ranks end with the weights of 1 process, and 2 FSDP ranks of LoRA with those of
1 LoRA process (1e-6, fp32); the validation metrics are exact: every row counted once (with
unequal shards), each metric the one computed from the gathered rows by scipy or by hand, and
the continuous ones within 1e-4 of 1 process's (a rank or a threshold jumps when two predictions
1e-6 apart swap, on one CPU and not another); a rank SIGKILLed mid-run resumes bitwise;
evaluate and score answer in the task's terms.
Independent launches run at once, to overlap their start-ups: one test per task.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics
from sklearn.preprocessing import MultiLabelBinarizer
from support.outputs import assert_confusion_shown, assert_picture, bar_heights, frame, read_summary, scatter_box
from support.runs import tiny_overrides, together, trainer_command
from support.weights import compare_weights

from trainer.data import demo

STEPS = 12
SHAPES = {
    # task: (the generator of its file, the keys a user sets)
    "single_label": (demo.sentiment, {"data.text_field": "review", "data.label_field": "sentiment",
                                           "train.class_weights": "balanced", "train.label_smoothing": 0.1}),
    "multi_label": (demo.complaints, {"data.label_field": "complaints", "data.problem_type": "multi_label",
                                           "train.class_weights": "balanced"}),
    "regression": (demo.score, {"data.label_field": "score", "data.problem_type": "regression",
                                     "checkpoint.best_metric": "spearman"}),
}
METRICS = {"single_label": {"accuracy", "f1_macro", "loss"},
           "multi_label": {"f1_micro", "f1_macro", "subset_accuracy", "loss"},
           "regression": {"mse", "mae", "pearson", "spearman", "loss"}}
CONTINUOUS = {"loss", "mse", "mae", "pearson"}
"""The metrics that move by about as much as the weights: 2 ranks and 1 process agree on them
within 1e-4. The others count thresholded or ranked predictions."""
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.dropout": 0.0}


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    """Each task's file, 700 rows: 630 train and 70 held out for validation."""
    folder = tmp_path_factory.mktemp("shaped")
    return {task: generate(folder / task, 700, seed=3) for task, (generate, _) in SHAPES.items()}


def options(task: str, path, **extra) -> dict:
    return {"data.path": path, "data.num_labels": "null", "train.max_steps": STEPS, "checkpoint.every": 5,
            "train.eval_every": 6, "train.eval_batch_size": 16, **SHAPES[task][1], **extra}


def succeeded(result) -> None:
    assert result.returncode == 0, result.output[-4000:]


@pytest.mark.parametrize("task", list(SHAPES))
def test_each_task_trains_exactly_resumes_bitwise_and_answers_in_its_own_terms(task, shaped, tiny_model, tmp_path):
    """70 validation rows in batches of 16 over 2 ranks: 35 each, 3 batches, the last short.
    The 2-rank DDP run is the reference of 1 process, and of its own kill and resume."""
    def overrides(name: str, **settings) -> list[str]:
        return tiny_overrides(tiny_model, shaped[task], tmp_path / name, **options(task, shaped[task], **settings))

    ddp, lora = {"train.batch_size": 8}, {**LORA, "ddp.sparse_embedding_grad": False}
    for result in together((trainer_command(overrides("single", **{"train.batch_size": 16}), None), {}),
                           (trainer_command(overrides("ddp", **ddp), 2), {})):
        succeeded(result)
    lora_single, lora_fsdp, killed = together(
        (trainer_command(overrides("lora-single", **lora, **{"train.batch_size": 16}), None), {}),
        (trainer_command(overrides("lora-fsdp", **lora, **{"train.batch_size": 8, "train.strategy": "fsdp",
                                                            "train.global_batch": 16}), 2), {}),
        (trainer_command(overrides("resumed", **ddp), 2), {"TRAINER_FAULT_SIGKILL": "1:8"}))
    succeeded(lora_single)
    succeeded(lora_fsdp)
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t, "review": t}) + "\n" for t in ("The food was terrible.", "Lovely!")))
    answers = tmp_path / "answers"
    resumed, evaluated, scored = together(
        (trainer_command(overrides("resumed", **ddp), 2), {}),
        (trainer_command(overrides("ddp", **ddp), 2, command="evaluate"), {}),
        (trainer_command([*overrides("ddp", **ddp), f"score.input={rows}", f"score.output={answers}",
                          "score.format=jsonl", "score.carry=[review]"], None, command="score"), {}))
    for result in (resumed, evaluated, scored):
        succeeded(result)

    # 2 ranks = 1 process, with DDP and with LoRA under FSDP.
    assert compare_weights(tmp_path / "single", tmp_path / "ddp", STEPS).max_abs <= 1e-6
    assert compare_weights(tmp_path / "lora-single", tmp_path / "lora-fsdp", STEPS).max_abs <= 1e-6
    single, two = read_summary(tmp_path / "single"), read_summary(tmp_path / "ddp")
    assert set(single["final_eval"]) == METRICS[task]
    for name in CONTINUOUS & set(single["final_eval"]):  # by weights within 1e-6
        assert two["final_eval"][name] == pytest.approx(single["final_eval"][name], abs=1e-4), name
    labels = single["labels"]
    assert labels["problem_type"] == task and labels == two["labels"]
    if task == "single_label":
        assert labels["names"] == ["negative", "neutral", "positive"] and labels["source"] == "the train split"
        assert labels["weights"] == pytest.approx([labels["rows"] / (3 * n) for n in labels["counts"]])
    if task == "regression":
        assert single["best"]["metric"] == "spearman"

    # Killed at step 8: resumed from the latest checkpoint (every 5 steps, and at each
    # evaluation, every 6, where a best_metric selects), bitwise on the uninterrupted run.
    latest = 6 if "checkpoint.best_metric" in SHAPES[task][1] else 5
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints' / f'step-{latest}'}" in resumed.output
    assert not compare_weights(tmp_path / "ddp", tmp_path / "resumed", STEPS).differing

    # final/ evaluated on 2 ranks, as training evaluated it: the same metrics, each one that of
    # the 70 rows gathered, once each and in order.
    report = json.loads((tmp_path / "ddp" / "final" / "eval-test.json").read_text())
    assert report["problem_type"] == task and report["samples"] == 70
    assert {name: report[name] for name in METRICS[task]} == pytest.approx(two["final_eval"], abs=1e-6)
    with (tmp_path / "ddp" / "final" / "eval-test-rows.csv").open() as f:
        gathered = list(csv.DictReader(f))
    assert [int(row["row"]) for row in gathered] == list(range(70))
    assert recomputed(task, gathered) == pytest.approx({name: report[name] for name in METRICS[task] - {"loss"}},
                                                       abs=1e-9)
    assert report["split"] == "test (held out of the train split)"
    assert_shown(task, assert_picture(tmp_path / "ddp" / "final" / "eval-test.png", min_size=(400, 300)), report)
    answered = [json.loads(line) for line in (answers / "rows.jsonl").read_text().splitlines()]
    assert [answer["review"] for answer in answered] == ["The food was terrible.", "Lovely!"]
    assert set(answered[0]) == {"review", *{"single_label": ["label", "label_name", "probs"],
                                            "multi_label": ["labels", "label_names", "probs"],
                                            "regression": ["value"]}[task]}
    if task == "single_label":
        assert {answer["label_name"] for answer in answered} <= {"negative", "neutral", "positive"}
    if task == "multi_label":
        assert all(set(answer["label_names"]) <= set(demo.COMPLAINED) for answer in answered)


def assert_shown(task: str, pixels: np.ndarray, report: dict) -> None:
    """evaluate's picture (eval-test.png, its pixels) shows what its report (eval-test.json) says:
    single_label, each count of the confusion matrix as its cells' colour; multi_label, each
    metric's tallest bar as tall as its largest value on the axis from 0 to 1.05 (within 3
    pixels); regression, the points from the smallest true value to the largest across and
    from the smallest prediction to the largest up, on the axes both spanning the line
    predicted = true from the least of them to the most, with matplotlib's margins (within 4
    pixels: a point's radius and a blended edge)."""
    if task == "single_label":
        assert_confusion_shown(pixels, report["confusion_matrix"])
    elif task == "multi_label":
        left, top, right, bottom = frame(pixels)
        for colour, metric in zip(("C0", "C1", "C2"), ("precision", "recall", "f1"), strict=True):
            tallest = max(row[metric] for row in report["per_label"]) / 1.05 * (bottom - top)
            bars = bar_heights(pixels, colour)
            assert len(bars) <= len(report["per_label"]) and max(bars, default=0) == pytest.approx(tallest, abs=3), \
                (metric, bars, tallest)
    else:
        import matplotlib

        truth, predicted = report["truth"], report["predicted"]
        low, high = min(truth["min"], predicted["min"]), max(truth["max"], predicted["max"])
        (left, top, right, bottom), (xmargin, ymargin) = frame(pixels), (matplotlib.rcParams["axes.xmargin"],
                                                                         matplotlib.rcParams["axes.ymargin"])

        def across(value: float) -> float:
            return left + (value - low + xmargin * (high - low)) / ((1 + 2 * xmargin) * (high - low)) * (right - left)

        def up(value: float) -> float:
            return bottom - (value - low + ymargin * (high - low)) / ((1 + 2 * ymargin) * (high - low)) * (bottom - top)

        expected = (across(truth["min"]), up(predicted["max"]), across(truth["max"]), up(predicted["min"]))
        assert scatter_box(pixels) == pytest.approx(expected, abs=4), (scatter_box(pixels), expected)


def recomputed(task: str, rows: list[dict]) -> dict[str, float]:
    """The task's metrics from evaluate's rows file, by scipy and scikit-learn."""
    if task == "regression":
        predicted, truth = (np.array([float(row[column]) for row in rows]) for column in ("value", "true"))
        return {"mse": metrics.mean_squared_error(truth, predicted),
                "mae": metrics.mean_absolute_error(truth, predicted),
                "pearson": float(stats.pearsonr(predicted, truth).statistic),
                "spearman": float(stats.spearmanr(predicted, truth).statistic)}
    if task == "single_label":
        truth, predicted = [row["true"] for row in rows], [row["label_name"] for row in rows]
        return {"accuracy": metrics.accuracy_score(truth, predicted),
                "f1_macro": metrics.f1_score(truth, predicted, average="macro")}
    truth, predicted = ([set(filter(None, row[column].split("|"))) for row in rows]
                        for column in ("true", "label_names"))
    # The labels in the truth or the predictions, as macro F1 averages over them (single_label's too).
    binarizer = MultiLabelBinarizer(classes=sorted(set().union(*truth, *predicted)))
    truth, predicted = binarizer.fit_transform(truth), binarizer.transform(predicted)
    return {"subset_accuracy": metrics.accuracy_score(truth, predicted),
            "f1_micro": metrics.f1_score(truth, predicted, average="micro"),
            "f1_macro": metrics.f1_score(truth, predicted, average="macro")}
