"""train.deterministic on CPU, where every kernel is deterministic already: two training runs.
(The device decisions, in process: tests/unit/test_devices.py.)"""

from conftest import compare_weights, tiny_overrides, train
from support import read_summary


def test_deterministic_kernels_train_the_same_weights_on_cpu(tiny_model, reviews, tmp_path):
    """train.deterministic turns on torch's deterministic mode (which would raise on any
    kernel without a deterministic version); CPU kernels are deterministic already."""
    plain, strict = tmp_path / "plain", tmp_path / "strict"
    train(tiny_overrides(tiny_model, reviews, plain), nproc=None)
    train(tiny_overrides(tiny_model, reviews, strict, **{"train.deterministic": True}), nproc=None)
    assert read_summary(strict)["deterministic_kernels"] and not read_summary(plain)["deterministic_kernels"]
    assert not compare_weights(plain, strict, 4).differing
