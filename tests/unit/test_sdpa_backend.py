"""model.sdpa_backend: the SDPA kernel in force in the step's forward and backward and in
evaluation, refused where it cannot run (the wrong attention, a GPU kernel on CPU)."""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf
from support.runs import tiny_overrides

from trainer.cli import run_config
from trainer.data import labels, loaders, reading
from trainer.errors import ConfigError
from trainer.model import packing, pretrained, varlen
from trainer.runtime.environment import DistEnv
from trainer.train import build, evaluation
from trainer.train.step import StepObserver

CPU = torch.device("cpu")


def built_with(dropout_model, reviews, tmp_path, backend: str):
    cfg = run_config.load(None, tiny_overrides(dropout_model, reviews, tmp_path / backend, **{
        "model.attn_implementation": "sdpa", "model.sdpa_backend": backend, "train.batch_size": 4}))
    return cfg, build.build(cfg, DistEnv(), CPU, labels.from_config(cfg.data), max_steps=2)


def flags() -> tuple[bool, bool, bool, bool]:
    """Which SDPA backends torch may pick now (process-wide; sdpa_kernel sets them)."""
    cuda = torch.backends.cuda
    return cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(), cuda.math_sdp_enabled()


def test_a_step_under_math_equals_autos_and_runs_math_alone(dropout_model, reviews, tmp_path):
    """Dropout on, as in training: on CPU, torch's only fused kernel (flash) takes no dropout, so
    auto runs math too, and one step under either gives the same weights, bit for bit. Under
    math the forward and the backward see math alone allowed; under auto every kernel but
    cuDNN's, whose backward goes NaN on H100s and H200s (pretrained.sdpa_kernel); afterwards
    torch's flags are back."""
    ids = torch.randint(1000, 2000, (4, 24))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.arange(4)}
    before = flags()
    weights, seen = {}, {}
    for backend in ("auto", "math"):
        _, built = built_with(dropout_model, reviews, tmp_path, backend)
        seen[backend] = []
        head = built.model.classifier  # its output is a tensor: backward hooks reach it
        head.register_forward_hook(lambda *_, b=backend: seen[b].append(("forward", flags())))
        head.register_full_backward_hook(lambda *_, b=backend: seen[b].append(("backward", flags())))
        initial = [p.detach().clone() for p in built.model.parameters()]
        torch.manual_seed(0)  # the same dropout masks
        built.step([batch], 1, StepObserver())
        weights[backend] = {name: p.detach().clone() for name, p in built.model.named_parameters()}
        assert not all(map(torch.equal, initial, weights[backend].values())), "the step was taken"
    assert flags() == before
    assert before == (True, True, True, True)  # torch's default: each may be chosen
    assert seen["auto"] == [("forward", (True, True, False, True)), ("backward", (True, True, False, True))]
    assert seen["math"] == [("forward", (False, False, False, True)), ("backward", (False, False, False, True))]
    assert weights["auto"].keys() == weights["math"].keys()
    assert all(torch.equal(weights["auto"][name], weights["math"][name]) for name in weights["auto"])


def test_evaluation_runs_the_configured_kernel(dropout_model, reviews, tmp_path):
    """Evaluation (no dropout: there auto may take CPU's flash kernel, which sums in another
    order) runs math alone under math, and auto's logits equal math's within float32 rounding.
    Its auto is torch's whole choice: cuDNN's forward is sound, only its backward is not."""

    cfg, built = built_with(dropout_model, reviews, tmp_path, "math")
    splits = reading.load(cfg, DistEnv(), labels=built.task.labels)
    loader, num_samples = loaders.build_eval(cfg, DistEnv(), splits, built.tokenizer, CPU)
    seen = []
    hook = built.model.register_forward_hook(lambda *_: seen.append(flags()))
    logits = {}
    for backend in ("auto", "math"):
        seen.clear()
        kept = evaluation.evaluate(built.logits, loader, num_samples, built.task, CPU, DistEnv(),
                                   keep_rows=True, sdpa_backend=backend)
        logits[backend] = kept.rows[1]
        assert seen and all(f == ((False, False, False, True) if backend == "math" else (True, True, True, True))
                            for f in seen)
    hook.remove()
    torch.testing.assert_close(logits["auto"], logits["math"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("settings", "device", "says"), [
    ({"model.sdpa_backend": "efficient", "model.attn_implementation": "sdpa"}, "cpu",
     "model.sdpa_backend: efficient has no CPU kernel (GPU only); use auto or math here"),
    ({"model.sdpa_backend": "cudnn", "model.attn_implementation": "sdpa"}, "cpu", "cudnn has no CPU kernel"),
    ({"model.sdpa_backend": "efficient"}, "cpu",
     ("the model's attention is eager (model.attn_implementation auto is eager on CPU); set "
      "model.attn_implementation=sdpa")),
    ({"model.sdpa_backend": "cudnn"}, "cuda", None),  # auto is sdpa on GPU
    ({"model.sdpa_backend": "math", "model.attn_implementation": "sdpa"}, "cpu", None),
])
def test_a_backend_that_cannot_run_is_refused_before_the_weights_load(tiny_model, reviews, tmp_path, settings,
                                                                      device, says):
    cfg = run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path, **settings))
    if says is None:
        assert pretrained.attention_for(cfg.model, device) == "sdpa"
        return
    with pytest.raises(ConfigError, match=re.escape(says)) as refused:
        pretrained.attention_for(cfg.model, device)
    assert "\n" not in str(refused.value)


