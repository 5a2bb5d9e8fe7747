"""DDP is exact: 2 ranks give the weights of 1 process on the union of their batches.

The runs cross an epoch boundary (600 samples / global batch 16 = 37 steps per epoch) with
shuffling and length-grouped batches on, so sampler epochs and grouping are covered too.
"""

import pytest
from support.runs import kill_then_resume, tiny_overrides, train, train_together
from support.weights import EXACT_STEPS, compare_weights, weights

STEPS = EXACT_STEPS


@pytest.mark.parametrize(
    "batch_size, grad_accum, sparse",
    [
        # accumulation with no_sync == one big batch, with gloo's sparse embedding gradients (the default on CPU)
        pytest.param(4, 2, True, id="ddp-2x4-accum2"),
        pytest.param(8, 1, False, id="ddp-2x8-dense-embedding"),  # 2 ranks x 8 == 1 process x 16, as on GPUs
        # (2 x 8 with sparse gradients: test_checkpoint_integrity's disk-full runs end equal to 1 x 16)
    ],
)
def test_two_ranks_match_one_process(single_process_weights, tiny_model, reviews, tmp_path, batch_size, grad_accum,
                                     sparse):
    overrides = {"train.batch_size": batch_size, "train.grad_accum": grad_accum, "train.max_steps": STEPS,
                 "ddp.sparse_embedding_grad": sparse}
    train(tiny_overrides(tiny_model, reviews, tmp_path, **overrides), nproc=2)
    trained = weights(tmp_path, STEPS)
    # The weights moved (the comparison is not between two untouched initializations) ...
    assert compare_weights(weights(tiny_model), trained).max_abs > 1e-2
    # ... and they moved the same way as in the single process, tensor for tensor.
    assert trained.keys() == single_process_weights.keys()
    assert compare_weights(single_process_weights, trained).max_abs <= 1e-5


@pytest.mark.parametrize("family, resume", [("gpt2", False), ("llama", True)], ids=["gpt2", "llama"])
def test_decoder_only_classifiers_match_one_process_and_llamas_resume_is_bitwise(decoder_models, reviews, tmp_path,
                                                                                 family, resume):
    """GPT-2 and Llama-shaped classifiers, which read each row's logits at its last real
    token and ship no pad token; Llama's tokenizer pads on the left, so each rank's batches
    pad differently from the single process's. As BERT's above: 2 ranks x 8 == 1 process
    x 16. And as in test_resume.py, for Llama, the one that pads on the left: rank 1
    SIGKILLed mid-epoch (step 13 of 20 per epoch) then relaunched ends bitwise equal to the
    uninterrupted 2 ranks, across the epoch boundary. (A checkpoint holds nothing a family
    adds: GPT-2's resume is Llama's; restoring every rank's dropout RNG is BERT's test.)"""
    model = decoder_models(family, dropout=0.0)
    steps = 24
    options = {"data.max_train_samples": 320, "train.max_steps": steps, "checkpoint.every": 5}
    single, ranks, resumed = tmp_path / "single", tmp_path / "ranks", tmp_path / "resumed"
    train_together((tiny_overrides(model, reviews, single, **options, **{"train.batch_size": 16,
                                                                        "ddp.sparse_embedding_grad": False}), None),
                   (tiny_overrides(model, reviews, ranks, **options, **{"train.batch_size": 8}), 2))
    assert compare_weights(weights(model), weights(ranks, steps)).max_abs > 1e-2
    assert compare_weights(single, ranks, steps).max_abs <= 1e-5
    if not resume:
        return
    kill_then_resume(tiny_overrides(model, reviews, resumed, **options, **{"train.batch_size": 8}), resumed,
                     {"TRAINER_FAULT_SIGKILL": "1:13"}, resumed_from=10)
    assert not compare_weights(ranks, resumed, steps).differing
