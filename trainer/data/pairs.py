"""data.problem_type=pairwise's rows: preference pairs, read, checked and tokenized.

A row holds a chosen answer (data.chosen_field) and a rejected one (data.rejected_field),
after an optional prompt (data.prompt_field, else a `prompt` column if the split has one)
and with an optional margin (data.margin_field, else a `margin` column, else 0). Each text
is plain text or a conversation, a list of {role, content} messages:
- plain: the prompt and the answer are tokenized as a text pair, the tokenizer's own way of
  joining two texts (BERT: [CLS] prompt [SEP] answer [SEP]); no prompt, the answer alone;
- a conversation (either side, or the prompt): the prompt's messages (a plain prompt is one
  user message) then the answer's (a plain answer is one assistant message), rendered by
  the tokenizer's chat template, then tokenized as the template wrote it.

What cannot train is found before any weights load, by kind and row, and refused or (with
data.drop_invalid_rows) dropped and counted, as trainer/data/sources.py does for every task:
an answer with no text, a margin that is no number, and a pair whose two sides are the same,
as written or once truncated to data.max_length (its loss would sit at ln 2 with no
gradient: trainer/data/encoding.py's `identical_pairs`, which needs the tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.config.schema import DataConfig
from trainer.data import arrow
from trainer.errors import DataError

PROMPT, MARGIN = "prompt", "margin"
"""The columns read as the prompt and the margin where data.prompt_field and
data.margin_field are null, if the split has them."""

TEXT, CONVERSATION, NOTHING = "text", "conversation", "nothing"
"""What a column of a pair holds: strings, lists of {role, content} messages, only nulls."""

REJECTED = "rejected_"
"""The prefix of the rejected side's tokenized columns (rejected_input_ids, ...)."""


@dataclass(frozen=True)
class Columns:
    """The columns a split's pairs are read from."""

    chosen: str
    rejected: str
    prompt: str | None
    margin: str | None

    @classmethod
    def of(cls, data_cfg: DataConfig, names: list[str]) -> Columns:
        """data.*_field's columns, the prompt and the margin found by name where unset."""
        prompt = data_cfg.prompt_field if data_cfg.prompt_field is not None else (PROMPT if PROMPT in names else None)
        margin = data_cfg.margin_field if data_cfg.margin_field is not None else (MARGIN if MARGIN in names else None)
        return cls(str(data_cfg.chosen_field), str(data_cfg.rejected_field), prompt, margin)

    def texts(self) -> list[tuple[str, str]]:
        """(key, column) of each column holding a text or a conversation."""
        keyed = [("data.chosen_field", self.chosen), ("data.rejected_field", self.rejected)]
        return keyed + ([] if self.prompt is None else [("data.prompt_field", self.prompt)])


def _kind(arrow_type) -> str:
    import pyarrow as pa

    if pa.types.is_null(arrow_type):
        return NOTHING
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return TEXT
    if (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and (
            pa.types.is_struct(arrow_type.value_type) or pa.types.is_null(arrow_type.value_type)
            or _is_json(arrow_type.value_type)):
        return CONVERSATION
    return str(arrow_type)


def _is_json(arrow_type) -> bool:
    """`datasets`' JSON values: how it stores a list's objects whose keys differ from row to row."""
    return getattr(arrow_type, "extension_name", None) == "arrow.json"


def check_columns(ds, data_cfg: DataConfig, split_key: str) -> None:
    """The pair's columns exist, each text column holds text or conversations of {role,
    content} messages (each message both, as text), and the margin numbers: else one line
    naming the key, the column, the split and the first row that is not."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = Columns.of(data_cfg, ds.column_names)
    named = [(key, getattr(data_cfg, key.removeprefix("data."))) for key in
             ("data.chosen_field", "data.rejected_field", "data.prompt_field", "data.margin_field")]
    for key, column in named:
        if column is not None and column not in ds.column_names:
            raise DataError(f"{key}: column {column!r} not in {split_key} (columns: {', '.join(ds.column_names)})")
    for key, column in columns.texts():
        values = arrow.column(ds, column)
        kind = _kind(values.type)
        if kind == CONVERSATION and _is_json(values.type.value_type):
            _check_decoded_messages(ds[column], key, column, split_key)
        elif kind == CONVERSATION and not pa.types.is_null(values.type.value_type):
            _check_messages(values, key, column, split_key)
        elif kind not in (TEXT, CONVERSATION, NOTHING):
            row = arrow.first_true(pc.invert(pc.is_null(values)))
            shown = ds[row][column] if row is not None else None
            raise DataError(f"{key}: column {column!r} in {split_key} holds {kind}, not text or a conversation (a "
                            f"list of {{role, content}} messages): row {row} is {json.dumps(shown)[:80]}")
    if columns.margin is not None:
        values = arrow.column(ds, columns.margin)
        if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_null(values.type)):
            raise DataError(f"data.margin_field: column {columns.margin!r} in {split_key} holds {values.type}, not "
                            "numbers: a pair's margin is a number")


def _check_messages(values, key: str, column: str, split_key: str) -> None:
    """Each message of a conversation column has a role and a content, both text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    messages = pc.list_flatten(values)
    rows = pc.list_parent_indices(values).to_numpy()
    fields = {values.type.value_type.field(i).name: i for i in range(values.type.value_type.num_fields)}
    advice = "each message is {\"role\": ..., \"content\": ...}, both text"
    for name in ("role", "content"):
        if name not in fields:
            raise DataError(f"{key}: column {column!r} in {split_key} holds messages without a {name!r} "
                            f"(row {rows[0] if len(rows) else 0}): {advice}")
        field = pc.struct_field(messages, [fields[name]])
        if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type) or
                pa.types.is_null(field.type)):
            raise DataError(f"{key}: column {column!r} in {split_key} holds a {name} of type {field.type} (row "
                            f"{rows[0]}): {advice}")
        missing = arrow.first_true(pc.or_(pc.is_null(field), pc.is_null(messages)))
        if missing is not None:
            raise DataError(f"{key}: column {column!r} in {split_key} has a message with no {name} in row "
                            f"{rows[missing]}: {advice}")


