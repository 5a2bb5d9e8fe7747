"""`python -m trainer check`'s look at the data, before a node is taken: the splits loaded and
checked as training will load and check them (trainer/data/reading.py: the same code, so what passes
here trains), the labels resolved and counted in Arrow, and the token lengths of a seeded
sample. No weights load and no process group forms: a mistake in the data (a missing column or
split, a label of the wrong type, a validation label outside the train split's classes) is one line and exit 2
in seconds, on a login node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.config.schema import Config
from trainer.data import packing, reading, samplers
from trainer.data import pairs as pairs_module
from trainer.data.batch_plan import BatchPlan
from trainer.data.reading import Splits
from trainer.errors import ConfigError
from trainer.model import pretrained
from trainer.runtime.environment import DistEnv
from trainer.tasks.registry import task_class
from trainer.tasks.space import Labels

SAMPLE_ROWS = 2_000
"""The rows per split whose token lengths are measured: seeded, a few hundred milliseconds."""
FEW_STEPS = 10
"""An epoch shorter than this many optimizer steps is warned about."""
PERCENTILES = (50, 90, 99)


@dataclass
class DataCheck:
    labels: Labels
    lines: list[str]
    warnings: list[str]


def check(cfg: Config, world_size: int) -> DataCheck:
    """The data report of `cfg` for a job of `world_size` ranks; raises a TrainerError on a
    mistake in the data."""
    tokenizer, warnings = _tokenizer(cfg)
    # A task of pairs reads its data with the tokenizer: the pairs truncation makes the same.
    splits = reading.load(cfg, DistEnv(), tokenizer=tokenizer if task_class(cfg.data.problem_type).pairs else None)
    labels = splits.labels
    lines = [_splits_line(cfg, splits), f"  labels: {labels.describe()}"]
    lines += [f"  dropped from {split} (data.drop_invalid_rows): " + ", ".join(f"{n:,} with {kind}"
                                                                           for kind, n in kinds.items())
              for split, kinds in splits.dropped.items()]
    warnings += splits.warnings
    if labels.counts:
        held = "rows holding each label" if task_class(labels.problem_type).label_sets else "rows of each label"
        lines.append(f"  {held}"
                     f" (train): " + ", ".join(f"{name} {count:,} ({count / max(labels.rows, 1):.1%})"
                                               for name, count in zip(labels.names, labels.counts, strict=True)))
        imbalance = labels.imbalance() or 1.0
        lines.append(f"  imbalance: the most frequent label has {imbalance:.3g}x the rows of the least")
        if labels.weights is not None:
            lines.append("  class weights: " + ", ".join(f"{name} {w:.4g}"
                                                         for name, w in zip(labels.names, labels.weights, strict=True)))
        elif imbalance > 10:
            warnings.append(f"the labels are imbalanced ({imbalance:.3g}x): consider train.class_weights=balanced")
    if tokenizer is not None:
        lines += _lengths(cfg, splits, tokenizer, warnings, world_size)
    warnings += _epoch(cfg, splits, world_size)
    return DataCheck(labels, lines, warnings)


def _splits_line(cfg: Config, splits: Splits) -> str:
    data_cfg = cfg.data
    validation = f"{len(splits.eval):,} rows" + (f" held out ({splits.held_out}), as {data_cfg.eval_split!r} is "
                                                 f"not a split of the data" if splits.held_out else
                                                 f" ({data_cfg.eval_split})")
    test = "none" if splits.test is None else f"{len(splits.test):,} rows ({data_cfg.test_split})"
    return (f"data: {data_cfg.path}, {data_cfg.problem_type}: train {len(splits.train):,} rows "
            f"({data_cfg.train_split}), validation {validation}, test {test}")


def _tokenizer(cfg: Config):
    """(model.name's tokenizer, or None with the warning why: a hub model a login node can't
    reach, where the rest of the check stands)."""
    try:
        return pretrained.load_tokenizer(cfg.model), []
    except ConfigError as e:
        return None, [f"token lengths not measured: {e}"]


def _sample_lengths(cfg: Config, split, tokenizer) -> np.ndarray:
    """The untruncated token lengths of a seeded sample of `split`'s rows: (rows,), or for
    pairs (rows, 2), each pair's chosen and rejected side."""
    data_cfg = cfg.data
    sample = split.shuffle(seed=cfg.seed).select(range(min(SAMPLE_ROWS, len(split))))
    if task_class(data_cfg.problem_type).pairs:
        columns = pairs_module.Columns.of(data_cfg, split.column_names)
        tokens = pairs_module.tokenize(sample[:], tokenizer, columns, UNTRUNCATED, str(data_cfg.truncation_side))
        rejected = tokens[pairs_module.REJECTED + "input_ids"]
        return np.array([[len(c), len(r)] for c, r in zip(tokens["input_ids"], rejected, strict=True)])
    sample = sample.with_format("arrow")
    texts = sample[data_cfg.text_field].to_pylist()
    pairs = sample[data_cfg.text_pair_field].to_pylist() if data_cfg.text_pair_field else None
    return np.array([len(ids) for ids in tokenizer(texts, pairs, truncation=False)["input_ids"]])


UNTRUNCATED = 10**9
"""A max_length no text reaches."""


