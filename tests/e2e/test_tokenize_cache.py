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


def test_a_second_run_on_the_same_data_reads_the_tokenized_cache(tiny_model, reviews, tmp_path):
    cache = tmp_path / "hf-datasets"
    env = {"HF_DATASETS_CACHE": str(cache)}

    def launch(name: str, nproc: int | None, **changes):
        out = tmp_path / name
        result = train(tiny_overrides(tiny_model, reviews, out, **{"train.max_steps": 2, **changes}), nproc=nproc,
                       env=env)
        assert "tokenize" in read_summary(out)["startup_s"]
        return result, map_cache_files(cache)

    _, written = launch("first", nproc=2)
    assert len(written) == 2, written  # the train and eval splits

    # The same training again, in its own output_dir as every run is, by 2 ranks as before.
    second, after = launch("second", nproc=2)
    assert after == written, f"the second run tokenized again: it wrote {sorted(p.name for p in after - written)}"
    assert second.output.count("tokenized before: read from the cache") == 2, second.output[-3000:]

    # What the tokens depend on changed: both splits are tokenized again, into new files.
    longer, changed = launch("longer", nproc=None, **{"data.max_length": 32})
    assert len(changed - written) == 2, sorted(p.name for p in changed)
    assert "read from the cache" not in longer.output
