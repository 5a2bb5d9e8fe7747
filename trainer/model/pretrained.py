"""The model: a transformers sequence classifier and its tokenizer, from a hub id or a folder.

This is the bare model: checkpoints, evaluation and the final export use it, so no `module.`
(or `_orig_mod.`) prefix ever reaches a file. These are the parts; trainer/train/build.py puts them
together (LoRA, the strategy that runs it across ranks, the step), the one way every command
builds it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError, describe
from trainer.model import varlen
from trainer.tasks.space import IDS, NUMBERS, Labels, placeholder_names

if TYPE_CHECKING:  # transformers is imported where a model is loaded: it is slow to import
    from transformers import PretrainedConfig, PreTrainedModel


def _load_error(model_cfg: ModelConfig, e: Exception) -> ConfigError:
    """A model that would not load, in the words of the key to change. transformers wraps the
    Hub's answers in OSError and ValueError: their text tells them apart."""
    name, text = model_cfg.name, str(e)
    if "trust_remote_code" in text:  # its refusal of a repository's own code
        return ConfigError(f"model.trust_remote_code: model.name {name} ships its own modeling code: set "
                           "model.trust_remote_code=true to run it (Python from the Hub, run on every node), or use a "
                           "model transformers has")
    if "gated repo" in text or "401 Client Error" in text:
        return ConfigError(f"model.name: {name}: the Hub refused access (a gated or private model): set HF_TOKEN to "
                           "a token that has been granted access to it")
    if model_cfg.revision is not None and "is not a valid git identifier" in text:
        return ConfigError(f"model.revision: {model_cfg.revision} is not a branch, tag or commit of {name}")
    return ConfigError(f"model.name: {name}: {describe(e)}")


def hub_options(model_cfg: ModelConfig) -> dict:
    """What every from_pretrained of model.name takes beside it: the revision (None: main)
    and whether its own code may run. The token is huggingface_hub's to read (HF_TOKEN)."""
    return {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code}


def hub_commit(model_cfg: ModelConfig) -> str | None:
    """The Hub commit model.name was loaded from, after it was: the snapshot of the HF cache
    that its revision (None: main) points to. None for a local folder."""
    if not from_hub(model_cfg):
        return None
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(model_cfg.name, "config.json", revision=model_cfg.revision)
    return Path(path).parent.name if isinstance(path, str) else None


def from_hub(model_cfg: ModelConfig) -> bool:
    """Whether the model comes from the hub (a download), not from a local folder."""
    return not Path(model_cfg.name).expanduser().exists()


