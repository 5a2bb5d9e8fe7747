"""LoRA (model.lora) keeps every guarantee of full fine-tuning: 2 ranks equal 1 process, a
run resumed on another world size stays on that trajectory, a SIGKILLed run resumes bitwise,
and final/ is a plain transformers model whose logits are the adapted model's.

A LoRA checkpoint holds the adapters and the head alone (and their optimizer state): the
frozen base is model.name's, loaded again on resume.
"""

import json
from pathlib import Path

import pytest
from support.outputs import model_card, read_summary
from support.runs import (
    failure_output,
    kill_then_resume,
    run_preloaded,
    tiny_overrides,
    together,
    train_together,
    trainer_command,
)
from support.weights import compare_weights, weights

STEPS = 24
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.dropout": 0.0, "train.global_batch": 16,
        "data.max_train_samples": 320, "train.max_steps": STEPS, "checkpoint.every": 5}
"""Across an epoch boundary: 320 samples / global batch 16 = 20 steps per epoch."""

TEXTS = ["The food was good and the staff kind.", "Rude, slow, and cold soup.", "It was fine, I guess."]


def logits_without_peft(model_dir: Path) -> list[list[float]]:
    """final/'s logits on TEXTS from plain transformers, in a process where peft can't be imported."""
    return logits_without_peft_of(model_dir)[0]


