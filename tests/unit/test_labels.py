"""Labels as users store them (trainer/data/labels.py, through reading.load as training and `check`
load them): names, ids, ClassLabel, lists, numbers; a validation split held out of train; class
weights; and each mistake as one line naming the column, the split, the row and the value."""

from __future__ import annotations

import csv
import itertools
import json
import re

import numpy as np
import pytest
from support.models import LABEL_NAMES

from trainer.cli import run_config
from trainer.data import labels as labels_module
from trainer.data import reading
from trainer.data.batch_plan import BatchPlan
from trainer.errors import ConfigError, DataError
from trainer.runtime.environment import DistEnv
from trainer.tasks.registry import task_class

ONE_BATCH = BatchPlan(16, 16, 1)
TEXTS = ["the food was great", "rude staff", "it was fine", "slow but tasty", "never again", "lovely place"]


def write_csv(path, rows: list[dict]):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(tmp_path, path, *overrides: str):
    cfg = run_config.load(None, ["model.name=org/model", f"data.path={path}", "train.max_steps=1",
                             f"output_dir={tmp_path / 'run'}", *overrides])
    return reading.load(cfg, DistEnv())


def sentiment(n: int, names=("negative", "neutral", "positive")) -> list[dict]:
    return [{"text": TEXTS[i % len(TEXTS)] + f" {i}", "label": names[i % len(names)]} for i in range(n)]


def test_a_csv_of_label_names_without_validation_trains_on_ids_with_a_stratified_held_out_split(tmp_path):
    rows = sentiment(90) + [{"text": f"great {i}", "label": "positive"} for i in range(30)]  # 30/30/60
    splits = load(tmp_path, write_csv(tmp_path / "reviews.csv", rows))
    labels = splits.labels
    assert labels.names == ("negative", "neutral", "positive") and labels.source == "the train split"
    assert (labels.stored_as, labels.num_labels) == ("names", 3)
    assert splits.held_out == "10% of data.train_split, stratified by label, seed 42"
    assert (len(splits.train), len(splits.eval)) == (108, 12)
    held_out = [row["label"] for row in splits.eval]
    assert sorted(held_out.count(name) for name in labels.names) == [3, 3, 6]  # as train: 1 : 1 : 2
    assert labels.counts == (27, 27, 54) and labels.rows == 108
    again = load(tmp_path, tmp_path / "reviews.csv")
    assert again.eval["text"] == splits.eval["text"]  # every rank, every restart: the same rows
    other = load(tmp_path, tmp_path / "reviews.csv", "data.eval_fraction=0.25")
    assert len(other.eval) == 30


def test_label_names_given_fix_the_ids_and_refuse_any_other_name(tmp_path):
    path = write_csv(tmp_path / "reviews.csv", sentiment(30))
    splits = load(tmp_path, path, "data.label_names=[positive,neutral,negative]")
    assert splits.labels.names == ("positive", "neutral", "negative") and splits.labels.source == "data.label_names"
    assert task_class("single_label").encode(["negative", "positive"], "names", splits.labels.names) == [2, 0]
    with pytest.raises(DataError, match=r"^data.label_field: column 'label' in data.train_split has 'neutral' in "
                                        r"row 1, which is not one of the labels from data.label_names "
                                        r"\(positive, negative\)$"):
        load(tmp_path, path, "data.label_names=[positive,negative]")
    with pytest.raises(DataError, match=r"^data.num_labels: 2, but the labels are 3 \(negative, neutral, positive, "
                                        r"from the train split\)$"):
        load(tmp_path, path, "data.num_labels=2")


def test_a_validation_label_that_train_never_saw_names_the_value_the_split_and_the_row(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", sentiment(12, ("negative", "positive")))
    write_jsonl(folder / "test.jsonl", [*sentiment(4, ("negative", "positive")), {"text": "meh", "label": "mixed"}])
    with pytest.raises(DataError, match=r"^data.label_field: column 'label' in data.eval_split has 'mixed' in row 4, "
                                        r"which is not one of the labels from the train split "
                                        r"\(negative, positive\)$"):
        load(tmp_path, folder)


def test_a_validation_split_that_is_not_one_is_refused_where_the_data_has_others(tmp_path, caplog):
    """Holding out is for data without a validation split: a mistyped name must not
    silently train on 90% of train and select the model on rows of its own."""
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "validation"):
        write_jsonl(folder / f"{split}.jsonl", sentiment(20))
    with pytest.raises(ConfigError, match=r"^data.eval_split: 'valid' is not a split of .*data \(its splits: "
                                          r"train, validation\); name one of them, or leave data.eval_split unset"):
        load(tmp_path, folder, "data.eval_split=valid")
    with caplog.at_level("WARNING", logger="trainer.data"):
        assert load(tmp_path, folder).held_out.startswith("10% of data.train_split")  # the default, test: none here
    assert "data.eval_split=validation would validate on that split" in caplog.text
    assert load(tmp_path, folder, "data.eval_split=validation").held_out is None
    single = write_csv(tmp_path / "reviews.csv", sentiment(20))  # one split: any name holds out
    assert load(tmp_path, single, "data.eval_split=validation").held_out.startswith("10% of data.train_split")


