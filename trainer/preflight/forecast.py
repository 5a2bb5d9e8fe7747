"""The scaling forecast that doctor prints: step time, samples/s and scaling efficiency at
more nodes, before the job runs (docs/forecast.md).

It is the product of three measurements and one model:
- the link: doctor's timed all-reduces, fitted as latency plus bytes over bus bandwidth
  (alpha-beta, `Link.fit`);
- the gradient traffic: the job's own buckets, in the order backward fills them, with the
  bytes that ddp.comm_hook puts on the wire (the strategy's `traffic`, trainer/strategies/);
- the compute: forward, backward and optimizer seconds of the real model on a micro-batch
  of the data's mean padded length, timed on every rank (`time_compute`);
- the model (`step_seconds`): each bucket's all-reduce starts when backward has produced its
  gradients and the previous bucket's all-reduce is done, as DDP runs them; the step ends
  with the last one. What outlasts backward is the exposed communication.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from trainer.config.schema import Config, typed
from trainer.data.batch_plan import BatchPlan
from trainer.strategies import registry
from trainer.strategies.traffic import MIB, Bucket, Param, Traffic
from trainer.train.step import StepObserver, TrainStep

if TYPE_CHECKING:
    from trainer.data.loaders import Data
    from trainer.train.build import Built

BUCKET_SIZES_MB = (5.0, 10.0, 25.0, 50.0, 100.0)
"""ddp.bucket_cap_mb values the forecast compares."""
NODE_COUNTS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Link:
    """A ring all-reduce of B bytes over n ranks takes 2(n-1) hops of `latency_s` plus
    2(n-1)/n x B / `busbw`: the bus bandwidth, in bytes/s, that nccl-tests report."""

    latency_s: float
    busbw: float

    @classmethod
    def fit(cls, timings: list[tuple[int, float]], world: int) -> Link:
        """From (bytes, seconds) all-reduces at `world` ranks: the latency from the smallest,
        which moves next to nothing; the bandwidth from the slope of least squares over
        those of 1 MiB and more, so that whatever a link lets through at full speed before
        it throttles (a token bucket's burst, a switch's buffers) doesn't count as bandwidth."""
        hops = 2 * (world - 1)
        smallest_bytes, smallest_s = min(timings)
        large = [(b, s) for b, s in timings if b >= MIB] or timings
        nbytes = np.array([b for b, _ in large], dtype=float)
        seconds = np.array([s for _, s in large], dtype=float)
        slope = np.polyfit(nbytes, seconds, 1)[0] if len(large) > 1 else seconds[0] / nbytes[0]
        slope = max(float(slope), 1e-15)  # a link faster than the clock can tell
        busbw = hops / world / slope
        latency_s = max(smallest_s - smallest_bytes * slope, 0.0) / hops
        return cls(latency_s=latency_s, busbw=busbw)

    def all_reduce_s(self, nbytes: float, world: int) -> float:
        if world == 1:
            return 0.0
        return 2 * (world - 1) * (self.latency_s + nbytes / world / self.busbw)

    def all_gather_s(self, nbytes_per_rank: float, world: int) -> float:
        """Every rank receives every other rank's bytes: a sparse gradient's rows."""
        if world == 1:
            return 0.0
        return (world - 1) * (self.latency_s + nbytes_per_rank / self.busbw)


@dataclass(frozen=True)
class Compute:
    """Seconds of one micro-batch's forward and backward, and of the optimizer step, on
    `micro_batch` samples; forward and backward scale with the samples."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    micro_batch: int

    def at(self, micro_batch: int) -> Compute:
        scale = micro_batch / self.micro_batch
        return Compute(self.forward_s * scale, self.backward_s * scale, self.optimizer_s, micro_batch)


def bucket_seconds(bucket: Bucket, link: Link, world: int) -> float:
    """A bucket's collectives on `link` across `world` ranks."""
    if bucket.sparse:
        return link.all_gather_s(bucket.nbytes, world)
    return link.all_reduce_s(bucket.nbytes, world) + (bucket.collectives - 1) * link.all_reduce_s(0, world)


