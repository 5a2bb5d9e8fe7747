"""The replica comparison (trainer/faults/replicas.py): the digest sees one flipped bit in any
weight or optimizer state, the odd rank is the majority's outlier, a divergence names its host
with exit 76, and ranks that start apart are told so as a setup error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.errors import LaunchError
from trainer.exit_codes import Exit
from trainer.faults import inject, replicas, watchdog
from trainer.faults.replicas import Replicas, ReplicasDiverged, digest, odd_ranks, replicated_state
from trainer.runtime.environment import DistEnv


def trained(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step: its optimizer holds a step count and two moments."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4, dtype=dtype)).sum().backward()
    optimizer.step()
    return model, optimizer


def digest_of(model, optimizer) -> list[int]:
    return digest([t for _, t in replicated_state(model, optimizer)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_flipped_bit_in_any_weight_or_optimizer_state_changes_that_tensors_digest_alone(dtype):
    reference = digest_of(*trained(dtype))
    names = [name for name, _ in replicated_state(*trained(dtype))]
    assert len(names) == 6 * 4 and "0.weight (exp_avg_sq)" in names  # each weight, its step and moments
    assert digest_of(*trained(dtype)) == reference  # the same state: the same digest
    for index in range(len(reference)):
        for bit in ("lowest", "middle", "sign"):
            state = trained(dtype)
            first = replicas.bits(replicated_state(*state)[index][1])[:1]
            first ^= torch.ones_like(first) << {"lowest": 0, "middle": 7, "sign": 8 * first.element_size() - 1}[bit]
            changed = [i for i, (a, b) in enumerate(zip(digest_of(*state), reference, strict=True)) if a != b]
            assert changed == [index], (names[index], bit)


def test_the_odd_rank_is_the_majoritys_outlier_and_without_a_majority_every_rank_is():
    assert odd_ranks([[1, 2]] * 4) == []
    assert odd_ranks([[1, 2], [1, 2], [1, 3]]) == [2]
    assert odd_ranks([[1, 3], [1, 2], [1, 2], [1, 2]]) == [0]
    assert odd_ranks([[1, 2], [1, 3]]) == [0, 1]  # 2 ranks: either could be wrong
    assert odd_ranks([[1, 2], [1, 2], [1, 3], [1, 3]]) == [0, 1, 2, 3]
    assert odd_ranks([[1], [2], [3]]) == [0, 1, 2]


def gathered_from(monkeypatch, ranks: list[tuple[list[int], str]]) -> None:
    """The ranks' (digest, host) as distributed.all_gather would return them."""
    monkeypatch.setattr(replicas.distributed, "all_gather", lambda dist_env, mine: ranks)


def comparing(world_size: int) -> Replicas:
    return Replicas(*trained(), DistEnv(rank=0, world_size=world_size), every=5, replicated=True)


def test_a_divergence_names_the_odd_rank_its_host_and_its_first_differing_tensor(monkeypatch):
    good = digest_of(*trained())
    bad = [good[0], good[1] + 1, good[2], good[3] + 4, *good[4:]]
    gathered_from(monkeypatch, [(good, "node0"), (good, "node0"), (bad, "node1")])
    with pytest.raises(ReplicasDiverged) as raised:
        comparing(3).check(10)
    assert str(raised.value).startswith(
        "the replicas diverged by step 10: rank 2 on node1 (2 of 24 tensors differ, the first 0.weight (step)) "
        "holds another state than ranks 0, 1. Exact DDP keeps them bitwise equal: most likely silent data "
        "corruption")
    assert raised.value.hosts == ["node1"]
    assert watchdog.verdict(raised.value, set()) == (Exit.NODE_FAULT, ["node1"])

    gathered_from(monkeypatch, [(good, "node0"), (bad, "node1")])
    with pytest.raises(ReplicasDiverged) as raised:
        comparing(2).check(10)
    assert ("ranks 0, 1 on node0, node1 hold 2 different states, none held by a majority (rank 0 and rank 1: "
            "2 of 24 tensors differ, the first 0.weight (step))") in str(raised.value)
    assert raised.value.hosts == ["node0", "node1"]

    gathered_from(monkeypatch, [(good, "node0")] * 6 + [(bad, "node1")])
    with pytest.raises(ReplicasDiverged, match=r"rank 6 on node1 \(.*\) holds another state than the other 6 ranks"):
        comparing(7).check(10)

    gathered_from(monkeypatch, [(good, "node0"), (list(good), "node1")])
    comparing(2).check(10)  # equal: nothing raised


def test_ranks_that_start_apart_loaded_different_files_which_is_a_setup_error(monkeypatch):
    good = digest_of(*trained())
    gathered_from(monkeypatch, [(good, "node0"), (good, "node0"), ([good[0] + 1, *good[1:]], "node1")])
    with pytest.raises(LaunchError, match=r"^the ranks start from different weights: rank 2 on node1 .*Every node "
                                          r"must load the same model.name"):
        comparing(3).check_start()
    assert LaunchError.exit_code == Exit.USAGE


def test_the_comparison_runs_every_interval_and_before_each_save_where_state_is_replicated():
    assert [step for step in range(1, 13) if comparing(2).due(step, saving=step == 7)] == [5, 7, 10]
    assert not Replicas(*trained(), DistEnv(rank=0, world_size=2), every=0, replicated=True).due(5, saving=True)
    assert not Replicas(*trained(), DistEnv(rank=0, world_size=2), every=5, replicated=False).due(5, saving=True)


def test_the_corrupt_fault_flips_the_lowest_bit_of_the_first_weight_on_its_rank():
    model, optimizer = trained()
    before = digest_of(model, optimizer)
    inject.configure(DistEnv(rank=1, world_size=2), {"TRAINER_FAULT_CORRUPT": "1:6"})
    try:
        inject.point("weights", 5, model=model)
        assert digest_of(model, optimizer) == before
        inject.point("weights", 6, model=model)
    finally:
        inject.configure(DistEnv(), {})
    after = digest_of(model, optimizer)
    assert [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a != b] == [0]
    assert abs(after[0] - before[0]) == 1
