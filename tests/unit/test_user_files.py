"""Data files as users have them (trainer/data/sources.py, through data.load as training and `check`
load them): GLUE's TSV files, `;`-separated CSV, label names that differ by case or spaces and
placeholder labels, every bad row named at once by its line in the file, or dropped and
counted, and a broken JSON line named."""

from __future__ import annotations

import json
import re

import pytest

from trainer.cli import run_config
from trainer.data import reading
from trainer.errors import ConfigError, DataError
from trainer.runtime.environment import DistEnv

WORDS = ["the food was great", "rude staff", "it was fine", "slow but tasty", "never again", "lovely place"]


def load(tmp_path, path, *overrides: str):
    cfg = run_config.load(None, ["model.name=org/model", f"data.path={path}", "train.max_steps=1",
                             f"output_dir={tmp_path / 'run'}", *overrides])
    return reading.load(cfg, DistEnv())


def glue_sst2(path, n: int = 60) -> list[str]:
    """SST-2's train.tsv: `sentence<TAB>label`, unquoted, texts with unpaired quote marks (some
    at the start, where a CSV reader takes one for quoting). Returns the sentences."""
    sentences = [('"' if i % 7 == 0 else "") + f"{WORDS[i % 6]} \"{i} 's tale " for i in range(n)]
    path.write_text("sentence\tlabel\n" + "".join(f"{text}\t{i % 2}\n" for i, text in enumerate(sentences)))
    return sentences


def sentences(splits) -> list[str]:
    return sorted(list(splits.train["sentence"]) + list(splits.eval["sentence"]))


def test_glues_tsv_files_read_as_glue_writes_them(tmp_path):
    written = glue_sst2(tmp_path / "sst2.tsv")
    splits = load(tmp_path, tmp_path / "sst2.tsv", "data.text_field=sentence")
    assert sentences(splits) == sorted(written)  # a quote mark does not join lines
    assert splits.labels.names == ("LABEL_0", "LABEL_1")
    # MRPC: a pair of texts in columns with spaces in their names, in a .txt named by its separator.
    mrpc = tmp_path / "msr_paraphrase_train.txt"
    mrpc.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n" + "".join(
        f"{i % 2}\t{i}\t{i + 1}\t{WORDS[i % 6]} \"quoted\t{WORDS[(i + 1) % 6]}\n" for i in range(40)))
    pairs = ["data.text_field='#1 String'", "data.text_pair_field='#2 String'", "data.label_field=Quality"]
    with pytest.raises(ConfigError, match=r"^data.csv_delimiter: .*msr_paraphrase_train.txt is a .txt file: name "):
        load(tmp_path, mrpc, *pairs)
    splits = load(tmp_path, mrpc, *pairs, "data.csv_delimiter=tab")
    assert len(splits.train) + len(splits.eval) == 40 and splits.labels.num_labels == 2


def test_a_folder_of_tsv_files_gives_its_splits_read_as_tsv(tmp_path):
    folder = tmp_path / "glue"
    folder.mkdir()
    written = glue_sst2(folder / "train.tsv", 40) + glue_sst2(folder / "test.tsv", 10)
    splits = load(tmp_path, folder, "data.text_field=sentence")
    assert (len(splits.train), len(splits.eval), splits.held_out) == (40, 10, None)
    assert sentences(splits) == sorted(written)


def test_a_semicolon_separated_csv_is_named_as_such_and_read_with_the_key(tmp_path):
    """A European CSV: `;` between columns, and a comma inside a text, which splits a line
    into more fields than the header's: pandas' error alone says "Expected 1 fields"."""
    path = tmp_path / "reviews.csv"
    path.write_text("text;label\n" + "".join(f"{WORDS[i % 6]}{', really' if i == 3 else ''};{i % 2}\n"
                                             for i in range(30)))
    with pytest.raises(DataError, match=r"looks ';'-separated .*: set data.csv_delimiter=\";\"$"):
        load(tmp_path, path)
    path.write_text("text;label\n" + "".join(f"{WORDS[i % 6]};{i % 2}\n" for i in range(30)))  # no comma at all
    with pytest.raises(DataError, match=r"^data.text_field: column 'text' not in .*\(columns: text;label\); its "
                                        r"first line looks ';'-separated"):
        load(tmp_path, path)
    assert len(load(tmp_path, path, 'data.csv_delimiter=";"').train) == 27


def mixed_case_labels(path):
    """The issue's file: `positive` and `negative`, and some of each written ` Positive`; and
    `?` for no label (pandas reads `n/a`, `NA` and `null` as missing already)."""
    rows = [(WORDS[i % 6] + f" {i}", name) for i, name in
            enumerate(["positive"] * 40 + ["negative"] * 40 + [" Positive"] * 3 + [" Negative"] * 2 + ["?"] * 2)]
    path.write_text("text,label\n" + "".join(f"{text},{label}\n" for text, label in rows))
    return path