def test_the_config_refuses_a_backend_with_eager_attention(tiny_model, reviews, tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.sdpa_backend: math picks an SDPA kernel, but "
                                          r"model\.attn_implementation is eager; set it to sdpa$"):
        run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path, **{
            "model.sdpa_backend": "math", "model.attn_implementation": "eager"}))
    with pytest.raises(ConfigError, match=r"^model\.sdpa_backend: "):
        run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path, **{"model.sdpa_backend": "fastest"}))


def test_flash_is_refused_without_packing_for_it_takes_no_mask(tiny_model, reviews, tmp_path):
    """torch's FlashAttention kernel takes no attention mask, and every padded batch carries one:
    on an H200 the first step failed with "No available kernel". Packed rows need none
    (trainer/model/varlen.py), in half precision."""
    with pytest.raises(ConfigError, match=r"^model\.sdpa_backend: flash takes no attention mask, and every "
                                          r"padded batch carries one; set data\.packing=true"):
        run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path, **{
            "model.sdpa_backend": "flash", "model.attn_implementation": "sdpa"}))
    with pytest.raises(ConfigError, match=r"^model\.sdpa_backend: flash computes in bf16 or fp16 only, but "
                                          r"train\.precision is fp32$"):
        run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path, **{
            "model.sdpa_backend": "flash", "data.packing": True, "train.precision": "fp32"}))
    cfg = run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path, **{
        "model.sdpa_backend": "flash", "data.packing": True, "train.precision": "bf16"}))
    with pytest.raises(ConfigError, match=r"^model\.sdpa_backend: flash has no CPU kernel \(GPU only\)"):
        pretrained.attention_for(cfg.model, "cpu", backward=False)
    assert pretrained.attention_for(cfg.model, "cuda") == varlen.ATTENTION


def test_a_flash_model_that_packing_cannot_run_is_refused_not_padded(tiny_model, tmp_path):
    """Its attention makes no mask: padded, its batches would attend to their padding."""
    from support.models import make_tiny_model
    from transformers import AutoConfig

    deberta = AutoConfig.from_pretrained(make_tiny_model(tmp_path, 0.0, "deberta-v2"),
                                         attn_implementation=varlen.register())
    with pytest.raises(ConfigError, match=r"^model\.sdpa_backend: flash runs packed batches only, but model type "
                                          r"deberta-v2 is not one packing is proven on"):
        packing.of_run(OmegaConf.create({"packing": True}), deberta)
    bert = AutoConfig.from_pretrained(tiny_model, attn_implementation=varlen.register())
    with pytest.raises(ConfigError, match=r"flash runs packed batches only, but data\.packing is false$"):
        packing.of_run(OmegaConf.create({"packing": False}), bert)
    assert packing.of_run(OmegaConf.create({"packing": True}), bert) == packing.Layout(pool_last=False)


def test_auto_attention_is_eager_for_a_cpu_model_that_trains_and_sdpa_for_one_that_only_scores(tiny_model, reviews,
                                                                                              tmp_path):
    cfg = run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path))
    assert pretrained.attention_for(cfg.model, "cpu") == "eager"
    assert pretrained.attention_for(cfg.model, "cpu", backward=False) == "sdpa"
    assert pretrained.attention_for(cfg.model, "cuda") == "sdpa"
    settings = {"model.attn_implementation": "eager"}
    eager = run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path, **settings))
    assert pretrained.attention_for(eager.model, "cpu", backward=False) == "eager"  # what the user set