def logits_without_peft_of(*model_dirs: Path) -> list[list[list[float]]]:
    """logits_without_peft of each of `model_dirs`, in one process forked from the preloaded
    server (tests/support/plain_logits.py): no interpreter's start and imports to pay."""
    result = run_preloaded("tests.support.plain_logits", [json.dumps(TEXTS), *map(str, model_dirs)], timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    answers = [json.loads(line) for line in result.output.splitlines() if line.startswith("[[")]
    assert len(answers) == len(model_dirs), result.output[-3000:]
    return answers


def adapter_logits(base: Path, adapter: Path):
    """The adapted model's logits on TEXTS: the base with final/adapter/ loaded by peft."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base, num_labels=5),
                                      str(adapter)).eval()
    with torch.no_grad():
        return model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits


def test_lora_is_exact_at_any_world_size_and_final_holds_the_merged_model(tiny_model, reviews, tmp_path):
    import torch

    single, ranks, elastic = tmp_path / "single", tmp_path / "ranks", tmp_path / "elastic"
    elastic_overrides = tiny_overrides(tiny_model, reviews, elastic, **LORA, **{"train.batch_size": 8})
    # The 1-process run, the 2-rank run and a third killed at step 13, all at once: independent.
    first, trained, killed = together(
        (trainer_command(tiny_overrides(tiny_model, reviews, single, **LORA, **{"train.batch_size": 16}), None), {}),
        (trainer_command(tiny_overrides(tiny_model, reviews, ranks, **LORA, **{"train.batch_size": 8,
                                                                                "checkpoint.export_adapter": True}),
                         2), {}),
        (trainer_command(elastic_overrides, nproc=2), {"TRAINER_FAULT_SIGKILL": "1:13"}))
    assert first.returncode == 0, failure_output(first.output)
    assert trained.returncode == 0, failure_output(trained.output)
    assert ("trains 1,189 of 1,000,261 parameters (0.12%: LoRA adapters and the head), kept in fp32, the frozen "
            "rest in fp32; computes in fp32") in trained.output

    # The checkpoint holds the adapters and the head, nothing of the frozen base.
    saved = weights(ranks, STEPS)
    assert saved and all("lora_" in name or "modules_to_save" in name for name in saved), sorted(saved)
    assert sum(t.numel() for t in saved.values()) == read_summary(ranks)["trained_parameters"] == 1189
    # The adapters moved (lora_B starts at zero) ...
    assert max(float(t.abs().max()) for name, t in saved.items() if "lora_B" in name) > 1e-3
    # ... the same way in 2 ranks as in 1 process.
    assert compare_weights(single, ranks, STEPS).max_abs <= 1e-6

    # Killed at step 13 on 2 ranks, resumed from step 10 on 1: the same trajectory. At once
    # with it, `evaluate` of the 2-rank run's last checkpoint (below): independent too.
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    checkpoint = ranks / "checkpoints" / f"step-{STEPS}"
    resumed, evaluated = together(
        (trainer_command(elastic_overrides, nproc=None), {}),
        (trainer_command([*tiny_overrides(tiny_model, reviews, ranks, **LORA), f"checkpoint={checkpoint}"], nproc=2,
                         command="evaluate"), {}))
    assert resumed.returncode == 0, failure_output(resumed.output)
    assert f"resumed from {elastic / 'checkpoints' / 'step-10'}" in resumed.output
    assert compare_weights(single, elastic, STEPS).max_abs <= 1e-6

    # final/ is the merged model: plain transformers loads it without peft, and its logits
    # are those of the base with the exported adapter.
    merged = torch.tensor(logits_without_peft(ranks / "final"))
    adapted = adapter_logits(tiny_model, ranks / "final" / "adapter")
    assert float((merged - adapted).abs().max()) <= 1e-5
    assert not (single / "final" / "adapter").exists()  # only with checkpoint.export_adapter
    # Each has its model card: the merged model's for transformers, the adapter's for peft.
    assert (model_card(ranks / "final").data.library_name, model_card(ranks / "final" / "adapter").data.library_name) \
        == ("transformers", "peft")

    # `evaluate` of a LoRA checkpoint: the base, the adapters from the checkpoint, and the
    # validation the run reported for it.
    assert evaluated.returncode == 0, evaluated.output[-3000:]
    report = json.loads((checkpoint / "eval-test.json").read_text())
    assert report["accuracy"] == read_summary(ranks)["final_eval"]["accuracy"]


def test_lora_sigkill_then_resume_is_bitwise(dropout_model, reviews, tmp_path):
    """With the adapters' dropout on, so that a resume that lost any rank's RNG state is not
    bitwise: rank 1 SIGKILLed at step 13, relaunched from step 10, ends equal to the
    uninterrupted run, bit for bit, with the optimizer state it had."""
    options = {**LORA, "model.lora.dropout": 0.1, "train.batch_size": 8}
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    kill_then_resume(tiny_overrides(dropout_model, reviews, resumed, **options), resumed,
                     {"TRAINER_FAULT_SIGKILL": "1:13"}, resumed_from=10,
                     beside=((tiny_overrides(dropout_model, reviews, uninterrupted, **options), 2),))
    assert not compare_weights(uninterrupted, resumed, STEPS).differing
    import torch

    for run_dir in (uninterrupted, resumed):
        assert (run_dir / "checkpoints" / f"step-{STEPS}" / "optimizer.pt").is_file()
    saved = [torch.load(d / "checkpoints" / f"step-{STEPS}" / "optimizer.pt", weights_only=True)["optimizer"]["state"]
             for d in (uninterrupted, resumed)]
    assert len(saved[0]) == len(weights(resumed, STEPS))  # AdamW's state: the adapters' and the head's alone
    assert all(torch.equal(saved[0][i][k], saved[1][i][k]) for i in saved[0] for k in ("exp_avg", "exp_avg_sq"))


def test_a_bf16_base_trains_fp32_adapters_and_resumes_bitwise(dropout_model, reviews, tmp_path):
    """model.dtype=bf16: the frozen base is stored in bf16, the adapters and head train in
    fp32, and the guarantees hold: a SIGKILLed rank resumes bitwise, the checkpoint holds
    fp32 tensors, final/ loads without peft, and the log and summary say which is which."""
    options = {**LORA, "model.lora.dropout": 0.1, "train.batch_size": 8, "model.dtype": "bf16",
               "train.precision": "bf16", "train.max_steps": 14}
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    relaunch = kill_then_resume(tiny_overrides(dropout_model, reviews, resumed, **options), resumed,
                                {"TRAINER_FAULT_SIGKILL": "1:13"}, resumed_from=10,
                                beside=((tiny_overrides(dropout_model, reviews, uninterrupted, **options), 2),))
    assert "kept in fp32, the frozen rest in bf16; computes in bf16" in relaunch.output
    assert not compare_weights(uninterrupted, resumed, 14).differing
    import torch

    assert {t.dtype for t in weights(resumed, 14).values()} == {torch.float32}
    assert read_summary(resumed)["precision"] == {"compute": "bf16", "trained": "fp32", "frozen": "bf16"}
    assert len(logits_without_peft(resumed / "final")) == len(TEXTS)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_on_decoder_only_classifiers_matches_one_process(decoder_models, reviews, tmp_path, family):
    """peft's defaults for GPT-2 (c_attn) and Llama (q_proj, v_proj), and their `score` head:
    2 ranks x 8 == 1 process x 16, and final/ loads as a plain classifier."""
    model = decoder_models(family, dropout=0.0)
    options = {**LORA, "train.max_steps": 8, "checkpoint.every": 0}
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    train_together((tiny_overrides(model, reviews, single, **options, **{"train.batch_size": 16}), None),
                   (tiny_overrides(model, reviews, ranks, **options, **{"train.batch_size": 8}), 2))
    saved = weights(ranks, 8)
    assert any("lora_B" in name for name in saved) and any("score.modules_to_save" in name for name in saved)
    assert max(float(t.abs().max()) for name, t in saved.items() if "lora_B" in name) > 1e-3
    assert compare_weights(single, ranks, 8).max_abs <= 1e-6
    assert len(logits_without_peft(ranks / "final")) == len(TEXTS)


@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", ["roberta", "deberta-v2", "modernbert", "qwen2", "mistral"])
def test_more_families_match_one_process_and_load_back(decoder_models, reviews, tmp_path, family, with_lora):
    """The other families users bring for classification, each with and without LoRA (peft's
    default targets; DeBERTa-v2's pooler trains as part of its head): 2 ranks x 8 == 1 process
    x 16 for a few steps, and final/ loads as a plain classifier. peft has no default
    targets for ModernBERT: its fused attention projection, Wqkv, is named."""
    model = decoder_models(family, dropout=0.0)
    options = {**LORA, "train.max_steps": 6, "checkpoint.every": 0}
    if not with_lora:
        options["model.lora.r"] = "null"
    elif family == "modernbert":
        options["model.lora.target_modules"] = "[Wqkv]"
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    train_together((tiny_overrides(model, reviews, single, **options, **{"train.batch_size": 16}), None),
                   (tiny_overrides(model, reviews, ranks, **options, **{"train.batch_size": 8}), 2))
    assert compare_weights(weights(model), weights(ranks, 6)).max_abs > 1e-3 if not with_lora else \
        max(float(t.abs().max()) for name, t in weights(ranks, 6).items() if "lora_B" in name) > 1e-3
    assert compare_weights(single, ranks, 6).max_abs <= 1e-5
    assert len(logits_without_peft(ranks / "final")) == len(TEXTS)
