"""The tokenized splits' cache key (the map's fingerprint), the num_proc rule, and the column
checks that read Arrow instead of Python rows, in process.

The cache is named by that fingerprint: the same data, tokenizer and data settings must give
the same one in every run, whatever else the run changes (a new output_dir, lr, seed), and a
change to what the tokens depend on must give another. tests/e2e/test_tokenize_cache.py
proves the same across real launches.
"""

from __future__ import annotations

import re
from collections import Counter

import datasets
import numpy as np
import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from trainer.cli import run_config
from trainer.data import encoding, labels, loaders, reading, sources
from trainer.data.demo import generate
from trainer.errors import DataError
from trainer.model import pretrained
from trainer.preflight import data_check
from trainer.runtime.environment import DistEnv
from trainer.train import build

ROWS = {"text": ["The food was good.", "The staff was rude and careless.", "It was okay."] * 4,
        "title": ["Good", "Bad", "Fine"] * 4, "label": [3, 0, 2] * 4}


def settings(tiny_model, reviews, tmp_path, **changes) -> DictConfig:
    overrides = {"model.name": tiny_model, "data.path": reviews, "data.max_length": 64, "train.max_steps": 4,
                 "wandb.mode": "disabled", "output_dir": tmp_path / "run", **changes}
    return run_config.load("configs/demo.yaml", [f"{key}={value}" for key, value in overrides.items()])


def as_the_trainer_leaves_it(cfg):
    """The tokenizer after what Trainer.__init__ does before data.build: the builder's load
    (and a call and a padded batch, which leave state in a fast tokenizer)."""
    tokenizer = build.load(cfg, DistEnv(), torch.device("cpu"), torch.float32,
                           labels.from_config(cfg.data)).tokenizer
    encoded = tokenizer(ROWS["text"][:2], truncation=True, max_length=8)
    loaders.Collate(tokenizer, pad_to_multiple_of=8)([{"input_ids": ids} for ids in encoded["input_ids"]])
    return tokenizer


def fingerprint(cfg, tokenizer) -> str:
    ds = datasets.Dataset.from_dict(ROWS)
    tokenized = encoding.tokenize_split(ds, cfg.data, "train_split", tokenizer, labels.from_config(cfg.data), DistEnv())
    return tokenized._fingerprint


def test_the_tokenize_fingerprint_is_the_same_in_every_run_of_the_same_data(tiny_model, reviews, tmp_path):
    """A DictConfig node that `encode` closed over would hash with its parent, the whole run
    config: a new output_dir would be a new cache file, the split tokenized again."""
    first = settings(tiny_model, reviews, tmp_path)
    expected = fingerprint(first, pretrained.load_tokenizer(first.model))
    another_run = settings(tiny_model, reviews, tmp_path, output_dir=tmp_path / "other", **{
        "train.lr": 3e-5, "train.max_steps": 9, "seed": 7, "wandb.name": "again", "checkpoint.every": 2})
    assert fingerprint(another_run, as_the_trainer_leaves_it(another_run)) == expected


@pytest.mark.parametrize("change", ["data.max_length", "data.text_field", "data.text_pair_field", "tokenizer"])
def test_the_tokenize_fingerprint_changes_with_what_the_tokens_depend_on(tiny_model, reviews, tmp_path, change):
    base = settings(tiny_model, reviews, tmp_path)
    tokenizer = pretrained.load_tokenizer(base.model)
    expected = fingerprint(base, tokenizer)
    changes = {"data.max_length": {"data.max_length": 32}, "data.text_field": {"data.text_field": "title"},
               "data.text_pair_field": {"data.text_pair_field": "title"}, "tokenizer": {}}[change]
    changed = settings(tiny_model, reviews, tmp_path, **changes)
    if change == "tokenizer":
        tokenizer.add_tokens(["careless"])  # another vocabulary: other ids for the same text
    assert fingerprint(changed, tokenizer) != expected