def test_class_ids_are_read_and_their_count_inferred(tmp_path, labeled_reviews):
    rows = [{"text": TEXTS[i % 6], "label": i % 4} for i in range(40)]
    splits = load(tmp_path, write_jsonl(tmp_path / "ids.jsonl", rows))
    assert splits.labels.names == ("LABEL_0", "LABEL_1", "LABEL_2", "LABEL_3") and splits.labels.stored_as == "ids"
    assert splits.labels.source == "the train split's ids"
    with pytest.raises(DataError, match=r"^data.num_labels: data.train_split has labels in \[0, 3\], outside "
                                        r"\[0, 2\] \(row 3\): the labels from data.num_labels are 3$"):
        load(tmp_path, tmp_path / "ids.jsonl", "data.num_labels=3")
    named = load(tmp_path, labeled_reviews)  # parquet written by `datasets` with a ClassLabel column
    assert named.labels.names == tuple(LABEL_NAMES) and named.labels.source == "ClassLabel"


def test_ids_written_as_floats_are_ids_and_other_numbers_are_named(tmp_path):
    rows = [{"text": TEXTS[i % 6], "label": float(i % 4)} for i in range(40)]  # pandas' ids beside a gap: 1.0
    labels = load(tmp_path, write_jsonl(tmp_path / "floats.jsonl", rows)).labels
    assert (labels.names, labels.stored_as, labels.counts) == (("LABEL_0", "LABEL_1", "LABEL_2", "LABEL_3"), "ids",
                                                               (9, 9, 9, 9))
    for value in (2.5, 1e30, float("inf")):  # json writes inf as Infinity, which Arrow reads
        bad = write_jsonl(tmp_path / "bad.jsonl", [*rows[:3], {"text": "x", "label": value}, *rows[4:]])
        with pytest.raises(DataError, match=r"^data.label_field: column 'label' in data.train_split holds numbers "
                                            rf"that are not class ids \({re.escape(repr(value))} in row 3\): "
                                            r"single_label needs"):
            load(tmp_path, bad)


def test_label_names_may_rename_a_classlabel_but_not_reorder_it(tmp_path, labeled_reviews):
    assert load(tmp_path, labeled_reviews, "data.label_names=[a,b,c,d,e]").labels.names == tuple("abcde")
    reordered = [LABEL_NAMES[1], LABEL_NAMES[0], *LABEL_NAMES[2:]]
    with pytest.raises(DataError, match=rf"^data.label_names: '{LABEL_NAMES[1]}' is id 0 there and id 1 in column "
                                        r"'label''s ClassLabel .*the names follow ClassLabel's order"):
        load(tmp_path, labeled_reviews, f"data.label_names=[{','.join(reordered)}]")


def test_multi_label_reads_lists_of_names_into_multi_hot_rows(tmp_path):
    tags = [["food"], ["service", "price"], [], ["food", "price"]] * 5
    rows = [{"text": TEXTS[i % 6], "tags": tag} for i, tag in enumerate(tags)]
    splits = load(tmp_path, write_jsonl(tmp_path / "tags.jsonl", rows), "data.problem_type=multi_label",
                  "data.label_field=tags")
    labels = splits.labels
    assert labels.names == ("food", "price", "service") and labels.problem_type == "multi_label"
    assert splits.held_out.startswith("10% of data.train_split, seeded")  # lists are not stratified
    assert task_class("multi_label").encode([["service", "price"], []], "names", labels.names) == [[0.0, 1.0, 1.0],
                                                                                                       [0.0, 0.0, 0.0]]
    with pytest.raises(DataError, match=r"column 'label' in data.train_split holds lists: for a set of classes per "
                                        r"row, set data.problem_type=multi_label"):
        load(tmp_path, write_jsonl(tmp_path / "lists.jsonl", [{"text": "a", "label": ["x"]}] * 4))
    with pytest.raises(DataError, match=r"column 'label' in data.train_split holds names, not lists"):
        load(tmp_path, write_csv(tmp_path / "flat.csv", sentiment(10)), "data.problem_type=multi_label")
    odd = [{"text": "a", "label": [{"name": "x"}]}] * 4
    with pytest.raises(DataError, match=r"^data.label_field: column 'label' in data.train_split holds lists of "
                                        r"struct<name: string>: multi_label reads each row's class names or ids, or "
                                        r"a multi-hot row \(a 0 or 1 per label\)$"):
        load(tmp_path, write_jsonl(tmp_path / "structs.jsonl", odd), "data.problem_type=multi_label")


