"""Reward models' parts, in process (data.problem_type=pairwise): the loss against a hand
computation, the metrics with ties and the length baseline, each text read at its own last
token whatever the padding side (a decoder without a pad token, a chat template that ends in
eos), pairs read as plain text or conversations, and every pair that cannot train named by
row before any weights load, or dropped and counted. tests/e2e/test_pairwise_training.py
trains them under torchrun."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from trainer.cli import run_config
from trainer.data import encoding, loaders, pairs, reading
from trainer.errors import ConfigError, DataError
from trainer.model import packing, pretrained
from trainer.runtime.environment import DistEnv
from trainer.tasks import registry as tasks
from trainer.tasks.pairwise import pair_metrics
from trainer.tasks.space import PAIRS, Labels

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
"""Every turn closed by eos, the tokenizer's pad stand-in."""
LABELS = Labels("pairwise", (), "the task", PAIRS)


def pairwise(center: float = 0.0):
    return tasks.of(LABELS, OmegaConf.create({"threshold": 0.5}),
                    OmegaConf.create({"label_smoothing": 0.0, "center_rewards": center}))


def test_the_loss_is_bradley_terrys_with_the_margin_and_the_centring_term():
    task = pairwise()
    # The model's rewards for 3 pairs, chosen rows first: chosen 1.0, 0.5, -2.0; rejected 0.0, 0.5, 1.0.
    logits = torch.tensor([[1.0], [0.5], [-2.0], [0.0], [0.5], [1.0]])
    rewards = task.per_sample(logits)
    assert rewards.tolist() == [[1.0, 0.0], [0.5, 0.5], [-2.0, 1.0]]
    labels = torch.tensor([[0.0, 5, 7], [0.0, 3, 3], [0.25, 9, 2]])  # margin, chosen and rejected tokens
    by_hand = [math.log(1 + math.exp(-(1.0 - 0.0))), math.log(2.0), math.log(1 + math.exp(-(-2.0 - 1.0 - 0.25)))]
    assert task.sample_losses(rewards, labels).tolist() == pytest.approx(by_hand, abs=1e-6)
    centred = pairwise(center=0.01).sample_losses(rewards, labels)
    sums = [1.0, 1.0, -1.0]
    assert centred.tolist() == pytest.approx([loss + 0.01 * s * s for loss, s in zip(by_hand, sums, strict=True)],
                                             abs=1e-6)


def test_accuracy_counts_a_tie_wrong_beside_the_longer_answers_accuracy():
    rewards = torch.tensor([[1.0, 0.0], [0.5, 0.5], [-2.0, 1.0], [3.0, 2.0]]).numpy()
    labels = torch.tensor([[0.0, 5, 7], [0.0, 3, 3], [0.0, 9, 2], [0.0, 4, 1]]).numpy()
    metrics = pair_metrics(rewards, labels)
    assert metrics["accuracy"] == 0.5  # pairs 0 and 3; pair 1's tie counts wrong
    assert metrics["length_baseline"] == 0.5  # pairs 2 and 3: the chosen is the longer
    assert metrics["margin"] == pytest.approx((1.0 + 0.0 - 3.0 + 1.0) / 4)
    assert metrics["reward_mean"] == pytest.approx(rewards.mean())
    report = pairwise().report({"pairs": (rewards, labels)})
    assert report["ties"] == 1
    assert report["chosen_longer"] == {"pairs": 2, "accuracy": 0.5}
    assert report["chosen_shorter"] == {"pairs": 1, "accuracy": 1.0}


def test_a_reward_models_head_bias_is_left_out_of_the_steps_unless_rewards_are_centred():
    """Bradley-Terry's loss depends on a pair's difference: its gradient in the head's bias is
    rounding, which AdamW would turn into steps of about lr."""
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16, num_labels=1))
    assert pairwise().unlearnt(model) == [model.classifier.bias]
    assert pairwise(center=0.01).unlearnt(model) == []


def _cfg(tmp_path, path, *overrides: str):
    return run_config.load(None, ["model.name=org/model", f"data.path={path}", "train.max_steps=1",
                                  "data.problem_type=pairwise", f"output_dir={tmp_path / 'run'}", *overrides])


