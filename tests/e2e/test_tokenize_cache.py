"""A second run on the same data reads its tokenized splits from the `datasets` cache.

The map's fingerprint names the cache file. If it took in anything beyond what the tokens
depend on (the whole run config, say), every run in a new output_dir would tokenize the whole
train split again. Asserted on the files, not on timings: a rerun that tokenized again writes a new
cache-*.arrow.
"""

from pathlib import Path

from support.outputs import read_summary
from support.runs import tiny_overrides, train


def map_cache_files(cache: Path) -> set[Path]:
    """The map results under HF_DATASETS_CACHE (the converted JSON is named otherwise)."""
    return set(cache.rglob("cache-*.arrow"))


LARGE_SPLIT_ROWS = 60_000
"""A user's CSV at the size real data has: from 20,000 rows local rank 0 tokenizes in 2 or more
processes (trainer/data/encoding.py, tokenize_processes, on 2 CPUs or more), each writing a
shard of the cache, the path that the demo's split and every other test's never take."""


def test_a_second_run_on_the_same_data_reads_the_tokenized_cache(tiny_model, tmp_path):
    from trainer.data.demo import sentiment

    data = sentiment(tmp_path / "data", rows=LARGE_SPLIT_ROWS)  # one file: 10% held out to validate
    cache = tmp_path / "hf-datasets"

    def launch(name: str, nproc: int | None, **changes):
        out = tmp_path / name
        overrides = tiny_overrides(tiny_model, data, out, **{
            "data.text_field": "review", "data.label_field": "sentiment", "data.num_labels": 3,
            "train.max_steps": 1, **changes})
        result = train(overrides, nproc=nproc, env={"HF_DATASETS_CACHE": str(cache)})
        assert "tokenize" in read_summary(out)["startup_s"]
        return result, map_cache_files(cache)

    first, written = launch("first", nproc=2)
    assert "train_split: tokenized 54000 rows" in first.output, first.output[-3000:]
    assert "(2 processes)" in first.output, first.output[-3000:]
    assert len({p for p in written if "_of_00002" in p.name}) == 2, sorted(p.name for p in written)

    # The same training again, in its own output_dir as every run is, by 2 ranks as before. No
    # file is new: neither rank tokenized again (rank 1 would have written its own, unsharded).
    second, after = launch("second", nproc=2)
    assert after == written, f"the second run tokenized again: it wrote {sorted(p.name for p in after - written)}"
    assert second.output.count("tokenized before: read from the cache") == 2, second.output[-3000:]

    # What the tokens depend on changed: both splits are tokenized again, into new files.
    longer, changed = launch("longer", nproc=None, **{"data.max_length": 32})
    assert len({p.name.split("_")[0] for p in changed - after}) == 2, sorted(p.name for p in changed - after)
    assert "read from the cache" not in longer.output