def _lengths(cfg: Config, splits: Splits, tokenizer, warnings: list[str], world_size: int) -> list[str]:
    """Each split's token-length percentiles from a seeded sample (a pair's: of each side),
    the data.max_length that keeps 99% of the train sample untruncated, and the padding its
    micro-batches carry."""
    data_cfg, lines = cfg.data, []
    train_lengths = None
    for name, split in (("train", splits.train), ("validation", splits.eval), ("test", splits.test)):
        if split is None:
            continue
        lengths = _sample_lengths(cfg, split, tokenizer)
        if train_lengths is None:
            train_lengths = lengths
        sides = [("rows", lengths)] if lengths.ndim == 1 else [("chosen", lengths[:, 0]), ("rejected", lengths[:, 1])]
        for side, values in sides:
            shown = ", ".join(f"p{q} {int(np.percentile(values, q))}" for q in PERCENTILES)
            what = f"sampled {side}" if side == "rows" else f"sampled pairs' {side} side"
            lines.append(f"  tokens ({name}, {len(values):,} {what}): {shown}, max {int(values.max())}")
    assert train_lengths is not None, "there is always a train split"
    longest = train_lengths if train_lengths.ndim == 1 else train_lengths.max(axis=1)
    keeps = int(np.ceil(np.percentile(longest, 99)))
    truncated = float((longest > data_cfg.max_length).mean())
    what, sample, kept = (("texts", "train sample", "it") if train_lengths.ndim == 1 else
                          ("pairs (either side)", "train sample's pairs (either side)", "them"))
    lines.append(f"  data.max_length {data_cfg.max_length} truncates {truncated:.1%} of the {sample}; "
                 f"data.max_length={keeps} keeps 99% of {kept} whole")
    if truncated > 0.05:
        warnings.append(f"data.max_length {data_cfg.max_length} truncates {truncated:.0%} of the training {what}; "
                        f"{keeps} would keep 99% whole (within the model's positions)")
    return lines + _padding(cfg, np.minimum(train_lengths, data_cfg.max_length), world_size, warnings)


PADDING_WARNED = 0.25
"""A share of padding in the micro-batches above which `check` suggests data.packing."""


def _padding(cfg: Config, lengths: np.ndarray, world_size: int, warnings: list[str]) -> list[str]:
    """The share of padding in rank 0's micro-batches of the train sample, drawn as the run's
    sampler draws them (length grouping as set), padded and packed (data.packing). `lengths`:
    each sample's, or (pairs) each side's, both rows of its micro-batch."""
    try:
        plan = BatchPlan.of(cfg.train, world_size)
    except ConfigError:  # _epoch says so
        return []
    if len(lengths) < plan.global_batch:
        return []
    rank_zero = DistEnv(world_size=world_size)
    sample_lengths = lengths if lengths.ndim == 1 else lengths.sum(axis=1)  # a pair's, as the sampler groups it
    sampler = samplers.GlobalBatchSampler(sample_lengths, np.zeros(len(lengths), np.int64), plan.global_batch,
                                          rank_zero, cfg.seed, cfg.data.group_by_length)
    order = lengths[list(sampler)]
    real = padded = packed = 0
    for start in range(0, len(order) - plan.micro_batch + 1, plan.micro_batch):
        batch = order[start:start + plan.micro_batch].T.ravel().tolist()  # a pair's sides: chosen rows, then rejected
        width = max(batch)
        real, padded = real + sum(batch), padded + width * len(batch)
        packed += width * len(packing.rows_of(batch, width))
    padded_share, packed_share = 1 - real / padded, 1 - real / packed
    grouping = "on" if cfg.data.group_by_length else "off"
    batches = f"of the tokens of the sample's micro-batches of {plan.micro_batch}"
    if cfg.data.packing:
        line = f"{packed_share:.1%} {batches} (data.packing; {padded_share:.1%} padded, length grouping {grouping})"
    else:
        line = f"{padded_share:.1%} {batches} (length grouping {grouping}; {packed_share:.1%} with data.packing)"
        if padded_share > PADDING_WARNED:
            warnings.append(f"{padded_share:.0%} of the tokens the micro-batches compute are padding (length "
                            f"grouping {grouping}): data.packing=true would leave {packed_share:.0%} (docs/packing.md)")
    return [f"  padding: {line}"]


def _epoch(cfg: Config, splits: Splits, world_size: int) -> list[str]:
    """An epoch of a few steps, or one that drops much of its data, at this world size."""
    try:
        plan = BatchPlan.of(cfg.train, world_size)
    except ConfigError as e:
        return [f"world_size={world_size}: {e}"]
    rows = len(splits.train)
    steps, dropped = divmod(rows, plan.global_batch)
    where = f"at a global batch of {plan.global_batch} (world size {world_size})"
    warnings = []
    if steps < FEW_STEPS:
        plural = "s" if steps != 1 else ""
        warnings.append(f"an epoch of {rows:,} train rows is {steps} optimizer step{plural} {where}: lower "
                        "train.batch_size, or set train.global_batch")
    if dropped > 0.1 * rows:
        warnings.append(f"each epoch drops {dropped:,} of its {rows:,} train rows (a last partial global batch) "
                        f"{where}")
    return warnings