def _write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_each_text_is_read_at_its_own_last_token_on_either_padding_side(family, decoder_models, tmp_path):
    """GPT-2 pads on the right, the tiny Llama on the left; neither has a pad token, so eos
    stands in, and the chat template ends each turn with it. A pair batch's rewards are each
    text's reward alone, and those transformers gives the rendered text, trailing eos and all
    (its classifier reads past it as a pad)."""
    from transformers import AutoModelForSequenceClassification

    folder = decoder_models(family, 0.0)
    cfg = _cfg(tmp_path, tmp_path, f"model.name={folder}", "data.max_length=128")
    tokenizer = pretrained.load_tokenizer(cfg.model)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # given by the trainer: the hub's has none
    tokenizer.chat_template = CHAT_TEMPLATE
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=1, id2label={0: "reward"}, label2id={"reward": 0}, ignore_mismatched_sizes=True,
        pad_token_id=tokenizer.pad_token_id).eval()
    rows = [{"chosen": [{"role": "user", "content": "How was the food?"},
                        {"role": "assistant", "content": "The food was great." * k}],
             "rejected": [{"role": "user", "content": "How was the food?"},
                          {"role": "assistant", "content": "Ask someone else."}]} for k in (1, 3, 6)]
    encode, _ = encoding._pair_encoder(cfg.data, tokenizer, ["chosen", "rejected"])
    encoded = encode({"chosen": [r["chosen"] for r in rows], "rejected": [r["rejected"] for r in rows]})
    features = [{name: values[i] for name, values in encoded.items()} for i in range(len(rows))]
    batch = loaders.collate(cfg, tokenizer, torch.device("cpu"))(features)
    assert batch["input_ids"].shape[0] == 2 * len(rows)
    labels = batch.pop("labels")
    assert labels[:, 0].tolist() == [0.0] * 3
    packed = loaders.collate(cfg, tokenizer, torch.device("cpu"), packing.layout(model.config))(features)
    packed.pop("labels"), packed.pop("lengths")
    with torch.no_grad():
        rewards = pairwise().per_sample(model(**batch).logits)
        # Packed, each text is read at its last token: the trailing eos left out, the same token.
        assert torch.allclose(pairwise().per_sample(packing.logits(model, packed)), rewards, rtol=0, atol=1e-5)
        for i, row in enumerate(rows):
            for side, column in (("chosen", 0), ("rejected", 1)):
                text = tokenizer.apply_chat_template(row[side], tokenize=False)
                assert text.endswith(tokenizer.eos_token)
                ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
                assert rewards[i, column].item() == pytest.approx(model(**ids).logits[0, 0].item(), abs=1e-5)
                assert labels[i, 1 + column] == len(ids["input_ids"][0]) - 1  # less its trailing eos


def test_plain_pairs_join_their_prompt_as_the_tokenizers_text_pair(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tmp_path, f"model.name={tiny_model}", "data.max_length=32")
    tokenizer = pretrained.load_tokenizer(cfg.model)
    encode, _ = encoding._pair_encoder(cfg.data, tokenizer, ["prompt", "chosen", "rejected", "margin"])
    encoded = encode({"prompt": ["How was it?", None], "chosen": ["Great food.", "Lovely."],
                      "rejected": ["Go away.", "No."], "margin": [1.5, 0]})
    assert encoded["input_ids"][0] == tokenizer("How was it?", "Great food.")["input_ids"]
    assert encoded["token_type_ids"][0] == tokenizer("How was it?", "Great food.")["token_type_ids"]
    assert encoded[pairs.REJECTED + "input_ids"][1] == tokenizer("No.")["input_ids"]  # no prompt: the answer alone
    assert encoded["labels"] == [1.5, 0.0]


