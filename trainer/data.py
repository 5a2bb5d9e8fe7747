"""Data: `datasets` loading, cached tokenization, and the samplers that make DDP exact.

Two properties matter and are tested:
- A global batch is the union of the ranks' batches, and it does not depend on the world
  size: N ranks x batch b see exactly what 1 process x batch N*b sees, step by step.
- Evaluation sees every sample exactly once (no padding duplicates), so metrics are exact.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from trainer import arrow, sources
from trainer import folds as folds_module
from trainer import labels as labels_module
from trainer.batch_plan import BatchPlan
from trainer.config import DataConfig
from trainer.distributed import DistEnv, local_rank_zero_first
from trainer.errors import CheckpointError, ConfigError, DataError, TrainerError, describe, one_line
from trainer.labels import Labels

log = logging.getLogger(__name__)

_MEGABATCH = 50  # length grouping sorts within windows of 50 global batches, as HF Trainer does


@dataclass
class Data:
    train_loader: DataLoader
    eval_loader: DataLoader
    train_sampler: GlobalBatchSampler
    num_train: int
    num_eval: int
    labels: Labels
    """The run's label space (trainer/labels.py)."""
    test_loader: DataLoader | None = None
    """data.test_split's, evaluated once at the end; None without one."""
    num_test: int = 0

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: a last partial global batch is dropped."""
        return self.train_sampler.steps_per_epoch

    def close(self) -> None:
        """End the loader workers now, on every exit path, errors included.

        They would otherwise outlive a failed run: at interpreter exit, multiprocessing
        SIGTERMs its daemonic children and joins them, but these block SIGTERM (see
        start_worker_server), and the traceback still holds their iterator, so the join
        would wait forever.
        """
        for loader in (self.train_loader, self.eval_loader, self.test_loader):
            stop_workers(loader)


def stop_workers(loader: DataLoader | None) -> list:
    """End `loader`'s persistent workers now; returns the worker processes it found (none: no
    loader, never iterated, or no workers).

    torch has no public way to stop persistent workers, hence the iterator's own shutdown; a
    worker stuck in a batch is then SIGKILLed. This is the one place that touches DataLoader
    internals: tests/unit/test_loader_internals.py fails, naming the attribute, if torch
    renames one, which would otherwise leave the workers running without a word.
    """
    iterator = getattr(loader, "_iterator", None)  # a persistent-workers loader keeps its own
    if loader is None or iterator is None:
        return []
    loader._iterator = None
    if not hasattr(iterator, "_workers"):  # an iterator in this process: nothing to stop
        return []
    workers = list(iterator._workers)
    iterator._shutdown_workers()  # tells each worker to finish, joins it briefly
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    return workers


def _load(data_cfg: DictConfig, split: str | None):
    """data.path's split `split` (a name, or `datasets` slicing: `train[:90%]`), or with
    None every split, as a DatasetDict. Local files are read by their suffix
    (trainer/sources.py)."""
    import datasets  # heavy import; only the training path needs it

    path = Path(data_cfg.path).expanduser()
    used_delimiter = None
    try:
        if path.is_file():
            builder = sources.BUILDERS.get(path.suffix)
            if builder is None:
                raise ConfigError(f"data.path: {path}: expected one of {sorted(sources.BUILDERS)}")
            options = sources.csv_options(data_cfg, path, path.suffix) if builder == "csv" else {}
            used_delimiter = options.get("sep")
            return datasets.load_dataset(builder, data_files=str(path), split=split, **options)
        if path.is_dir():
            suffix = sources.folder_suffix(path)
            if suffix is not None or data_cfg.csv_delimiter is not None:  # not `datasets`' own reading of them
                return datasets.load_dataset("csv", data_dir=str(path), split=split,
                                             **sources.csv_options(data_cfg, path, suffix or ".csv"))
            return datasets.load_dataset(str(path), split=split)
        return datasets.load_dataset(data_cfg.path, data_cfg.name, split=split)
    except TrainerError:
        raise
    except ValueError as e:
        if split is not None and "split" in str(e).lower():  # a slice `datasets` can't take
            raise ConfigError(f"data split {split!r}: {one_line(e)}") from None
        raise DataError(f"data.path: {data_cfg.path}: {one_line(e)}") from None
    except Exception as e:  # datasets raises many types for an unreadable or unknown source  # noqa: BLE001
        broken = sources.broken_json_line(path)
        if broken is not None:
            raise DataError(f"data.path: {data_cfg.path}: {broken}") from None
        raise DataError(f"data.path: {data_cfg.path}: {_describe(e)}{sources.delimiter_hint(path, used_delimiter)}"
                        ) from None


def split_name(spec: str) -> str:
    """The split a spec reads: `train` of `train[:90%]`."""
    return spec.split("[", 1)[0].strip()


def _load_split(data_cfg: DictConfig, split_key: str, available: list[str]):
    """data.<split_key>'s split, which must exist and hold rows."""
    spec = data_cfg[split_key]
    if split_name(spec) not in available:
        raise ConfigError(f"data.{split_key}: {spec!r} is not a split of {data_cfg.path} (its splits: "
                          f"{', '.join(available)})")
    ds = _load(data_cfg, spec)
    if len(ds) == 0:
        raise DataError(f"data.{split_key}: {spec!r} is empty")
    return ds


