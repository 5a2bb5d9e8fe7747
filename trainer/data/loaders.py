"""The loaders: the tokenized splits batched by the batch plan and padded (`Collate`) or packed
(`PackedCollate`, data.packing), and where the train loader stands (its position, saved in
each checkpoint).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainer.config.schema import Config
from trainer.data import arrow, encoding, packing, pairs, reading, samplers, worker_server
from trainer.data import labels as labels_module
from trainer.data.batch_plan import BatchPlan
from trainer.data.packing import Layout
from trainer.errors import CheckpointError
from trainer.runtime.distributed import local_rank_zero_first
from trainer.runtime.environment import DistEnv
from trainer.tasks.registry import task_class
from trainer.tasks.space import Labels

log = logging.getLogger(__name__)


@dataclass
class Data:
    train_loader: DataLoader
    eval_loader: DataLoader
    train_sampler: samplers.GlobalBatchSampler
    num_train: int
    num_eval: int
    labels: Labels
    """The run's label space (trainer/data/labels.py)."""
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


def build(cfg: Config, dist_env: DistEnv, splits: reading.Splits, tokenizer, device: torch.device,
          plan: BatchPlan, layout: Layout | None = None) -> Data:
    """The loaders of the `load`ed splits: tokenized (once per node), batched by `plan`, padded
    or (a `layout`: data.packing) packed."""
    data_cfg = cfg.data
    with local_rank_zero_first(dist_env, "tokenizing"):
        train_ds = encoding.tokenize_split(splits.train, data_cfg, "train_split", tokenizer, splits.labels, dist_env)
        eval_ds = encoding.tokenize_split(splits.eval, data_cfg, "eval_split", tokenizer, splits.labels, dist_env)
        test_ds = None if splits.test is None else encoding.tokenize_split(
            splits.test, data_cfg, "test_split", tokenizer, splits.labels, dist_env)
    splits.steps_per_epoch(plan, cfg.train)  # checked before the model loads; again for other callers
    worker_server.start_worker_server(cfg)  # a no-op after run_train's; benchmarks and tests call build() alone
    loader_options = _loader_options(cfg, tokenizer, device, layout)
    if layout is not None and dist_env.is_rank_zero:
        log.info("%s", packing_line(cfg, layout))
    train_sampler = samplers.GlobalBatchSampler(
        arrow.int_column(train_ds, "length"), labels_module.ledger_keys(arrow.column(train_ds, "labels")),
        plan.global_batch, dist_env, cfg.seed, data_cfg.group_by_length,
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


def build_eval(cfg: Config, dist_env: DistEnv, splits: reading.Splits, tokenizer, device: torch.device,
               layout: Layout | None = None) -> tuple[DataLoader, int]:
    """The validation split of the `load`ed splits alone, for `python -m trainer evaluate`:
    (loader, samples)."""
    with local_rank_zero_first(dist_env, "tokenizing"):
        eval_ds = encoding.tokenize_split(splits.eval, cfg.data, "eval_split", tokenizer, splits.labels, dist_env)
    if layout is not None and dist_env.is_rank_zero:
        log.info("%s", packing_line(cfg, layout))
    return _eval_loader(eval_ds, cfg, dist_env, _loader_options(cfg, tokenizer, device, layout)), len(eval_ds)


def pad_multiple(cfg: Config, device: torch.device) -> int | None:
    """What each batch's padded length is rounded up to (data.pad_to_multiple_of, auto: 8 on
    GPU); None: each batch is padded to its own longest sample."""
    return cfg.data.pad_to_multiple_of or (8 if device.type == "cuda" else None)


def collate(cfg: Config, tokenizer, device: torch.device, layout: Layout | None = None,
            texts_only: bool = False) -> Collate | PairCollate:
    """Padded batches, or packed ones in `layout` (data.packing: trainer/model/packing.py's);
    of preference pairs, two texts a sample, for a task of pairs, unless `texts_only` (score:
    a reward per text)."""
    texts: Collate = (PackedCollate(tokenizer, layout, pad_multiple(cfg, device)) if layout is not None
                      else Collate(tokenizer, pad_multiple(cfg, device)))
    return PairCollate(texts) if task_class(cfg.data.problem_type).pairs and not texts_only else texts


def packing_line(cfg: Config, layout: Layout) -> str:
    """What the log says of data.packing, once a command packs its batches."""
    return (f"data.packing: each batch's samples laid end to end in rows as wide as its longest (at most "
            f"{cfg.data.max_length} tokens), each sample read at its {'last' if layout.pool_last else 'first'} token")


def _loader_options(cfg: Config, tokenizer, device: torch.device, layout: Layout | None) -> dict:
    data_cfg = cfg.data
    workers = data_cfg.num_workers
    return {
        "collate_fn": collate(cfg, tokenizer, device, layout),
        "num_workers": workers, "pin_memory": pins_memory(cfg, device),
        "persistent_workers": workers > 0,
        # Never a fork of the rank (start_worker_server says why). The worker reads the
        # tokenized split from the same memory-mapped Arrow cache files: it is sent their paths,
        # not the rows (an in-memory split, which has no cache file, is sent whole).
        "multiprocessing_context": "forkserver" if workers > 0 else None,
        "worker_init_fn": worker_server.init_worker,
        # Each new iterator draws its workers' base seed from this generator. Without one it
        # draws from torch's global RNG, which dropout uses too: a resumed run, which starts
        # its train iterator mid-epoch, and each evaluation would shift every dropout mask
        # after them, and a resume would no longer be bitwise.
        "generator": torch.Generator().manual_seed(cfg.seed),
    }


def pins_memory(cfg: Config, device: torch.device) -> bool:
    """Batches go through page-locked host memory (data.pin_memory, on GPU only), so their
    copies to the device need not block the host."""
    return device.type == "cuda" and cfg.data.pin_memory


def _eval_loader(ds, cfg: Config, dist_env: DistEnv, loader_options: dict) -> DataLoader:
    """Eval batches are padded in the rank's own process; data.num_workers is the train
    loader's. The samples are tokenized already, so an eval worker would save little, while
    a train worker pays: it pads the next batches while the rank computes."""
    return DataLoader(
        ds.remove_columns("length"), batch_size=cfg.train.eval_batch_size,
        sampler=samplers.EvalShardSampler(arrow.int_column(ds, "length"), dist_env),
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

    def width(self, longest: int) -> int:
        """A batch's row width: its longest sample, rounded up to `pad_to_multiple_of`."""
        return -(-longest // self.multiple) * self.multiple if self.multiple else longest

    def stacked(self, features: list[dict]) -> dict[str, torch.Tensor]:
        """The columns that are not padded (the labels), stacked as they are."""
        return {"labels" if key in ("label", "label_ids") else key: torch.tensor([f[key] for f in features])
                for key in features[0] if key not in self.pad_values}

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = np.fromiter((len(f["input_ids"]) for f in features), np.int64, len(features))
        width = self.width(int(lengths.max()))
        columns = np.arange(width)
        real = columns >= (width - lengths)[:, None] if self.left else columns < lengths[:, None]
        batch = {}
        for key in features[0]:
            if key in self.pad_values:
                padded = np.full((len(features), width), self.pad_values[key], np.int64)
                padded[real] = np.fromiter(itertools.chain.from_iterable(f[key] for f in features), np.int64,
                                           int(lengths.sum()))
                batch[key] = torch.from_numpy(padded)
        batch |= self.stacked(features)
        if self.with_mask and "attention_mask" not in batch:
            batch["attention_mask"] = torch.from_numpy(real.astype(np.int64))
        if self.left:
            batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return batch


class PackedCollate(Collate):
    """Tokenized samples to one packed micro-batch (data.packing, trainer/data/packing.py):
    `input_ids`, and `token_type_ids` where the samples have them, padded as `Collate` pads
    them; `position_ids`, `sequence_ids`, and `cu_seqlens` (where each sequence starts in the
    rows laid end to end, for FlashAttention's varlen kernel: trainer/model/varlen.py);
    `pool_index` and `lengths`, one per sample in order;
    the other columns (the labels) stacked as `Collate` stacks them.

    Rows are as wide as the micro-batch's longest sample (rounded up to `pad_to_multiple_of`),
    the width its padded batch has: the attention's masked blocks cost compute (a row's
    scores are width x width), so wider rows would trade the linear layers' saving for
    attention over blocks that are masked. At this width no layer computes more than padded,
    and the linear layers compute on fewer rows (benchmarks/RESULTS.md, 2026-11-29)."""

    def __init__(self, tokenizer, layout: Layout, pad_to_multiple_of: int | None):
        super().__init__(tokenizer, pad_to_multiple_of)
        self.layout = layout

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(f["input_ids"]) for f in features]
        width = self.width(max(lengths))
        rows = packing.rows_of(lengths, width)
        offset = self.layout.position_offset
        ids = {key: np.full((len(rows), width), self.pad_values[key], np.int64)
               for key in ("input_ids", "token_type_ids") if key in features[0]}
        positions = np.full((len(rows), width), offset, np.int64)
        sequences = np.full((len(rows), width), packing.PAD_SEQUENCE, np.int64)
        pool_index = np.zeros(len(features), np.int64)
        ends = []  # where each sequence, and each row's padded tail, ends in the rows laid end to end
        for r, row in enumerate(rows):
            start = 0
            for n, i in enumerate(row, start=1):
                end = start + lengths[i]
                for key, packed in ids.items():
                    packed[r, start:end] = features[i][key]
                positions[r, start:end] = np.arange(offset, offset + lengths[i])
                sequences[r, start:end] = n
                pool_index[i] = r * width + (end - 1 if self.layout.pool_last else start)
                ends.append(r * width + end)
                start = end
            if start < width:
                ends.append((r + 1) * width)
        return {**{key: torch.from_numpy(packed) for key, packed in ids.items()},
                "position_ids": torch.from_numpy(positions), "sequence_ids": torch.from_numpy(sequences),
                "cu_seqlens": torch.tensor([0, *ends], dtype=torch.int32),
                "pool_index": torch.from_numpy(pool_index), "lengths": torch.tensor(lengths),
                **self.stacked(features)}


class PairCollate:
    """Preference pairs (trainer/data/pairs.py) to one batch of twice as many texts, every
    pair's chosen side first, then every pair's rejected side, in the same order, padded or
    packed as `texts` pads or packs them: the model runs both sides in one forward, and the
    task reads pair i's rewards at rows i and pairs + i (trainer/tasks/pairwise.py). A pair's
    labels: its margin and each side's tokens, in float32 (pairwise.MARGIN, ...).

    One forward, not two: the step's backward then runs once, through one graph, so DDP's
    hooks fire once per parameter per micro-batch (two forwards before a backward break
    DDP under activation checkpointing, trl#480), and the two sides share the kernels."""

    def __init__(self, texts: Collate):
        self.texts = texts

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        names = [name for name in ("input_ids", "token_type_ids") if name in features[0]]
        sides = [{name: f[prefix + name] for name in names} for prefix in ("", pairs.REJECTED) for f in features]
        batch = self.texts(sides)
        batch["labels"] = torch.tensor([[f["labels"], len(f["input_ids"]), len(f[pairs.REJECTED + "input_ids"])]
                                        for f in features], dtype=torch.float32)
        return batch


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