def test_pairs_that_truncation_makes_the_same_are_named_or_dropped_and_counted(tiny_model, tmp_path):
    long = " ".join(["the food was great"] * 20)
    rows = [{"prompt": "How was it?", "chosen": f"Good. {i}", "rejected": f"Bad. {i}"} for i in range(40)]
    rows[7] = {"prompt": "How was it?", "chosen": long + " yes", "rejected": long + " no"}
    path = _write(tmp_path / "pairs.jsonl", rows)
    cfg = _cfg(tmp_path, path, f"model.name={tiny_model}", "data.max_length=32")
    tokenizer = pretrained.load_tokenizer(cfg.model)
    with pytest.raises(DataError, match=r"^data.path: .*1 row cannot train: 1 with chosen and rejected the same "
                                        r"once cut to data.max_length=32 tokens at their end \(raise it, or set "
                                        r"data.truncation_side=left\) \(line 8\)"):
        reading.load(cfg, DistEnv(), tokenizer=tokenizer)
    kept = reading.load(_cfg(tmp_path, path, f"model.name={tiny_model}", "data.max_length=32",
                             "data.drop_invalid_rows=true"), DistEnv(), tokenizer=tokenizer)
    assert len(kept.train) + len(kept.eval) == 39 and list(kept.dropped["train"].values()) == [1]
    # Cut at the start, the two keep the words they differ in.
    left = reading.load(_cfg(tmp_path, path, f"model.name={tiny_model}", "data.max_length=32",
                             "data.truncation_side=left"), DistEnv(), tokenizer=tokenizer)
    assert len(left.train) + len(left.eval) == 40


