"""A corpus as shards, and each shard as chunks of score.chunk_rows rows, read one at a time.

A shard is a Parquet, JSON lines (.jsonl, .json, .ndjson) or CSV/TSV (.csv, .tsv) file,
each also compressed (.gz, .zst; pyarrow decompresses them as a stream). Memory holds one
chunk, whatever the shard's size. A chunk is rows [N x chunk_rows, (N + 1) x chunk_rows) of
its shard, the same for every worker: a Parquet chunk is read from the row groups under it
alone; a text shard is read from its start, its lines passed over unparsed up to the chunk
(parsing is what costs, and a worker reads only the chunks it claims).

A row that cannot be scored (not JSON, a CSV record of the wrong width, its text missing or
not text, not UTF-8) is named by file and line (Parquet: row, from 0): with
score.bad_rows=stop it stops the job, with skip it is left out and counted. A shard that
cannot be read at all (a truncated .gz, not Parquet) is named by file, and stops the job.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trainer.errors import ConfigError, DataError, describe

KINDS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "tsv"}
COMPRESSION = {".gz": "gzip", ".zst": "zstd"}


@dataclass(frozen=True)
class Shard:
    path: Path
    name: str
    """Its path under the input's folder, less its suffixes: its name in the output and the ledger."""
    kind: str
    compression: str | None


@dataclass
class Chunk:
    index: int
    texts: list[str | list[dict]] = field(default_factory=list)
    """Each row's data.text_field: a text, or a conversation (a list of {role, content} messages)."""
    pairs: list[str | list[dict]] | None = None
    carried: list[dict] = field(default_factory=list)
    """Each row's score.carry columns."""
    skipped: list[str] = field(default_factory=list)
    """`FILE line N: why`, for each row left out (score.bad_rows=skip)."""


def is_conversation(value) -> bool:
    """A list of {role, content} messages, both text: what a chat template renders."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def kind_of(path: Path) -> tuple[str, str | None] | None:
    """(kind, compression) of a shard's file name, None if it is not one."""
    suffixes = path.suffixes[-2:]
    compression = COMPRESSION.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    kind = KINDS.get(suffixes[-1]) if suffixes else None
    return None if kind is None or (kind == "parquet" and compression) else (kind, compression)


def shards(pattern: str, output: Path) -> list[Shard]:
    """score.input's shards, in path order: a file, every shard under a folder, or a glob's;
    none under `output` (score.output may be inside the input's folder)."""
    path = Path(pattern)
    if path.is_file():
        if kind_of(path) is None:
            raise ConfigError(f"score.input: {path}: not a Parquet, JSON lines or CSV/TSV file "
                              f"({', '.join(KINDS)}, also .gz or .zst)")
        root, found = path.parent, [path]
    elif path.is_dir():
        root, found = path, sorted(p for p in path.rglob("*") if p.is_file() and kind_of(p))
    else:
        fixed = []  # the folder before the glob's first wildcard: the shards' names start under it
        for part in path.parts:
            if glob.has_magic(part):
                break
            fixed.append(part)
        root = Path(*fixed) if fixed else Path(".")
        found = sorted(p for p in map(Path, glob.glob(pattern, recursive=True)) if p.is_file() and kind_of(p))
        if not glob.has_magic(pattern):
            raise ConfigError(f"score.input: {pattern}: no such file or folder")
    found = [p for p in found if not p.resolve().is_relative_to(output.resolve())]
    if not found:
        raise ConfigError(f"score.input: {pattern}: no Parquet, JSON lines or CSV/TSV shards there")
    result = []
    for p in found:
        kind, compression = kind_of(p)  # type: ignore[misc]  # found holds shards only
        relative = p.relative_to(root).as_posix()
        result.append(Shard(p, relative[: len(relative) - len("".join(p.suffixes[-2 if compression else -1:]))],
                            kind, compression))
    names = [s.name for s in result]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"score.input: {pattern}: shards {', '.join(twice)} differ only in their suffix: "
                          "each would write the same output shard")
    return result


