"""DDP is exact: 2 ranks give the weights of 1 process on the union of their batches.

The runs cross an epoch boundary (600 samples / global batch 16 = 37 steps per epoch) with
shuffling and length-grouped batches on, so sampler epochs and grouping are covered too.
"""

import pytest

from conftest import compare_weights, tiny_overrides, train, weights

STEPS = 40


@pytest.fixture(scope="module")
def single_process_weights(tiny_model, reviews, tmp_path_factory):
    """The reference: one plain process (no torchrun), batch 16, with the textbook dense
    embedding gradient (the default sends it through backward and DDP as sparse rows)."""
    out = tmp_path_factory.mktemp("single")
    overrides = {"train.batch_size": 16, "train.max_steps": STEPS, "ddp.sparse_embedding_grad": False}
    train(tiny_overrides(tiny_model, reviews, out, **overrides), nproc=None)
    return weights(out, STEPS)


@pytest.mark.parametrize(
    "batch_size, grad_accum, sparse",
    [
        pytest.param(8, 1, True, id="ddp-2x8"),  # 2 ranks x 8 == 1 process x 16
        pytest.param(4, 2, True, id="ddp-2x4-accum2"),  # accumulation with no_sync == one big batch
        pytest.param(8, 1, False, id="ddp-2x8-dense-embedding"),
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


def test_accumulation_in_one_process(single_process_weights, tiny_model, reviews, tmp_path):
    """4 micro-batches of 4 in a plain process == 1 batch of 16."""
    overrides = {"train.batch_size": 4, "train.grad_accum": 4, "train.max_steps": STEPS}
    train(tiny_overrides(tiny_model, reviews, tmp_path, **overrides), nproc=None)
    accumulated = weights(tmp_path, STEPS)
    assert accumulated.keys() == single_process_weights.keys()
    assert compare_weights(single_process_weights, accumulated).max_abs <= 1e-5