def _check_decoded_messages(conversations: list, key: str, column: str, split_key: str) -> None:
    """`_check_messages` for messages `datasets` stores as JSON (their keys differ), decoded."""
    for row, conversation in enumerate(conversations):
        for message in conversation or []:
            for name in ("role", "content"):
                value = message.get(name) if isinstance(message, dict) else None
                if not isinstance(value, str):
                    what = f"no {name}" if value is None else f"a {name} of type {type(value).__name__}"
                    raise DataError(f"{key}: column {column!r} in {split_key} has a message with {what} in row "
                                    f"{row}: each message is {{\"role\": ..., \"content\": ...}}, both text")


def invalid_rows(ds, data_cfg: DataConfig) -> dict[str, np.ndarray]:
    """Each kind of pair that cannot train, and its rows: a side with no text (null, blank or
    an empty conversation), a margin that is null or NaN, the two sides the same."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns, found = Columns.of(data_cfg, ds.column_names), {}
    for _, column in columns.texts()[:2]:
        values = arrow.column(ds, column)
        if _kind(values.type) == TEXT:
            empty = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(values), ""), True)
        elif _kind(values.type) == CONVERSATION:
            empty = pc.fill_null(pc.equal(pc.list_value_length(values), 0), True)
        else:
            empty = pa.array(np.ones(len(values), dtype=bool))
        rows = np.flatnonzero(empty.to_numpy(zero_copy_only=False))
        if len(rows):
            found[f"no text in column {column!r}"] = rows
    if columns.margin is not None:
        values = arrow.column(ds, columns.margin)
        missing = pc.is_null(values)
        if pa.types.is_floating(values.type):
            missing = pc.or_(missing, pc.fill_null(pc.is_nan(values), False))
        rows = np.flatnonzero(missing.to_numpy(zero_copy_only=False))
        if len(rows):
            found[f"no margin in column {columns.margin!r}"] = rows
    chosen, rejected = (arrow.column(ds, column).to_pylist() for column in (columns.chosen, columns.rejected))
    same = np.flatnonzero([c is not None and c == r for c, r in zip(chosen, rejected, strict=True)])
    if len(same):
        found[f"the same text in {columns.chosen!r} and {columns.rejected!r}"] = same
    return found


def to_messages(value: Any, role: str) -> list[dict]:
    """A text or a conversation as a list of messages (a text: one message of `role`)."""
    if value is None or value == "":
        return []
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def tokenize(batch: dict[str, list], tokenizer, columns: Columns, max_length: int, side: str) -> dict[str, list]:
    """A batch of pairs as tokens: the chosen side's columns as the model takes them
    (input_ids, token_type_ids where the tokenizer makes them), the rejected side's the same
    with REJECTED before each name. Truncated to `max_length` (data.max_length) at `side`
    (data.truncation_side)."""
    tokenizer.truncation_side = side
    prompts = batch[columns.prompt] if columns.prompt is not None else [None] * len(batch[columns.chosen])
    tokenized: dict[str, list] = {}
    for prefix, column in (("", columns.chosen), (REJECTED, columns.rejected)):
        for name, values in _tokenize_side(prompts, batch[column], tokenizer, max_length).items():
            tokenized[prefix + name] = values
    return tokenized


def _tokenize_side(prompts: list, answers: list, tokenizer, max_length: int) -> dict[str, list]:
    """One side of each pair after its prompt; rows tokenized in three batches by how they
    join (a conversation, a text pair, a text alone), then put back in order."""
    options = {"truncation": True, "max_length": max_length}
    groups: dict[str, list[int]] = {"conversation": [], "pair": [], "alone": []}
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        conversation = not isinstance(answer, str) or not (prompt is None or isinstance(prompt, str))
        groups["conversation" if conversation else "pair" if prompt else "alone"].append(i)
    out: list[dict | None] = [None] * len(answers)
    for how, rows in groups.items():
        if not rows:
            continue
        if how == "conversation":
            texts = [render(tokenizer, to_messages(prompts[i], "user") + to_messages(answers[i], "assistant"))
                     for i in rows]
            encoded = tokenizer(texts, add_special_tokens=False, **options)
        elif how == "pair":
            encoded = tokenizer([prompts[i] for i in rows], [answers[i] for i in rows], **options)
        else:
            encoded = tokenizer([answers[i] for i in rows], **options)
        keep = [name for name in ("input_ids", "token_type_ids") if name in encoded]
        for n, i in enumerate(rows):
            out[i] = {name: encoded[name][n] for name in keep}
    names = [name for name in ("input_ids", "token_type_ids") if all(name in row for row in out if row is not None)]
    return {name: [row[name] for row in out if row is not None] for name in names}


def render(tokenizer, messages: list[dict], key: str = "data.chosen_field") -> str:
    """A conversation as the tokenizer's chat template writes it, or one line saying there is
    none, naming `key`, the column that holds it."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{key}: the texts hold conversations, and the tokenizer of model.name "
                        f"({getattr(tokenizer, 'name_or_path', '?')}) has no chat template to render them: use a "
                        "model whose tokenizer has one, or give the texts as plain strings")
    return tokenizer.apply_chat_template(messages, tokenize=False)