class Reader:
    """One shard's chunks, read in order: `chunks(wanted)` yields each chunk index and, where
    `wanted(index)`, its rows; the others are passed over. The last index it yields + 1 is the
    shard's number of chunks."""

    def __init__(self, shard: Shard, chunk_rows: int, text: str, pair: str | None, carry: list[str], skip: bool):
        self.shard, self.chunk_rows = shard, chunk_rows
        self.text, self.pair, self.carry, self.skip = text, pair, carry, skip

    def columns(self) -> list[str]:
        return list(dict.fromkeys([self.text, *([self.pair] if self.pair else []), *self.carry]))

    def check_columns(self) -> None:
        """The text and carried columns are in the shard: its schema (Parquet) or its first
        row. Before any weights load: a misnamed column costs seconds, not a model's load."""
        try:
            if self.shard.kind == "parquet":
                names = pq.read_schema(self.shard.path).names
            else:
                names = list(self._first_record())
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"score.input: {self.shard.path}: unreadable: {describe(e)}") from None
        missing = [c for c in self.columns() if c not in names]
        if missing:
            raise DataError(f"score.input: {self.shard.path}: no column {missing[0]!r} (its first row has "
                            f"{', '.join(names) or 'none'})")

    def _first_record(self) -> dict:
        """The first row that parses (a bad one is the chunks' to report), else {}."""
        with self._records() as records:
            for _, record in records:
                with contextlib.suppress(ValueError):
                    parsed = json.loads(record) if isinstance(record, bytes) else record
                    if isinstance(parsed, dict):
                        return parsed
        return {}

    def chunks(self, wanted: Callable[[int], bool]) -> Iterator[tuple[int, Chunk | None]]:
        try:
            if self.shard.kind == "parquet":
                yield from self._parquet(wanted)
            else:
                yield from self._text(wanted)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"score.input: {self.shard.path}: unreadable: {describe(e)}") from None

    # --- Parquet -----------------------------------------------------------------------

    def _parquet(self, wanted: Callable[[int], bool]) -> Iterator[tuple[int, Chunk | None]]:
        file = pq.ParquetFile(self.shard.path)
        missing = [c for c in self.columns() if c not in file.schema_arrow.names]
        if missing:
            raise DataError(f"score.input: {self.shard.path}: no column {missing[0]!r} "
                            f"(it has {', '.join(file.schema_arrow.names)})")
        starts = [0]
        for group in range(file.num_row_groups):
            starts.append(starts[-1] + file.metadata.row_group(group).num_rows)
        for index in range(-(-starts[-1] // self.chunk_rows)):
            if not wanted(index):
                yield index, None
                continue
            begin, end = index * self.chunk_rows, min((index + 1) * self.chunk_rows, starts[-1])
            groups = [g for g in range(file.num_row_groups) if starts[g] < end and starts[g + 1] > begin]
            table = file.read_row_groups(groups, columns=self.columns()).slice(begin - starts[groups[0]], end - begin)
            yield index, self._chunk(index, table.to_pylist(), [f"row {begin + i}" for i in range(end - begin)])

    # --- JSON lines, CSV, TSV --------------------------------------------------------------

    @contextlib.contextmanager
    def _records(self) -> Iterator[Iterator[tuple[int, bytes | dict | str]]]:
        """The shard's records, each with its line number, as a stream (decompressed on the way)."""
        with io.BufferedReader(pa.input_stream(str(self.shard.path), compression=self.shard.compression)) as stream:
            yield self._json(stream) if self.shard.kind == "json" else self._delimited(stream)

    def _text(self, wanted: Callable[[int], bool]) -> Iterator[tuple[int, Chunk | None]]:
        with self._records() as records:
            index, rows, where = 0, [], []
            for line, record in records:
                rows.append(record)
                where.append(f"line {line}")
                if len(rows) == self.chunk_rows:
                    yield index, self._parsed(index, rows, where) if wanted(index) else None
                    index, rows, where = index + 1, [], []
            if rows:
                yield index, self._parsed(index, rows, where) if wanted(index) else None

    @staticmethod
    def _json(stream) -> Iterator[tuple[int, bytes]]:
        """(line number, its bytes) of each line that is not blank: parsed only if wanted."""
        for number, line in enumerate(stream, 1):
            if line.strip():
                yield number, line

    def _delimited(self, stream) -> Iterator[tuple[int, dict | str]]:
        """(line number, its record) of each CSV/TSV record, or the reason it is not one. A
        TSV is read unquoted, as GLUE's are written (a text may hold quote marks)."""
        text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
        reader = csv.reader(text, delimiter="\t", quoting=csv.QUOTE_NONE) if self.shard.kind == "tsv" else \
            csv.reader(text)
        try:
            header = next(reader)
            for record in reader:
                if len(record) != len(header):
                    yield reader.line_num, f"{len(record)} fields, the header has {len(header)}"
                else:
                    yield reader.line_num, dict(zip(header, record, strict=True))
        except UnicodeDecodeError as e:
            # Decoded a block at a time: the line is not known, the byte within its block is.
            raise DataError(f"score.input: {self.shard.path}: not UTF-8 text: {e.reason}") from None
        except csv.Error as e:
            raise DataError(f"score.input: {self.shard.path}: line {reader.line_num}: not CSV: {e}") from None

    def _parsed(self, index: int, rows: list, where: list[str]) -> Chunk:
        records: list[dict | str] = []
        for row in rows:
            if not isinstance(row, bytes):
                records.append(row)
                continue
            try:
                record = json.loads(row.rstrip(b"\r\n"))
                records.append(record if isinstance(record, dict) else f"not a JSON object: {type(record).__name__}")
            except UnicodeDecodeError as e:
                records.append(f"not UTF-8: {e.reason}")
            except json.JSONDecodeError as e:
                records.append(f"not JSON: {e.msg} (column {e.colno})")
        return self._chunk(index, records, where)

    # --- rows ------------------------------------------------------------------------------

    def _chunk(self, index: int, records: list[dict | str], where: list[str]) -> Chunk:
        chunk = Chunk(index, pairs=[] if self.pair else None)
        for record, place in zip(records, where, strict=True):
            why = record if isinstance(record, str) else self._unscorable(record)
            if why is not None:
                problem = f"{self.shard.path} {place}: {why}"
                if not self.skip:
                    raise DataError(f"score.input: {problem} (score.bad_rows=skip leaves such rows out)")
                chunk.skipped.append(problem)
                continue
            assert isinstance(record, dict)
            chunk.texts.append(record[self.text])
            if chunk.pairs is not None:
                chunk.pairs.append(record[self.pair])
            chunk.carried.append({name: record.get(name) for name in self.carry})
        return chunk

    def _unscorable(self, record: dict) -> str | None:
        for name in [self.text, *([self.pair] if self.pair else [])]:
            if record.get(name) is None:
                return f"no {name!r}" if name not in record else f"{name!r} is null"
            if not isinstance(record[name], str) and not is_conversation(record[name]):
                return (f"{name!r} is neither text nor a conversation (a list of {{role, content}} messages, both "
                        f"text): {str(record[name])[:40]!r}")
        for name in self.carry:
            if name not in record:
                return f"no {name!r} (score.carry)"
        return None
