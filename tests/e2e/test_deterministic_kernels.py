"""train.deterministic on CPU, where every kernel is deterministic already. What the CPU can
prove, it proves here; that it makes a GPU's kernels reproducible (the embedding backward's
atomics, SDPA's backends, cuBLAS's split reductions) is tests/e2e/test_cuda.py's kill and
resume under deterministic kernels, bitwise (it passed on an H200 on 2026-11-28). The device
decisions, in process: tests/unit/test_devices.py."""

from support.outputs import read_summary
from support.runs import tiny_overrides, train
from support.weights import compare_weights


def test_deterministic_mode_holds_for_the_whole_run_and_changes_no_cpu_result(dropout_model, reviews, tmp_path):
    """Two ranks, dropout on (the DDP step, gloo's all-reduce, dropout's kernels, evaluation):
    - the key reaches torch: the summary reads torch's own flag at the run's end, after the
      last evaluation, so deterministic mode held for the whole run (and is off without it);
    - no op the run executes lacks a deterministic version: in that mode torch raises at the
      first one, and the run completes;
    - on CPU it changes no result: the same weights, bit for bit, as without."""
    plain, strict = tmp_path / "plain", tmp_path / "strict"
    train(tiny_overrides(dropout_model, reviews, plain))
    train(tiny_overrides(dropout_model, reviews, strict, **{"train.deterministic": True}))
    assert read_summary(strict)["deterministic_kernels"] and not read_summary(plain)["deterministic_kernels"]
    assert not compare_weights(plain, strict, 4).differing
