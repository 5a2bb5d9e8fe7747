"""A worker of `python -m trainer score`: the chunks it claims, read and tokenized on a loader
thread while the model scores the chunk before, committed whole, and each shard published
once its every chunk is done.

Every worker runs alone: a rank of torchrun, a Slurm array task, a Kubernetes pod. They meet
only in the ledger (ledger.py), so none waits for another except at the very end, where a
worker whose pass found every chunk left claimed by live workers waits for them, taking over
the claims of any that dies: while one worker lives, the job ends with every row scored.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from trainer import files
from trainer.config.schema import Config
from trainer.data import encoding, loaders
from trainer.data import pairs as pairs_module
from trainer.data.pairs import to_messages
from trainer.errors import DataError, TrainerError
from trainer.faults import inject
from trainer.model import packing
from trainer.scoring.corpus import Chunk, Reader, Shard
from trainer.scoring.ledger import Ledger
from trainer.train.build import Trained

log = logging.getLogger(__name__)

PROGRESS_S = float(os.environ.get("TRAINER_SCORE_PROGRESS_S", 30))
"""How often a worker logs its progress line (rows/s, the corpus's chunks done, ETA)."""


@dataclass
class Tokenized:
    """One claimed chunk, ready for the model: its batches cut by the token budget."""

    shard: Shard
    chunk: Chunk
    batches: list[tuple[list[int], dict[str, torch.Tensor]]]
    """(the rows' places in the chunk, their padded tensors), longest rows first."""
    truncated: int


@dataclass
class Counts:
    rows: int = 0
    truncated: int = 0
    chunks: int = 0
    skipped: list[str] = field(default_factory=list)
    shards_published: list[str] = field(default_factory=list)
    shards_skipped: dict[str, str] = field(default_factory=dict)
    """Shards this worker found it could not read (score.bad_rows=skip), and why."""


def budget_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The rows' indices, longest first, cut into batches whose padded size (rows x the
    longest) stays within `max_tokens`; a row over the budget is a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def truncated_rows(encoded, texts: list[str], pairs: list[str] | None, max_length: int) -> int:
    """How many rows lost text to data.max_length: a row at the limit whose last token of a
    text ends before that text's end (fast tokenizers' offsets); by its length alone where
    the tokenizer gives no offsets."""
    count = 0
    for i, ids in enumerate(encoded["input_ids"]):
        if len(ids) < max_length:
            continue
        if not encoded.is_fast:
            count += 1
            continue
        ends: dict[int, int] = {}
        for sequence, (_, end) in zip(encoded.sequence_ids(i), encoded["offset_mapping"][i], strict=True):
            if sequence is not None:
                ends[sequence] = end
        segments = [texts[i], *([pairs[i]] if pairs is not None else [])]
        count += any(ends.get(s, 0) < len(text.rstrip()) for s, text in enumerate(segments))
    return count


