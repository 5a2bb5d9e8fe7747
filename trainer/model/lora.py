"""LoRA (`model.lora`): low-rank adapters beside a frozen model, through peft.

Only the adapters and the classification head train, so only they get gradients: DDP
buckets and all-reduces them alone, the optimizer holds their state alone, and a checkpoint
saves them alone (trained_tensors). The frozen rest is model.name's, loaded again
on resume, and model.name is a FIXED key: a resume on another base is refused by name.

final/ holds the adapters merged into the model: a plain transformers classifier, loaded
without peft, whose logits equal the adapted model's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError, one_line

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel


def enabled(model_cfg: ModelConfig) -> bool:
    return model_cfg.lora.r is not None


def frozen_dtype(model_cfg: ModelConfig, amp_dtype: torch.dtype) -> torch.dtype:
    """The dtype the model loads in (model.dtype): bf16 for a LoRA run's frozen base when
    the run computes in bf16; apply() then keeps what trains in fp32. Without LoRA nothing is
    frozen: fp32."""
    if not enabled(model_cfg) or model_cfg.dtype == "fp32":
        return torch.float32
    if amp_dtype == torch.bfloat16:
        return torch.bfloat16
    if model_cfg.dtype == "bf16":  # train.precision=auto chose another dtype on this device
        raise ConfigError(f"model.dtype: bf16 weights need bf16 compute, but train.precision=auto is "
                          f"{dtype_name(amp_dtype)} on this device; set model.dtype=fp32 (or auto)")
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def apply(model: PreTrainedModel, model_cfg: ModelConfig) -> PreTrainedModel:
    """`model` with adapters and its head trainable, in fp32, every other weight frozen in
    the dtype it was loaded in (frozen_dtype); `model` itself without model.lora. The
    adapters' random half is drawn from torch's RNG, seeded by load_model: the same in every
    process."""
    if not enabled(model_cfg):
        return model
    # peft takes seconds to import: only runs with LoRA pay for it.
    from peft import LoraConfig, TaskType, get_peft_model
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    lora_cfg = model_cfg.lora
    target_modules = None if lora_cfg.target_modules is None else list(lora_cfg.target_modules)
    assert lora_cfg.r is not None, "a model with adapters has model.lora.r"
    # peft annotates lora_alpha as an int, and takes a float: the scaling is alpha / r.
    settings = LoraConfig(task_type=TaskType.SEQ_CLS, r=lora_cfg.r, lora_alpha=lora_cfg.alpha,  # type: ignore[arg-type]
                          lora_dropout=lora_cfg.dropout, target_modules=target_modules,
                          modules_to_save=head_modules(model))
    try:
        with warnings.catch_warnings():
            # peft asks for transformers' renamed attribute: noise in every LoRA run's log
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            adapted = get_peft_model(model, settings)  # its adapters are fp32 over any base
        # The head's trained copy is the loaded dtype's: under bf16, an update smaller than
        # 1/256 of a weight would round away. Autocast computes in bf16 all the same.
        for parameter in adapted.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()
        # Typed as what it wraps: peft's model answers the same calls (forward, config,
        # save_pretrained), which is all the trainer makes.
        return cast("PreTrainedModel", adapted)
    except ValueError as e:
        family = getattr(model.config, "model_type", "?")
        if target_modules is None and family not in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
            raise ConfigError(f"model.lora.target_modules: peft has no default for model family {family!r}; "
                              "name the linear layers to adapt (e.g. [q_proj, v_proj])") from None
        targets = target_modules or TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[family]
        raise ConfigError(f"model.lora.target_modules: {targets} adapt no layer of this {family!r} model "
                          f"({one_line(e)[:120]})") from None


def head_modules(model: PreTrainedModel) -> list[str]:
    """The classifier's own modules, which train in full beside the adapters: every child of
    the model outside its base (BERT's `classifier`; DistilBERT's `pre_classifier` too;
    DeBERTa-v2's `pooler`; Llama's `score`). A fine-tuning run initializes them anew, so a
    frozen one would stay random. peft's own list (names ending in `classifier` or `score`)
    misses DeBERTa-v2's pooler."""
    return [name for name, child in model.named_children()
            if name != model.base_model_prefix and any(True for _ in child.parameters())]


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """How many parameters `model` has, and how many of them train."""
    # Not peft's `original_module`: the frozen copy of a head it trains, which never runs.
    parameters = [p for name, p in model.named_parameters() if ".original_module." not in name]
    return {"parameters": sum(p.numel() for p in parameters),
            "trained_parameters": sum(p.numel() for p in parameters if p.requires_grad)}


def precisions(model: nn.Module, amp_dtype: torch.dtype) -> dict[str, str | None]:
    """In which precision the run computes, and keeps the weights it trains and those it
    doesn't (None: none frozen), read from the parameters themselves."""
    def stored(trained: bool) -> str | None:
        dtypes = sorted({dtype_name(p.dtype) for name, p in model.named_parameters()
                         if p.requires_grad == trained and ".original_module." not in name})
        return "+".join(dtypes) or None

    return {"compute": dtype_name(amp_dtype), "trained": stored(True), "frozen": stored(False)}


def describe(counts: dict[str, int], precision: dict[str, str | None]) -> str:
    """What trains (parameter_counts), in which precision (precisions): all parameters, or
    the adapters' and head's share beside the frozen rest."""
    total, trained = counts["parameters"], counts["trained_parameters"]
    computes = f"computes in {precision['compute']}"
    if trained == total:
        return f"all {total:,} parameters, kept in {precision['trained']}; {computes}"
    return (f"{trained:,} of {total:,} parameters ({100 * trained / total:.2f}%: LoRA adapters and the head), "
            f"kept in {precision['trained']}, the frozen rest in {precision['frozen']}; {computes}")


def trained_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of `model`: its whole state dict, or where some of its
    parameters are frozen (LoRA's base), the parameters that train alone. The frozen ones
    are model.name's, loaded again from there: a checkpoint of megabytes, not gigabytes."""
    state = model.state_dict()
    if all(p.requires_grad for p in model.parameters()):
        return state
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: tensor for name, tensor in state.items() if name in trained}


def merged(model: PreTrainedModel) -> PreTrainedModel:
    """The plain transformers model with the adapters merged into its weights, for final/.
    In place: the adapted model is gone afterwards, so it is the run's last use of it."""
    from peft import PeftModel

    return cast("PreTrainedModel", model.merge_and_unload()) if isinstance(model, PeftModel) else model


def save_adapter(model: PreTrainedModel, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """The adapters and the head alone, in peft's format: PeftModel.from_pretrained loads them.
    `state`: their whole tensors, when the model's own are shards (FSDP)."""
    model.save_pretrained(folder, state_dict=state)