def test_labels_that_differ_by_case_or_spaces_are_warned_about_and_merged_by_a_key(tmp_path):
    path = mixed_case_labels(tmp_path / "reviews.csv")
    splits = load(tmp_path, path)
    assert splits.labels.num_labels == 5  # as the file says, but not silently:
    assert splits.warnings[:2] == [
        f"label names ' {name}', '{name.lower()}' differ only by case or spaces, and train as 2 classes: set "
        "data.normalize_labels=true to make them one" for name in ("Negative", "Positive")]
    assert re.fullmatch(r"label name '\?' \(\d train rows\) looks like a placeholder for no label, and trains as "
                        r"a class: if it means no label, set data.label_map='\{\"\?\": null\}' with "
                        r"data.drop_invalid_rows=true, or fix the file", splits.warnings[2]), splits.warnings
    merged = load(tmp_path, path, "data.normalize_labels=true")
    assert merged.labels.names == ("?", "negative", "positive")
    # The placeholder mapped to no label: refused as rows without a label, or dropped and counted.
    with pytest.raises(DataError, match=r"2 rows cannot train: 2 with no label in column 'label' \(lines 87, 88\)"):
        load(tmp_path, path, "data.normalize_labels=true", 'data.label_map={"?": null}')
    clean = load(tmp_path, path, "data.normalize_labels=true", 'data.label_map={"?": null}',
                 "data.drop_invalid_rows=true")
    assert clean.labels.names == ("negative", "positive") and not clean.warnings
    assert clean.dropped == {"train": {"no label in column 'label'": 2}}
    assert len(clean.train) + len(clean.eval) == 85


def test_every_bad_row_is_named_at_once_by_its_line_in_the_file(tmp_path):
    """2 empty texts and 2 missing labels, after a quoted text with a newline: one error names
    both kinds, their counts and the lines an editor shows them on."""
    rows = [(f"{WORDS[i % 6]} {i}", ["negative", "positive"][i % 2]) for i in range(40)]
    rows[2] = ("a review\nover two lines", "positive")
    rows[10], rows[25] = ("", "negative"), ("   ", "positive")
    rows[28], rows[31] = (rows[28][0], ""), (rows[31][0], "")
    path = tmp_path / "reviews.csv"
    path.write_text("text,label\n" + "".join(f"\"{text}\",{label}\n" for text, label in rows))
    lines = path.read_text().splitlines()

    def line_of(row: int) -> int:  # the header, then the quoted newline of row 2
        number = row + 2 + (row > 2)
        assert lines[number - 1].startswith(f'"{rows[row][0]}'), (row, lines[number - 1])
        return number

    with pytest.raises(DataError) as refused:
        load(tmp_path, path)
    assert str(refused.value) == (
        f"data.path: {path} (data.train_split 'train'): 4 rows cannot train: 2 with no text in column 'text' (lines "
        f"{line_of(10)}, {line_of(25)}); 2 with no label in column 'label' (lines {line_of(28)}, {line_of(31)}); fix "
        "them, or set data.drop_invalid_rows=true to drop such rows")
    dropped = load(tmp_path, path, "data.drop_invalid_rows=true")
    assert dropped.dropped == {"train": {"no text in column 'text'": 2, "no label in column 'label'": 2}}
    assert len(dropped.train) + len(dropped.eval) == 36
    assert "" not in list(dropped.train["text"]) + list(dropped.eval["text"])


def test_bad_rows_of_json_lines_and_of_a_validation_split_are_named_too(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [{"text": f"{WORDS[i % 6]} {i}", "label": i % 3} for i in range(30)]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    bad = rows[:10]
    bad[4], bad[7] = {"text": None, "label": 1}, {"text": "fine", "label": None}
    (folder / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in bad))
    with pytest.raises(DataError, match=r"^data.path: .* \(data.eval_split 'test'\): 2 rows cannot train: 1 with no "
                                        r"text in column 'text' \(row 4\); 1 with no label in column 'label' "
                                        r"\(row 7\); fix"):
        load(tmp_path, folder)
    assert load(tmp_path, folder, "data.drop_invalid_rows=true").dropped == {
        "test": {"no text in column 'text'": 1, "no label in column 'label'": 1}}


@pytest.mark.parametrize("cut, why", [
    ('{"text": "cut off in the mid', r"Unterminated string .*"),
    ('{"text": "oops", "label": ', r"Expecting value, column 27"),  # pyarrow reports this one, by byte
], ids=["inside-a-string", "after-a-key"])
def test_a_broken_json_line_is_named(tmp_path, cut, why):
    path = tmp_path / "reviews.jsonl"
    lines = [json.dumps({"text": f"{WORDS[i % 6]} {i}", "label": i % 2}) for i in range(30)]
    lines[16] = cut
    path.write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")  # and a blank line before it
    with pytest.raises(DataError, match=rf"^data.path: .*reviews.jsonl: line 18 is not valid JSON \({why}\): "
                                        rf"{re.escape(repr(cut.strip()))}$"):
        load(tmp_path, path)