def test_conversations_need_a_chat_template(decoder_models, tmp_path):
    rows = [{"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": f"Hello {i}"}],
             "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go."}]}
            for i in range(20)]
    path = _write(tmp_path / "chat.jsonl", rows)
    cfg = _cfg(tmp_path, path, f"model.name={decoder_models('llama', 0.0)}")
    tokenizer = pretrained.load_tokenizer(cfg.model)
    with pytest.raises(DataError, match=r"^data.chosen_field: the texts hold conversations, and the tokenizer of "
                                        r"model.name \(.*\) has no chat template to render them"):
        reading.load(cfg, DistEnv(), tokenizer=tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(reading.load(cfg, DistEnv(), tokenizer=tokenizer).train) == 18


GOOD = {"chosen": "a", "rejected": "b"}


@pytest.mark.parametrize(("rows", "message"), [
    ([{"answer": "a", "rejected": "b"}] * 10, (r"^data.chosen_field: column 'chosen' not in data.train_split "
                                              r"\(columns: answer, rejected\)$")),
    ([{"chosen": 3, "rejected": "b"}] * 10, (r"^data.chosen_field: column 'chosen' in data.train_split holds int64, "
                                            r"not text or a conversation \(a list of \{role, content\} messages\): "
                                            r"row 0 is 3$")),
    ([{"chosen": ["hello"], "rejected": "b"}] * 10, (r"^data.chosen_field: column 'chosen' in data.train_split holds "
                                                    r"list<item: string>, not text or a conversation")),
    ([GOOD] * 3 + [{"chosen": "a", "rejected": " "}] + [GOOD] * 6,
     (r"^data.path: .*: 1 row cannot train: 1 with no text in column 'rejected' \(line 4\); fix them, or set "
     r"data.drop_invalid_rows=true")),
    ([{"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}] * 4 +
     [{"chosen": [{"role": "user"}], "rejected": [{"role": "user", "content": "b"}]}] * 6,
     (r"^data.chosen_field: column 'chosen' in data.train_split has a message with no content in row 4: each message "
     r"is \{\"role\": ..., \"content\": ...\}, both text$")),
    ([{"chosen": [{"content": "a"}], "rejected": [{"role": "user", "content": "b"}]}] * 10,
     r"^data.chosen_field: column 'chosen' in data.train_split holds messages without a 'role' \(row 0\)"),
    ([GOOD, {"chosen": "a", "rejected": "a"}] + [GOOD] * 8, (r"1 row cannot train: 1 with the same text in 'chosen' "
                                                            r"and 'rejected' \(line 2\)")),
    ([{**GOOD, "margin": None}] + [{**GOOD, "margin": 1.0}] * 9, r"1 with no margin in column 'margin' \(line 1\)"),
])
def test_pairs_that_cannot_train_are_one_line_before_any_weights_load(rows, message, tmp_path):
    with pytest.raises(DataError, match=message):
        reading.load(_cfg(tmp_path, _write(tmp_path / "pairs.jsonl", rows)), DistEnv())


def test_a_pairwise_config_refuses_what_has_no_meaning_for_pairs(tmp_path):
    for override, key in (("data.num_labels=3", "data.num_labels"), ("data.label_names=[a,b]", "data.label_names"),
                          ("train.class_weights=balanced", "train.class_weights"),
                          ("data.rejected_field=chosen", "data.rejected_field"),
                          ("train.strategy=dp", "train.strategy")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
            _cfg(tmp_path, tmp_path, override)
    with pytest.raises(ConfigError, match=r"^train\.center_rewards: centres a reward model's rewards"):
        run_config.load(None, ["model.name=org/model", f"data.path={tmp_path}", "train.max_steps=1",
                               "train.center_rewards=0.1", f"output_dir={tmp_path / 'run'}"])


def test_the_tasks_of_pairs_are_told_apart_before_torch_as_their_classes_say():
    assert {name for name in tasks.TASKS if tasks.task_class(name).pairs} == tasks.PAIR_TASKS


@pytest.mark.parametrize(("problem_type", "setting", "kept"), [
    ("pairwise", "null", False), ("pairwise", "true", True), ("single_label", "null", True),
    ("single_label", "false", False)])
def test_a_reward_model_trains_without_dropout_unless_asked(problem_type, setting, kept, dropout_model,
                                                            decoder_models, tmp_path):
    """A pair's two sides would see independent dropout masks, which blur the difference its
    loss reads: off by default for pairwise (model.dropout), as TRL trains reward models."""
    from trainer.train import build

    labels = LABELS if problem_type == "pairwise" else Labels(problem_type, ("a", "b"), "test", "ids")
    for model in (dropout_model, decoder_models("llama", 0.1)):
        cfg = _cfg(tmp_path, tmp_path, f"model.name={model}", f"data.problem_type={problem_type}",
                   f"model.dropout={setting}", "train.precision=fp32")
        loaded = build.load(cfg, DistEnv(), torch.device("cpu"), torch.float32, labels).model
        rates = [m.p for m in loaded.modules() if isinstance(m, torch.nn.Dropout)]
        rates += [m.attention_dropout for m in loaded.modules() if isinstance(getattr(m, "attention_dropout", None),
                                                                              float)]
        assert rates and all((rate > 0) == kept for rate in rates), (model, rates)


def test_check_reports_each_sides_token_lengths_and_the_pairs_truncation_cuts(tiny_model, tmp_path):
    from trainer.data import demo
    from trainer.preflight import data_check

    path = demo.preferences(tmp_path / "data", 300, seed=0)
    report = data_check.check(_cfg(tmp_path, path, f"model.name={tiny_model}", "data.max_length=24"), world_size=1)
    lines = "\n".join(report.lines)
    assert report.labels.stored_as == PAIRS and report.labels.rows == 270
    for side in ("chosen", "rejected"):
        assert re.search(rf"tokens \(train, 270 sampled pairs' {side} side\): p50 \d+, p90 \d+, p99 \d+, "
                         r"max \d+", lines)
    truncated = re.search(r"data.max_length 24 truncates ([\d.]+)% of the train sample's pairs \(either side\); "
                          r"data.max_length=(\d+) keeps 99% of them whole", lines)
    assert truncated and float(truncated[1]) > 5 and int(truncated[2]) > 24, lines
    assert any("truncates" in warning and "pairs (either side)" in warning for warning in report.warnings)
    assert re.search(r"padding: [\d.]+% of the tokens of the sample's micro-batches of 16", lines)


def test_a_reward_model_may_say_it_has_one_output(tmp_path):
    """data.num_labels=1 is the head a reward model has, as for regression."""
    assert _cfg(tmp_path, tmp_path, "data.num_labels=1").data.num_labels == 1
