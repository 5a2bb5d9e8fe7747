"""Tokenizing a split, cached: `datasets` writes each tokenized split to an Arrow file named
by what decides its tokens, which a rerun and the node's other ranks read instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import pickle
import time
from pathlib import Path

import numpy as np

from trainer.config.schema import DataConfig
from trainer.data import datasets_errors, pairs
from trainer.runtime.environment import DistEnv
from trainer.tasks.registry import task_class
from trainer.tasks.space import Labels

log = logging.getLogger(__name__)


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


_FINGERPRINT_CHARS = 32
"""The map's fingerprint, in hex characters: 128 bits of the digest. `datasets` names the
cache file by it and refuses a fingerprint over 64 characters, counting the suffix it
appends to each shard's with num_proc (`_00000_of_00002`: 15 more); the whole sha256 (64)
refused every split big enough for 2 processes (tokenize_processes)."""


def _cache_files(ds) -> set[str] | None:
    """The map cache files (cache-*.arrow) beside `ds`'s own, or None: `ds` is in memory."""
    if not ds.cache_files:
        return None
    return {str(path) for path in Path(ds.cache_files[0]["filename"]).parent.glob("cache-*.arrow")}


_LOADING_ONLY = {"name_or_path", "is_local", "local_files_only", "cache_dir", "revision", "token", "_commit_hash"}
"""Tokenizer settings that say where it was loaded from, not how it tokenizes: a copy of the
model elsewhere (staged to a node's disk, say) reads the same cache."""