def test_multi_label_counts_the_rows_holding_each_label(tmp_path):
    """A label listed twice in a row is one row holding it: balanced weights weigh rows."""
    tags = [["food", "food"], ["service", "price"], [], ["food", "price"]] * 5
    rows = [{"text": TEXTS[i % 6], "tags": tag} for i, tag in enumerate(tags)]
    labels = load(tmp_path, write_jsonl(tmp_path / "twice.jsonl", rows), "data.problem_type=multi_label",
                  "data.label_field=tags", "data.eval_split=train[:1]").labels
    assert (labels.names, labels.counts, labels.rows) == (("food", "price", "service"), (10, 10, 5), 20)


def test_multi_label_reads_multi_hot_rows_of_ints_or_floats(tmp_path):
    """A row of as many 0s and 1s as there are labels (HF Trainer's own format) is read as the
    row's labels, not as ids 0 and 1: [1, 0, 1] is labels 0 and 2."""
    hot = [[1, 0, 1], [0, 1, 0], [0, 0, 0], [1, 1, 0]] * 5
    rows = [{"text": TEXTS[i % 6], "label": row} for i, row in enumerate(hot)]
    splits = load(tmp_path, write_jsonl(tmp_path / "hot.jsonl", rows), "data.problem_type=multi_label",
                  "data.eval_split=train[:4]")
    labels = splits.labels
    assert (labels.names, labels.stored_as, labels.counts) == (("LABEL_0", "LABEL_1", "LABEL_2"), "multi-hot rows",
                                                               (10, 10, 5))
    assert task_class("multi_label").encode([[1, 0, 1]], labels.stored_as, labels.names) == [[1.0, 0.0, 1.0]]
    floats = [{"text": row["text"], "label": [float(v) for v in row["label"]]} for row in rows]
    named = load(tmp_path, write_jsonl(tmp_path / "floats.jsonl", floats), "data.problem_type=multi_label",
                 "data.label_names=[food,price,service]", "data.eval_split=train[:4]").labels
    assert (named.names, named.stored_as, named.counts) == (("food", "price", "service"), "multi-hot rows", (10, 10, 5))
    with pytest.raises(DataError, match=r"^data.label_field: column 'label' in data.train_split holds multi-hot rows "
                                        r"of 3 values, for the 4 labels from data.label_names \(a, b, c, d\)$"):
        load(tmp_path, tmp_path / "hot.jsonl", "data.problem_type=multi_label", "data.label_names=[a,b,c,d]")
    fractions = [{"text": "a", "label": [0.2, 0.8]}] * 4
    with pytest.raises(DataError, match=r"holds numbers that are not class ids \(0.2 in the list of row 0\): "
                                        r"multi_label reads each row's class names or ids, or a multi-hot row"):
        load(tmp_path, write_jsonl(tmp_path / "soft.jsonl", fractions), "data.problem_type=multi_label")


def test_multi_hot_rows_of_other_lengths_are_refused_not_read_as_ids(tmp_path):
    """One short row must not turn a multi-hot column into ids 0 and 1 (a 2-label task)."""
    hot = [[1, 0, 1], [0, 1, 0], [0, 0, 1], [1, 1]]
    rows = [{"text": TEXTS[i % 6], "label": row} for i, row in enumerate(hot * 5)]
    with pytest.raises(DataError, match=r"^data.label_field: column 'label' in data.train_split holds multi-hot rows "
                                        r"of 2 and 3 values \(row 3\): each row holds a 0 or 1 for every label$"):
        load(tmp_path, write_jsonl(tmp_path / "ragged.jsonl", rows), "data.problem_type=multi_label")


