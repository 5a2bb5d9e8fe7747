"""Device decisions and the GPU-side mechanisms that a CPU can still prove.

What needs a real GPU is in tests/test_cuda.py (skipped here); these run everywhere.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import compare_weights, tiny_overrides, train
from trainer.checkpoint import host_copy
from trainer.errors import LaunchError
from trainer.distributed import DistEnv, pick_device

TWO_LOCAL_RANKS = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                          master_port=29500)


@pytest.fixture
def one_gpu(monkeypatch):
    """torch believes one GPU is visible: the decision, not the device, is under test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_gloo_ranks_may_share_a_gpu(one_gpu):
    assert pick_device(TWO_LOCAL_RANKS, "gloo") == (torch.device("cuda", 0), "gloo")


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_nccl_refuses_more_ranks_than_gpus(one_gpu, backend):
    with pytest.raises(LaunchError, match=r"LOCAL_RANK=1 but only 1 GPU\(s\) are visible.*dist.backend=gloo"):
        pick_device(TWO_LOCAL_RANKS, backend)


def test_host_copy_is_a_snapshot_that_keeps_tied_tensors_tied():
    weight = torch.randn(4, 3)
    state = {"model": {"embed": weight, "tied_head": weight, "bias": torch.zeros(3)},
             "optimizer": {"state": {0: {"step": torch.tensor(5.0)}}, "param_groups": [{"lr": 0.1}]}}
    before = weight.clone()
    copied = host_copy(state)
    weight.add_(1.0)  # training goes on after the snapshot
    assert torch.equal(copied["model"]["embed"], before)
    assert copied["model"]["embed"].data_ptr() == copied["model"]["tied_head"].data_ptr()
    assert copied["model"]["embed"].data_ptr() != weight.data_ptr()
    assert copied["optimizer"]["param_groups"] == [{"lr": 0.1}] and copied["optimizer"]["state"][0]["step"] == 5


def test_deterministic_kernels_train_the_same_weights_on_cpu(tiny_model, reviews, tmp_path):
    """train.deterministic turns on torch's deterministic mode (which would raise on any
    kernel without a deterministic version); CPU kernels are deterministic already."""
    plain, strict = tmp_path / "plain", tmp_path / "strict"
    train(tiny_overrides(tiny_model, reviews, plain), nproc=None)
    train(tiny_overrides(tiny_model, reviews, strict, **{"train.deterministic": True}), nproc=None)
    summary = lambda out: json.loads((out / "summary.json").read_text())  # noqa: E731
    assert summary(strict)["deterministic_kernels"] and not summary(plain)["deterministic_kernels"]
    assert not compare_weights(plain, strict, 4).differing
