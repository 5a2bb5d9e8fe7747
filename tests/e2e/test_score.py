"""`python -m trainer score` over a corpus of three shards (JSON lines .gz, Parquet in row
groups, CSV) in chunks of 32 rows: 2 ranks score it as 1 process does, bit for bit; a worker
killed with SIGKILL anywhere (a chunk scored or just committed, in JSON lines or Parquet) loses
at most its chunk, and a restart completes the output equal to the uninterrupted run's; a
second job on the same output joins, one with another model is refused; bad rows stop the job
naming file and line, or are skipped and counted."""

from __future__ import annotations

import csv
import gzip
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.runs import PYTHON, launch, run, trainer_command

CHUNK = 32
SHARDS = {"part-0": 230, "sub/part-1": 170, "part-2": 40}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three shards of reviews, each row an id; some longer than max_length (truncated)."""
    from trainer.data.demo import review

    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    rows = {name: [{"id": f"{name}:{i}", "text": " ".join(review(rng, i % 5) for _ in range(1 + i % 4))}
                   for i in range(count)] for name, count in SHARDS.items()}
    with gzip.open(folder / "part-0.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows["part-0"])
    (folder / "sub").mkdir()
    pq.write_table(pa.Table.from_pylist(rows["sub/part-1"]), folder / "sub" / "part-1.parquet", row_group_size=50)
    with (folder / "part-2.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "text"])
        writer.writeheader()
        writer.writerows(rows["part-2"])
    return folder


def settings(model, corpus, output, *more) -> list[str]:
    """The training run's config (the demo's: its data.path and model.name need not be here),
    and the corpus to score with `model`."""
    return ["model.name=/not/here/any/more", "data.path=/nor/here", f"output_dir={output.parent / 'run'}",
            f"score.model={model}", f"score.input={corpus}", f"score.output={output}", "score.carry=[id]",
            f"score.chunk_rows={CHUNK}", "score.max_tokens=512", "data.max_length=48", "dist.init_timeout_s=60",
            *more]


def score(model, corpus, output, *more, nproc=None, env=None):
    return launch(scoring(settings(model, corpus, output, *more), nproc), env=env)


def scoring(overrides: list[str], nproc: int | None = None) -> list[str]:
    return trainer_command(overrides, nproc=nproc, command="score", config="configs/demo.yaml")


def scored(output) -> dict[str, pa.Table]:
    """Each published shard's table; the ledger's chunks gone with their publication."""
    tables = {name: pq.read_table(output / f"{name}.parquet") for name in SHARDS}
    assert not list((output / ".score" / "chunks").rglob("0*.parquet"))
    return tables


def summaries(output) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((output / ".score" / "summaries").glob("*.json"))]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, corpus, tmp_path_factory):
    output = tmp_path_factory.mktemp("uninterrupted") / "out"
    result = score(tiny_model, corpus, output)
    assert result.returncode == 0, result.output[-3000:]
    return output


def test_one_process_scores_every_row_once_in_order(uninterrupted):
    tables = scored(uninterrupted)
    for name, count in SHARDS.items():
        assert tables[name].column("id").to_pylist() == [f"{name}:{i}" for i in range(count)]
        assert tables[name].column_names == ["id", "label", "label_name", "probs"]
    (summary,) = summaries(uninterrupted)
    chunks = sum(-(-count // CHUNK) for count in SHARDS.values())
    assert (summary["rows"], summary["chunks"], summary["skipped"]) == (sum(SHARDS.values()), chunks, 0)
    assert 0 < summary["truncated"] < summary["rows"]
    reported = run([PYTHON, "-m", "trainer", "report", str(uninterrupted)])
    assert reported.returncode == 0 and reported.output.startswith(
        f"scoring of {uninterrupted}: 3 of 3 shards published, {summary['rows']} rows in {chunks} chunks by 1 "
        f"worker(s); {summary['truncated']} truncated, 0 skipped, 0 chunks scored twice\n"), reported.output


def test_two_ranks_equal_one_process(tiny_model, corpus, uninterrupted, tmp_path):
    output = tmp_path / "out"
    result = score(tiny_model, corpus, output, nproc=2)
    assert result.returncode == 0, result.output[-3000:]
    expected = scored(uninterrupted)
    assert {name: t.to_pylist() for name, t in scored(output).items()} == \
           {name: t.to_pylist() for name, t in expected.items()}
    by_rank = summaries(output)
    assert len(by_rank) == 2 and all(s["chunks"] > 0 for s in by_rank), by_rank  # both ranks took chunks
    assert sum(s["chunks"] for s in by_rank) == sum(-(-n // CHUNK) for n in SHARDS.values())


def test_packed_batches_score_what_padded_batches_score(tiny_model, corpus, uninterrupted, tmp_path):
    """data.packing: each chunk's batches packed, each sample read at its own first token: the
    same answers, each probability within 1e-5 of the padded run's."""
    output = tmp_path / "out"
    result = score(tiny_model, corpus, output, "data.packing=true")
    assert result.returncode == 0, result.output[-3000:]
    assert "data.packing: each batch's samples laid end to end in rows as wide as its longest (at most 48" in \
        result.output
    for name, padded in scored(uninterrupted).items():
        packed = scored(output)[name]
        assert packed.column("label").to_pylist() == padded.column("label").to_pylist(), name
        for got, expected in zip(packed.column("probs").to_pylist(), padded.column("probs").to_pylist(), strict=True):
            assert got == pytest.approx(expected, abs=1e-5), name


