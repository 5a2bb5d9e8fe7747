"""The memory plan: what one device holds for a run, from the model's config.json alone.

`python -m trainer check` prints it and `python -m trainer doctor` holds it against each
rank's device, before any weights load: for an 8B model a batch too big is then a one-line
answer in seconds, not an out-of-memory error after minutes of loading.

- weights, gradients and optimizer state are exact: the model is built on the meta device
  (shapes and dtypes, no storage) by training's own builder (trainer/train/build.py), LoRA and
  model.dtype included, counted tensor by tensor, and split as the run's strategy splits them
  (tests/unit/test_memory_plan.py holds them to the byte against a real model and optimizer);
- activations are an estimate (`activation_bytes`, its formula in docs/memory.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.config.schema import Config
from trainer.errors import ConfigError
from trainer.model import lora
from trainer.runtime import devices
from trainer.runtime.environment import DistEnv
from trainer.strategies import registry
from trainer.tasks.registry import task_class
from trainer.tasks.space import Labels
from trainer.train import build

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

GIB = 1024**3
HEADROOM = 0.10
"""The share of a device's memory the plan leaves free: the CUDA context, the caching
allocator's fragmentation, and short-lived buffers (the optimizer step's, the logits')."""

GATED_MLP = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "gemma", "gemma2", "gemma3",
                       "phi3", "olmo", "olmo2", "granite", "modernbert"})
"""Families whose MLP is gated (SwiGLU, GeGLU): it keeps 4 intermediate-sized tensors for
the backward, not 2."""


