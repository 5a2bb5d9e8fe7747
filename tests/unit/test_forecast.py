"""The scaling forecast's parts (trainer/preflight/forecast.py): the link fit recovers a known link, the
traffic model cuts the buckets DDP itself cuts, each hook's bytes follow torch's hooks, and
the step model overlaps as DDP does. Whether the whole forecast matches measured steps is
benchmarks/forecast.py's question, on shaped links: timings don't belong in the suite."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from trainer.model import lora
from trainer.preflight import forecast
from trainer.preflight.forecast import Compute, Link
from trainer.strategies.ddp import DDP
from trainer.strategies.traffic import Bucket, Param, Traffic

MB = 1e6


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4,
                                                    num_attention_heads=4, intermediate_size=128, num_labels=5))


def cfg(**ddp) -> OmegaConf:
    settings = {"bucket_cap_mb": 25.0, "sparse_embedding_grad": True, "comm_hook": "none", "powersgd_rank": 4}
    return OmegaConf.create({"train": {"strategy": "ddp"}, "ddp": settings | ddp})


def test_the_fit_recovers_a_known_link_from_its_timings():
    link = Link(latency_s=50e-6, busbw=1.25e8)  # 1 Gb/s
    timings = [(n, link.all_reduce_s(n, 4)) for n in (1024, 256 * 1024, 4 * 2**20, 16 * 2**20)]
    fitted = Link.fit(timings, world=4)
    assert fitted.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fitted.busbw == pytest.approx(1.25e8, rel=1e-6)
    assert forecast.fmt_rate(fitted.busbw) == "1 Gb/s"
    # A token bucket lets its burst through at full speed: the 256 KiB all-reduce is fast.
    # The bandwidth comes from the large sizes' slope, so the burst does not inflate it.
    burst = [(n, s / 5 if n < 2**20 else s) for n, s in timings]
    assert Link.fit(burst, world=4).busbw == pytest.approx(1.25e8, rel=1e-6)


def test_buckets_are_the_ones_ddp_cuts_in_the_order_backward_fills_them():
    """A real DDP (gloo, one process) rebuilds its buckets after its first step, in the order
    autograd produced the gradients: the forecast's buckets hold the same bytes, in order."""
    model = tiny_bert()
    model.get_input_embeddings().sparse = True  # as trainer/strategies/ddp.py does on CPU
    params = Param.all_of(model)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in process: no address
    try:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
        for _ in range(3):  # DDP rebuilds at the forward after its first backward
            ddp(input_ids=torch.randint(0, 1000, (4, 16)), labels=torch.zeros(4, dtype=torch.long)).loss.backward()
        real = [int(n) for n in ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
    finally:
        dist.destroy_process_group()
    sparse_bytes = model.get_input_embeddings().weight.numel() * 4
    real.remove(sparse_bytes)
    modelled = DDP(cfg(bucket_cap_mb=0.05)).traffic(params, "gloo", sparse_rows=10)
    dense = [b for b in modelled.buckets if not b.sparse]
    assert [int(b.nbytes) for b in dense] == real
    assert [b.ready for b in dense] == sorted(b.ready for b in dense)
    assert dense[-1].ready == 1.0 and dense[0].ready < 0.2
    (sparse,) = [b for b in modelled.buckets if b.sparse]
    assert sparse.nbytes == 10 * (64 * 4 + 8)  # the touched rows' values and indices
    # NCCL has no sparse all-reduce: the embedding goes dense, in a bucket.
    on_nccl = DDP(cfg(bucket_cap_mb=0.05)).traffic(params, "nccl", sparse_rows=10)
    assert not any(b.sparse for b in on_nccl.buckets)
    assert on_nccl.nbytes == sum(real) + sparse_bytes


def test_each_hook_sends_what_torch_s_hook_sends():
    params = Param.all_of(tiny_bert())
    dense = DDP(cfg()).traffic(params, "nccl", 0)
    assert DDP(cfg(comm_hook="bf16")).traffic(params, "nccl", 0).nbytes == dense.nbytes / 2
    powersgd = DDP(cfg(comm_hook="powersgd", powersgd_rank=4)).traffic(params, "nccl", 0)
    # torch's rule, matrix by matrix: factors where they are under half the matrix.
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    expected = 0
    for p in params:
        rows, cols = (p.shape[0], p.numel // p.shape[0]) if len(p.shape) > 1 else (1, p.numel)
        compress, plain, compressed = _should_compress(rows, cols, 4, 2)
        expected += 4 * (compressed if compress and len(p.shape) > 1 else plain)
    assert powersgd.nbytes == expected < dense.nbytes / 4
    assert all(b.collectives == 3 for b in powersgd.buckets)
    assert powersgd.overlapped and not DDP(cfg(comm_hook="powersgd")).traffic(params, "gloo", 0).overlapped


def test_lora_sends_only_what_trains():
    model = lora.apply(tiny_bert(), OmegaConf.create({"lora": {"r": 4, "alpha": 8, "dropout": 0.0,
                                                               "target_modules": None}}))
    params = Param.all_of(model)
    trained = sum(p.numel * p.element_size for p in params if p.trained)
    assert DDP(cfg()).traffic(params, "gloo", 10).nbytes == trained  # the embedding is frozen: no rows
    assert trained < sum(p.numel * p.element_size for p in params) / 5


def test_the_step_hides_communication_behind_backward_until_the_link_is_slow():
    compute = Compute(forward_s=0.1, backward_s=0.2, optimizer_s=0.05, micro_batch=8)
    buckets = [Bucket(10 * MB, 0.25), Bucket(10 * MB, 0.5), Bucket(10 * MB, 0.75), Bucket(10 * MB, 1.0)]
    fast = Link(0.0, 10e9)  # 10 GB/s: 2 ms a bucket at 2 ranks
    overlapped = Traffic(buckets, overlapped=True)
    assert forecast.step_seconds(compute, overlapped, fast, 2) == pytest.approx(0.35 + 0.001)  # the last alone
    slow = Link(0.0, 0.1e9)  # 100 ms a bucket: the link sets the pace from the first bucket on
    assert forecast.step_seconds(compute, overlapped, slow, 2) == pytest.approx(0.1 + 0.05 + 0.05 + 4 * 0.1)
    waited = Traffic(buckets, overlapped=False)  # backward stops for each bucket
    assert forecast.step_seconds(compute, waited, slow, 2) == pytest.approx(0.35 + 4 * 0.1)
    assert forecast.step_seconds(compute, overlapped, slow, 1) == pytest.approx(0.35)  # one rank sends nothing
    # Accumulation: the earlier micro-batches compute alone.
    assert forecast.step_seconds(compute, overlapped, fast, 2, grad_accum=3) == pytest.approx(3 * 0.3 + 0.05 + 0.001)


def test_the_table_keeps_the_global_batch_rule():
    compute = Compute(0.1, 0.2, 0.05, 16)
    link = Link(1e-4, 1e9)

    def traffic(micro_batch: int) -> Traffic:
        return Traffic([Bucket(40 * MB, 0.5), Bucket(40 * MB, 1.0)], overlapped=True)

    def per_rank_16(world: int):
        return 16 * world, 16, 1

    weak = forecast.rows(compute, traffic, link, 2, per_rank_16)
    assert [r.world for r in weak] == [2, 4, 8, 16, 32, 64]
    assert all(r.micro_batch == 16 for r in weak)
    assert all(0 < r.efficiency <= 1 for r in weak)
    assert [r.step_s for r in weak] == sorted(r.step_s for r in weak)

    def global_128(world: int):
        return (128, 128 // world, 1) if 128 % world == 0 and world <= 128 else None

    strong = forecast.rows(compute, traffic, link, 8, global_128)
    assert [(r.world, r.micro_batch) for r in strong] == [(8, 16), (16, 8), (32, 4), (64, 2), (128, 1)]
    assert strong[-1].efficiency < strong[0].efficiency