@pytest.mark.parametrize("point", ["part-0:0:scored", "part-0:3:committed", "sub/part-1:2:scored"])
def test_a_kill_9_loses_at_most_its_chunk_and_a_restart_completes_the_output(tiny_model, corpus, uninterrupted,
                                                                              tmp_path, point):
    output = tmp_path / "out"
    killed = score(tiny_model, corpus, output, env={"TRAINER_FAULT_SCORE_SIGKILL": point})
    assert killed.returncode == -9, killed.output[-3000:]
    shard, index, at = point.rsplit(":", 2)
    committed = {p.relative_to(output / ".score" / "chunks").as_posix()
                 for p in (output / ".score" / "chunks").rglob("0*.parquet")}
    assert (f"{shard}/{int(index):08d}.parquet" in committed) == (at == "committed")
    published = [name for name in SHARDS if (output / f"{name}.parquet").exists()]  # their chunks removed

    restarted = score(tiny_model, corpus, output)
    assert restarted.returncode == 0, restarted.output[-3000:]
    assert {n: t.to_pylist() for n, t in scored(output).items()} == \
           {n: t.to_pylist() for n, t in scored(uninterrupted).items()}
    # The restart's summary (the killed worker wrote none): it scored exactly what was not
    # committed before the kill, the killed chunk included.
    (summary,) = summaries(output)
    total = sum(-(-n // CHUNK) for n in SHARDS.values())
    assert summary["chunks"] == total - len(committed) - sum(-(-SHARDS[n] // CHUNK) for n in published)


def test_a_second_job_on_the_same_output_joins_and_one_with_another_model_is_refused(tiny_model, dropout_model,
                                                                                     corpus, uninterrupted, tmp_path):
    from support.runs import together

    output = tmp_path / "out"
    first, second = together(*[(scoring(settings(tiny_model, corpus, output)), {}) for _ in range(2)])
    assert first.returncode == 0 and second.returncode == 0, first.output[-2000:] + second.output[-2000:]
    assert {n: t.to_pylist() for n, t in scored(output).items()} == \
           {n: t.to_pylist() for n, t in scored(uninterrupted).items()}
    jobs = summaries(output)
    assert len(jobs) == 2 and sum(s["chunks"] for s in jobs) == sum(-(-n // CHUNK) for n in SHARDS.values())

    other = score(dropout_model, corpus, output)
    errors = [line for line in other.output.splitlines() if line.startswith("error: ")]
    assert other.returncode == 2 and "Traceback" not in other.output, other.output[-3000:]
    assert errors == [(f"error: score.output: {output} holds another scoring job's output (it differs in model, "
                       "model_files): give this job its own score.output")]


def test_bad_rows_stop_naming_file_and_line_or_are_skipped_and_counted(tiny_model, tmp_path):
    """With score.bad_rows=skip, 2 ranks: a bad row is left out and counted, and a shard that
    cannot be read (a copy cut short) is left out whole by the rank that meets it; no rank
    waits for its chunks, and `report` names it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"id": 1, "text": "fine"}\n{"id": 2, "text": "broken\n{"id": 3}\n'
                                    '{"id": 4, "text": "also fine"}\n')
    whole = gzip.compress(b"".join(b'{"id": %d, "text": "row %d"}\n' % (i, i) for i in range(5, 400)))
    (corpus / "b.jsonl.gz").write_bytes(whole[:len(whole) // 2])  # cut short: its first chunks read
    stopped = score(tiny_model, corpus, tmp_path / "stopped")
    errors = [line for line in stopped.output.splitlines() if line.startswith("error: ")]
    assert stopped.returncode == 2 and "Traceback" not in stopped.output, stopped.output[-3000:]
    assert errors == [(f"error: score.input: {corpus / 'a.jsonl'} line 2: not JSON: Unterminated string starting "
                       "at (column 19) (score.bad_rows=skip leaves such rows out)")]

    skipped = score(tiny_model, corpus, tmp_path / "skipped", "score.bad_rows=skip", nproc=2)
    assert skipped.returncode == 0, skipped.output[-3000:]
    assert pq.read_table(tmp_path / "skipped" / "a.parquet").column("id").to_pylist() == [1, 4]
    assert not (tmp_path / "skipped" / "b.parquet").exists()
    workers = summaries(tmp_path / "skipped")
    assert sum(s["skipped"] for s in workers) == 2 and [r for s in workers for r in s["skipped_rows"]] == [
        f"{corpus / 'a.jsonl'} line 2: not JSON: Unterminated string starting at (column 19)",
        f"{corpus / 'a.jsonl'} line 3: no 'text'"]
    # Each rank that met it (one, or both at once) says so; the ledger keeps the first reason.
    unreadable = [s["shards_skipped"] for s in workers if s["shards_skipped"]]
    assert unreadable and all(list(u) == ["b"] and u["b"] == unreadable[0]["b"] for u in unreadable), unreadable
    assert unreadable[0]["b"].startswith(f"score.input: {corpus / 'b.jsonl.gz'}: unreadable: ")
    report = run([PYTHON, "-m", "trainer", "report", str(tmp_path / "skipped")])
    assert report.returncode == 0, report.output
    assert "1 of 2 shards published, 1 unreadable and skipped" in report.output
    assert f"  skipped: {unreadable[0]['b']}" in report.output


def test_a_missing_column_is_one_line_before_the_model_loads(tiny_model, corpus, tmp_path):
    result = score(tiny_model, corpus, tmp_path / "out", "data.text_field=review")
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-3000:]
    assert errors == [(f"error: score.input: {corpus / 'part-0.jsonl.gz'}: no column 'review' (its first row has "
                       "id, text)")]
    assert "Loading weights" not in result.output and not (tmp_path / "out").exists()


def test_check_covers_a_scoring_config(usage_run, tiny_model, corpus, tmp_path):
    """`check` of a config with score.input: the corpus as `score` checks it, before any job."""
    planned = [f"model.name={tiny_model}", "--no-data"]  # check also plans the training's memory
    checked = usage_run([*settings(tiny_model, corpus, tmp_path / "out"), *planned], command="check",
                        config="configs/demo.yaml")
    assert checked.returncode == 0, checked.output[-3000:]
    assert f"score: 3 shard(s) under {corpus}, the first with the text and carried columns" in checked.output
    refused = usage_run([*settings(tiny_model, corpus, tmp_path / "out"), "score.carry=[url]", *planned],
                        command="check", config="configs/demo.yaml")
    errors = [line for line in refused.output.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and errors == [
        f"error: score.input: {corpus / 'part-0.jsonl.gz'}: no column 'url' (its first row has id, text)"]