def _describe(e: BaseException) -> str:
    """The root cause says what is wrong with the file (a JSON parse error and its row); the
    wrappers raised from it ("An error occurred while generating the dataset") don't."""
    while e.__cause__ is not None:
        e = e.__cause__
    return describe(e) if one_line(e) else f"{describe(e)}: no rows could be read (is the file empty?)"


def _int_column(ds, column: str) -> np.ndarray:
    """An integer column as an int64 array of its own: Arrow's is read-only, and
    torch.from_numpy (the length grouping) warns on a read-only array."""
    return np.asarray(arrow.column(ds, column).to_numpy(), dtype=np.int64).copy()


def _check_columns(ds, data_cfg: DictConfig, split_key: str) -> None:
    """The named columns exist, and the text columns hold text (a row without any is
    sources.invalid_rows')."""
    import pyarrow as pa

    for key in ("text_field", "text_pair_field", "label_field"):
        column = data_cfg[key]
        if column is not None and column not in ds.column_names:
            path = Path(data_cfg.path).expanduser()
            hint = (sources.delimiter_hint(path, sources.delimiter(data_cfg, path.suffix))
                    if len(ds.column_names) == 1 else "")
            raise DataError(
                f"data.{key}: column {column!r} not in {split_key} (columns: {', '.join(ds.column_names)}){hint}"
            )
    for key in ("text_field", "text_pair_field"):
        column = data_cfg[key]
        if column is not None:
            values = arrow.column(ds, column)
            if any(test(values.type) for test in (pa.types.is_string, pa.types.is_large_string, pa.types.is_null)):
                continue  # a string column's nulls, and an all-null column's, are rows without text
            # any other type: the first row that is not a str, found row by row
            row = next((i for i, value in enumerate(ds[column]) if not isinstance(value, str) and value is not None),
                       None)
            if row is not None:
                raise DataError(f"data.{key}: column {column!r} in {split_key} has a non-text value "
                                  f"in row {row}: {ds[row][column]!r}")


def _subsample(ds, limit: int | None, seed: int):
    """Seeded, before tokenization: no wasted work."""
    return ds.shuffle(seed=seed).select(range(limit)) if limit is not None and limit < len(ds) else ds


def _hold_out(train, labels: Labels, data_cfg: DictConfig, seed: int) -> tuple[Any, Any, str]:
    """(train, validation, how): data.eval_fraction of the train split held out, seeded and,
    for single_label, stratified by class: the same rows on every rank and every restart."""
    import datasets

    fraction, ids = data_cfg.eval_fraction, labels_module.single_label_ids(train, labels, data_cfg)
    parts, how = None, "seeded"
    if ids is not None:
        by_class = train.add_column("__class__", ids).cast_column(
            "__class__", datasets.ClassLabel(num_classes=labels.num_labels))
        try:
            parts = by_class.train_test_split(test_size=fraction, seed=seed, stratify_by_column="__class__")
            parts = {name: part.remove_columns("__class__") for name, part in parts.items()}
            how = "stratified by label"
        except ValueError as e:  # a class of one row, or more classes than held-out rows
            how = f"not stratified: {one_line(e)}"
    if parts is None:
        parts = train.train_test_split(test_size=fraction, seed=seed)
    return parts["train"], parts["test"], f"{fraction * 100:g}% of data.train_split, {how}, seed {seed}"


def _fold_out(train, labels: Labels, data_cfg: DictConfig) -> tuple[Any, Any, str]:
    """(train, validation, how): fold data.fold of the train split's data.folds held out."""
    ids = labels_module.single_label_ids(train, labels, data_cfg)
    training, validating = folds_module.held_out(folds_module.assign(len(train), data_cfg.folds, ids), data_cfg.fold)
    how = "stratified by label" if ids is not None else "seeded"
    return (train.select(training), train.select(validating),
            f"fold {data_cfg.fold} of {data_cfg.folds} of data.train_split, {how}")


