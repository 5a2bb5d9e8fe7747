"""Elastic, in process: the global batch split over any world size that divides it, the
global sampler read from a global position by any world size, the ledger that proves a resume
reads on where it stopped, and the RNGs reseeded apart on a world-size change. A run that
changes its world size twice: tests/e2e/test_elastic.py.
"""

import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from trainer.checkpoint.rng import ProcessRNG
from trainer.config.schema import TrainConfig
from trainer.data.batch_plan import BatchPlan
from trainer.data.samplers import _MEGABATCH, GlobalBatchSampler
from trainer.errors import ConfigError
from trainer.runtime.environment import DistEnv


def plan(world_size: int, resumed: int | None = None, **train) -> tuple[int, int, int]:
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), train)
    made = BatchPlan.of(cfg, world_size, resumed)
    assert made.micro_batch * made.grad_accum * world_size == made.global_batch
    return made.global_batch, made.micro_batch, made.grad_accum


def test_the_global_batch_is_split_over_any_world_size_that_divides_it():
    # (global batch, micro-batch, accumulation): the fewest micro-batches of at most batch_size
    assert plan(1, global_batch=16, batch_size=8) == (16, 8, 2)
    assert plan(2, global_batch=16, batch_size=8) == (16, 8, 1)
    assert plan(4, global_batch=16, batch_size=8) == (16, 4, 1)
    assert plan(2, global_batch=48, batch_size=16) == (48, 12, 2)  # 24 a rank: 2 x 12, not 16 + 8
    assert plan(1, global_batch=7, batch_size=4) == (7, 1, 7)  # a prime share: micro-batches of one
    # Without a global batch: batch_size x grad_accum x world size, or the resumed checkpoint's.
    assert plan(2, batch_size=8, grad_accum=2) == (32, 8, 2)
    assert plan(1, 16, batch_size=8) == (16, 8, 2)
    assert plan(2, 16, batch_size=8, grad_accum=3) == (16, 8, 1)
    with pytest.raises(ConfigError, match=r"^train.global_batch: 16 samples per step cannot be split evenly over "
                                          r"world size 3; run on a world size that divides it \(1, 2, 4, 8, 16"):
        plan(3, global_batch=16)
    with pytest.raises(ConfigError, match=r"^train.global_batch: 16 \(the resumed checkpoint's\) samples"):
        plan(3, 16)


def sampler(world_size: int, rank: int, lengths, labels, global_batch=12, seed=0, group_by_length=True
            ) -> GlobalBatchSampler:
    return GlobalBatchSampler(lengths, labels, global_batch, DistEnv(rank=rank, world_size=world_size), seed,
                              group_by_length)


def test_any_world_size_reads_the_same_global_batches_from_a_global_position():
    """Positions are global: from a mid-epoch position, the ranks of every world size read the
    rest of the epoch's global batches, each exactly once, and the ledger of what came
    before is the same for all of them."""
    rng = np.random.default_rng(0)
    lengths, labels = rng.integers(5, 60, 100), rng.integers(0, 5, 100)  # 100 samples: 8 batches of 12, 4 dropped
    order = sampler(1, 0, lengths, labels).global_order(3).tolist()
    ledgers = set()
    for world_size in (1, 2, 3, 4, 6, 12):
        for start in (0, 36):
            ranks = [sampler(world_size, r, lengths, labels) for r in range(world_size)]
            for s in ranks:
                s.set_position(3, start)
            per_rank = [list(s) for s in ranks]
            share = 12 // world_size
            for k in range(len(per_rank[0]) // share):  # global batch k after the position
                batch = {i for reads in per_rank for i in reads[k * share:(k + 1) * share]}
                assert batch == set(order[start + 12 * k: start + 12 * (k + 1)])
            assert sorted(i for reads in per_rank for i in reads) == sorted(order[start:96])
            ledgers.add(ranks[0].ledger(3, start))
    assert sorted(count for count, _ in ledgers) == [0, 36]  # one ledger per position, whatever the world size


@pytest.mark.parametrize("group_by_length", [True, False], ids=["grouped", "shuffled"])
def test_several_length_windows_and_a_partial_last_one_are_read_alike_by_every_world_size(group_by_length):
    """The other tests fit in one length-grouping window (50 global batches); a real epoch has
    many, and a last partial one, whose last partial global batch is dropped. Every world size
    must read the same global batches in the same order, each row at most once, and drop the
    same rows; grouping only reorders each window, longest first."""
    rng = np.random.default_rng(1)
    window = 4 * _MEGABATCH  # a global batch of 4
    rows = 3 * window + 135  # 3 windows and a partial one: 183 global batches, 3 rows dropped
    lengths, labels = rng.integers(5, 60, rows), rng.integers(0, 5, rows)
    order = sampler(1, 0, lengths, labels, 4, group_by_length=group_by_length).global_order(0).tolist()
    for world_size in (1, 2, 4):
        per_rank = [list(sampler(world_size, r, lengths, labels, 4, group_by_length=group_by_length))
                    for r in range(world_size)]
        share = 4 // world_size
        batches = [{i for reads in per_rank for i in reads[k * share:(k + 1) * share]}
                   for k in range(len(per_rank[0]) // share)]
        assert batches == [set(order[k * 4:(k + 1) * 4]) for k in range(rows // 4)]
        read = [i for reads in per_rank for i in reads]
        assert len(read) == len(set(read)) and set(range(rows)) - set(read) == set(order[-3:])
    if group_by_length:  # each window holds the shuffle's rows of that window, longest first
        shuffle = sampler(1, 0, lengths, labels, 4, group_by_length=False).global_order(0).tolist()
        for start in range(0, rows, window):
            part = order[start:start + window]
            assert sorted(part) == sorted(shuffle[start:start + window])
            assert lengths[part].tolist() == sorted(lengths[part], reverse=True)


def test_the_ledger_changes_with_the_data_the_seed_and_the_global_batch():
    rng = np.random.default_rng(0)
    # 1000 samples: more than one length-grouping window (50 global batches)
    lengths, labels = rng.integers(5, 60, 1000), rng.integers(0, 5, 1000)
    ledger = sampler(2, 0, lengths, labels).ledger(1, 24)
    assert sampler(4, 3, lengths, labels).ledger(1, 24) == ledger
    relabeled = labels.copy()
    relabeled[int(sampler(1, 0, lengths, labels).global_order(1)[5])] += 1  # one consumed sample's label
    changed = [sampler(2, 0, lengths, relabeled).ledger(1, 24), sampler(2, 0, lengths, labels, seed=1).ledger(1, 24),
               sampler(2, 0, lengths, labels, global_batch=8).ledger(1, 24),
               sampler(2, 0, lengths, labels).ledger(1, 36), sampler(2, 0, lengths, labels).ledger(0, 24)]
    assert len({ledger, *changed}) == 6


def test_a_world_size_change_reseeds_each_rank_deterministically_and_apart():
    def draws(seed, step, rank):
        ProcessRNG.reseed(seed, step, rank)
        return torch.rand(4).tolist(), np.random.rand(), random.random()

    assert draws(42, 20, 0) == draws(42, 20, 0)
    assert len({str(draws(42, 20, rank)) for rank in range(4)} | {str(draws(42, 21, 0)), str(draws(7, 20, 0))}) == 6