def test_a_changed_max_length_tokenizes_again_and_the_same_one_reads_the_cache(tiny_model, reviews, tmp_path):
    """On a file-backed split, as the trainer's are: the same settings write nothing new."""
    ds = datasets.load_dataset("json", data_files=str(reviews / "train.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    cfg = settings(tiny_model, reviews, tmp_path)
    tokenizer = pretrained.load_tokenizer(cfg.model)

    def tokenize(cfg) -> set[str]:
        space = labels.from_config(cfg.data)
        tokenized = encoding.tokenize_split(ds, cfg.data, "train_split", tokenizer, space, DistEnv())
        assert len(tokenized) == len(ds)
        return encoding._cache_files(ds) or set()

    written = tokenize(cfg)
    assert written, "the map wrote no cache file"
    assert tokenize(settings(tiny_model, reviews, tmp_path, output_dir=tmp_path / "again")) == written
    assert len(tokenize(settings(tiny_model, reviews, tmp_path, **{"data.max_length": 32})) - written) == 1


def cpus_and_rows_per_process(monkeypatch, cpus: int, rows: int) -> None:
    """tokenize_processes' rule at a test's size: the CPUs this rank may use, and the rows a
    process is worth (10,000 in the product, beyond a unit test's split)."""
    monkeypatch.setattr(encoding.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(encoding, "_ROWS_PER_PROCESS", rows)


@pytest.mark.parametrize("first, then", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_a_split_tokenized_by_any_number_of_processes_is_read_again_by_any_other(
        tiny_model, reviews, tmp_path, monkeypatch, caplog, first, then):
    """num_proc of 2 or more writes a cache file per process, named by the fingerprint and a
    suffix (`_00000_of_00002`) that `datasets` counts in the fingerprint's 64 characters: the
    path every split of 20,000 rows or more takes. A rerun with another count (another node's
    CPUs, another local rank's share) reads those files, and tokenizes nothing."""
    ds = datasets.load_dataset("json", data_files=str(reviews / "train.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    cfg = settings(tiny_model, reviews, tmp_path)
    tokenizer, space = pretrained.load_tokenizer(cfg.model), labels.from_config(cfg.data)

    def tokenize(processes: int):
        cpus_and_rows_per_process(monkeypatch, processes, rows=len(ds) // 3)
        caplog.clear()
        with caplog.at_level("INFO", logger=encoding.__name__):
            tokenized = encoding.tokenize_split(ds, cfg.data, "train_split", tokenizer, space, DistEnv())
        return tokenized, encoding._cache_files(ds) or set(), caplog.text

    tokenized, written, said = tokenize(first)
    assert ("in process" if first == 1 else f"({first} processes)") in said, said
    shards = [name for name in written if f"_of_{first:05d}" in name]
    assert len(shards) == (first if first > 1 else 0), sorted(written)
    expected = tokenizer(list(ds["text"]), truncation=True, max_length=cfg.data.max_length)["input_ids"]
    assert tokenized["input_ids"] == expected  # every row once, in the split's order

    again, after, said = tokenize(then)
    assert after == written and "tokenized before: read from the cache" in said, (sorted(after - written), said)
    assert again["input_ids"] == expected


def test_a_failure_of_datasets_while_tokenizing_is_one_line_naming_the_split(tiny_model, reviews, tmp_path):
    """A cache disk that takes no more (here: a file size limit, which fails the map's write of
    the tokenized split with EFBIG as a full disk fails it with ENOSPC) is one line, not
    `datasets`' traceback."""
    import resource

    ds = datasets.load_dataset("json", data_files=str(reviews / "train.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    cfg = settings(tiny_model, reviews, tmp_path)
    tokenizer, space = pretrained.load_tokenizer(cfg.model), labels.from_config(cfg.data)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))  # Python ignores SIGXFSZ: a write fails
    try:
        with pytest.raises(DataError) as refused:
            encoding.tokenize_split(ds, cfg.data, "train_split", tokenizer, space, DistEnv())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(refused.value).startswith("data.train_split: tokenizing: OSError: [Errno 27] File too large"), \
        refused.value


def test_tokenize_processes(monkeypatch):
    monkeypatch.setattr(encoding.os, "sched_getaffinity", lambda pid: set(range(4)))
    first, second = (DistEnv(rank=r, local_rank=r, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                             master_port=29500) for r in (0, 1))
    assert encoding.tokenize_processes(1_000, first) is None  # a small split: starting processes costs more
    assert encoding.tokenize_processes(19_999, first) is None
    assert encoding.tokenize_processes(30_000, first) == 3  # each process gets 10,000 rows at least
    assert encoding.tokenize_processes(400_000, first) == 4  # local rank 0: the others wait for it
    assert encoding.tokenize_processes(400_000, second) == 2  # the others together: a share each
    assert encoding.tokenize_processes(400_000, DistEnv()) == 4


CHECKED = {"path": "data.jsonl", "csv_delimiter": None, "text_field": "text", "text_pair_field": None,
           "label_field": "label", "num_labels": 5, "problem_type": "single_label"}


def checked(rows: dict, **changes):
    data_cfg = OmegaConf.create({**CHECKED, **changes})
    reading._check_columns(datasets.Dataset.from_dict(rows), data_cfg, "data.train_split")


@pytest.mark.parametrize("rows, expected", [
    ({"text": [1, 2], "label": [0, 1]}, "non-text value in row 0: 1"),
    ({"text": ["a", "b"], "score": [0, 1]}, "data.label_field: column 'label' not in data.train_split"),
], ids=["int-text", "no-label-column"])
def test_the_column_checks(rows, expected):
    with pytest.raises(DataError) as refused:
        checked(rows)
    assert expected in str(refused.value)


def test_the_rows_without_text_or_label_are_found_in_a_subsample_in_its_own_order():
    ds = datasets.Dataset.from_dict({"text": ["a", None, "b", " ", "c"], "label": [0, 1, None, 3, 4]}
                                    ).select([3, 0, 1, 2])
    found = sources.invalid_rows(ds, OmegaConf.create(CHECKED))
    assert {kind: rows.tolist() for kind, rows in found.items()} == {
        "no text in column 'text'": [0, 2], "no label in column 'label'": [3]}
    assert not sources.invalid_rows(ds.select([1]), OmegaConf.create(CHECKED))
    checked({"text": ["a", "b"], "title": ["x", "y"], "label": [0, 4]}, text_pair_field="title")


def rows_read(loader) -> list[tuple]:
    """Each row a loader yields, as (its real tokens, its label), and asserts on the way that
    each batch is padded to its own longest row and no further."""
    rows = []
    for batch in loader:
        real = batch["attention_mask"].sum(dim=1)
        assert batch["input_ids"].shape[1] == int(real.max()), real.tolist()
        rows += [(tuple(ids[:n].tolist()), int(label))
                 for ids, n, label in zip(batch["input_ids"], real, batch["labels"], strict=True)]
    return rows


def test_an_eval_split_cut_by_max_eval_samples_is_read_whole_each_row_once_on_one_rank_or_two(
        tiny_model, reviews, tmp_path):
    """data.max_eval_samples below the split's 203 rows takes `_subsample`'s branch, which no
    test of the whole split reaches: the eval loader must then read exactly the seeded 50 rows,
    each once, in batches of train.eval_batch_size (the last one shorter), and two ranks'
    unpadded shards must together read each of them once."""
    cfg = settings(tiny_model, reviews, tmp_path, **{"data.max_eval_samples": 50, "train.eval_batch_size": 12})
    splits = reading.load(cfg, DistEnv())
    tokenizer = pretrained.load_tokenizer(cfg.model)
    whole = datasets.load_dataset("json", data_files=str(reviews / "test.jsonl"), split="train",
                                  cache_dir=str(tmp_path / "hf"))
    chosen = whole.shuffle(seed=cfg.seed).select(range(50))  # the seeded subsample, drawn here
    ids = tokenizer(list(chosen["text"]), truncation=True, max_length=cfg.data.max_length)["input_ids"]
    expected = Counter(zip(map(tuple, ids), chosen["label"], strict=True))
    assert len(whole) == 203 and sum(expected.values()) == 50

    loader, samples = loaders.build_eval(cfg, DistEnv(), splits, tokenizer, torch.device("cpu"))
    assert samples == 50 and [len(batch["input_ids"]) for batch in loader] == [12, 12, 12, 12, 2]
    assert Counter(rows_read(loader)) == expected

    tokenized = encoding.tokenize_split(splits.eval, cfg.data, "eval_split", tokenizer, splits.labels, DistEnv())
    options = loaders._loader_options(cfg, tokenizer, torch.device("cpu"), None)
    shards = [rows_read(loaders._eval_loader(tokenized, cfg, DistEnv(
        rank=r, local_rank=r, world_size=2, local_world_size=2, master_addr="localhost", master_port=1), options))
        for r in (0, 1)]
    assert [len(shard) for shard in shards] == [25, 25]
    assert Counter(shards[0] + shards[1]) == expected


def test_check_measures_the_token_lengths_of_a_seeded_sample_of_2000_rows_of_a_larger_split(tiny_model, tmp_path):
    """`check` tokenizes at most data_check.SAMPLE_ROWS (2,000) rows of a split, seeded: a
    train split of 2,500 rows takes the sampled side, which the 600-row reviews never reach.
    Its figures must be those of that seeded sample, not of the whole split (the 100
    validation rows are all measured)."""
    data = generate(tmp_path / "data", num_train=2500, num_test=100)
    cfg = settings(tiny_model, data, tmp_path, **{"data.max_length": 30})
    tokenizer = pretrained.load_tokenizer(cfg.model)

    def lengths(split: str, rows: int, seed: int | None = cfg.seed) -> np.ndarray:
        ds = datasets.load_dataset("json", data_files=str(data / f"{split}.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "hf"))
        texts = (ds if seed is None else ds.shuffle(seed=seed)).select(range(rows))["text"]
        return np.array([len(ids) for ids in tokenizer(list(texts))["input_ids"]])

    def tokens(name: str, sample: np.ndarray) -> str:
        p50, p90, p99 = (int(np.percentile(sample, q)) for q in (50, 90, 99))
        return f"  tokens ({name}, {len(sample):,} sampled rows): p50 {p50}, p90 {p90}, p99 {p99}, max {sample.max()}"

    def truncation(sample: np.ndarray) -> str:
        return (f"  data.max_length 30 truncates {(sample > 30).mean():.1%} of the train sample; "
                f"data.max_length={int(np.ceil(np.percentile(sample, 99)))} keeps 99% of it whole")

    sample = lengths("train", 2000)
    expected = [tokens("train", sample), tokens("validation", lengths("test", 100)), truncation(sample)]
    # The sample tells apart: the whole split, or its first 2,000 rows, truncate another share.
    assert expected[2] not in {truncation(lengths("train", 2500, None)), truncation(lengths("train", 2000, None))}
    checked = data_check.check(cfg, world_size=1)
    assert [line for line in checked.lines if line.startswith(("  tokens", "  data.max_length"))] == expected


def test_check_says_how_much_of_the_micro_batches_is_padding_and_what_packing_would_leave(tiny_model, tmp_path):
    """The padding of the train sample's micro-batches as the run's sampler draws them: with
    length grouping on little, with it off much, and then a warning that data.packing would
    leave a fraction of it; with packing on, the packed share leads."""
    data = generate(tmp_path / "data", num_train=600, num_test=100)

    def padding(**changes) -> tuple[list[float], list[str]]:
        cfg = settings(tiny_model, data, tmp_path, **{"train.batch_size": 16, **changes})
        checked = data_check.check(cfg, world_size=2)
        (line,) = [line for line in checked.lines if line.startswith("  padding: ")]
        return [float(share) for share in re.findall(r"([\d.]+)%", line)], checked.warnings

    (grouped, grouped_packed), grouped_warnings = padding()
    (mixed, mixed_packed), mixed_warnings = padding(**{"data.group_by_length": False})
    assert grouped < 10 and mixed > 25 and mixed_packed < mixed - 5, (grouped, mixed, mixed_packed)
    assert grouped_packed <= grouped
    assert not [w for w in grouped_warnings if "data.packing" in w]
    (suggestion,) = [re.fullmatch(r"(\d+)% of the tokens the micro-batches compute are padding \(length grouping "
                                  r"off\): data.packing=true would leave (\d+)% \(docs/packing.md\)", w)
                     for w in mixed_warnings if "data.packing" in w]
    assert suggestion and [int(n) for n in suggestion.groups()] == [pytest.approx(mixed, abs=0.51),
                                                                    pytest.approx(mixed_packed, abs=0.51)]
    (packed, padded), packed_warnings = padding(**{"data.group_by_length": False, "data.packing": True})
    assert (packed, padded) == (mixed_packed, mixed) and not [w for w in packed_warnings if "data.packing" in w]