def step_seconds(compute: Compute, traffic: Traffic, link: Link, world: int, grad_accum: int = 1) -> float:
    """One optimizer step: the micro-batches before the last compute alone; the last one's
    backward releases the buckets, in order, onto one link."""
    backward_s, delay, link_free = compute.backward_s, 0.0, 0.0
    for bucket in traffic.buckets:
        start = max(bucket.ready * backward_s + delay, link_free)
        link_free = start + bucket_seconds(bucket, link, world)
        if not traffic.overlapped:
            delay = link_free - bucket.ready * backward_s  # backward resumes when it is done
    last_backward = max(backward_s + delay, link_free)
    return grad_accum * compute.forward_s + (grad_accum - 1) * backward_s + last_backward + compute.optimizer_s


# --- timing the real model ------------------------------------------------------------------


@dataclass(frozen=True)
class Batches:
    """What the training data's micro-batches look like on this rank."""

    padded_length: int
    """The mean padded length of a micro-batch over the first epoch."""
    sparse_rows: float
    """The mean distinct tokens of a micro-batch: the embedding rows its gradient touches."""


def describe_batches(train_ds, sampler, micro_batch: int, pad_multiple: int | None, samples: int = 64) -> Batches:
    """From the tokenized training set and this rank's sampler: every micro-batch's padded
    length, and the distinct tokens in the first `samples` micro-batches."""
    positions = list(iter(sampler))
    chunks = [positions[i:i + micro_batch] for i in range(0, len(positions) - micro_batch + 1, micro_batch)]
    lengths = sampler.lengths
    padded = [int(lengths[c].max()) for c in chunks]
    if pad_multiple:
        padded = [-(-n // pad_multiple) * pad_multiple for n in padded]
    distinct = [len(np.unique(np.concatenate([np.asarray(ids) for ids in train_ds.select(c)["input_ids"]])))
                for c in chunks[:samples]]
    return Batches(round(statistics.fmean(padded)), statistics.fmean(distinct))


class PhaseClock(StepObserver):
    """A StepObserver (trainer/train/step.py) that times the step's forward, backward and optimizer,
    syncing the device at each boundary: on a GPU the host runs ahead of the kernels. The
    comm phase is backward's tail here: over a group of one rank, DDP's hooks run but send
    nothing, and what the link costs is the model's to add."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list[tuple[str | None, float]] = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def phase(self, name: str | None, at: float | None = None) -> None:
        if name != "comm":
            self.marks.append((name, self._now()))

    def step_done(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.marks.append((None, self._now()))

    def step_skipped(self) -> None:
        self.marks.append((None, self._now()))

    def seconds(self) -> dict[str, float]:
        spent: dict[str, float] = {}
        for (name, started), (_, ended) in zip(self.marks, self.marks[1:], strict=False):
            if name is not None:
                spent[name] = spent.get(name, 0.0) + ended - started
        return spent


def time_compute(step: TrainStep, micro_batch: int, length: int, vocab: int, device: torch.device,
                 labels: torch.Tensor, steps: int = 4, texts_per_sample: int = 1) -> Compute:
    """Median forward, backward and optimizer seconds over `steps` runs (after two that warm
    up allocations and kernels) of the training step itself, on one micro-batch of random
    tokens and `labels` (the task's shape): the work depends on the shapes, not the values.
    A sample is `texts_per_sample` rows of the batch (a pair's two)."""
    generator = torch.Generator().manual_seed(0)
    rows = micro_batch * texts_per_sample
    batch = {"input_ids": torch.randint(0, vocab, (rows, length), generator=generator).to(device),
             "attention_mask": torch.ones(rows, length, dtype=torch.long, device=device),
             "labels": labels}
    times: list[dict[str, float]] = []
    for i in range(steps + 2):
        clock = PhaseClock(device)
        step([batch], i + 1, clock)
        if i >= 2:
            times.append(clock.seconds())
    forward_s, backward_s, optimizer_s = (statistics.median(t[phase] for t in times)
                                          for phase in ("forward", "backward", "optimizer"))
    return Compute(forward_s, backward_s, optimizer_s, micro_batch)


class Measured(NamedTuple):
    compute: Compute
    batches: Batches
    params: list[Param]
    built: Built
    """The timed model, strategy and step, with the state a checkpoint would hold."""
    data: Data
    """The training data as the run tokenizes it (its loaders closed)."""


def measure(cfg: Config, dist_env, device: torch.device, alone: bool = True) -> Measured:
    """This rank's compute on the job's real model, at the mean padded length of its real
    micro-batches: training's own model and step (trainer/train/build.py), LoRA, gradient
    checkpointing, precision, the sparse embedding gradient, DDP with ddp.comm_hook
    (PowerSGD's compression included), accumulation's gradient sync, clipping, the loss
    scaler, AdamW and its schedule. Only the network is left out: DDP runs over a group of this
    rank alone. Every rank times at once, so ranks that share a node's CPUs compete as they
    will in training. `alone=False`: over every rank instead, with the network, for a
    strategy the forecast does not model (its steps and state for the grace check)."""
    import torch.distributed as dist

    from trainer.data import loaders, reading
    from trainer.train import build
    from trainer.train.policy import Policy

    plan = BatchPlan.of(cfg.train, dist_env.world_size)
    splits = reading.load(cfg, dist_env)
    max_steps = Policy.from_config(cfg, splits.steps_per_epoch(plan, cfg.train)).max_steps
    # PowerSGD compresses from the first timed step: the two before it warm up.
    timed = typed(cast(DictConfig, OmegaConf.merge(cfg, {"ddp": {"powersgd_start_step": 2}})))
    group = dist.new_subgroups(group_size=1)[0] if alone else None  # collective: every rank makes its own
    try:
        built = build.build(timed, dist_env, device, splits.labels, max_steps=max_steps, group=group)
        # Without loader workers: they are not timed here, and their server's start-up (its
        # imports, ~2 s of CPU a rank) would run beside the timed steps, on the cores the ranks
        # share: at 4 ranks on 2 cores it doubled the compute timed (benchmarks/RESULTS.md).
        loaderless = typed(cast(DictConfig, OmegaConf.merge(cfg, {"data": {"num_workers": 0}})))
        tokenized = loaders.build(loaderless, dist_env, splits, built.tokenizer, device, plan)
        try:
            batches = describe_batches(tokenized.train_loader.dataset, tokenized.train_sampler, plan.micro_batch,
                                       loaders.pad_multiple(cfg, device))
        finally:
            tokenized.close()
        params = Param.all_of(built.model)
        compute = time_compute(built.step, plan.micro_batch, batches.padded_length, built.config.vocab_size, device,
                               labels=built.task.dummy_labels(plan.micro_batch, device),
                               texts_per_sample=built.task.texts_per_sample())
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return Measured(compute, batches, params, built, tokenized)


# --- the forecast -------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    nodes: int
    world: int
    micro_batch: int
    grad_accum: int
    step_s: float
    samples_per_s: float
    efficiency: float
    """samples/s per rank against one rank's, the same global-batch rule."""


def rows(compute: Compute, make_traffic, link: Link, ranks_per_node: int, batch_plan, node_counts=NODE_COUNTS
         ) -> list[Row]:
    """The forecast at each node count: `batch_plan(world)` is (global batch, micro-batch,
    grad accumulation) or None where the global batch can't be split; `make_traffic(micro_batch)`."""
    out: list[Row] = []
    base = None
    for nodes in node_counts:
        world = nodes * ranks_per_node
        plan = batch_plan(world)
        if plan is None:
            continue
        global_batch, micro_batch, grad_accum = plan
        seconds = step_seconds(compute.at(micro_batch), make_traffic(micro_batch), link, world, grad_accum)
        per_rank = global_batch / seconds / world
        if base is None:
            single = batch_plan(1)
            base = per_rank if single is None else single[0] / step_seconds(
                compute.at(single[1]), make_traffic(single[1]), link, 1, single[2])
        out.append(Row(nodes, world, micro_batch, grad_accum, seconds, global_batch / seconds, per_rank / base))
    return out


def best_change(current: float, options: dict[str, float]) -> tuple[str, float] | None:
    """The option that saves the most, if it saves at least 5% of `current` seconds."""
    if not options:
        return None
    name, seconds = min(options.items(), key=lambda item: item[1])
    return (name, seconds) if seconds < 0.95 * current else None


def fmt_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6)):
        if bits >= scale * 0.9995:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits / 1e3:.3g} kb/s"


def table(found: list[Row]) -> list[str]:
    lines = [f"  {'nodes':>5}  {'ranks':>5}  {'micro-batch':>11}  {'step':>9}  {'samples/s':>10}  efficiency"]
    for r in found:
        batch = f"{r.micro_batch}" + (f" x{r.grad_accum}" if r.grad_accum > 1 else "")
        lines.append(f"  {r.nodes:>5}  {r.world:>5}  {batch:>11}  {r.step_s * 1e3:>6.0f} ms  {r.samples_per_s:>10.1f}  "
                     f"{r.efficiency:>9.0%}")
    return lines


def section(cfg: Config, backend: str, link: Link, compute: Compute, batches: Batches, params: list[Param],
            world: int, ranks_per_node: int) -> list[str]:
    """doctor's "Scaling forecast": what it was made from, the table, and what would help."""
    from trainer.errors import ConfigError

    nodes, strategy = world // ranks_per_node, registry.of(cfg)

    def batch_plan(ranks: int) -> tuple[int, int, int] | None:
        try:
            plan = BatchPlan.of(cfg.train, ranks)
        except ConfigError:
            return None  # a global batch that this world size can't split
        return plan.global_batch, plan.micro_batch, plan.grad_accum

    def make_traffic(micro_batch: int, **what_if) -> Traffic:
        return strategy.traffic(params, backend, batches.sparse_rows * micro_batch / compute.micro_batch, **what_if)

    def seconds_at(ranks: int, **what_if) -> float:
        plan = batch_plan(ranks)
        assert plan is not None, "asked only at world sizes that split the global batch"
        return step_seconds(compute.at(plan[1]), make_traffic(plan[1], **what_if), link, ranks, plan[2])

    found = rows(compute, make_traffic, link, ranks_per_node, batch_plan, sorted({*NODE_COUNTS, nodes}))
    now = make_traffic(compute.micro_batch)
    mode = "overlapped with backward" if now.overlapped else "not overlapped with backward"
    this_job = seconds_at(world)
    lines = ["Scaling forecast (docs/forecast.md)",
             (f"  link: {fmt_rate(link.busbw)} bus bandwidth, {link.latency_s * 1e3:.2f} ms a hop "
              "(fitted to the all-reduces above)"),
             (f"  compute, the slowest rank, a micro-batch of {compute.micro_batch} x {batches.padded_length} "
              f"tokens: forward {compute.forward_s * 1e3:.0f} ms, backward {compute.backward_s * 1e3:.0f} ms, "
              f"optimizer {compute.optimizer_s * 1e3:.0f} ms"),
             (f"  gradients: {now.nbytes / 1e6:.1f} MB a step per rank in {len(now.buckets)} buckets "
              f"({cfg.train.strategy}, ddp.comm_hook={cfg.ddp.comm_hook}, "
              f"ddp.bucket_cap_mb={cfg.ddp.bucket_cap_mb:g}), {mode}"),
             f"  this job, {nodes} nodes x {ranks_per_node}: {this_job * 1e3:.0f} ms a step",
             *table(found)]
    ranks = max(found, key=lambda r: r.world).world if nodes == 1 else world
    at = f"at {ranks // ranks_per_node} nodes"
    current = seconds_at(ranks)
    hooks = {f"ddp.comm_hook={h}": seconds_at(ranks, comm_hook=h) for h in ("bf16", "powersgd")
             if h != cfg.ddp.comm_hook}
    caps = {f"ddp.bucket_cap_mb={mb:g}": seconds_at(ranks, bucket_cap_mb=mb) for mb in BUCKET_SIZES_MB
            if mb != cfg.ddp.bucket_cap_mb}
    for what, options in (("compression", hooks), ("bucket size", caps)):
        best = best_change(current, options)
        if best is None:
            lines.append(f"  {what} {at}: no other value saves 5% of the step")
            continue
        name, seconds = best
        caveat = " (approximate gradients: docs/compression.md)" if "powersgd" in name else ""
        lines.append(f"  {what} {at}: {name}, {seconds * 1e3:.0f} ms a step instead of {current * 1e3:.0f} "
                     f"({current / seconds:.2f}x){caveat}")
    return lines
