"""Left padding, in process: a decoder-only classifier's logits for a sample do not depend on
how far its batch pads it. (GPT-2's and Llama's runs held to one process: tests/e2e/test_ddp_exact.py.)"""

import pytest


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padding_leaves_each_samples_logits_alone(decoder_models, family):
    """What a sample's logits are must not depend on how far its batch pads it: under left
    padding, positions count from each row's first real token (trainer.data.loaders.Collate).
    GPT-2's learned absolute positions show it most; Llama's rotary ones up to rounding."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainer.data.loaders import Collate

    folder = decoder_models(family, dropout=0.0)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(folder, pad_token_id=tokenizer.pad_token_id).eval()
    texts = ["The food was good.", "The staff was rude and the room was a complete waste of money. Never again."]
    collate = Collate(tokenizer, pad_to_multiple_of=None)
    with torch.no_grad():
        batched = model(**collate([tokenizer(text) for text in texts])).logits
        alone = model(**collate([tokenizer(texts[0])])).logits
    assert torch.allclose(batched[0], alone[0], atol=1e-5), (batched[0], alone[0])