def train_folds(cfg: DictConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """(each train row's fold, its class id or None but for single_label): the folds that
    data.folds holds out, for a sweep that checks them before its trials and gathers their
    out-of-fold predictions after. In this process, no ranks."""
    data_cfg = cfg.data
    train = _readable_split(data_cfg, "train_split", list(_load(data_cfg, None).keys()), {})
    ids = labels_module.single_label_ids(train, labels_module.resolve(train, data_cfg), data_cfg)
    return folds_module.assign(len(train), data_cfg.folds, ids), ids


_ROWS_PER_PROCESS = 10_000
"""Tokenizing with num_proc starts a process per share of the split (~0.1 s each: a fork,
the tokenizer pickled, a shard written and joined); with at least this many rows (~0.6 s of
tokenizing on one core) each share is worth its process. Measured on 2 cores, in process ->
2 processes (benchmarks/startup_vs_data.py, RESULTS.md of 2026-11-24): 40,000 rows 2.6 ->
1.8 s, 400,000 rows 26.7 -> 13.9 s; 10,000 rows 0.64 -> 0.40 s, but 1,000 rows 0.06 -> 0.15 s."""


def tokenize_processes(rows: int, dist_env: DistEnv) -> int | None:
    """num_proc for tokenizing `rows` rows on this rank: None (in process) for a small split.
    Local rank 0 tokenizes while the node's other ranks wait for it (local_rank_zero_first),
    so it takes every CPU it may use; the others read its cache, or, where nothing is cached
    (an in-memory dataset), tokenize all at once, each on its share of the CPUs. The
    processes are forks of the rank (datasets' pool): short-lived, they run the tokenizer and
    write Arrow only, nothing (gloo, CUDA) whose lock another thread of the rank could hold."""
    cpus = len(os.sched_getaffinity(0))
    if not dist_env.is_local_rank_zero:
        cpus //= dist_env.local_world_size
    processes = min(cpus, rows // _ROWS_PER_PROCESS)
    return processes if processes > 1 else None


def _cache_files(ds) -> set[str] | None:
    """The map cache files (cache-*.arrow) beside `ds`'s own, or None: `ds` is in memory."""
    if not ds.cache_files:
        return None
    return {str(path) for path in Path(ds.cache_files[0]["filename"]).parent.glob("cache-*.arrow")}


_LOADING_ONLY = {"name_or_path", "is_local", "local_files_only", "cache_dir", "revision", "token", "_commit_hash"}
"""Tokenizer settings that say where it was loaded from, not how it tokenizes: a copy of the
model elsewhere (staged to a node's disk, say) reads the same cache."""


def _encoding_digest(tokenizer, settings: list) -> str | None:
    """A digest of what `_tokenize`'s encode turns a row into tokens with: the tokenizer as a
    fast tokenizer serializes itself (its vocabulary, added tokens, normalizer and the rest,
    not the truncation and padding state a call leaves in it) and its Python-side settings,
    the data settings, and the code (this module and trainer/labels.py). None for a tokenizer
    with no fast backend: `datasets` then hashes `encode` and all it closes over, pickling the
    tokenizer by value, in every run and on every rank: the tiny run's tokenize phase (two
    splits read from the cache) took 0.19 s so, 0.04 s with this (benchmarks/RESULTS.md).
    (Pickled, not dumped as JSON again: the first json.dumps of a vocabulary took 0.6 s.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    serialized = json.loads(backend.to_str())  # in the same order every time
    serialized.pop("truncation", None)
    serialized.pop("padding", None)
    python_side = {k: v for k, v in tokenizer.init_kwargs.items() if k not in _LOADING_ONLY}
    digest = hashlib.sha256(pickle.dumps(serialized, protocol=5))
    for part in (json.dumps([type(tokenizer).__name__, python_side, settings], sort_keys=True, default=str).encode(),
                 Path(__file__).read_bytes(), Path(labels_module.__file__).read_bytes()):
        digest.update(part)
    return digest.hexdigest()


def _tokenize(ds, data_cfg: DictConfig, split_key: str, tokenizer, labels: Labels, dist_env: DistEnv):
    # A batched map writes an Arrow cache file named by a fingerprint of the data (`ds`'s
    # own) and of `encode`: everything that decides its output (`_encoding_digest`). A rerun,
    # or the node's other ranks, then read that file instead of tokenizing again. So the
    # fingerprint holds exactly that and no more: the whole run config would give every run
    # with another output_dir (or lr, seed, ...) a new one, and the whole split tokenized again.
    text, pair, label = str(data_cfg.text_field), data_cfg.text_pair_field, str(data_cfg.label_field)
    pair = None if pair is None else str(pair)
    max_length = int(data_cfg.max_length)
    problem_type, stored_as, names = labels.problem_type, labels.stored_as, labels.names
    encoding = _encoding_digest(tokenizer, [text, pair, label, max_length, problem_type, stored_as, names])

    def encode(batch):
        encoded = tokenizer(batch[text], batch[pair] if pair else None, truncation=True, max_length=max_length)
        encoded["labels"] = labels_module.encode(batch[label], problem_type, stored_as, names)
        encoded["length"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    cached = _cache_files(ds)
    processes = tokenize_processes(len(ds), dist_env)
    started = time.perf_counter()
    fingerprint = None if encoding is None else hashlib.sha256(f"{ds._fingerprint} {encoding}".encode()).hexdigest()
    tokenized = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=processes,
                       new_fingerprint=fingerprint, desc=f"tokenize {split_key}")
    if cached is not None and {f["filename"] for f in tokenized.cache_files} <= cached:
        log.info("%s: %d rows, tokenized before: read from the cache", split_key, len(tokenized))
    else:
        log.info("%s: tokenized %d rows in %.1f s (%s)", split_key, len(tokenized), time.perf_counter() - started,
                 f"{processes} processes" if processes else "in process")
    return tokenized


@dataclass
class Splits:
    """The splits as loaded and checked, not yet tokenized."""

    train: Any  # datasets.Dataset: datasets ships no types
    eval: Any
    test: Any | None
    labels: Labels
    """The run's label space (trainer/labels.py): its classes from the whole train split, its
    counts and class weights from the rows that train."""
    held_out: str | None = None
    """How the validation split was held out of the train split (data.eval_fraction), or None:
    data.eval_split is a split of the data."""
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    """The rows data.drop_invalid_rows dropped: split: kind of problem: rows."""
    warnings: list[str] = field(default_factory=list)
    """What looks wrong in the labels (labels.name_warnings): `check` prints them, training logs them."""

    def steps_per_epoch(self, plan: BatchPlan, train_cfg: DictConfig) -> int:
        """Optimizer steps per epoch (a last partial global batch is dropped), known before
        tokenization: the run's length, and its LR schedule's, follow from it."""
        if len(self.train) < plan.global_batch:
            key = "train.global_batch" if train_cfg.global_batch else "train.batch_size"
            raise ConfigError(f"{key}: the global batch ({plan.global_batch}) is larger than the "
                              f"{len(self.train)} training samples")
        return len(self.train) // plan.global_batch


def load(cfg: DictConfig, dist_env: DistEnv, labels: Labels | None = None) -> Splits:
    """Every split loaded, checked and subsampled, before the model is: a mistake in the data
    is reported in seconds, not after a model download. The label space is resolved from the
    train split, or given (`labels`: a trained model's, which every split must fit). Where
    data.eval_split names no split of the data, validation is held out of the train split.
    Local rank 0 fills the node's `datasets` cache first, the other ranks then read it."""
    data_cfg = cfg.data
    import datasets  # noqa: F401  (~0.5 s) before the wait below, not after it

    with local_rank_zero_first(dist_env):
        available = list(_load(data_cfg, None).keys())
        dropped: dict[str, dict[str, int]] = {}
        train = _readable_split(data_cfg, "train_split", available, dropped)
        labels = labels or labels_module.resolve(train, data_cfg)
        held_out = None
        if data_cfg.folds is not None:
            train, evaluated, held_out = _fold_out(train, labels, data_cfg)
        elif split_name(data_cfg.eval_split) in available:
            evaluated = _readable_split(data_cfg, "eval_split", available, dropped)
        elif data_cfg.eval_split != DataConfig.eval_split and len(available) > 1:  # a mistyped split
            raise ConfigError(f"data.eval_split: {data_cfg.eval_split!r} is not a split of {data_cfg.path} (its "
                              f"splits: {', '.join(available)}); name one of them, or leave data.eval_split unset "
                              "to hold out data.eval_fraction of the train split")
        else:
            train, evaluated, held_out = _hold_out(train, labels, data_cfg, cfg.seed)
            others = [name for name in available if name != split_name(data_cfg.train_split)]
            # A warning where the data has a split that may be meant for validation.
            log.log(logging.WARNING if others else logging.INFO,
                    "data.eval_split: %r is not a split of %s (its splits: %s): validation is %s: %d rows, and %d "
                    "train rows%s", data_cfg.eval_split, data_cfg.path, ", ".join(available), held_out, len(evaluated),
                    len(train), f"; data.eval_split={others[0]} would validate on that split" if others else "")
        test = None if data_cfg.test_split is None else _readable_split(data_cfg, "test_split", available, dropped)
    train = _subsample(train, data_cfg.max_train_samples, cfg.seed)
    evaluated = _subsample(evaluated, data_cfg.max_eval_samples, cfg.seed)
    test = None if test is None else _subsample(test, data_cfg.max_eval_samples, cfg.seed)
    for split, split_key in ((evaluated, "eval_split"), (test, "test_split")):
        if split is not None:
            labels_module.check_split(split, labels, data_cfg, f"data.{split_key}")
    counted = labels_module.with_counts_and_weights(labels, train, data_cfg, cfg.train)
    return Splits(train, evaluated, test, counted, held_out, dropped, labels_module.name_warnings(counted))


def _readable_split(data_cfg: DictConfig, split_key: str, available: list[str], dropped: dict):
    """data.<split_key>'s split, its columns checked, its label names normalized and mapped
    (data.normalize_labels, data.label_map), and its rows that cannot train refused or, with
    data.drop_invalid_rows, dropped and counted into `dropped` (split: kind: rows)."""
    ds = _load_split(data_cfg, split_key, available)
    _check_columns(ds, data_cfg, f"data.{split_key}")
    ds, counts = sources.drop_or_refuse(labels_module.relabel(ds, data_cfg), data_cfg, f"data.{split_key}")
    if counts:
        dropped[split_name(data_cfg[split_key])] = counts
    return ds


class GlobalBatchSampler(DistributedSampler):
    """DistributedSampler whose global batches are the same for every world size.

    One permutation per epoch (seed + epoch, identical on every rank) is cut into global
    batches of `global_batch` samples (a last partial one is dropped), and rank r takes every
    world_size-th sample of it. So batch k of every rank together is exactly positions
    [k*G, (k+1)*G) of the permutation, whatever the world size. With `lengths`, samples are
    first sorted by length within windows of 50 global batches: each global batch has similar
    lengths (little padding), while the set of samples in each global batch still doesn't
    depend on the world size.

    The data position is global: an epoch and how many of its samples were consumed (a
    multiple of the global batch), not a per-rank offset, so a run resumes on any world size.
    `ledger` proves a position: it digests the samples that no rank will read from there on.
    """

    def __init__(self, lengths: np.ndarray, label_keys: np.ndarray, global_batch: int, dist_env: DistEnv, seed: int,
                 group_by_length: bool):
        super().__init__(
            # Typed for a Dataset, but reads only its len(): the positions stand in for the samples.
            range(len(lengths)), num_replicas=dist_env.world_size, rank=dist_env.rank,  # type: ignore[arg-type]
            shuffle=True, seed=seed, drop_last=True,
        )
        self.lengths, self.label_keys = lengths, label_keys
        """Each sample's token length, and its label as one int64 (labels.ledger_keys), for the ledger."""
        self.global_batch = global_batch
        self.group_by_length = group_by_length
        self.steps_per_epoch = len(lengths) // global_batch
        self.usable = self.steps_per_epoch * global_batch
        """Positions read per epoch: whole global batches only."""
        self.start = 0
        """The global position in this epoch that iteration starts from (a mid-epoch resume)."""
        self._order: tuple[int, torch.Tensor] | None = None

    def global_order(self, epoch: int) -> torch.Tensor:
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.lengths), generator=generator)
        if self.group_by_length:
            window = self.global_batch * _MEGABATCH
            lengths = torch.from_numpy(self.lengths)
            order = torch.cat([chunk[torch.argsort(-lengths[chunk], stable=True)] for chunk in order.split(window)])
        self._order = (epoch, order)
        return order

    def set_position(self, epoch: int, samples_in_epoch: int) -> None:
        """Iterate epoch `epoch` from its global position `samples_in_epoch`."""
        assert samples_in_epoch % self.global_batch == 0, "positions are whole global batches"
        self.set_epoch(epoch)
        self.start = samples_in_epoch

    def _positions(self, rank: int, start: int) -> slice:
        """The positions of the epoch's order that `rank` reads, from global position `start` on."""
        return slice(start + rank, self.usable, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_order(self.epoch)[self._positions(self.rank, self.start)].tolist())

    def __len__(self) -> int:
        return len(range(self.usable)[self._positions(self.rank, self.start)])

    def ledger(self, epoch: int, samples_in_epoch: int) -> tuple[int, str]:
        """How many samples of `epoch` count as consumed at global position
        `samples_in_epoch`, and their digest, as this world size deals the epoch: the
        positions none of the ranks reads from there on. Each sample counts by its id, token
        length and label, in order, so a changed dataset, seed, global batch or sampler code
        gives another digest."""
        unread = np.ones(self.usable, dtype=bool)
        for rank in range(self.num_replicas):
            unread[self._positions(rank, samples_in_epoch)] = False
        ids = self.global_order(epoch).numpy()[: self.usable][unread]
        digest = hashlib.sha256()
        for column in (ids, self.lengths[ids], self.label_keys[ids]):
            digest.update(np.ascontiguousarray(column, dtype=np.int64).tobytes())
        return len(ids), digest.hexdigest()


class EvalShardSampler(Sampler[int]):
    """A contiguous, unpadded shard per rank: every eval sample is seen exactly once.

    Ranks may get one sample more or less. That is safe because evaluation runs no
    collective per batch, only one all-reduce of the totals at the end.
    """

    def __init__(self, lengths: np.ndarray, dist_env: DistEnv):
        n = len(lengths)
        start = n * dist_env.rank // dist_env.world_size
        end = n * (dist_env.rank + 1) // dist_env.world_size
        shard = np.arange(start, end)
        # Longest first: batches of similar length pad little, and memory peaks at once.
        self.indices = shard[np.argsort(-lengths[start:end], kind="stable")].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build(cfg: DictConfig, dist_env: DistEnv, splits: Splits, tokenizer, device: torch.device,
          plan: BatchPlan) -> Data:
    """The loaders of the `load`ed splits: tokenized (once per node), batched by `plan`."""
    data_cfg = cfg.data
    with local_rank_zero_first(dist_env):
        train_ds = _tokenize(splits.train, data_cfg, "train_split", tokenizer, splits.labels, dist_env)
        eval_ds = _tokenize(splits.eval, data_cfg, "eval_split", tokenizer, splits.labels, dist_env)
        test_ds = None if splits.test is None else _tokenize(splits.test, data_cfg, "test_split", tokenizer,
                                                             splits.labels, dist_env)
    splits.steps_per_epoch(plan, cfg.train)  # checked before the model loads; again for other callers
    start_worker_server(cfg)  # a no-op after run_train's; benchmarks and tests call build() alone
    loader_options = _loader_options(cfg, tokenizer, device)
    train_sampler = GlobalBatchSampler(
        _int_column(train_ds, "length"), labels_module.ledger_keys(arrow.column(train_ds, "labels")), plan.global_batch,
        dist_env, cfg.seed, data_cfg.group_by_length,
    )
    train_loader = DataLoader(
        train_ds.remove_columns("length"), batch_size=plan.micro_batch, sampler=train_sampler,
        drop_last=True, **loader_options,
    )
    return Data(
        train_loader, _eval_loader(eval_ds, cfg, dist_env, loader_options), train_sampler,
        len(train_ds), len(eval_ds), splits.labels,
        test_loader=None if test_ds is None else _eval_loader(test_ds, cfg, dist_env, loader_options),
        num_test=0 if test_ds is None else len(test_ds),
    )


def build_eval(cfg: DictConfig, dist_env: DistEnv, splits: Splits, tokenizer, device: torch.device
               ) -> tuple[DataLoader, int]:
    """The validation split of the `load`ed splits alone, for `python -m trainer evaluate`:
    (loader, samples)."""
    with local_rank_zero_first(dist_env):
        eval_ds = _tokenize(splits.eval, cfg.data, "eval_split", tokenizer, splits.labels, dist_env)
    return _eval_loader(eval_ds, cfg, dist_env, _loader_options(cfg, tokenizer, device)), len(eval_ds)


def pad_multiple(cfg: DictConfig, device: torch.device) -> int | None:
    """What each batch's padded length is rounded up to (data.pad_to_multiple_of, auto: 8 on
    GPU); None: each batch is padded to its own longest sample."""
    return cfg.data.pad_to_multiple_of or (8 if device.type == "cuda" else None)


def collate(cfg: DictConfig, tokenizer, device: torch.device) -> Collate:
    return Collate(tokenizer, pad_multiple(cfg, device))


def _loader_options(cfg: DictConfig, tokenizer, device: torch.device) -> dict:
    data_cfg = cfg.data
    workers = data_cfg.num_workers
    return {
        "collate_fn": collate(cfg, tokenizer, device),
        "num_workers": workers, "pin_memory": pins_memory(cfg, device),
        "persistent_workers": workers > 0,
        # Never a fork of the rank (start_worker_server says why). The worker reads the
        # tokenized split from the same memory-mapped Arrow cache files: it is sent their paths,
        # not the rows (an in-memory split, which has no cache file, is sent whole).
        "multiprocessing_context": "forkserver" if workers > 0 else None,
        "worker_init_fn": _init_worker,
        # Each new iterator draws its workers' base seed from this generator. Without one it
        # draws from torch's global RNG, which dropout uses too: a resumed run, which starts
        # its train iterator mid-epoch, and each evaluation would shift every dropout mask
        # after them, and a resume would no longer be bitwise.
        "generator": torch.Generator().manual_seed(cfg.seed),
    }


def pins_memory(cfg: DictConfig, device: torch.device) -> bool:
    """Batches go through page-locked host memory (data.pin_memory, on GPU only), so their
    copies to the device need not block the host."""
    return device.type == "cuda" and cfg.data.pin_memory


def _eval_loader(ds, cfg: DictConfig, dist_env: DistEnv, loader_options: dict) -> DataLoader:
    """Eval batches are padded in the rank's own process; data.num_workers is the train
    loader's. The samples are tokenized already, so an eval worker would save little, while
    a train worker pays: it pads the next batches while the rank computes."""
    return DataLoader(
        ds.remove_columns("length"), batch_size=cfg.train.eval_batch_size,
        sampler=EvalShardSampler(_int_column(ds, "length"), dist_env),
        **loader_options | {"num_workers": 0, "persistent_workers": False, "multiprocessing_context": None},
    )


class Collate:
    """A batch of tokenized rows padded to its longest (rounded up to `pad_to_multiple_of`), on
    the tokenizer's own padding side, as tensors: what transformers' DataCollatorWithPadding
    returns, bit for bit (tests/unit/test_collate.py), plus position ids where that
    side is the left (Llama's tokenizers).

    In numpy, not through `tokenizer.pad`, whose per-row Python cost the loader worker 35 ms
    for a batch of 512 rows of ~90 tokens on a quiet 2-core Xeon (2 ms this way): against a
    GPU's 75 ms step, one worker on a slower or busier core would leave the step waiting
    (benchmarks/RESULTS.md, 2026-11-28).

    Left padding shifts each row's real tokens right by however much its batch pads, and
    decoder-only models count positions from column 0: a sample's logits would depend on
    its batch-mates (and on the world size, which sets who they are). Counted from each
    row's first real token instead, they don't.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None):
        # tokenizer.pad's padding values; any other column (the labels) is stacked as it is.
        self.pad_values = {"input_ids": tokenizer.pad_token_id, "token_type_ids": tokenizer.pad_token_type_id,
                           "attention_mask": 0, "special_tokens_mask": 1}
        self.with_mask = "attention_mask" in tokenizer.model_input_names
        self.multiple = pad_to_multiple_of
        self.left = tokenizer.padding_side == "left"

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = np.fromiter((len(f["input_ids"]) for f in features), np.int64, len(features))
        width = int(lengths.max())
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        columns = np.arange(width)
        real = columns >= (width - lengths)[:, None] if self.left else columns < lengths[:, None]
        batch = {}
        for key in features[0]:
            values = [f[key] for f in features]
            if key in self.pad_values:
                padded = np.full((len(features), width), self.pad_values[key], np.int64)
                padded[real] = np.fromiter(itertools.chain.from_iterable(values), np.int64, int(lengths.sum()))
                batch[key] = torch.from_numpy(padded)
            else:
                batch["labels" if key in ("label", "label_ids") else key] = torch.tensor(values)
        if self.with_mask and "attention_mask" not in batch:
            batch["attention_mask"] = torch.from_numpy(real.astype(np.int64))
        if self.left:
            batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return batch


WORKER_SERVER_PRELOAD = ["trainer.loader_server", "trainer.data", "datasets"]
"""The server's set-up (trainer/loader_server.py), then what a worker unpickles its loader
with: imported once by the server, each worker, its fork, starts with it imported."""


def start_worker_server(cfg: DictConfig) -> None:
    """Start the server that the train loader's workers are forked from (data.num_workers > 0).

    A worker is never a fork of its rank. By the first step each rank runs threads that Python
    does not see: gloo's connection loops (NCCL's on GPUs), torch's pools. A lock one of them
    holds at the fork instant stays held in the child for good, and a worker that needs it
    never delivers its first batch: its rank waits in the loader, its peers in the first
    all-reduce, and only the 30-minute init timeout ends it. multiprocessing's forkserver
    (Python 3.14's default) is a fresh program, exec'd, that only forks: it holds none of the
    rank's locks, and none of its sockets either, so a SIGKILLed rank's peers see its
    connections close at once.

    The preemption signals (fault.preempt_signals) stay blocked in the server and its workers,
    and in multiprocessing's resource tracker (which ignores SIGTERM itself): launchers signal
    whole process groups (torchrun) or every process of a job step (Slurm), and a server that
    died would take the workers with it, failing the rank ("DataLoader worker exited
    unexpectedly") before it saves. A signal mask is inherited through fork and exec alike,
    from the instant the server starts, where a handler would be set only once it has
    imported; the workers still exit with their rank (_init_worker).

    Idempotent. Call it early (run_train does): the server imports WORKER_SERVER_PRELOAD
    (~2 s of CPU) while the rank loads its data and model.
    """
    if cfg.data.num_workers == 0:
        return
    from multiprocessing import forkserver, resource_tracker

    multiprocessing.get_context("forkserver").set_forkserver_preload(WORKER_SERVER_PRELOAD)
    preemption = {getattr(signal, name) for name in cfg.fault.preempt_signals}
    # The tracker first, on its own: starting, it unblocks SIGTERM in this process again.
    for helper in (resource_tracker, forkserver):
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, preemption)
        try:  # a signal sent meanwhile still reaches this rank: blocked, not ignored
            helper.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def _init_worker(worker_id: int) -> None:
    """A worker ends the moment its rank does, SIGKILL and the OOM killer included. torch's own
    check watches the worker's parent, which is the server, not the rank; and the server
    outlives its rank while any worker lives (each worker holds a copy of the pipe whose
    closing tells the server to exit), so the two would wait on each other forever, holding
    the job's output open. The pipe this worker was started through closes when the rank dies,
    whatever killed it: a thread waits for that."""
    rank = multiprocessing.parent_process()
    if rank is None:
        raise RuntimeError("a loader worker is a multiprocessing child of its rank")
    threading.Thread(target=_exit_when_closed, args=(rank.sentinel,), name="exit-with-rank", daemon=True).start()


def _exit_when_closed(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(0)  # now, even mid-batch: the batch has no reader left


def to_device(batch: dict, device: torch.device, loader: DataLoader) -> dict[str, torch.Tensor]:
    # From page-locked memory (data.pin_memory, on GPU) the copies need not block the host.
    return {k: v.to(device, non_blocking=loader.pin_memory) for k, v in batch.items()}


def position(data: Data, batches: int) -> dict:
    """The global data position after `batches` global batches read, for a checkpoint: the
    epoch, the samples consumed in it and the ledger's digest of them."""
    epoch, batch_in_epoch = divmod(batches, data.steps_per_epoch)
    consumed, ledger = data.train_sampler.ledger(epoch, batch_in_epoch * data.train_sampler.global_batch)
    return {"epoch": epoch, "samples_in_epoch": consumed, "ledger": ledger}


def batch_position(data: Data, batch: int) -> dict:
    """Where global batch number `batch` (0: the run's first) lies: its epoch, its samples'
    positions [start, end) in that epoch's order (a function of the seed and the epoch), and
    the rows they are of the train split as the run reads it (after data.max_train_samples
    and the validation hold-out)."""
    epoch, batch_in_epoch = divmod(batch, data.steps_per_epoch)
    sampler = data.train_sampler
    start = batch_in_epoch * sampler.global_batch
    rows = sampler.global_order(epoch)[start:start + sampler.global_batch].tolist()
    return {"epoch": epoch, "samples_in_epoch": [start, start + sampler.global_batch], "rows": rows}


def check_position(data: Data, saved: dict | None, batches: int) -> None:
    """A resume's ledger: before the first step, the sampler (at this run's world size) must
    give the checkpoint's position exactly: the same samples consumed so far in the epoch,
    nothing lost, nothing repeated. Every rank checks alone: the same files, the same answer."""
    if saved is None:
        log.warning("the checkpoint has no data ledger: its data position is not verified")
        return
    here = position(data, batches)
    if here != saved:
        raise CheckpointError(
            f"the data position does not reproduce: the checkpoint consumed "
            f"{saved['samples_in_epoch']} samples of epoch {saved['epoch']} (ledger {saved['ledger'][:12]}), "
            f"this run's sampler gives {here['samples_in_epoch']} of epoch {here['epoch']} (ledger "
            f"{here['ledger'][:12]}): the dataset, the seed, the global batch or the code changed; resume with "
            "the data the run was started on, or start over with checkpoint.resume=never")
    log.info("data position verified: epoch %d, %d samples consumed (ledger %s)", here["epoch"],
             here["samples_in_epoch"], here["ledger"][:12])


def micro_batches(data: Data, grad_accum: int, start: int) -> Iterator[tuple[int, list[dict]]]:
    """Endless (epoch, micro-batches of one global batch), from global batch `start` (the
    steps done, and the batches skipped by trainer/faults/numerics.py).

    Mid-epoch resume needs no saved iterator: the sampler's order is a function of
    (seed, epoch), so the global position follows from that count alone.

    The train loader's workers start here (from start_worker_server's server) and persist
    across epochs.
    """
    epoch, step_in_epoch = divmod(start, data.steps_per_epoch)
    data.train_sampler.set_position(epoch, step_in_epoch * data.train_sampler.global_batch)
    return _steps(data, grad_accum, epoch, step_in_epoch, iter(data.train_loader))


def _steps(data: Data, grad_accum: int, epoch: int, step_in_epoch: int,
           batches: Iterator[dict]) -> Iterator[tuple[int, list[dict]]]:
    sampler = data.train_sampler
    while True:
        for _ in range(step_in_epoch, data.steps_per_epoch):
            yield epoch, [next(batches) for _ in range(grad_accum)]
        epoch, step_in_epoch = epoch + 1, 0
        sampler.set_position(epoch, 0)
        batches = iter(data.train_loader)
