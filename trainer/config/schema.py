"""The run configuration's schema: every key, its type, default and docstring, its check and
its rule on resume, on its field (docs/config.md is generated from it).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from omegaconf import MISSING, DictConfig

# --- keys: each one's check and its rule on resume sit on its field ----------------------

FREE, EXTEND, FIXED = "free", "extend", "fixed"
"""What a resumed run may do with a key (`trainer.checkpoint.resume.config_changes`). FREE: change it; it is how the
run is observed, stored or launched, the same math by other kernels or layouts, or how each
global batch is split (the global batch itself is checked against the checkpoint's). EXTEND:
raise it (a longer run). FIXED: it alters the weights, the data order or the model
selection, so a change is refused unless checkpoint.allow_changes names it."""

Check = tuple[Callable[[Any], bool], str]
"""A predicate on the value, and what the error says it must be: "KEY: must ..."."""


def key(default: Any = MISSING, resume: str = MISSING, check: Check | None = None,
        factory: Callable[[], Any] | None = None) -> Any:
    """A config key. `resume` must be given: every new key says whether a resume may change
    it (the schema refuses to import otherwise)."""
    if resume not in (FREE, EXTEND, FIXED):
        raise TypeError(f"key(): resume must be FREE, EXTEND or FIXED, got {resume!r}")
    metadata = {"resume": resume, **({"check": check} if check else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def at_least(low: int) -> Check:
    return lambda v: v >= low, f"must be >= {low}"


def at_least_or_null(low: int) -> Check:
    return lambda v: v is None or v >= low, f"must be >= {low} or null"


def above(low: float) -> Check:
    return lambda v: v > low, f"must be > {low:g}"


def above_or_null(low: float) -> Check:
    return lambda v: v is None or v > low, f"must be > {low:g} or null"


def fraction(closed_at_zero: bool) -> Check:
    """In (0, 1), or [0, 1) with `closed_at_zero`."""
    if closed_at_zero:
        return lambda v: 0 <= v < 1, "must be in [0, 1)"
    return lambda v: 0 < v < 1, "must be in (0, 1)"


NOT_EMPTY: Check = (bool, "must not be empty")

def _class_weights(value: Any) -> bool:
    return value in (None, "balanced") or (
        isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
        and all(isinstance(w, int | float) and not isinstance(w, bool) and w > 0 for w in value))


CLASS_WEIGHTS: Check = (_class_weights, "must be null, balanced or a list of positive numbers")

STEPS_OR_EPOCH: Check = (lambda v: v == "epoch" or (type(v) is int and v >= 0), "must be a step count >= 0 or `epoch`")
"""An interval: a step count (0: only at the end) or `epoch`, at the end of each epoch."""



def node(cfg: Any) -> DictConfig:
    """The OmegaConf node a typed config (`Config`, or one of its sections) is at run time,
    for OmegaConf's own functions (select, merge, to_yaml)."""
    return cast(DictConfig, cfg)


def typed(cfg: DictConfig) -> Config:
    """A loaded and checked config as the schema's type: at run time still OmegaConf's
    DictConfig, which checks each value's type on assignment; for mypy a `Config`, whose
    keys it checks (OmegaConf's structured configs: `cfg: Config = OmegaConf.structured(Config)`)."""
    return cast(Config, cfg)


# --- the schema --------------------------------------------------------------------------


@dataclass
class LoraConfig:
    r: int | None = key(None, FIXED, at_least_or_null(1))
    """LoRA's rank: the model's weights stay frozen, rank-r adapters beside its
    target_modules train, and so does the classification head, in full (peft). DDP, the
    optimizer and checkpoints then hold only those: megabytes. null: no LoRA, every weight
    trains."""
    alpha: float = key(16.0, FIXED, above(0))
    """The adapters' scale: their output is multiplied by alpha / r."""
    dropout: float = key(0.05, FIXED, fraction(closed_at_zero=True))
    """Dropout on the adapters' input."""
    target_modules: list[str] | None = key(None, FIXED)
    """Names (or name suffixes) of the linear layers that get adapters. null: peft's default
    for the model's family (BERT, RoBERTa: query, value; GPT-2: c_attn; Llama, Qwen2,
    Mistral: q_proj, v_proj); a family without one is an error naming this key."""


@dataclass
class ModelConfig:
    name: str = key(MISSING, FIXED, NOT_EMPTY)
    """Hub id or local directory of a transformers model (config, weights, tokenizer). A
    gated or private Hub model reads its token from HF_TOKEN (or `hf auth login`),
    as huggingface_hub does; the token is never written anywhere by the run."""
    revision: str | None = key(None, FIXED)
    """The Hub revision of model.name to load: a branch, a tag or a commit; null: main. Pin
    a commit for a run that can be repeated: summary.json records the commit loaded
    (`model.commit`) either way. Only for a Hub id."""
    trust_remote_code: bool = key(False, FIXED)
    """Run the modeling code that model.name's repository ships (an architecture transformers
    does not have): Python from the Hub, run on every node. false refuses such a model."""
    pretrained: bool = key(True, FIXED)
    """False: build the architecture from its config with random weights (benchmarks, tests)."""
    attn_implementation: str = key("auto", FREE)
    """Passed to from_pretrained: `sdpa`, `eager`, ... auto: `sdpa` on GPU (flash and
    memory-efficient kernels), `eager` on CPU for train and evaluate, where SDPA's backward
    under bf16 autocast is ~1.9x slower than eager's, and `sdpa` for score, which runs no
    backward (benchmarks/RESULTS.md)."""
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = key("auto", FREE)
    """Which kernel runs SDPA attention in the step's forward and backward and in evaluation
    (torch.nn.attention.sdpa_kernel): efficient (memory-efficient), cudnn (cuDNN's fused
    attention) or math (plain matmuls and softmax, any device). auto: torch picks per call, but
    in training never cuDNN's, whose backward can write NaN on H100s and H200s (docs/gpus.md).
    Other than auto it needs model.attn_implementation sdpa, and efficient and cudnn a GPU:
    they have no CPU kernels. flash (FlashAttention, through torch's variable-length
    attention) takes no mask, so it runs packed batches only (data.packing), in bf16 or fp16:
    each row's sequences by their lengths, with no attention dropout (the kernel has none;
    docs/packing.md). A kernel that cannot run a shape fails the step rather than falling
    back (docs/gpus.md)."""
    gradient_checkpointing: bool = key(False, FREE)
    """Activation checkpointing (transformers' own, non-reentrant): each layer's activations
    are recomputed in the backward instead of kept from the forward. A third less memory on
    the demo, at 1.4x the step time (benchmarks/RESULTS.md); the same weights, bit for bit
    (each layer's dropout masks are replayed), so a resume may turn it on or off."""
    dropout: bool | None = key(None, FIXED)
    """The model's own dropout (its config's probabilities) while it trains; false: none.
    null (auto): none for data.problem_type=pairwise, whose loss reads the difference of a
    pair's two rewards, which independent dropout masks on the two sides would blur (as TRL
    and OpenRLHF train reward models: 0.97 held-out accuracy with it, 0.995 without, in
    benchmarks/RESULTS.md's run); the model's own for the other tasks. LoRA's own dropout is
    model.lora.dropout."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of training every weight (`model.lora.r`)."""
    dtype: Literal["auto", "bf16", "fp32"] = key("auto", FIXED)
    """How the frozen weights of a LoRA run are stored: bf16 halves them (16 GB, not 32, for
    an 8B base). What trains (the adapters, the head) and the optimizer state stay fp32.
    auto: bf16 when model.lora is on and the run computes in bf16 (train.precision), else
    fp32. bf16 needs both; without LoRA every weight trains, in fp32."""


@dataclass
class DataConfig:
    path: str = key(MISSING, FIXED, NOT_EMPTY)
    """Hub dataset name, or a local json/jsonl/csv/parquet file, or a folder of them."""
    name: str | None = key(None, FIXED)
    """The dataset's configuration (subset) name, for hub datasets that have several."""
    csv_delimiter: str | None = key(None, FIXED, (lambda v: v is None or len(v) == 1 or v == "tab",
                                                   "must be one character, tab or null"))
    """The column separator of a delimited text file: null, `,` for .csv and a tab for .tsv;
    a .txt file needs it named (`data.csv_delimiter=";"`, `"|"` or `tab`). A tab-separated
    file is read without quoting, as GLUE's TSV files are written: a text may hold quote marks."""
    text_field: str = key("text", FIXED, NOT_EMPTY)
    """The column holding the text to classify."""
    text_pair_field: str | None = key(None, FIXED)
    """Second text of a pair (e.g. `hypothesis` after `premise`), or None for single texts."""
    label_field: str = key("label", FIXED, NOT_EMPTY)
    """The column holding the label, as data.problem_type reads it: single_label, a class id
    (an integer from 0) or a class name (a string); multi_label, a list of ids or names;
    regression, a number (docs/tasks.md)."""
    problem_type: Literal["single_label", "multi_label", "regression", "pairwise"] = key("single_label", FIXED)
    """What the model learns from the label: single_label, one class of num_labels per row
    (cross-entropy); multi_label, any set of them (binary cross-entropy on each, predicted
    where its sigmoid reaches data.threshold); regression, one number (mean squared error);
    pairwise, a reward model: no label column, a row is a preference pair (data.chosen_field
    over data.rejected_field, Bradley-Terry's loss: docs/task-pairwise.md)."""
    chosen_field: str = key("chosen", FIXED, NOT_EMPTY)
    """pairwise: the column of the preferred answer: a text, or a conversation (a list of
    {role, content} messages, rendered by the tokenizer's chat template)."""
    rejected_field: str = key("rejected", FIXED, NOT_EMPTY)
    """pairwise: the column of the answer it is preferred to, as data.chosen_field."""
    prompt_field: str | None = key(None, FIXED)
    """pairwise: the column of the prompt both answers follow (a text or a conversation).
    null: the split's `prompt` column if it has one, else none (each side holds it all)."""
    margin_field: str | None = key(None, FIXED)
    """pairwise: the column of each pair's margin, a number the chosen reward must exceed the
    rejected one by (Llama 2's loss, -log sigmoid(chosen - rejected - margin)). null: the
    split's `margin` column if it has one, else 0."""
    num_labels: int | None = key(None, FIXED, at_least_or_null(1))
    """How many classes: the size of the classification head. null: inferred from the label
    names (data.label_names, the dataset's ClassLabel, or the train split's distinct values),
    or from the largest class id + 1; given, it is checked against them. Regression: 1."""
    train_split: str = key("train", FIXED)
    """A split name; `datasets` slicing such as `train[:90%]` works too."""
    eval_split: str = key("test", FIXED)
    """The validation split: evaluated during and after training, each sample exactly once,
    and what checkpoint.best_metric selects the model on. Where the data has no split of
    this default name (a single CSV, say), data.eval_fraction of the train split is held out
    instead; another name must be a split of the data, unless the data has a train split only."""
    eval_fraction: float = key(0.1, FIXED, fraction(closed_at_zero=False))
    """The share of the train split held out for validation when data.eval_split is not a
    split of the data: seeded (seed), stratified by label for single_label, the same on every
    rank and every restart."""
    test_split: str | None = key(None, FREE)
    """A held-out split evaluated once, at the end, on the final (best) model, and reported
    apart from the validation split (summary.json `test_eval`, wandb `test/`). null: none."""
    label_names: list[str] | None = key(None, FIXED)
    """The class names, in id order: they go into the exported model's id2label/label2id, so
    a `transformers` pipeline and `score` answer with names. A label column of names must
    hold only these, which fixes each one's id. null: the label column's ClassLabel names if
    the dataset has them, else its distinct names in the train split, sorted, else (class
    ids) LABEL_0, LABEL_1, ..."""
    threshold: float = key(0.5, FIXED, fraction(closed_at_zero=False))
    """multi_label: a class is predicted where its sigmoid reaches this."""
    max_length: int = key(128, FIXED, at_least(8))
    """Truncation length in tokens. Batches are padded only to their longest sample."""
    truncation_side: Literal["right", "left"] = key("right", FIXED)
    """Which end of a text too long for data.max_length is cut: right keeps its start (as
    transformers' tokenizers do), left its end (the answer after a long prompt: pairwise)."""
    pad_to_multiple_of: int | None = key(None, FIXED, at_least_or_null(1))
    """Round each batch's padded length up to a multiple of this. null (auto): 8 on GPU, for
    tensor-core-aligned shapes and fewer distinct ones for cuDNN's plan cache and
    torch.compile; 1 on CPU, where the extra padding only costs (3%, benchmarks/RESULTS.md)."""
    folds: int | None = key(None, FIXED, (lambda v: v is None or v >= 2, "must be >= 2 or null"))
    """K-fold cross-validation: the train split cut into this many folds (stratified by
    label for single_label, seeded apart from `seed`, the same on every restart and for
    every seed), and fold data.fold held out as the validation split, in place of
    data.eval_split. `sweep.folds` sets both for each trial. null: no folds."""
    fold: int = key(0, FIXED, at_least(0))
    """With data.folds: which fold validates (0 to data.folds - 1); the others train."""
    max_train_samples: int | None = key(None, FIXED, at_least_or_null(1))
    """Subsample the train split (seeded, before tokenization)."""
    max_eval_samples: int | None = key(None, FIXED, at_least_or_null(1))
    """Subsample the eval split and the test split (seeded, before tokenization)."""
    drop_invalid_rows: bool = key(False, FIXED)
    """Rows that can't train (no text, no label, a NaN score) are dropped, and counted in the
    log, summary.json (`dropped_rows`) and the model card. false: they stop the run, every
    kind of problem named at once, with its count and first lines in the file."""
    normalize_labels: bool = key(False, FIXED)
    """Label names are stripped of surrounding spaces and case-folded before the classes are
    found: ` Positive` and `positive` are one class. `check` warns where names differ only so."""
    label_map: dict[str, str | None] | None = key(None, FIXED)
    """Label names renamed before the classes are found (after data.normalize_labels), e.g.
    `{pos: positive, "n/a": null}`; a name mapped to null is a row with no label (see
    data.drop_invalid_rows)."""
    packing: bool = key(False, FREE)
    """Lay each micro-batch's samples end to end in as few rows as fit its longest sample, so
    no layer computes on padding but a row's tail; each sample attends to itself alone and is
    classified at its own token, so it trains what padding trains (docs/packing.md: the
    families it runs on, and why it is off by default). Not under train.strategy=dp."""
    group_by_length: bool = key(True, FIXED)
    """Group samples of similar length into the same global batch (less padding)."""
    num_workers: int = key(1, FREE, at_least(0))
    """Train loader worker processes per rank; 0 loads in the training process. Eval and
    test batches are always loaded in the training process (data._eval_loader says why)."""
    pin_memory: bool = key(True, FREE)
    """On GPU: batches in page-locked host memory, copied to the device without blocking
    the host (benchmarks/RESULTS.md measures it). Ignored on CPU."""


@dataclass
class TrainConfig:
    global_batch: int | None = key(None, FREE, at_least_or_null(1))
    """Samples per optimizer step, across all ranks: the invariant of the run. batch_size is
    then each rank's micro-batch limit, and the accumulation follows from the world size, so
    one config runs on any world size that divides it (and a checkpoint resumes on any such
    world size). null: batch_size x grad_accum x world size, or on resume the checkpoint's."""
    batch_size: int = key(16, FREE, at_least(1))
    """Per rank, per micro-step. Without global_batch, global batch = batch_size x grad_accum
    x world size; with it, the largest micro-batch a rank may run."""
    eval_batch_size: int = key(64, FREE, at_least(1))
    """Per rank, for evaluation (no gradients: larger than batch_size fits)."""
    grad_accum: int | None = key(None, FREE, at_least_or_null(1))
    """Micro-batches per optimizer step; gradients are all-reduced on the last one only.
    null: 1, or what global_batch makes it (set one of the two)."""
    max_steps: int | None = key(None, EXTEND, at_least_or_null(1))
    """Optimizer steps. Set exactly one of max_steps and epochs."""
    epochs: int | None = key(None, EXTEND, at_least_or_null(1))
    """Passes over the training data; the steps follow from the data size and the global
    batch (a last partial global batch of each epoch is dropped). The LR schedule and the
    progress bar count the derived steps."""
    lr: float = key(2e-5, FIXED, fraction(closed_at_zero=False))
    """Peak learning rate of AdamW, reached after the warmup, then following train.lr_scheduler."""
    weight_decay: float = key(0.01, FIXED, at_least(0))
    """AdamW's decoupled weight decay, on every trained weight but the biases and the
    normalization layers' weights (as transformers.Trainer and torchtune do)."""
    lr_scheduler: Literal["linear", "cosine", "constant"] = key("linear", FIXED)
    """The learning rate after warmup: linear decay to 0 at max_steps, a cosine to 0, or
    constant at train.lr."""
    warmup_ratio: float = key(0.06, FIXED, fraction(closed_at_zero=True))
    """Share of max_steps spent warming the learning rate up from 0."""
    warmup_steps: int | None = key(None, FIXED, at_least_or_null(0))
    """Warmup in steps instead: when set, train.warmup_ratio is not used."""
    class_weights: Any = key(None, FIXED, CLASS_WEIGHTS)
    """Weigh each sample's loss by its class, for an imbalanced label set: `balanced` (the
    inverse of each class's frequency in the train split, n / (classes x n_class); for
    multi_label each label's positives against its negatives, (n - n_label) / n_label),
    computed once and saved with the run, or a list of num_labels weights. null: none. The
    batch's loss is the mean of the weighted losses, so that 2 ranks still equal 1 process."""
    label_smoothing: float = key(0.0, FIXED, fraction(closed_at_zero=True))
    """single_label: the cross-entropy's target puts this much of its mass evenly on every class."""
    center_rewards: float = key(0.0, FIXED, at_least(0))
    """pairwise: the weight of each pair's squared reward sum, (chosen + rejected)^2, added to
    its loss, which keeps rewards centred on 0 (arXiv 2312.09244's auxiliary loss; 0.01 there).
    0: off."""
    max_grad_norm: float = key(1.0, FIXED, at_least(0))
    """Gradient clipping by global L2 norm; 0 turns it off."""
    fused_adamw: bool = key(True, FREE)
    """AdamW as one fused kernel over all parameters (CPU and GPU); on the CPU benchmark the
    optimizer phase drops from 120 to 33 ms per step."""
    device: Literal["auto", "cuda", "cpu"] = key("auto", FIXED)
    """auto: the GPU of this rank's LOCAL_RANK when CUDA works, else the CPU; but a job that
    was granted GPUs (SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES) that
    CUDA cannot use is an error, not a silent run on CPU hundreds of times slower. cpu: the
    CPU even when GPUs work (with dist.backend gloo or auto). cuda: a GPU, or an error."""
    precision: Literal["fp32", "bf16", "fp16", "auto"] = key("auto", FIXED)
    """Autocast precision of the forward and backward; weights and optimizer stay fp32.
    auto: bf16 on GPUs with native bf16 (Ampere and newer: A100, H100, L4, L40S), fp16 with
    a loss scaler (torch.amp.GradScaler, saved in checkpoints) on older GPUs (V100, T4),
    bf16 on CPUs with native bf16 matmuls (AVX512-BF16, AMX), fp32 on other CPUs. bf16 on a
    device without native bf16 is emulated, and slow (about 15x fp32 on a CPU): it warns."""
    strategy: str = key("ddp", FIXED)
    """ddp: DistributedDataParallel, one process per device. fsdp: FSDP2 (fully_shard), one
    process per device, each holding 1/N of the weights, gradients and optimizer state
    (docs/fsdp.md). dp: nn.DataParallel, one process. (trainer/strategies/registry.py)"""
    compile: bool | None = key(None, FREE)
    """torch.compile each transformer block (any strategy): 1.33x on an H100 for bert-base (the
    whole model; per block on an H200, 0.98x in one run gated by data), but ~30 s more before
    the first step, and 2 graphs for training's batch lengths, 1 for evaluation's
    (docs/speed.md). null (auto): on a GPU for runs of 2,000 steps or more."""
    eval_every: int | str = key(0, FIXED, STEPS_OR_EPOCH)
    """Evaluate every N steps, or at each epoch's end (`epoch`); 0 evaluates only at the
    end. The end of the run is always evaluated."""
    early_stopping_patience: int = key(0, FIXED, at_least(0))
    """Stop after this many evaluations in a row without an improvement of
    checkpoint.best_metric (every rank at the same step; the run then ends as usual: saves,
    selects the best, exports, exit 0). 0: off."""
    early_stopping_threshold: float = key(0.0, FIXED, at_least(0))
    """The smallest change of checkpoint.best_metric that counts as an improvement."""
    log_every: int = key(10, FREE, at_least(1))
    """Log global loss, rates and step-time phases every N steps (one all-reduce each)."""
    threads: int | None = key(None, FREE, at_least_or_null(1))
    """torch intra-op threads per rank; None: the CPUs this process may use / local ranks."""
    peak_tflops: float | None = key(None, FREE, above_or_null(0))
    """The peak dense TFLOP/s of one device in the run's precision, the denominator of MFU.
    null: the data sheet's, for GPUs the trainer knows by exact name (H100, H200, A100, L4,
    L40, L40S, A10, A10G, V100, T4); on a CPU, the best of a 1024^3 matmul in fp32 and in
    the run's precision where the CPU has it natively, measured after the first step; and
    MFU is reported as unknown (null) on any other GPU. MFU is never above 100%: a model that
    beats the peak makes it unknown (null) from then on, with a warning."""
    deterministic: bool = key(False, FREE)
    """Bitwise-reproducible kernels: torch.use_deterministic_algorithms with
    CUBLAS_WORKSPACE_CONFIG, which also makes scaled_dot_product_attention use only its
    deterministic backends. On GPU, without it, kernels such as the embedding backward add
    with atomics in a varying order, so two runs (or a run and its resume) differ in the
    last bits. Costs speed on GPU (0.58x on an H100, benchmarks/RESULTS.md); CPU kernels are
    deterministic either way."""


@dataclass
class DDPConfig:
    bucket_cap_mb: float = key(25.0, FREE, above(0))
    """Gradient bucket size: each bucket's all-reduce starts as soon as its gradients are ready.
    Smaller buckets start sooner, larger ones pay the link's latency less often: doctor's
    scaling forecast names the size that would be fastest on the job's link (docs/forecast.md)."""
    gradient_as_bucket_view: bool = key(True, FREE)
    """Gradients live inside the communication buckets: no copy, less memory."""
    static_graph: bool = key(False, FREE)
    """Promise DDP the same graph every step (it may then skip some bookkeeping); off by
    default because it forbids models whose graph changes."""
    sparse_embedding_grad: bool = key(True, FREE)
    """All-reduce the word embedding's gradient as sparse rows (the tokens in the batch)
    instead of a dense matrix: on MiniLM over half of all gradient bytes, and the last
    bucket, which no backward compute can hide. gloo on CPU only: NCCL has no sparse
    all-reduce, and GPU links are fast enough not to need it."""
    comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = key("none", FIXED)
    """Compress the gradient all-reduce, through torch's DDP comm hooks, where the link and
    not the GPU sets the pace (docs/compression.md): bf16 or fp16 halve the bytes; powersgd
    sends rank-`powersgd_rank` factors of each gradient matrix, with error feedback. none
    is exact: 2 ranks equal 1 process. A compressed run is not an uncompressed one: fixed."""
    powersgd_rank: int = key(4, FIXED, at_least(1))
    """PowerSGD's rank: the factors' width. Higher sends more and approximates better: on the
    demo across a 500 Mb/s link, rank 4 kept the accuracy within 0.6 pp of none, rank 1 lost
    3 pp, at nearly the same speed (benchmarks/RESULTS.md)."""
    powersgd_start_step: int = key(10, FIXED, at_least(2))
    """PowerSGD compresses from this step on; before it, the exact all-reduce (torch's
    advice: let the first ~10% of training run uncompressed)."""


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = key(True, FREE)
    """Free each block's gathered weights after its forward and gather them again for its
    backward: the least memory, at one more all-gather per block. False keeps them from the
    forward to the backward, as ZeRO-2 does."""


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = key("auto", FREE)
    """auto: nccl when CUDA is present, gloo otherwise."""
    init_timeout_s: float = key(1800.0, FREE, above(0))
    """Rendezvous and the first step (data loading, compilation) may take this long."""
    timeout_s: float = key(300.0, FREE, above(0))
    """Any collective after the first step that waits longer than this fails the job."""
    world_size: int | None = key(None, FREE, at_least_or_null(1))
    """The ranks the job is planned for (nodes x GPUs per node), as `check` plans its memory
    and epochs; training takes the launcher's. null: check's world_size=N, else WORLD_SIZE
    where a launcher set it, else 8 (one node of 8 GPUs), said once in check's report."""


@dataclass
class FaultConfig:
    preempt_signals: list[str] = key(resume=FREE, factory=lambda: ["SIGTERM"])
    """Signals that mean "save and stop": at the next step boundary every rank saves, then
    the job exits with code 75. torchrun forwards SIGTERM (and SIGINT, SIGHUP) to workers."""
    slow_step_factor: float = key(10.0, FREE, above(1))
    """The watchdog reports a step slower than this many times the recent median..."""
    slow_step_min_s: float = key(60.0, FREE, above(0))
    """...and slower than this, with every rank's Python stacks, before dist.timeout_s fires."""
    heartbeat_s: float = key(5.0, FREE, above(0))
    """How often each rank records its step in the rendezvous store, for those reports, and
    rank 0 renews output_dir's lease (trainer/runtime/lease.py)."""
    lease_timeout_s: float = key(120.0, FREE, above(0))
    """A lease on output_dir (one job per folder) not renewed for this long is taken over by
    the next job: its holder is dead. Above NFS's attribute cache (60 s by default), through
    which another host may see a renewal late."""
    max_stalled_restarts: int = key(3, FREE, at_least(0))
    """A start of the job after this many attempts that all resumed from the same checkpoint
    and failed exits with code 77 (no progress: launchers stop retrying) instead of failing
    the same way again. Attempts stopped by a preemption don't count; 0 never stops."""
    fingerprint_every: int = key(100, FREE, at_least(0))
    """Every this many steps, and before each checkpoint is written, the ranks compare a digest
    of their weights and optimizer state, which exact DDP keeps bitwise equal: a rank that
    drifted (silent data corruption) ends the job with code 76, its node named. 0: never.
    Off under FSDP."""
    max_bad_steps: int = key(3, FREE, at_least(0))
    """A step whose loss or gradient norm is not finite on any rank (a NaN, an Inf) is skipped
    on every rank and tried again with the next batch. After this many failed tries of one step
    in a row, the run rolls back to its newest checkpoint and goes on with the batches after
    the bad ones; if that step fails as often again, the run stops with code 77, naming the
    step and the data position (output_dir/bad-batches.jsonl). 0: no check, and no host sync
    per step (a non-finite step is then trained on)."""
    spike_factor: float = key(10.0, FREE, (lambda v: v == 0 or v > 1, "must be 0 (off) or above 1"))
    """A finite loss above this many times the median of the last 100 steps (after 20) is a
    spike, logged with its batch's data position. 0: no spike check."""
    rollback_on_spike: bool = key(False, FREE)
    """A spike counts as a bad step: skipped, and after fault.max_bad_steps tries, a rollback."""


@dataclass
class CheckpointConfig:
    every: int | str = key(500, FREE, STEPS_OR_EPOCH)
    """Save every N optimizer steps, or at each epoch's end (`epoch`), and always at the
    end; 0 saves only at the end."""
    keep: int = key(3, FREE, at_least(1))
    """Keep the newest k complete checkpoints, and the best one besides (best_metric)."""
    best_metric: str | None = key(None, FIXED)
    """The validation metric that picks the best checkpoint, which pruning keeps beside the
    newest `keep`: any metric data.problem_type reports (single_label: accuracy, f1_macro,
    loss; multi_label: f1_micro, f1_macro, subset_accuracy, loss; regression: mse, mae,
    pearson, spearman, loss). Every evaluation then also saves a checkpoint, so the best one
    exists. Ties go to the earlier step. null: no selection."""
    best_mode: Literal["max", "min"] | None = key(None, FIXED)
    """Whether higher or lower is better; null: what the metric needs (min for loss, mse and
    mae, max otherwise)."""
    load_best_at_end: bool = key(False, FIXED)
    """final/ exports the best checkpoint's weights instead of the last step's; the done line,
    summary.json's final_eval and the test split then score that model, and the last step's
    validation is reported beside it, labelled (last_step_eval)."""
    allow_changes: list[str] = key(resume=FREE, factory=list)
    """Keys (or sections, `data`) whose change from the resumed checkpoint's config the
    user accepts; they are logged and take effect. Any other change that alters the run is
    refused on resume (the keys marked FIXED)."""
    resume: str = key("auto", FREE)
    """auto: latest valid checkpoint in output_dir, if any. never: start fresh. Or a step-N path."""
    export_adapter: bool = key(False, FREE)
    """With model.lora: final/adapter/ also holds the adapter alone, in peft's format
    (`PeftModel.from_pretrained(base, "final/adapter")`). final/ itself always holds the merged
    model, which plain transformers loads without peft."""
    async_save: bool | None = key(None, FREE)
    """True: training waits only while the state is copied to host memory, and a background
    thread writes, checksums and renames the checkpoint (a failed write stops every rank at
    the next save or at the end). False: training waits for the whole write. None (auto):
    true on GPU, where a bert-base save would otherwise pause training for seconds; false on
    CPU, where the writer would take cores from the step (benchmarks/RESULTS.md)."""


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = key("offline", FREE)
    """offline: runs in output_dir/wandb, to `wandb sync` later. online needs WANDB_API_KEY."""
    project: str = key("ddp-finetune", FREE)
    """The wandb project the run belongs to."""
    entity: str | None = key(None, FREE)
    """The wandb user or team; None: the API key's default."""
    name: str | None = key(None, FREE)
    """The run's display name; None: wandb picks one."""
    tags: list[str] = key(resume=FREE, factory=list)
    """Tags to filter runs by in the wandb UI."""


@dataclass
class TrackingConfig:
    curves: bool = key(True, FREE)
    """Draw output_dir/curves.png (loss, learning rate, throughput and validation metrics by
    step, from metrics.jsonl, restarts marked) as the run ends; final/ and its card carry it.
    `python -m trainer plot OUTPUT_DIR` draws it at any time."""
    tensorboard: bool = key(False, FREE)
    """Also write TensorBoard event files (output_dir/tensorboard, rank 0): the keys of
    metrics.jsonl, each at its step; a resumed run's steps redone replace the ones before."""


@dataclass
class HubConfig:
    push_at_end: bool = key(False, FREE)
    """Upload final/ to the Hub (hub.repo_id) once the run has written it: rank 0, with
    HF_TOKEN. A failed upload is one error line and loses nothing: the run still ends done,
    and `python -m trainer push OUTPUT_DIR --repo-id ...` uploads it later."""
    repo_id: str | None = key(None, FREE)
    """The model repository, ORG/NAME (created if missing)."""
    private: bool = key(True, FREE)
    """A repository this run creates is private (false: public); one that exists keeps its
    visibility. Private by default: a model fine-tuned on a lab's data is the lab's to publish."""
    revision: str | None = key(None, FREE)
    """The branch to commit to (created from main if missing); null: main."""


@dataclass
class SweepConfig:
    parameters: dict[str, Any] = key(resume=FREE, factory=dict)
    """`python -m trainer sweep`: the config keys searched, each mapped to a list of values
    or to a range `{low, high, log}` (`count` too for method grid: that many points, evenly
    or log spaced). Keys are written dotted (`train.lr: [1e-5, 3e-5]`). Checked, with every
    value, before any trial starts (docs/sweeps.md)."""
    method: Literal["grid", "random", "tpe"] = key("grid", FREE)
    """grid: every combination; random: seeded random samples; tpe: Optuna's TPE sampler."""
    trials: int | None = key(None, FREE, at_least_or_null(1))
    """How many settings are tried (each run sweep.seeds x sweep.folds times). null: the
    grid's size (method grid only)."""
    seeds: int = key(1, FREE, at_least(1))
    """Each setting trained with this many seeds: `seed`, `seed` + 1, ..."""
    folds: int | None = key(None, FREE, (lambda v: v is None or v >= 2, "must be >= 2 or null"))
    """K-fold cross-validation of the train split (data.folds): each setting and seed
    trained once per fold. null: validate on data.eval_split (or its held-out share)."""
    metric: str | None = key(None, FREE)
    """The validation metric settings are ranked by, its direction the task's. null:
    checkpoint.best_metric, or the task's first metric."""
    pruner: Literal["none", "halving"] = key("none", FREE)
    """halving: Optuna's successive halving on the runs' own evaluations (train.eval_every,
    a step count): once every run of a setting has evaluated at a step, their mean there is
    reported, and a setting in the bottom of its rung (the first evaluation, 4x, 16x its steps)
    is stopped, its runs saving and exiting 75; the sweep goes on (docs/sweeps.md)."""
    parallel: int = key(1, FREE, at_least(1))
    """Trials run at once on this node, the ranks split between them."""
    ranks: int | None = key(None, FREE, at_least_or_null(1))
    """Ranks on this node for all the trials at once, split evenly between sweep.parallel
    trials. null: the GPUs (CUDA_VISIBLE_DEVICES split between trials), or one per trial on CPU."""
    refit: bool = key(False, FREE)
    """final/: the chosen setting retrained on the whole train split (no validation
    held out); false: the best run of the chosen setting copied."""
    preload: bool = key(True, FREE)
    """Runs of one rank (and folds' evaluations) start as forks of a process that imported
    torch, transformers and datasets once, not as fresh interpreters under torchrun: seconds
    saved per run, the same bits trained (docs/sweeps.md). false: each starts afresh."""


@dataclass
class ScoreConfig:
    input: str | None = key(None, FREE)
    """`python -m trainer score`: the corpus, a file, a folder (every shard under it) or a glob
    of shards: Parquet, JSON lines (.jsonl, .json, .ndjson) or CSV/TSV (.csv, .tsv), each
    also .gz or .zst. Read in chunks: memory stays flat whatever the corpus's size. Its text
    columns are data.text_field (and data.text_pair_field), as in training (docs/scoring.md)."""
    output: str | None = key(None, FREE)
    """The folder of scored shards: one per input shard, at the same relative path, each
    published whole once its every chunk is done. Jobs pointed at the same folder with the
    same model and settings share the work; with others, they are refused."""
    model: str = key("final", FREE, NOT_EMPTY)
    """The trained model: `final` (output_dir/final), a model folder (save_pretrained's) or a
    checkpoint (step-N)."""
    carry: list[str] = key(resume=FREE, factory=list)
    """Input columns copied into the output beside the answer, e.g. `[id, url]`."""
    format: Literal["parquet", "jsonl"] = key("parquet", FREE)
    """The scored shards' format."""
    chunk_rows: int = key(4096, FREE, at_least(1))
    """Rows per chunk, the unit of work that a worker claims, scores and commits whole: a
    worker stopped at any instant loses at most its current chunk. Rows are sorted by
    length within a chunk."""
    max_tokens: int | None = key(None, FREE, at_least_or_null(1))
    """Each batch's token budget: rows x its longest row's tokens (a row longer than the
    budget is a batch of its own). null: 4096 on CPU (for MiniLM on a 2-core Xeon, 4,000 rows
    took 17.3 s against 16384's 21.4 s, one run each: benchmarks/RESULTS.md), 32768 on a GPU
    (not yet measured)."""
    bad_rows: Literal["stop", "skip"] = key("stop", FREE)
    """A row that cannot be scored (not valid JSON or CSV, its text missing or not text):
    stop, the job stops naming its file and row, every worker at its next chunk; skip, it is
    left out of the output and counted by file and row in the workers' summaries."""
    lease_s: float = key(60.0, FREE, (lambda v: v >= 2, "must be >= 2 seconds"))
    """A worker on another node whose heartbeat has not changed for this long is taken for
    dead, and its claimed chunks are done by others (on its own node, at once)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """What is fine-tuned."""
    data: DataConfig = field(default_factory=DataConfig)
    """What it is trained and evaluated on, and how batches are formed."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimization: batch, steps, learning rate, precision, speed switches."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """DistributedDataParallel's knobs."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2's knobs (train.strategy=fsdp)."""
    dist: DistConfig = field(default_factory=DistConfig)
    """The process group: backend and timeouts."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written, how many are kept, where a run resumes from."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Preemption signals and the stall watchdog."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Experiment tracking on rank 0."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """What rank 0 writes beside metrics.jsonl and wandb: curves, TensorBoard."""
    hub: HubConfig = field(default_factory=HubConfig)
    """Uploading final/ to the Hugging Face Hub."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """`python -m trainer sweep`: the search over settings, seeds and folds (docs/sweeps.md);
    training ignores it."""
    score: ScoreConfig = field(default_factory=ScoreConfig)
    """`python -m trainer score`: a trained model applied to a corpus (docs/scoring.md);
    training ignores it."""
    seed: int = key(42, FIXED)
    """Seeds the new classification head, the data order and dropout: same seed, same run."""
    output_dir: str = key(MISSING, FREE, NOT_EMPTY)
    """Checkpoints, metrics.jsonl, summary.json, final/ and wandb's offline runs."""


def _keys(schema: type = Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every key of the schema, dotted, in schema order, with its field."""
    types = typing.get_type_hints(schema)
    keys = {}
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(types[f.name]):
            keys.update(_keys(types[f.name], f"{prefix}{f.name}."))
        else:
            keys[f"{prefix}{f.name}"] = f
    return keys


KEYS = _keys()
RESUME_RULES = {name: f.metadata["resume"] for name, f in KEYS.items()}
"""Each key's rule on resume: FREE, EXTEND or FIXED."""