def _encoding_digest(tokenizer, settings: list, code: list[str]) -> str | None:
    """A digest of what `tokenize_split`'s encode turns a row into tokens with: the tokenizer as a
    fast tokenizer serializes itself (its vocabulary, added tokens, normalizer and the rest,
    not the truncation and padding state a call leaves in it) and its Python-side settings,
    the data settings, and the `code` (the files of this module, of the task that encodes the
    labels, of trainer/data/pairs.py for pairs). None for a tokenizer
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
    template = getattr(tokenizer, "chat_template", None)
    for part in (json.dumps([type(tokenizer).__name__, python_side, template, settings], sort_keys=True,
                            default=str).encode(), *(Path(file).read_bytes() for file in code)):
        digest.update(part)
    return digest.hexdigest()


def read_at_last_token(encoded, pad_id: int | None) -> None:
    """Each row without the pad ids that end it, in place, where the pad stands in for eos.

    transformers' decoder classifiers (GPT-2, Llama, ...) read a row at its rightmost token
    that is not the pad id; with eos as the pad (trainer/model/pretrained.py), a text that
    ends in eos (a chat template's, say) would be read at the token before. Causal attention
    makes those trailing tokens invisible to that token, so dropping them changes no logit of
    a padded batch, and a packed one (trainer/data/packing.py) reads each sample at its last
    token: the same token."""
    if pad_id is None:
        return
    columns = [name for name in encoded if name != "labels"]
    for i, ids in enumerate(encoded["input_ids"]):
        end = len(ids)
        while end > 1 and ids[end - 1] == pad_id:
            end -= 1
        if end < len(ids):
            for name in columns:
                encoded[name][i] = encoded[name][i][:end]


def stand_in_pad(tokenizer) -> int | None:
    """The pad id where it is eos standing in (decoders without a pad token), else None."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None and pad == tokenizer.eos_token_id else None


def _text_encoder(data_cfg: DataConfig, tokenizer, labels: Labels):
    """(encode, what decides its tokens) for a task of one text (or text pair) and a label per row."""
    text, pair, label = str(data_cfg.text_field), data_cfg.text_pair_field, str(data_cfg.label_field)
    pair = None if pair is None else str(pair)
    max_length, side, pad = int(data_cfg.max_length), str(data_cfg.truncation_side), stand_in_pad(tokenizer)
    problem_type, stored_as, names = labels.problem_type, labels.stored_as, labels.names
    task = task_class(problem_type)

    def encode(batch):
        tokenizer.truncation_side = side
        encoded = tokenizer(batch[text], batch[pair] if pair else None, truncation=True, max_length=max_length)
        read_at_last_token(encoded, pad)
        encoded["labels"] = task.encode(batch[label], stored_as, names)
        encoded["length"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    settings = [text, pair, label, max_length, side, problem_type, stored_as, names]
    return encode, _encoding_digest(tokenizer, settings, [__file__, inspect.getfile(task)])


def _pair_encoder(data_cfg: DataConfig, tokenizer, column_names: list[str]):
    """(encode, what decides its tokens) for preference pairs (trainer/data/pairs.py): each
    side's tokens (the rejected side's columns named pairs.REJECTED + ...), the pair's margin
    as its label, and as its length both sides' tokens, what it costs in a batch."""
    columns = pairs.Columns.of(data_cfg, column_names)
    max_length, side, pad = int(data_cfg.max_length), str(data_cfg.truncation_side), stand_in_pad(tokenizer)

    def encode(batch):
        encoded = pairs.tokenize(batch, tokenizer, columns, max_length, side)
        for prefix in ("", pairs.REJECTED):
            side_columns = {name: encoded[prefix + name] for name in ("input_ids", "token_type_ids")
                            if prefix + name in encoded}
            read_at_last_token(side_columns, pad)
            encoded.update({prefix + name: values for name, values in side_columns.items()})
        rows = len(encoded["input_ids"])
        encoded["labels"] = [0.0] * rows if columns.margin is None else [float(m) for m in batch[columns.margin]]
        rejected = encoded[pairs.REJECTED + "input_ids"]
        encoded["length"] = [len(c) + len(r) for c, r in zip(encoded["input_ids"], rejected, strict=True)]
        return encoded

    settings = [dataclasses.astuple(columns), max_length, side]
    return encode, _encoding_digest(tokenizer, settings, [__file__, pairs.__file__])


def identical_pairs(ds, data_cfg: DataConfig, tokenizer, split_key: str = "data.train_split") -> dict[str, np.ndarray]:
    """The pairs of `ds` whose two sides tokenize the same once truncated to data.max_length
    (the part they differ in is cut off): {what is wrong: their rows}, or {}. Tokenized as
    training tokenizes them; the answer, a flag a row, is cached as the tokens are (its
    fingerprint says so), so a rerun and the node's other ranks read it."""
    encode, encoding = _pair_encoder(data_cfg, tokenizer, ds.column_names)

    def flag(batch):
        encoded = encode(batch)
        return {"same": [c == r for c, r in zip(encoded["input_ids"], encoded[pairs.REJECTED + "input_ids"],
                                                strict=True)]}

    fingerprint = None if encoding is None else hashlib.sha256(
        f"{ds._fingerprint} {encoding} the same once truncated".encode()).hexdigest()[:_FINGERPRINT_CHARS]
    with datasets_errors.as_data_error(split_key, "tokenizing its pairs"):
        flags = ds.map(flag, batched=True, remove_columns=ds.column_names, new_fingerprint=fingerprint,
                       desc="pairs the same once truncated")
    same = np.flatnonzero(flags.with_format("numpy")["same"])
    if not len(same):
        return {}
    cut = "end" if data_cfg.truncation_side == "right" else "start"
    return {f"chosen and rejected the same once cut to data.max_length={data_cfg.max_length} tokens at their {cut} "
            f"(raise it, or set data.truncation_side={'left' if cut == 'end' else 'right'})": same}


def tokenize_split(ds, data_cfg: DataConfig, split_key: str, tokenizer, labels: Labels, dist_env: DistEnv):
    # A batched map writes an Arrow cache file named by a fingerprint of the data (`ds`'s
    # own) and of `encode`: everything that decides its output (`_encoding_digest`). A rerun,
    # or the node's other ranks, then read that file instead of tokenizing again. So the
    # fingerprint holds exactly that and no more: the whole run config would give every run
    # with another output_dir (or lr, seed, ...) a new one, and the whole split tokenized again.
    if task_class(labels.problem_type).pairs:
        encode, encoding = _pair_encoder(data_cfg, tokenizer, ds.column_names)
    else:
        encode, encoding = _text_encoder(data_cfg, tokenizer, labels)
    cached = _cache_files(ds)
    processes = tokenize_processes(len(ds), dist_env)
    started = time.perf_counter()
    fingerprint = None if encoding is None else hashlib.sha256(
        f"{ds._fingerprint} {encoding}".encode()).hexdigest()[:_FINGERPRINT_CHARS]
    with datasets_errors.as_data_error(f"data.{split_key}", "tokenizing"):
        tokenized = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=processes,
                           new_fingerprint=fingerprint, desc=f"tokenize {split_key}")
    if cached is not None and {f["filename"] for f in tokenized.cache_files} <= cached:
        log.info("%s: %d rows, tokenized before: read from the cache", split_key, len(tokenized))
    else:
        log.info("%s: tokenized %d rows in %.1f s (%s)", split_key, len(tokenized), time.perf_counter() - started,
                 f"{processes} processes" if processes else "in process")
    return tokenized