PLANNED_PRECISION = {"auto": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""train.precision on the GPU `check` plans for, which has native bf16 (A100, H100 and newer)."""


@dataclass(frozen=True)
class MemoryPlan:
    """The bytes one rank holds while it trains; `activations` at `micro_batch` samples."""

    weights: int
    gradients: int
    optimizer: int
    activations_per_sample: int
    micro_batch: int
    max_length: int
    parameters: int
    trained_parameters: int
    precision: dict[str, str | None]
    shards: int = 1
    """FSDP's ranks: weights, gradients and optimizer are one rank's shard (1: DDP, whole)."""
    gathered: int = 0
    """FSDP: the weights gathered whole for compute at once, an estimate."""
    workspaces: int = 0
    """On CUDA: the cuBLAS workspaces torch allocates (`cublas_workspaces`); 0 on CPU."""

    @property
    def activations(self) -> int:
        return self.activations_per_sample * self.micro_batch

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.gathered + self.workspaces

    @property
    def total(self) -> int:
        return self.static + self.activations

    def fits(self, device_bytes: int) -> bool:
        return self.total <= usable(device_bytes)

    def largest_micro_batch(self, device_bytes: int) -> int:
        """The most samples per micro-step that fit `device_bytes` (0: not even the static part)."""
        return max(0, (usable(device_bytes) - self.static) // self.activations_per_sample)

    def lines(self, device: str) -> list[str]:
        """The plan as `check` and `doctor` print it, on `device` (its description)."""
        trained, total, precision = self.trained_parameters, self.parameters, self.precision
        frozen = "" if trained == total else f", {total - trained:,} frozen in {precision['frozen']}"
        share = f", 1/{self.shards} of each on this rank (FSDP)" if self.shards > 1 else ""
        rows = [("weights", human(self.weights), f"{total:,} parameters: {trained:,} trained in {precision['trained']}"
                 + frozen + share),
                ("gradients", human(self.gradients), "of the trained parameters"),
                ("optimizer", human(self.optimizer), "AdamW: 2 moments per trained parameter, a step count per tensor"),
                *([("gathered", "~" + human(self.gathered), "2 blocks and the root whole, for compute (FSDP)")]
                  if self.gathered else []),
                *([("cuBLAS", human(self.workspaces),
                    f"{BLAS_THREADS} workspaces: the forward's thread's and autograd's (CUBLAS_WORKSPACE_CONFIG)")]
                  if self.workspaces else []),
                ("activations", "~" + human(self.activations),
                 f"an estimate: {human(self.activations_per_sample)} per sample (docs/memory.md)"),
                ("total", "~" + human(self.total), "")]
        header = (f"memory plan per rank on {device}: micro-batch {self.micro_batch} x {self.max_length} tokens, "
                  f"compute in {precision['compute']}")
        return [header, *(f"  {name:<12} {size:>11}  {note}".rstrip() for name, size, note in rows)]

    def verdict(self, device_bytes: int) -> str:
        """Whether the plan fits `device_bytes`, less the headroom, and the largest micro-batch that does."""
        return (f"{'fits' if self.fits(device_bytes) else 'does NOT fit'} in {human(device_bytes)} "
                f"({human(usable(device_bytes))} after {HEADROOM:.0%} headroom); the largest micro-batch that "
                f"fits: {self.largest_micro_batch(device_bytes)} (train.batch_size {self.micro_batch})")


def usable(device_bytes: int) -> int:
    return int(device_bytes * (1 - HEADROOM))


def human(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"


def make(cfg: Config, labels: Labels, device: torch.device | None = None, world_size: int = 1) -> MemoryPlan:
    """The plan of `cfg` on `device`; None: a GPU with native bf16 (what `check` plans for,
    on a machine that may have none). Reads model.name's config.json and its tokenizer, if
    it has one, never its weights; data.max_length is checked against the model's positions
    first; `labels` give the head's size. The run's strategy says how its `world_size` ranks
    split the weights, gradients and optimizer state (FSDP: one rank's shard), and what they
    gather whole for compute."""
    workspaces = cublas_workspaces(device)  # before device is None becomes "cuda": the planned GPU's
    if device is None:
        device, amp_dtype = torch.device("cuda"), PLANNED_PRECISION[cfg.train.precision]
    else:
        amp_dtype = devices.resolve_precision(cfg.train.precision, device)
    on_meta = build.load(cfg, DistEnv(), device, amp_dtype, labels, on_meta=True)
    strategy = registry.of(cfg)
    shards = strategy.memory_shards(world_size)
    weights, gradients, optimizer = static_bytes(on_meta.model, strategy.gradient_copies(), shards)
    counts = lora.parameter_counts(on_meta.model)
    config = on_meta.config
    # A sample of a task of pairs is two texts, both in the micro-batch's forward.
    per_sample = task_class(labels.problem_type).texts_per_sample() * activation_bytes(
        config, cfg.data.max_length, amp_dtype, keeps_attention_probs=config._attn_implementation == "eager",
        checkpointing=cfg.model.gradient_checkpointing)
    return MemoryPlan(weights, gradients, optimizer, per_sample, cfg.train.batch_size, cfg.data.max_length,
                      counts["parameters"], counts["trained_parameters"], lora.precisions(on_meta.model, amp_dtype),
                      shards, strategy.gathered_bytes(on_meta.model, amp_dtype, world_size),
                      workspaces)


def static_bytes(module: nn.Module, gradient_copies: int = 1, shards: int = 1) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) in bytes, exactly, for `module` (on any device).
    Weights: every parameter and buffer, peft's frozen copy of the head included. Gradients:
    `gradient_copies` per trained parameter, in its dtype (DDP keeps a second in its buckets
    unless ddp.gradient_as_bucket_view). AdamW: exp_avg and exp_avg_sq like each trained
    parameter, and one fp32 step count per tensor.

    With `shards` (FSDP's ranks), rank 0's share: FSDP2 splits each parameter along its first
    dimension in torch.chunk's way, ceil(rows / shards) rows to rank 0 (the most any rank
    holds: every rank's storage is padded to it). Buffers are not sharded."""
    def held(t: torch.Tensor) -> int:
        if shards == 1 or t.dim() == 0:
            return t.numel() * t.element_size()
        rows = t.shape[0]
        return -(-rows // shards) * (t.numel() // rows) * t.element_size()

    weights = sum(held(p) for p in module.parameters()) + sum(b.numel() * b.element_size() for b in module.buffers())
    trained = [p for p in module.parameters() if p.requires_grad]
    gradients = sum(held(p) for p in trained)
    optimizer = 2 * gradients + 4 * len(trained)
    return weights, gradient_copies * gradients, optimizer


# --- what CUDA adds: cuBLAS's workspaces and the caching allocator's rounding -----------------

HOPPER_CUBLAS_WORKSPACE = 4096 * 8 * 1024
"""torch's cuBLAS workspace on sm_90 (H100, H200): 32 MiB, ":4096:8" (aten/src/ATen/cuda/
CublasHandlePool.cpp, parseChosenWorkspaceSize)."""
CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
"""...on every other GPU: ":4096:2:16:8", cuBLAS's own recommended default (8.125 MiB)."""
CUBLASLT_WORKSPACE = 1024 * 1024
"""torch's cuBLASLt workspace where it is not the cuBLAS one (CUBLASLT_WORKSPACE_SIZE, KiB)."""
BLAS_THREADS = 2
"""The (cuBLAS handle, stream) pairs of a step, each with a workspace of its own: torch keeps a
handle per thread, and the forward (the training thread) and the backward (autograd's device
thread) run on different threads, both on the current stream. Evaluation's forward reuses the
first; FSDP's and DDP's side streams run collectives and copies, no matmuls."""
PLANNED_CAPABILITY = (9, 0)
"""`check` plans for an H100: the larger (Hopper) workspace."""


def cublas_workspace_bytes(capability: tuple[int, int], env: Mapping[str, str]) -> int:
    """The workspace torch gives one (cuBLAS handle, stream): CUBLAS_WORKSPACE_CONFIG's
    `:SIZE_KIB:COUNT` pairs summed (`:4096:8` is 32 MiB; torch's deterministic mode asks for
    `:4096:8` or `:16:8`), else torch's default for the GPU's compute capability; plus cuBLASLt's
    own, unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 makes it share cuBLAS's (counted either way
    where the torch version does not say: at most 1 MiB over)."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        cublas = sum(int(size) * 1024 * int(count) for size, count in pairs)
    else:  # unset, or unparsable (torch warns and takes its default)
        cublas = HOPPER_CUBLAS_WORKSPACE if capability == (9, 0) else CUBLAS_WORKSPACE
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").lower() in ("1", "true", "on", "yes")
    size = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    lt = int(size) * 1024 if size.isdigit() else CUBLASLT_WORKSPACE
    return cublas + (0 if unified else min(lt, cublas))


def cublas_workspaces(device: torch.device | None, env: Mapping[str, str] = os.environ) -> int:
    """What a step's cuBLAS workspaces hold on `device` (None: the GPU `check` plans for):
    they come from the caching allocator, so torch.cuda.memory_allocated counts them, for the
    life of the process. 0 off CUDA."""
    if device is not None and device.type != "cuda":
        return 0
    capability = PLANNED_CAPABILITY if device is None else torch.cuda.get_device_capability(device)
    return BLAS_THREADS * allocated_block(cublas_workspace_bytes(capability, env))


ALLOCATOR_ROUND = 512
"""The caching allocator hands out blocks of a multiple of 512 bytes (kMinBlockSize)."""
ALLOCATOR_SMALL = 1024 * 1024
"""Requests up to 1 MiB come from the small pool, whose blocks are split to the rounded size.
A larger request may get a cached block that is up to 1 MiB bigger (kSmallSize): a remainder
that small is not split off, and the block counts whole as allocated."""


def allocated_block(nbytes: int) -> int:
    """The block the caching allocator rounds a request of `nbytes` to (c10's round_size)."""
    return max(ALLOCATOR_ROUND, -(-nbytes // ALLOCATOR_ROUND) * ALLOCATOR_ROUND)


def allocated_bounds(sizes: Iterable[int]) -> tuple[int, int]:
    """The least and the most that torch.cuda.memory_allocated counts for tensors of `sizes`
    bytes, each in a block of its own: the rounded blocks, and those plus an unsplit remainder
    of up to 1 MiB for each request over 1 MiB (which one gets it depends on what was freed
    before: a step's activations are, before AdamW's moments are first allocated)."""
    least = most = 0
    for nbytes in sizes:
        block = allocated_block(nbytes)
        least += block
        most += block + (ALLOCATOR_SMALL if block > ALLOCATOR_SMALL else 0)
    return least, most


def dimensions(config: PretrainedConfig) -> tuple[int, int, int, int]:
    """(layers, hidden, intermediate, attention heads) of a transformers config. GPT-2's
    names (n_embd, ...) are mapped by its config; its intermediate size is n_inner or 4x."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return config.num_hidden_layers, hidden, intermediate, config.num_attention_heads


def activation_bytes(config: PretrainedConfig, seq_len: int, compute: torch.dtype, keeps_attention_probs: bool,
                     checkpointing: bool) -> int:
    """The estimated bytes one sample of seq_len tokens keeps for the backward. Per layer and
    token, after Korthikanti et al. (2022), generalized to any MLP width and dtype:

        x*8h + e*m*f + 2h  [+ 9*a*s with eager attention]

    h hidden, f intermediate, a heads, s seq_len; e the compute dtype's bytes; x = 4 in fp32,
    6 under autocast (the residual stream stays fp32, and the next matmul reads a bf16 copy);
    m = 2 intermediate tensors (4 for a gated MLP); 2h the dropout masks. SDPA's flash and
    memory-efficient kernels keep no attention probabilities. Plus 2*x*h for the embeddings.
    With activation checkpointing, a layer keeps only its input (x*h), and one layer at a time
    is recomputed in full."""
    layers, h, f, heads = dimensions(config)
    e = torch.finfo(compute).bits // 8
    x = 4 if compute == torch.float32 else 6
    m = 4 if getattr(config, "model_type", "") in GATED_MLP else 2
    layer = x * 8 * h + e * m * f + 2 * h + (9 * heads * seq_len if keeps_attention_probs else 0)
    per_token = (layers * x * h + layer) if checkpointing else layers * layer
    return seq_len * (per_token + 2 * x * h)


def device_bytes(device: torch.device, local_world_size: int) -> int:
    """What one rank may use: its GPU's memory, or on CPU its share of the host's, or of
    the container's limit (cgroup v2 memory.max) where that is lower."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    return (host if limit == "max" else min(host, int(limit))) // local_world_size


def parse_gib(value: str) -> int:
    """`check gpu_gib=80`: a device size in GiB."""
    try:
        gib = float(value)
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise ConfigError(f"gpu_gib: {value!r}: expected a device's memory in GiB, e.g. 80")
    return int(gib * GIB)


PLANNED_WORLD_SIZE = 8
"""`check`'s world size where none is given: a node of 8 GPUs."""


def parse_world_size(value: str) -> int:
    """`check world_size=16`: how many ranks an FSDP run shards over."""
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"world_size: {value!r}: expected the number of ranks (GPUs), e.g. 8")
    return int(value)