def test_multi_hot_validation_rows_where_train_holds_ids_are_refused(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": TEXTS[i % 6], "label": [i % 3]} for i in range(12)])
    write_jsonl(folder / "test.jsonl", [{"text": "a", "label": [0, 1, 1]}, {"text": "b", "label": [1, 0, 0]}])
    with pytest.raises(DataError, match=r"^data.label_field: column 'label' in data.eval_split holds multi-hot rows, "
                                        r"where the labels from the train split's ids are ids$"):
        load(tmp_path, folder, "data.problem_type=multi_label")


def test_regression_reads_numbers_and_refuses_what_is_not_one(tmp_path):
    rows = [{"text": TEXTS[i % 6], "label": i / 10} for i in range(30)]
    splits = load(tmp_path, write_jsonl(tmp_path / "scores.jsonl", rows), "data.problem_type=regression")
    assert (splits.labels.problem_type, splits.labels.num_labels, splits.labels.names) == ("regression", 1, ())
    assert task_class("regression").encode([1, 2.5], "numbers", ()) == [1.0, 2.5]
    with pytest.raises(DataError, match=r"holds numbers that are not class ids \(0.1 in row 1\): single_label needs "
                                        r"class ids \(integers\) or names \(strings\); for a number to predict, "
                                        r"set data.problem_type=regression"):
        load(tmp_path, tmp_path / "scores.jsonl")
    with pytest.raises(DataError, match=r"column 'label' in data.train_split holds names: "
                                        r"data.problem_type=regression needs numbers"):
        load(tmp_path, write_csv(tmp_path / "names.csv", sentiment(10)), "data.problem_type=regression")


def test_a_row_without_a_label_is_named(tmp_path):
    rows = sentiment(6)
    rows[4]["label"] = None
    with pytest.raises(DataError, match=r"^data.path: .*gap.jsonl \(data.train_split 'train'\): 1 row cannot train: 1 "
                                        r"with no label in column 'label' \(line 5\); fix them"):
        load(tmp_path, write_jsonl(tmp_path / "gap.jsonl", rows))


def test_balanced_class_weights_invert_each_class_frequency(tmp_path):
    rows = sentiment(30, ("a", "b")) + [{"text": f"more {i}", "label": "a"} for i in range(30)]  # a 45, b 15
    path = write_csv(tmp_path / "skewed.csv", rows)
    labels = load(tmp_path, path, "train.class_weights=balanced", "data.eval_fraction=0.2").labels
    assert labels.counts == (36, 12)
    assert labels.weights == pytest.approx((48 / (2 * 36), 48 / (2 * 12)))
    with pytest.raises(DataError, match=r"train.class_weights: balanced weighs each class by its train rows, and c "
                                        r"has none"):
        load(tmp_path, path, "train.class_weights=balanced", "data.label_names=[a,b,c]")
    assert load(tmp_path, path, "train.class_weights=[1,3]").labels.weights == (1.0, 3.0)


def test_missing_splits_and_columns_are_one_line(tmp_path):
    path = write_csv(tmp_path / "reviews.csv", sentiment(20))
    with pytest.raises(ConfigError, match=r"^data.train_split: 'training' is not a split of .*reviews.csv "
                                          r"\(its splits: train\)$"):
        load(tmp_path, path, "data.train_split=training")
    with pytest.raises(ConfigError, match=r"^data.test_split: 'test' is not a split"):
        load(tmp_path, path, "data.test_split=test")
    with pytest.raises(DataError, match=r"^data.label_field: column 'stars' not in data.train_split"):
        load(tmp_path, path, "data.label_field=stars")


def test_slicing_keeps_working(tmp_path):
    splits = load(tmp_path, write_csv(tmp_path / "reviews.csv", sentiment(40)), "data.train_split=train[:75%]",
                  "data.eval_split=train[75%:]")
    assert (len(splits.train), len(splits.eval), splits.held_out) == (30, 10, None)


def test_the_ledger_key_changes_with_the_label():
    import pyarrow as pa

    ids, numbers = pa.array([0, 2, 1]), pa.array([0.5, 1.5, 0.5], type=pa.float32())
    hot = pa.array([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], type=pa.list_(pa.float32()))
    assert labels_module.ledger_keys(ids).tolist() == [0, 2, 1]
    for column in (numbers, hot):
        keys = labels_module.ledger_keys(column)
        assert keys.dtype == np.int64 and keys[0] == keys[2] != keys[1]



def test_the_ledger_key_of_more_than_64_labels_changes_with_the_labels_beyond_the_first_64():
    """Above 64 labels a multi-hot row packs into several 64-bit words, folded into one key: a
    label beyond the first word (64, 65, the last: 129) must change it, alone or beside others,
    and equal rows must give equal keys. Every set of one or two labels of 130 gets a key of
    its own: a sum of the words times powers of an odd number gave {56} and {120} (each the top
    bit of its word) the same one, and 145 such pairs of 8,256."""
    import pyarrow as pa

    sets = [set(), {0}, {63}, {64}, {65}, {129}, {0, 64}, {0, 65}, {0, 129}, {64, 65}, {64, 129}, {65, 129},
            {0, 64, 65, 129}, set(range(64)), set(range(64)) | {64}, set(range(130)), set(range(129))]
    rows = sets + sets[::-1]  # each set twice, apart
    hot = pa.array([[float(i in row) for i in range(130)] for row in rows], type=pa.list_(pa.float32()))
    keys = labels_module.ledger_keys(hot)
    assert keys.dtype == np.int64 and len(set(keys[:len(sets)].tolist())) == len(sets)
    assert keys[:len(sets)].tolist() == keys[len(sets):][::-1].tolist()

    pairs = np.zeros((130 + 130 * 129 // 2, 130), dtype=np.float32)
    for row, chosen in enumerate([(i,) for i in range(130)] + list(itertools.combinations(range(130), 2))):
        pairs[row, list(chosen)] = 1
    keys = labels_module.ledger_keys(pa.FixedSizeListArray.from_arrays(pa.array(pairs.ravel()), 130))
    assert len(np.unique(keys)) == len(pairs)


def test_a_resume_whose_data_gives_other_labels_is_refused(tmp_path):
    """The names are fixed by the train split: a resumed run on data with a new class would
    give every class a new id. Refused before the model loads."""
    from trainer.checkpoint.resume import ResumePlan, labels_on_resume
    from trainer.errors import CheckpointError

    saved = load(tmp_path, write_csv(tmp_path / "a.csv", sentiment(30, ("negative", "positive")))).labels
    now = load(tmp_path, write_csv(tmp_path / "b.csv", sentiment(30))).labels
    plan = ResumePlan(ONE_BATCH, tmp_path, {"labels": saved.state_dict(), "step": 1})
    with pytest.raises(CheckpointError, match=r"^the labels changed from the checkpoint's to what this run's data and "
                                              r"config give: names: \(negative, positive\) -> \(negative, neutral, "
                                              r"positive\): resume with the data and labels the run was started on"):
        labels_on_resume(plan, now)


def test_a_resume_keeps_the_class_weights_computed_at_the_runs_start(tmp_path):
    """Balanced weights are computed once: a resume on fewer rows (checkpoint.allow_changes:
    data.max_train_samples) keeps the checkpoint's counts and weights, so its loss is the run's."""
    from trainer.checkpoint.resume import ResumePlan, labels_on_resume

    path = write_csv(tmp_path / "skewed.csv", sentiment(30, ("a", "b")) + sentiment(30, ("a",)))
    started = load(tmp_path, path, "train.class_weights=balanced").labels
    fewer = load(tmp_path, path, "train.class_weights=balanced", "data.max_train_samples=20").labels
    assert fewer.weights != started.weights
    plan = ResumePlan(ONE_BATCH, tmp_path, {"labels": started.state_dict(), "step": 1})
    assert labels_on_resume(plan, fewer) == started
    assert labels_on_resume(ResumePlan(ONE_BATCH), fewer) == fewer  # a fresh run: its own


def test_lists_of_classlabel_are_ids_whatever_their_values(tmp_path):
    """A Hub dataset's Sequence(ClassLabel) holds class ids: rows of two ids among 0 and 1 are
    two classes each, not multi-hot rows, with or without data.label_names renaming them."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.Sequence(datasets.ClassLabel(names=["food", "price", "staff"]))})
    rows = {"text": [TEXTS[i % 6] for i in range(20)], "label": [[0, 1], [1, 0]] * 10}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "tags.parquet")
    for renamed in ([], ["data.label_names=[meal,cost,staff]"]):
        labels = load(tmp_path, tmp_path / "tags.parquet", "data.problem_type=multi_label", *renamed).labels
        assert (labels.stored_as, labels.num_labels, labels.counts[2]) == ("ids", 3, 0)