def load_tokenizer(model_cfg: ModelConfig):
    """The model's tokenizer, with a pad token. Its padding side is its own: right for
    BERT and GPT-2, left for Llama's (trainer/data/loaders.py keeps positions right under left padding)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_cfg.name, **hub_options(model_cfg))
    except (OSError, ValueError) as e:
        raise _load_error(model_cfg, e) from None
    if tokenizer.pad_token is None:
        # Decoder-only tokenizers (GPT-2, Llama) ship without one; batches need it, and so does
        # the classifier, to find each row's last real token. eos is the usual stand-in: pads
        # are masked out of attention, so which id they carry changes nothing else.
        if tokenizer.eos_token is None:
            raise ConfigError(f"model.name: {model_cfg.name}: the tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model", "vocab.json")


def has_tokenizer(model_cfg: ModelConfig) -> bool:
    """Whether model.name has a tokenizer to load: a hub model, or a folder with one. A
    folder with config.json alone (configs/models/) is enough for the memory plan."""
    folder = Path(model_cfg.name).expanduser()
    return from_hub(model_cfg) or any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_config(model_cfg: ModelConfig, labels: Labels, device_type: str,
                pad_token_id: int | None, backward: bool = True) -> PretrainedConfig:
    """The classifier's config (config.json, no weights): all that the checks before the
    load and the memory plan need, with the run's labels: the head's size, the class names
    (id2label, label2id: a `transformers` pipeline on final/ answers with them), the task
    (problem_type: the pipeline's softmax, sigmoid or none), and the label space itself
    (`trainer_labels`, for evaluate and score on final/). `pad_token_id` is the tokenizer's
    (None: config.json's): a decoder-only classifier (GPT-2, Llama) reads each row's logits at
    its last token that is not a pad, and without the id it refuses every batch of more than
    one row."""
    from transformers import AutoConfig

    from trainer.tasks.registry import task_class

    names = labels.names or placeholder_names(labels.num_labels)
    try:
        pad = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
        config = AutoConfig.from_pretrained(
            model_cfg.name, id2label=dict(enumerate(names)), label2id={name: i for i, name in enumerate(names)},
            problem_type=task_class(labels.problem_type).hf_problem_type, **pad,
            attn_implementation=attention_for(model_cfg, device_type, backward), **hub_options(model_cfg))
    except (OSError, ValueError) as e:
        raise _load_error(model_cfg, e) from None
    config.trainer_labels = labels.state_dict()  # not a key transformers knows: from_pretrained would drop it
    return config


def check_max_length(model_cfg: ModelConfig, max_length: int, config: PretrainedConfig, tokenizer=None) -> None:
    """data.max_length within the model's positions: beyond them the position embedding
    lookup fails on the first sample that long, mid-epoch. The tokenizer's model_max_length
    can be tighter (RoBERTa: 514 embeddings, 512 usable); tokenizers without a limit report 1e30."""
    candidates = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [limit for limit in candidates if isinstance(limit, int) and limit < 10**9]
    if limits and max_length > min(limits):
        raise ConfigError(f"data.max_length: {max_length} is more than the {min(limits)} positions of "
                          f"model.name {model_cfg.name}")


def attention_for(model_cfg: ModelConfig, device_type: str, backward: bool = True) -> str:
    """model.attn_implementation; auto: SDPA, but eager on a CPU for a model that trains, where
    SDPA's backward under bf16 autocast is ~1.9x slower (`backward`). A model that only runs
    forward (score) takes SDPA there too: its fused CPU kernel, 1.1x eager's speed on MiniLM's
    batches (benchmarks/RESULTS.md)."""
    if model_cfg.attn_implementation != "auto":
        implementation = model_cfg.attn_implementation
    else:
        implementation = "sdpa" if device_type == "cuda" or not backward else "eager"
    check_sdpa_backend(model_cfg, implementation, device_type)
    if getattr(model_cfg, "sdpa_backend", "auto") == "flash":  # packed rows, no mask (trainer/model/varlen.py)
        return varlen.register()
    return implementation


SDPA_BACKENDS = {"efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
"""model.sdpa_backend's names for torch.nn.attention.SDPBackend's."""


def check_sdpa_backend(model_cfg: ModelConfig, implementation: str, device_type: str) -> None:
    """model.sdpa_backend against the attention the model is built with, on `device_type`:
    before the weights load, rather than as "No available kernel" in the first step."""
    backend = getattr(model_cfg, "sdpa_backend", "auto")
    if backend == "auto":
        return
    if implementation != "sdpa":
        reason = " (model.attn_implementation auto is eager on CPU)" if model_cfg.attn_implementation == "auto" else ""
        raise ConfigError(f"model.sdpa_backend: {backend} picks an SDPA kernel, but the model's attention is "
                          f"{implementation}{reason}; set model.attn_implementation=sdpa")
    if backend != "math" and device_type != "cuda":
        raise ConfigError(f"model.sdpa_backend: {backend} has no {device_type.upper()} kernel (GPU only); "
                          "use auto or math here")
    if backend == "flash" and (missing := varlen.available()) is not None:
        raise ConfigError(f"model.sdpa_backend: flash: {missing}")


def sdpa_kernel(backend: str, backward: bool) -> AbstractContextManager:
    """The context that makes SDPA run `backend` (model.sdpa_backend). torch.nn.attention.sdpa_kernel
    sets process-wide flags: enter it on the thread that launches the forward, around the
    backward too (autograd's thread replays the forward's kernel choice, but checkpointed
    layers recompute their forward there).

    auto is torch's choice per call, but where a `backward` follows, never cuDNN's attention:
    on H100 and H200 since torch 2.11 its backward writes NaN into the queries' gradient when a
    mask is passed, the keys number 64 past a multiple of 128, and a query's log-sum-exp is under
    ln(FLT_MAX), about -88.7 (pytorch/pytorch#196678). Every pad row of a left-padded decoder's
    batch is such a query (it attends to nothing); a tiny Llama's gradients came back NaN on an
    H200 from such a batch (docs/gpus.md). The memory-efficient kernel ran the defaults' step as
    fast there (1.04x, 2026-11-28); model.sdpa_backend=cudnn still asks for cuDNN's."""
    if backend == "flash" or (backend == "auto" and not backward):  # flash: varlen.py calls its kernel
        return nullcontext()
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as kernel

    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"] if backend == "auto" else [SDPA_BACKENDS[backend]]
    return kernel([getattr(SDPBackend, name) for name in names])


def load_model(model_cfg: ModelConfig, config: PretrainedConfig, seed: int, device: torch.device,
               dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The bare classifier of `config` (load_config) on `device`, its weights in `dtype`
    (whatever config.json says). Seeded, so the new head is the same in every process and run."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    try:
        if not model_cfg.pretrained:
            return AutoModelForSequenceClassification.from_config(
                config, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code).to(device)
        # A classifier fine-tuned before with another label count gets a new head (the
        # load report names it), rather than an error.
        # On a GPU, straight to it from the memory-mapped file: no copy in host memory per
        # rank (a node's 8 ranks would otherwise each hold the model there at once).
        placement = {"device_map": {"": device}} if device.type == "cuda" else {}
        return AutoModelForSequenceClassification.from_pretrained(
            model_cfg.name, config=config, ignore_mismatched_sizes=True, dtype=dtype, **placement,
            **hub_options(model_cfg)).to(device)
    except (OSError, ValueError) as e:
        raise _load_error(model_cfg, e) from None


def meta_model(config: PretrainedConfig, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    """The classifier of `config` on the meta device: every tensor's shape and dtype, no
    storage. Seconds, and no memory, for an 8B model."""
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer, FSDP's units and what compiles: the children of
    the model's largest ModuleList of same-class modules (BERT's encoder.layer, Llama's
    model.layers, GPT-2's h)."""
    stacks = [stack for stack in model.modules() if isinstance(stack, torch.nn.ModuleList) and len(stack) > 0
              and len({type(block) for block in stack}) == 1]
    if not stacks:
        return []
    largest = max(stacks, key=lambda stack: sum(p.numel() for p in stack.parameters()))
    return list(largest)


COMPILE_AFTER_STEPS = 2000
"""train.compile=null compiles on a GPU for runs of this many optimizer steps or more:
compiling costs about 30 s before the first step (more with a cold cache) and saved about 20 ms
a step for bert-base at batch 256 on an H100 (1.33x, the whole model compiled, 2026-11-23): it
pays from about 1,500 steps. Compiled per block, on an H200 at batch 512 (2026-11-28), one run
gave 0.98x while the step waited for its data (benchmarks/RESULTS.md): the rule stands on the
H100's figure until a GPU check measures per-block compile without that wait."""
COMPILE_BACKEND = "inductor"


def compiles(setting: bool | None, device: torch.device, max_steps: int) -> bool:
    """train.compile: as set, or (null) on a GPU for a run of COMPILE_AFTER_STEPS steps or more."""
    if setting is not None:
        return setting
    return device.type == "cuda" and max_steps >= COMPILE_AFTER_STEPS


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each transformer block's forward in place, as torchtitan does: the blocks
    are the same code, so they share their graphs; a strategy's hooks around a block (FSDP2's
    gathers, activation checkpointing) stay outside the graph, and the parameters keep their
    names, so checkpoints and final/ are those of an uncompiled run. Shapes: the first batch
    length compiles a static graph, a second one a graph with the length dynamic, which then
    serves every length (torch's automatic dynamic shapes); evaluation, without gradients, one
    more (tests/unit/test_compile.py counts them). Returns how many blocks compile."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=COMPILE_BACKEND)
    return len(blocks)


def is_model_folder(folder: Path) -> bool:
    """A folder written by save_pretrained (final/), not a checkpoint (step-N)."""
    return (folder / "config.json").is_file()


def without_dropout(model: torch.nn.Module) -> None:
    """Every dropout of `model` off while it trains (model.dropout): its nn.Dropout modules,
    whose p the attention of BERT's family reads too, and the attention dropout that Llama's
    and its kin keep as a number (`attention_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # a plain attribute, not a submodule  # noqa: B010


def use_gradient_checkpointing(model: PreTrainedModel) -> None:
    """model.gradient_checkpointing. Non-reentrant (torch.utils.checkpoint's
    use_reentrant=False): it needs no input that requires grad, which a frozen embedding
    (LoRA) would not give, nor DDP's static_graph, and it saves each layer's RNG state so the
    recomputed forward draws the same dropout masks."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def labels_of(config: PretrainedConfig) -> Labels:
    """The label space a trained model's config holds: the run's own (`trainer_labels`, as
    load_config writes it), else what a transformers config says (id2label, problem_type)."""
    saved = getattr(config, "trainer_labels", None)
    if saved:
        return Labels.from_state(saved)
    from trainer.tasks.registry import of_transformers, task_class

    problem_type = of_transformers(getattr(config, "problem_type", None))
    if task_class(problem_type).predicts_a_number:
        return Labels(problem_type, (), "the task", NUMBERS)
    # A loaded config's id2label has int keys (transformers converts config.json's strings).
    id2label = cast("dict[int, str]", config.id2label)
    return Labels(problem_type, tuple(id2label[i] for i in range(config.num_labels)), "the model's config", IDS)