class Worker:
    def __init__(self, cfg: Config, trained: Trained, device: torch.device, ledger: Ledger, shards: list[Shard],
                 first: int):
        self.cfg, self.trained, self.device, self.ledger = cfg, trained, device, ledger
        self.shards = shards[first:] + shards[:first]  # workers start apart, and meet at the tail
        self.output = Path(cfg.score.output or "")
        self.suffix = f".{cfg.score.format}"
        layout = packing.of_run(cfg.data, trained.config)
        if layout is not None:
            log.info("%s", loaders.packing_line(cfg, layout))
        self.collate = loaders.collate(cfg, trained.tokenizer, device, layout, texts_only=True)
        self.pin = device.type == "cuda"
        self.max_tokens = cfg.score.max_tokens or (32768 if device.type == "cuda" else 4096)
        self.counts = Counts()
        self._footer_chunks: dict[str, int] = {}
        """Parquet shards' chunk counts, from their footers, read at the first progress line."""
        self._stop = threading.Event()

    # --- the loader thread ---------------------------------------------------------------

    def _reader(self, shard: Shard) -> Reader:
        score_cfg, data_cfg = self.cfg.score, self.cfg.data
        return Reader(shard, score_cfg.chunk_rows, data_cfg.text_field, data_cfg.text_pair_field, score_cfg.carry,
                      skip=score_cfg.bad_rows == "skip")

    def _claimed(self) -> Iterator[Tokenized]:
        """Each chunk this worker claims, pass after pass over the shards not yet published,
        until every one is (or a worker failed)."""
        while not self._stop.is_set():
            if failure := self.ledger.failure():
                raise DataError(f"score: stopped: another worker failed: {failure}")
            pending = [s for s in self.shards if not self.published(s) and not self.ledger.skipped(s.name)]
            if not pending:
                return
            claimed_any = False
            for shard in pending:
                for tokenized in self._claim_in(shard):
                    claimed_any = True
                    yield tokenized
                if self.ledger.missing(shard.name, self.suffix) == []:
                    yield Tokenized(shard, Chunk(-1), [], 0)  # every chunk done: the shard to publish
            if not claimed_any:
                # The rest is claimed by live workers: look again soon, for their end or death.
                self._stop.wait(min(1.0, self.cfg.score.lease_s / 8))

    def _claim_in(self, shard: Shard) -> Iterator[Tokenized]:
        """The chunks of `shard` this worker claims, each as the reader reaches it: one at a
        time, so that other workers share the shard's tail."""
        ledger = self.ledger
        missing = ledger.missing(shard.name, self.suffix)
        first, left = None, None if missing is None else set(missing)
        if missing is not None:  # its length known: read it only if a chunk left is claimable now
            first = next((i for i in missing if ledger.claim(shard.name, i, self.suffix)), None)
            if first is None:
                return

        def wanted(index: int) -> bool:
            if index == first:
                return True
            if left is not None and index not in left:
                return False
            return ledger.claim(shard.name, index, self.suffix)
        chunks = 0
        try:
            for index, chunk in self._reader(shard).chunks(wanted):
                chunks = index + 1
                if failure := ledger.failure():
                    raise DataError(f"score: stopped: another worker failed: {failure}")
                if chunk is not None:
                    yield self._tokenized(shard, chunk)
        except DataError as e:
            # With bad_rows=skip a bad row never raises: what does is the shard itself (cut
            # short, not UTF-8, without the text column). Left out whole, for every worker.
            if self.cfg.score.bad_rows != "skip" or not str(e).startswith(f"score.input: {shard.path}"):
                raise
            ledger.skip_shard(shard.name, str(e))
            self.counts.shards_skipped[shard.name] = str(e)
            log.warning("score: %s: skipped, with its rows (score.bad_rows=skip)", e)
            return
        ledger.set_count(shard.name, chunks)

    def _tokenized(self, shard: Shard, chunk: Chunk) -> Tokenized:
        """The chunk's rows as tokens, in batches: texts (and text pairs) as the tokenizer
        joins them, conversations as its chat template renders them, as training reads them
        (trainer/data/pairs.py), each read at its last token (encoding.read_at_last_token)."""
        tokenizer, max_length = self.trained.tokenizer, self.cfg.data.max_length
        tokenizer.truncation_side = self.cfg.data.truncation_side
        rendered = [i for i, text in enumerate(chunk.texts)
                    if not isinstance(text, str) or (chunk.pairs is not None and not isinstance(chunk.pairs[i], str))]
        texts, pairs = chunk.texts, chunk.pairs
        if rendered:  # a conversation in the chunk: each such row rendered to one text, joined as written
            texts, pairs = list(texts), None if pairs is None else list(pairs)
            for i in rendered:
                messages = [*to_messages(chunk.texts[i], "user"),
                            *(to_messages(chunk.pairs[i], "assistant") if chunk.pairs is not None else [])]
                texts[i] = pairs_module.render(tokenizer, messages, "data.text_field")
                if pairs is not None:
                    pairs[i] = ""
        columns, truncated = self._encode(texts, pairs, set(rendered), max_length)
        lengths = [len(ids) for ids in columns["input_ids"]]
        batches = []
        for rows in budget_batches(lengths, self.max_tokens):
            batch = self.collate([{k: values[i] for k, values in columns.items()} for i in rows])
            batches.append((rows, {k: v.pin_memory() if self.pin else v for k, v in batch.items()}))
        return Tokenized(shard, chunk, batches, truncated)

    def _encode(self, texts: list, pairs: list | None, rendered: set[int], max_length: int) -> tuple[dict, int]:
        """({column: each row's values}, the rows truncation cut): the rows in `rendered`
        (a chat template's text, whole: no special tokens added, no pair) apart from the others."""
        tokenizer, truncated = self.trained.tokenizer, 0
        columns: dict[str, list] = {}
        groups = [(sorted(rendered), False), ([i for i in range(len(texts)) if i not in rendered], True)]
        for rows, plain in groups:
            if not rows:
                continue
            group_texts = [texts[i] for i in rows]
            group_pairs = [pairs[i] for i in rows] if pairs is not None and plain else None
            encoded = tokenizer(group_texts, group_pairs, truncation=True, max_length=max_length,
                                add_special_tokens=plain, return_offsets_mapping=tokenizer.is_fast)
            truncated += truncated_rows(encoded, group_texts, group_pairs, max_length)
            values = {k: list(v) for k, v in encoded.items() if k in ("input_ids", "token_type_ids")}
            encoding.read_at_last_token(values, encoding.stand_in_pad(tokenizer))
            for name, column in values.items():
                columns.setdefault(name, [None] * len(texts))
                for i, value in zip(rows, column, strict=True):
                    columns[name][i] = value
        return {name: column for name, column in columns.items() if all(v is not None for v in column)}, truncated

    def _prefetched(self) -> Iterator[Tokenized]:
        """`_claimed`, run on a loader thread one chunk ahead of the model. Tokenizing (in
        Rust) and the model both release the GIL, so the two overlap."""
        ahead: queue.Queue = queue.Queue(maxsize=1)

        def put(item: Tokenized | BaseException | None) -> None:
            # Never a blocking put: a model side that stopped (its error) no longer takes.
            while not self._stop.is_set():
                try:
                    return ahead.put(item, timeout=0.5)
                except queue.Full:
                    continue

        def load() -> None:
            try:
                for tokenized in self._claimed():
                    put(tokenized)
                put(None)
            except BaseException as e:  # the worker's to raise  # noqa: BLE001
                put(e)

        thread = threading.Thread(target=load, name="trainer-score-loader", daemon=True)
        thread.start()
        try:
            while (item := ahead.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._stop.set()
            thread.join()

    # --- the model -----------------------------------------------------------------------

    def run(self) -> Counts:
        began, last_line = time.monotonic(), time.monotonic()
        done_at_start = self.chunks_done()
        try:
            for tokenized in self._prefetched():
                if tokenized.chunk.index >= 0:
                    self._score(tokenized)
                self._publish_if_done(tokenized.shard)
                if time.monotonic() - last_line >= PROGRESS_S:
                    last_line = time.monotonic()
                    self._progress(last_line - began, done_at_start)
        except TrainerError as e:
            if isinstance(e, DataError) and not str(e).startswith("score: stopped:"):
                self.ledger.fail(str(e))  # every other worker stops at its next chunk
            raise
        return self.counts

    @torch.inference_mode()
    def _score(self, tokenized: Tokenized) -> None:
        chunk, task = tokenized.chunk, self.trained.task
        answers: list[dict] = [{}] * len(chunk.texts)
        for rows, batch in tokenized.batches:
            on_device = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            logits = self.trained.logits(**on_device).float().cpu()  # the batch's one host read
            for i, answer in zip(rows, task.predictions(logits), strict=True):
                answers[i] = answer
        records = [{**carried, **answer} for carried, answer in zip(chunk.carried, answers, strict=True)]
        inject.scoring("scored", tokenized.shard.name, chunk.index)
        if self.published(tokenized.shard):  # its chunks all committed meanwhile, by others
            return
        if self.ledger.commit(tokenized.shard.name, chunk.index, self.suffix, lambda p: self._write(p, records)):
            self.counts.chunks += 1
            self.counts.rows += len(records)
            self.counts.truncated += tokenized.truncated
            self.counts.skipped += chunk.skipped
        inject.scoring("committed", tokenized.shard.name, chunk.index)

    def _write(self, path: Path, records: list[dict]) -> None:
        if self.suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(records), path)
        else:
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")

    # --- shards ----------------------------------------------------------------------------

    def output_path(self, shard: Shard) -> Path:
        return self.output / f"{shard.name}{self.suffix}"

    def published(self, shard: Shard) -> bool:
        return self.output_path(shard).exists()

    def _publish_if_done(self, shard: Shard) -> None:
        """The shard's chunks, in order, as one file written aside and renamed into place. Two
        workers may both find the shard done: each writes the same file, the rename is whole."""
        count, target = self.ledger.count(shard.name), self.output_path(shard)
        if count is None or target.exists() or self.ledger.missing(shard.name, self.suffix):
            return
        chunks = [self.ledger.chunk_path(shard.name, i, self.suffix) for i in range(count)]
        target.parent.mkdir(parents=True, exist_ok=True)
        aside = target.with_name(f".{target.name}.{self.ledger.me.lease_id}.tmp")
        try:
            if self.suffix == ".parquet":
                schemas = [pq.read_schema(p) for p in chunks]
                schema = pa.unify_schemas([s for s in schemas if s.names]) if any(s.names for s in schemas) \
                    else pa.schema([])
                with pq.ParquetWriter(aside, schema) as writer:
                    for path in chunks:  # one chunk in memory at a time
                        table = pq.read_table(path)
                        if table.num_rows:
                            writer.write_table(table.select(schema.names).cast(schema))
            else:
                with aside.open("wb") as out:
                    for path in chunks:
                        out.write(path.read_bytes())
            files.rename_into_place(aside, target)
        except FileNotFoundError:  # another worker published it and removed its chunks first
            aside.unlink(missing_ok=True)
            if target.exists():
                return
            raise
        self.counts.shards_published.append(shard.name)
        self.ledger.remove_chunks(shard.name)
        log.info("score: published %s", target)

    def chunks_done(self) -> int:
        """The corpus's chunks done by every worker, as the ledger shows them: a published
        shard's count (kept in the ledger), else its committed chunks."""
        return sum((self.ledger.count(shard.name) or 0) if self.published(shard) else
                   self.ledger.committed(shard.name, self.suffix) for shard in self.shards)

    def chunks_in_corpus(self) -> float | None:
        """The corpus's chunks: a shard's count once a worker has read it through (a Parquet
        shard's from its footer, read once), else estimated from its size by the shards of its
        kind whose counts are known; None before any is."""
        known = {}
        for shard in self.shards:
            count = self.ledger.count(shard.name)
            if count is None and shard.kind == "parquet":
                if shard.name not in self._footer_chunks:
                    rows = pq.ParquetFile(shard.path).metadata.num_rows
                    self._footer_chunks[shard.name] = -(-rows // self.cfg.score.chunk_rows)
                count = self._footer_chunks[shard.name]
            if count is not None:
                known[shard] = count
        total = 0.0
        for shard in self.shards:
            alike = [s for s in known if (s.kind, s.compression) == (shard.kind, shard.compression)]
            if shard not in known and not alike:
                return None
            total += known[shard] if shard in known else \
                shard.path.stat().st_size * sum(known[s] for s in alike) / max(1, sum(s.path.stat().st_size
                                                                                     for s in alike))
        return total

    def _progress(self, seconds: float, done_at_start: int) -> None:
        done, total = self.chunks_done(), self.chunks_in_corpus()
        rate = (done - done_at_start) / max(seconds, 1e-9)  # every worker's, as the ledger shows it
        eta = "ETA unknown yet"
        if total is not None and rate > 0:
            left_s = max(0.0, total - done) / rate
            eta = f"ETA {left_s:.0f} s" if left_s < 120 else f"ETA {left_s / 60:.0f} min"
        log.info("score: %d rows here (%.1f rows/s), %d truncated, %d skipped; corpus: %d of %s chunks done, %s",
                 self.counts.rows, self.counts.rows / max(seconds, 1e-9), self.counts.truncated,
                 len(self.counts.skipped), done, "?" if total is None else f"~{total:.0f}", eta)
