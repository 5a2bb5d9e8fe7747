"""Reward models (data.problem_type=pairwise) under torchrun, with every task's guarantees:
2 DDP ranks end with the weights of 1 process, and 2 FSDP2 ranks of LoRA with those of 1 LoRA
process (1e-6, fp32); a rank SIGKILLed mid-run resumes bitwise; evaluate's metrics are those of
its rows, every pair once; LoRA's final/ scores under plain transformers (no peft) as the
trainer scored its checkpoint; `score` gives each text's reward, the one training gives it.

An encoder on plain pairs with a prompt and a margin column, found by name; a decoder (Llama,
no pad token, left padding) on conversations rendered by its chat template, which ends each
turn with eos: the token transformers' classifier skips, as a pad.
"""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from support.outputs import read_summary
from support.runs import tiny_overrides, together, trainer_command
from support.weights import compare_weights

from trainer.data import demo

STEPS = 12
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
"""A Llama-2-like template: every turn closed by eos (</s>), the tokenizer's pad stand-in."""
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.dropout": 0.0, "ddp.sparse_embedding_grad": False}


def _folder(path, generate, train: int, test: int, margin: bool = False):
    """train.jsonl and test.jsonl of `generate`'s pairs (with `margin`: 0.5 on every other pair)."""
    path.mkdir()
    rows = [json.loads(line) for line in generate(path / "all", train + test, seed=5).read_text().splitlines()]
    if margin:
        rows = [{**row, "margin": 0.5 * (i % 2)} for i, row in enumerate(rows)]
    for name, part in (("train", rows[:train]), ("test", rows[train:])):
        (path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    shutil.rmtree(path / "all")
    return path


@pytest.fixture(scope="module")
def chat_model(decoder_models, tmp_path_factory):
    """The tiny Llama with a chat template."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("llama-chat")
    shutil.copytree(decoder_models("llama", 0.0), folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def succeeded(result) -> None:
    assert result.returncode == 0, result.output[-4000:]


def test_reward_models_train_exactly_resume_bitwise_and_score_as_transformers(tiny_model, chat_model, tmp_path):
    plain = _folder(tmp_path / "plain", demo.preferences, 320, 70, margin=True)
    chat = _folder(tmp_path / "chat", demo.chat_preferences, 320, 70)

    def encoder(name: str, **settings) -> list[str]:
        return tiny_overrides(tiny_model, plain, tmp_path / name, **{
            "data.num_labels": "null", "data.problem_type": "pairwise", "train.max_steps": STEPS,
            "checkpoint.every": 5, "train.eval_every": 6, "train.eval_batch_size": 16, "train.center_rewards": 0.01,
            **settings})

    def decoder(name: str, **settings) -> list[str]:
        return tiny_overrides(chat_model, chat, tmp_path / name, **{
            "data.num_labels": "null", "data.problem_type": "pairwise", "data.max_length": 128,
            "train.max_steps": STEPS, "checkpoint.every": 6, "train.eval_batch_size": 16, **LORA, **settings})

    ddp = {"train.batch_size": 8}
    single, two, killed, lora_single, lora_fsdp = together(
        (trainer_command(encoder("single", **{"train.batch_size": 16}), None), {}),
        (trainer_command(encoder("ddp", **ddp), 2), {}),
        (trainer_command(encoder("resumed", **ddp), 2), {"TRAINER_FAULT_SIGKILL": "1:8"}),
        (trainer_command(decoder("lora-single", **{"train.batch_size": 16}), None), {}),
        (trainer_command(decoder("lora-fsdp", **{"train.batch_size": 8, "train.strategy": "fsdp",
                                                 "train.global_batch": 16}), 2), {}))
    for result in (single, two, lora_single, lora_fsdp):
        succeeded(result)
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]

    texts = tmp_path / "texts.jsonl"
    pairs = [json.loads(line) for line in (plain / "test.jsonl").read_text().splitlines()]
    texts.write_text("".join(json.dumps({"question": p["prompt"], "answer": p["chosen"]}) + "\n" for p in pairs[:5]))
    answers, chat_answers = tmp_path / "answers", tmp_path / "chat-answers"
    conversations = [json.loads(line) for line in (chat / "test.jsonl").read_text().splitlines()]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"conversation": c["chosen"]}) + "\n" for c in conversations[:5]))
    resumed, evaluated, peft_scored, scored, chat_scored = together(
        (trainer_command(encoder("resumed", **ddp), 2), {}),
        (trainer_command(encoder("ddp", **ddp), 2, command="evaluate"), {}),
        (trainer_command([*decoder("lora-single"), f"checkpoint={tmp_path / 'lora-single' / 'checkpoints'}/step-12"],
                         None, command="evaluate"), {}),
        (trainer_command([*encoder("ddp", **ddp), f"score.input={texts}", f"score.output={answers}",
                          "score.format=jsonl", "data.text_field=question", "data.text_pair_field=answer"],
                         None, command="score"), {}),
        (trainer_command([*decoder("lora-single"), f"score.input={chats}", f"score.output={chat_answers}",
                          "score.format=jsonl", "data.text_field=conversation"], None, command="score"), {}))
    for result in (resumed, evaluated, peft_scored, scored, chat_scored):
        succeeded(result)

    # 2 ranks = 1 process: DDP, and LoRA under FSDP2 on the decoder.
    # A pair's gradient is the difference of its two texts', so the same rounding weighs more than
    # in a task of one text; with the tiny random encoder's features nearly alike for every
    # text, AdamW's normalized steps carry it: 1.3e-6 measured (2026-11-29, Xeon), 1e-5 allowed.
    # (Without train.center_rewards the encoder's pair gradients are nearly all rounding:
    # 1.4e-4 apart.) The decoder's LoRA, whose gradients are not: 3.9e-8 measured.
    assert compare_weights(tmp_path / "single", tmp_path / "ddp", STEPS).max_abs <= 1e-5
    assert compare_weights(tmp_path / "lora-single", tmp_path / "lora-fsdp", STEPS).max_abs <= 1e-6
    first, second = read_summary(tmp_path / "single"), read_summary(tmp_path / "ddp")
    assert set(first["final_eval"]) == {"accuracy", "margin", "reward_mean", "reward_std", "length_baseline", "loss"}
    assert first["final_eval"]["length_baseline"] == second["final_eval"]["length_baseline"]
    assert second["final_eval"]["loss"] == pytest.approx(first["final_eval"]["loss"], abs=1e-5)
    assert first["labels"]["problem_type"] == "pairwise" and first["labels"]["stored_as"] == "preference pairs"

    # Killed at step 8, resumed from step 5's checkpoint, bitwise.
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints' / 'step-5'}" in resumed.output
    assert not compare_weights(tmp_path / "ddp", tmp_path / "resumed", STEPS).differing

    # evaluate on 2 ranks: every pair once, in order, and the metrics those of its rows.
    report = json.loads((tmp_path / "ddp" / "final" / "eval-test.json").read_text())
    assert report["samples"] == 70 and report["problem_type"] == "pairwise"
    rows = _rows(tmp_path / "ddp" / "final" / "eval-test-rows.csv")
    assert [int(row["row"]) for row in rows] == list(range(70))
    chosen, rejected = (np.array([float(row[side]) for row in rows]) for side in ("chosen_reward", "rejected_reward"))
    assert report["accuracy"] == pytest.approx(float((chosen > rejected).mean()), abs=1e-12)
    assert report["margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-9)
    assert [float(row["true"]) for row in rows] == [p["margin"] for p in pairs]
    tokenizer = _tokenizer(tiny_model)
    longer = [len(tokenizer(p["prompt"], p["chosen"])["input_ids"]) > len(tokenizer(p["prompt"], p["rejected"])
                                                                          ["input_ids"]) for p in pairs]
    assert report["length_baseline"] == pytest.approx(float(np.mean(longer)), abs=1e-12)
    assert report["accuracy"] == pytest.approx(second["final_eval"]["accuracy"], abs=1e-12)

    card = (tmp_path / "ddp" / "final" / "README.md").read_text()
    assert "A reward model fine-tuned from" in card and "length_baseline" in card and ".logits[0, 0]" in card

    # score: each text's reward, as evaluate's rows gave the same text as a chosen answer.
    scored_rows = [json.loads(line) for line in (answers / "texts.jsonl").read_text().splitlines()]
    assert [set(row) for row in scored_rows] == [{"reward"}] * 5
    assert [row["reward"] for row in scored_rows] == pytest.approx(list(chosen[:5]), abs=1e-5)

    # LoRA's final/ under plain transformers (no peft, the adapters merged, the score head
    # saved), one conversation at a time as RewardBench runs it: the rewards the trainer gave
    # the checkpoint's adapters.
    from transformers import AutoModelForSequenceClassification

    final = tmp_path / "lora-single" / "final"
    assert not (final / "adapter_config.json").exists()
    model, chat_tokenizer = AutoModelForSequenceClassification.from_pretrained(final).eval(), _tokenizer(final)
    expected = _rows(final.parent / "checkpoints" / "step-12" / "eval-test-rows.csv")
    # score on conversations: each rendered by the chat template, the reward training gave it.
    chat_rewards = [json.loads(line)["reward"] for line in (chat_answers / "chats.jsonl").read_text().splitlines()]
    assert chat_rewards == pytest.approx([float(row["chosen_reward"]) for row in expected[:5]], abs=1e-5)
    with torch.no_grad():
        for conversation, row in zip(conversations[:10], expected, strict=False):
            for side in ("chosen", "rejected"):
                text = chat_tokenizer.apply_chat_template(conversation[side], tokenize=False)
                assert text.endswith("</s>")  # the token transformers reads past, as a pad
                ids = chat_tokenizer(text, add_special_tokens=False, return_tensors="pt")
                reward = model(**ids).logits[0, 0].item()
                assert reward == pytest.approx(float(row[f"{side}_reward"]), abs=1e-5), (side, row)


def _rows(path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
