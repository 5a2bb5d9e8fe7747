"""The training batches as the loop reads them (trainer/data/): BatchPlan's split of the
global batch, micro_batches over a real DataLoader at world sizes 1, 2 and 3 across epoch
boundaries and from a resumed step, and the data position a checkpoint saves and a resume
checks. The sampler alone, at more world sizes, and the ledger's digest: tests/unit/test_elastic_plan.py."""

from __future__ import annotations

import logging
from itertools import islice

import numpy as np
import pytest
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from trainer.config.schema import TrainConfig
from trainer.data.batch_plan import BatchPlan
from trainer.data.loaders import Data, check_position, micro_batches, position
from trainer.data.samplers import GlobalBatchSampler
from trainer.errors import CheckpointError, ConfigError
from trainer.runtime.environment import DistEnv
from trainer.tasks.space import IDS, Labels, placeholder_names

SAMPLES, GLOBAL_BATCH, BATCH_SIZE = 50, 6, 3  # 8 steps per epoch; 2 samples dropped from each
THREE_CLASSES = Labels("single_label", placeholder_names(3), "data.num_labels", IDS)
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
RNG = np.random.default_rng(0)
LENGTHS, LABELS = RNG.integers(5, 60, SAMPLES), RNG.integers(0, 3, SAMPLES)


def train_cfg(**train):
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), train)


def test_every_world_size_that_divides_the_global_batch_gets_the_fewest_micro_batches():
    cfg = train_cfg(global_batch=24, batch_size=5)
    for world_size in range(1, 31):
        if 24 % world_size:
            with pytest.raises(ConfigError, match=rf"^train.global_batch: 24 samples per step cannot be split "
                                                  rf"evenly over world size {world_size}; "):
                BatchPlan.of(cfg, world_size)
            continue
        plan = BatchPlan.of(cfg, world_size)
        share = 24 // world_size
        assert plan.global_batch == 24 and plan.micro_batch * plan.grad_accum == share, plan
        assert plan.micro_batch <= 5
        # no fewer micro-batches of at most batch_size split the share evenly
        assert not [n for n in range(1, plan.grad_accum) if share % n == 0 and share // n <= 5], plan


def rank_data(world_size: int, rank: int, seed: int = 0, labels=LABELS, group_by_length: bool = False
              ) -> tuple[Data, int]:
    """Rank `rank`'s Data and grad_accum, as data.build makes them, over samples that are their ids.
    Not grouped by length by default: 50 samples are one grouping window, which sorts each
    epoch by length and leaves little of the shuffle to see."""
    plan = BatchPlan.of(train_cfg(global_batch=GLOBAL_BATCH, batch_size=BATCH_SIZE), world_size)
    sampler = GlobalBatchSampler(LENGTHS, labels, GLOBAL_BATCH, DistEnv(rank=rank, world_size=world_size), seed,
                                 group_by_length)
    loader = DataLoader(list(range(SAMPLES)), batch_size=plan.micro_batch, sampler=sampler, drop_last=True)
    return Data(loader, None, sampler, SAMPLES, 0, THREE_CLASSES), plan.grad_accum


def global_batches(world_size: int, start_step: int, steps: int, group_by_length: bool = False
                   ) -> list[tuple[int, list[int]]]:
    """(epoch, the sample ids of all ranks) of each optimizer step from `start_step` on."""
    ranks = [micro_batches(*rank_data(world_size, rank, group_by_length=group_by_length), start_step)
             for rank in range(world_size)]
    batches = []
    for per_rank in islice(zip(*ranks, strict=True), steps):
        (epoch,) = {epoch for epoch, _ in per_rank}  # the ranks agree
        batches.append((epoch, sorted(i for _, micros in per_rank for micro in micros for i in micro.tolist())))
    return batches


STEPS = 2 * STEPS_PER_EPOCH + 4  # into a third epoch


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, list[int]]]:
    return global_batches(1, 0, STEPS)


@pytest.mark.parametrize("group_by_length", [False, True])
def test_the_steps_read_the_same_global_batches_at_world_sizes_1_2_3(group_by_length):
    reference = global_batches(1, 0, STEPS, group_by_length)
    assert [epoch for epoch, _ in reference] == [0] * 8 + [1] * 8 + [2] * 4
    for epoch in (0, 1):
        batches = [batch for e, batch in reference if e == epoch]
        ids = [i for batch in batches for i in batch]
        assert len(batches[0]) == GLOBAL_BATCH and len(ids) == len(set(ids)) == STEPS_PER_EPOCH * GLOBAL_BATCH
    assert [batch for _, batch in reference[:8]] != [batch for _, batch in reference[8:16]]  # each epoch its order
    for world_size in (2, 3):
        assert global_batches(world_size, 0, STEPS, group_by_length) == reference, world_size


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("step", [3, STEPS_PER_EPOCH, STEPS_PER_EPOCH + 3])
def test_a_resume_at_step_k_reads_the_rest(reference, world_size, step):
    assert global_batches(world_size, step, STEPS - step) == reference[step:]


def test_the_position_after_each_step_is_the_same_at_every_world_size():
    data = {world_size: rank_data(world_size, world_size - 1)[0] for world_size in (1, 2, 3)}
    for step in range(STEPS):
        positions = [position(d, step) for d in data.values()]
        epoch, in_epoch = divmod(step, STEPS_PER_EPOCH)
        assert positions[0] == positions[1] == positions[2]
        assert (positions[0]["epoch"], positions[0]["samples_in_epoch"]) == (epoch, in_epoch * GLOBAL_BATCH)
    # Within an epoch each step moves the ledger; the next epoch starts a new one.
    ledgers = [position(data[1], step)["ledger"] for step in range(STEPS_PER_EPOCH)]
    assert len(set(ledgers)) == STEPS_PER_EPOCH
    assert position(data[1], STEPS_PER_EPOCH)["ledger"] == ledgers[0]


def test_a_resume_checks_its_position_at_any_world_size(reference, caplog):
    saved = position(rank_data(2, 1)[0], 11)
    with caplog.at_level(logging.INFO, logger="trainer.data"):
        check_position(rank_data(3, 0)[0], saved, 11)
    assert f"data position verified: epoch 1, 18 samples consumed (ledger {saved['ledger'][:12]})" in caplog.text

    relabeled = LABELS.copy()
    relabeled[reference[8][1][0]] += 1  # a sample consumed by step 11, in its epoch
    for data, step in [(rank_data(3, 0, seed=1)[0], 11), (rank_data(3, 0, labels=relabeled)[0], 11),
                       (rank_data(3, 0)[0], 12)]:
        with pytest.raises(CheckpointError, match=r"the data position does not reproduce: the checkpoint consumed "
                                                  r"18 samples of epoch 1"):
            check_position(data, saved, step)


def test_a_checkpoint_without_a_ledger_is_resumed_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        check_position(rank_data(1, 0)[0], None, 5)
    assert "no data ledger: its data position is not verified" in caplog.text
