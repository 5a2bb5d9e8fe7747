"""`python -m trainer predict`: the trained model's answer for every row of a jsonl or csv file.

Each rank predicts a contiguous shard of the rows, and rank 0 writes them in input order, so
under any world size every row is predicted exactly once. Output rows: `row` (the input's
index, from 0), then the task's answer (trainer/tasks/):
- single_label: `label` (the class id), `label_name`, and the softmax in id order (jsonl:
  `probs`, a list; csv: columns prob_0, prob_1, ...);
- multi_label: `labels` and `label_names`, those whose sigmoid reaches data.threshold (csv:
  joined by `|`), and each label's sigmoid (`probs`, prob_0, ...);
- regression: `value`.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import cast

import torch

from trainer import files
from trainer.config.schema import Config, DataConfig
from trainer.data import loaders
from trainer.errors import ConfigError, DataError
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv
from trainer.tasks.base import Task
from trainer.train import build

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}


def file_format(key: str, path: Path) -> str:
    if path.suffix not in FORMATS:
        raise ConfigError(f"{key}: {path}: expected a .jsonl or .csv file")
    return FORMATS[path.suffix]


def read_rows(path: Path, data_cfg: DataConfig) -> list[dict[str, str]]:
    """The text fields of every row (data.text_field, and data.text_pair_field if set). A
    row that is not valid, or lacks a text, is an error naming the file and the row (its
    line, from 1; a csv's header is line 1)."""
    fields = [f for f in (data_cfg.text_field, data_cfg.text_pair_field) if f is not None]
    kind = file_format("input", path)
    if not path.is_file():
        raise ConfigError(f"input: {path}: no such file")
    rows = []
    try:
        with path.open(newline="" if kind == "csv" else None, encoding="utf-8") as f:
            if kind == "jsonl":
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        rows.append(_fields(path, line_no, _json_object(path, line_no, line), fields))
            else:
                reader = csv.DictReader(f)
                rows += [_fields(path, reader.line_num, record, fields) for record in reader]
    except UnicodeDecodeError as e:
        raise DataError(f"input: {path}: not UTF-8 text: {e.reason} at byte {e.start}") from None
    except csv.Error as e:
        raise DataError(f"input: {path}: invalid csv: {e}") from None
    if not rows:
        raise DataError(f"input: {path}: no rows")
    return rows


def _json_object(path: Path, line_no: int, line: str) -> dict:
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise DataError(f"input: {path}: row {line_no}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"input: {path}: row {line_no}: expected a JSON object, got {type(record).__name__}")
    return record


def _fields(path: Path, line_no: int, record: dict, fields: list[str]) -> dict[str, str]:
    for name in fields:
        if not isinstance(record.get(name), str):
            what = "is missing" if record.get(name) is None else f"is not text: {record[name]!r}"
            raise DataError(f"input: {path}: row {line_no}: field {name!r} {what}")
    return {name: record[name] for name in fields}


@torch.no_grad()
def run(cfg: Config, dist_env: DistEnv, device: torch.device, folder: Path, rows: list[dict[str, str]],
        output: Path) -> None:
    trained = build.trained(cfg, dist_env, device, folder)
    start = len(rows) * dist_env.rank // dist_env.world_size
    end = len(rows) * (dist_env.rank + 1) // dist_env.world_size
    answers = _predictions(cfg, trained, rows[start:end], device)
    shards = distributed.gather_to_rank_zero(dist_env, answers)

    def write_all() -> None:
        assert shards is not None, "rank_zero_does runs this on rank 0, which gathered the shards"
        write(output, [answer for shard in shards for answer in shard], trained.task)

    distributed.rank_zero_does(dist_env, f"output: {output}", write_all)


def _predictions(cfg: Config, trained: build.Trained, rows: list[dict[str, str]], device) -> list[dict]:
    """Each row's answer (the task's), in the rows' order; batched longest first (little padding)."""
    if not rows:  # a shard of a file with fewer rows than ranks
        return []
    text, pair = cfg.data.text_field, cfg.data.text_pair_field
    encoded = trained.tokenizer([r[text] for r in rows], [r[pair] for r in rows] if pair else None,
                                truncation=True, max_length=cfg.data.max_length)
    features = [{k: encoded[k][i] for k in encoded} for i in range(len(rows))]
    order = sorted(range(len(rows)), key=lambda i: -len(features[i]["input_ids"]))
    collate = loaders.collate(cfg, trained.tokenizer, device)
    answers: list[dict | None] = [None] * len(rows)
    size = cfg.train.eval_batch_size
    for begin in range(0, len(order), size):
        indices = order[begin:begin + size]
        batch = {k: v.to(device) for k, v in collate([features[i] for i in indices]).items()}
        for i, answer in zip(indices, trained.task.predictions(trained.logits(**batch).float().cpu()), strict=True):
            answers[i] = answer
    return cast("list[dict]", answers)  # every slot is filled: `order` is a permutation of the rows


def write(path: Path, answers: list[dict], task: Task) -> None:
    """One row per answer, `row` first, then the task's fields; written under a temporary
    name, then published (trainer/files.py): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        if file_format("output", path) == "jsonl":
            for row, answer in enumerate(answers):
                f.write(json.dumps({"row": row, **answer}) + "\n")
        else:
            writer = csv.writer(f)
            writer.writerow(["row", *task.csv_header()])
            writer.writerows([row, *task.csv_row(answer)] for row, answer in enumerate(answers))
    files.rename_into_place(tmp, path)
