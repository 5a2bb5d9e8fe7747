"""A user's data files as they come: how each kind is read, what a parse error means in the
file's own terms, and the rows that cannot train, all named at once.

- `.csv`, `.tsv` (GLUE's SST-2, STS-B and MRPC files) and `.txt` with data.csv_delimiter;
  JSON lines and JSON; Parquet. A tab-separated file is read without quoting, as GLUE's
  files are written: their texts hold unpaired quote marks.
- A parse error names the line (a broken JSON line), or the likely cause (a `;`-separated
  CSV read as `,`-separated).
- `invalid_rows`: every row with no text or no label, by kind, found in Arrow; `drop_or_refuse`
  drops them (data.drop_invalid_rows) or refuses the split in one line that gives each kind's
  count and first lines in the file, so a user fixes them all in one pass.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np

from trainer.config.schema import DataConfig
from trainer.data import arrow, encoding, pairs
from trainer.data import labels as labels_module
from trainer.errors import ConfigError, DataError
from trainer.tasks.registry import task_class

log = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".txt": "csv", ".parquet": "parquet"}
"""The `datasets` builder of each local file kind."""
_DEFAULT_DELIMITERS = {".csv": ",", ".tsv": "\t"}
_LIKELY_DELIMITERS = {",": "','", ";": "';'", "\t": "tab", "|": "'|'"}
SHOWN = 5
"""The rows or lines an error names of each kind of problem."""


def delimiter(data_cfg: DataConfig, suffix: str) -> str | None:
    """The column separator of a delimited file: data.csv_delimiter, else the suffix's."""
    given = data_cfg.csv_delimiter
    if given is not None:
        return "\t" if given == "tab" else str(given)
    return _DEFAULT_DELIMITERS.get(suffix)


def csv_options(data_cfg: DataConfig, path: Path, suffix: str) -> dict:
    """The csv builder's options (pandas.read_csv's) for a file or folder of `suffix` files."""
    sep = delimiter(data_cfg, suffix)
    if sep is None:
        raise ConfigError(f"data.csv_delimiter: {path} is a {suffix} file: name its column separator "
                          "(data.csv_delimiter=tab, \",\", \";\" or \"|\")")
    # pandas' default quoting would join a TSV's lines from one unpaired quote mark to the next.
    return {"sep": sep, **({"quoting": csv.QUOTE_NONE} if sep == "\t" else {})}


def folder_suffix(path: Path) -> str | None:
    """The one delimited-text suffix of a folder's data files (.tsv or .txt), else None."""
    suffixes = {p.suffix for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS and
                not p.name.startswith(".")}
    return next(iter(suffixes)) if len(suffixes) == 1 and suffixes <= {".tsv", ".txt"} else None


