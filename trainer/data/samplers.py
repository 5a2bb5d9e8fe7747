"""The samplers that make DDP exact.

Two properties matter and are tested:
- A global batch is the union of the ranks' batches, and it does not depend on the world
  size: N ranks x batch b see exactly what 1 process x batch N*b sees, step by step.
- Evaluation sees every sample exactly once (no padding duplicates), so metrics are exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from trainer.runtime.environment import DistEnv

_MEGABATCH = 50  # length grouping sorts within windows of 50 global batches, as HF Trainer does


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