def _first_line(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.readline()


def delimiter_hint(path: Path, used: str | None) -> str:
    """', it looks ;-separated: set ...' where the first line of `path` has more of another
    separator than of `used`; else ''."""
    if not path.is_file() or used is None:
        return ""
    header = _first_line(path)
    counts = {sep: header.count(sep) for sep in _LIKELY_DELIMITERS}
    likely = max(counts, key=lambda sep: counts[sep])
    if likely == used or counts[likely] == 0 or counts[likely] <= counts.get(used, 0):
        return ""
    name = _LIKELY_DELIMITERS[likely]
    setting = "tab" if likely == "\t" else f'"{likely}"'
    return (f"; its first line looks {name}-separated ({counts[likely]} of them, {counts.get(used, 0)} "
            f"{_LIKELY_DELIMITERS[used]}): set data.csv_delimiter={setting}")


def broken_json_line(path: Path) -> str | None:
    """'FILE: line N is not valid JSON (why): ...' of the first such line of a JSON-lines file
    (or of the folder's files); None where every line parses, or a file is one JSON document."""
    files = sorted(path.rglob("*.json*")) if path.is_dir() else [path] if path.is_file() else []
    for file in files:
        if file.suffix not in (".json", ".jsonl"):
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        if file.suffix == ".json":
            try:
                json.loads(text)
                continue
            except json.JSONDecodeError:
                pass  # JSON lines in a .json file, as `datasets` reads them too
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    return (f"{file.name if path.is_dir() else ''}{': ' if path.is_dir() else ''}line {number} is not "
                            f"valid JSON ({e.msg}, column {e.colno}): {line.strip()[:60]!r}")
    return None


# --- the rows that cannot train ---------------------------------------------------------


def invalid_rows(ds, data_cfg: DataConfig, tokenizer=None,
                 split_key: str = "data.train_split") -> dict[str, np.ndarray]:
    """Each kind of row that cannot train, and the rows of that kind (in `ds`'s order): no
    text (null, empty or only spaces) in a text column, no label (null, or a NaN number); a
    preference pair's own (trainer/data/pairs.py), those the same once truncated found with
    `tokenizer`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found: dict[str, np.ndarray]
    if task_class(data_cfg.problem_type).pairs:
        found = pairs.invalid_rows(ds, data_cfg)
        if tokenizer is not None:  # of the rows that tokenize: those with text on both sides
            valid = np.setdiff1d(np.arange(len(ds)), np.concatenate([np.zeros(0, np.int64), *found.values()]))
            for kind, rows in encoding.identical_pairs(ds.select(valid), data_cfg, tokenizer, split_key).items():
                found[kind] = valid[rows]
        return found
    found = {}
    for key in ("text_field", "text_pair_field"):
        column = getattr(data_cfg, key)
        if column is None:
            continue
        values = arrow.column(ds, column)
        if pa.types.is_null(values.type):  # a column with no value at all
            rows = np.arange(len(values))
        elif pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            empty = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(values), ""), True)
            rows = np.flatnonzero(empty.to_numpy(zero_copy_only=False))
        else:
            rows = np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))
        if len(rows):
            found[f"no text in column {column!r}"] = rows
    rows = labels_module.unlabelled_rows(arrow.column(ds, data_cfg.label_field), data_cfg.problem_type)
    if len(rows):
        found[f"no label in column {data_cfg.label_field!r}"] = rows
    return found


def drop_or_refuse(ds, data_cfg: DataConfig, split_key: str, tokenizer=None) -> tuple[object, dict[str, int]]:
    """`ds` without its invalid rows and how many of each kind it had (data.drop_invalid_rows),
    or, where it has some and they are not to be dropped, a DataError naming every kind."""
    found = invalid_rows(ds, data_cfg, tokenizer, split_key)
    if not found:
        return ds, {}
    counts = {kind: len(rows) for kind, rows in found.items()}
    bad = np.unique(np.concatenate(list(found.values())))
    where = f"{data_cfg.path} ({split_key} {getattr(data_cfg, split_key.removeprefix('data.'))!r})"
    if not data_cfg.drop_invalid_rows:
        lines = file_lines(data_cfg, split_key, sorted({int(r) for rows in found.values() for r in rows[:SHOWN]}))
        kinds = "; ".join(f"{len(rows):,} with {kind} ({_places(rows, lines)})" for kind, rows in found.items())
        raise DataError(f"data.path: {where}: {len(bad):,} row{'s' if len(bad) != 1 else ''} cannot train: {kinds}; "
                        "fix them, or set data.drop_invalid_rows=true to drop such rows")
    if len(bad) == len(ds):
        raise DataError(f"data.path: {where}: every row has no text or no label ("
                        + "; ".join(f"{n:,} with {kind}" for kind, n in counts.items()) + ")")
    log.warning("%s: dropped %d of %d rows (data.drop_invalid_rows): %s", where, len(bad), len(ds),
                "; ".join(f"{n:,} with {kind}" for kind, n in counts.items()))
    return ds.select(np.setdiff1d(np.arange(len(ds)), bad)), counts


def _places(rows: np.ndarray, lines: dict[int, int] | None) -> str:
    shown = [int(r) for r in rows[:SHOWN]]
    more = ", ..." if len(rows) > SHOWN else ""
    if lines is not None:
        return ("line " if len(shown) == 1 else "lines ") + ", ".join(str(lines[r]) for r in shown) + more
    return ("row " if len(shown) == 1 else "rows ") + ", ".join(map(str, shown)) + more


def file_lines(data_cfg: DataConfig, split_key: str, rows: list[int]) -> dict[int, int] | None:
    """The line of a local file where each of `rows` (0-based rows of the split) starts, as
    an editor numbers them: after a header line, blank lines and a quoted field's newlines.
    None where the split is not one whole file (a folder, a slice, the Hub, Parquet)."""
    path = Path(data_cfg.path).expanduser()
    spec = str(getattr(data_cfg, split_key.removeprefix("data.")))
    if not rows or not path.is_file() or "[" in spec or BUILDERS.get(path.suffix) not in ("csv", "json"):
        return None
    wanted, found = set(rows), {}
    last = max(rows)
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        if BUILDERS[path.suffix] == "json":
            records = ((number, line) for number, line in enumerate(f, start=1) if line.strip())
            for row, (number, _) in enumerate(records):
                if row in wanted:
                    found[row] = number
                if row >= last:
                    break
            return found if len(found) == len(wanted) else None
        options = csv_options(data_cfg, path, path.suffix)
        reader = csv.reader(f, delimiter=options["sep"], quoting=options.get("quoting", csv.QUOTE_MINIMAL))
        ended, row = 0, -1  # the last line read; the header is row -1
        for record in reader:
            start, ended = ended + 1, reader.line_num
            if not record:  # a blank line: pandas skips it
                continue
            if row in wanted:
                found[row] = start
            if row >= last:
                break
            row += 1
    return found if len(found) == len(wanted) else None
