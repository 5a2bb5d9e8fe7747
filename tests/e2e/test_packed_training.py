"""data.packing end to end: packing changes how a micro-batch is laid out, never what trains.

A Llama-shaped classifier (its tokenizer pads on the left; the classifier reads each
sequence's last token, under a causal mask): 2 ranks with packed micro-batches of 8 end
where 1 process with padded batches of 16 ends, and evaluate the same (`evaluate` of one
final/, packed and padded: every row's answer the same); rank 1 SIGKILLed
mid-epoch and relaunched, packed, ends bitwise where the uninterrupted packed run ends.
(Packed against padded per family, full and LoRA, in process: tests/unit/test_packing.py.)
"""

import json
import shutil

import pytest
from support.outputs import read_summary
from support.runs import kill_then_resume, tiny_overrides, together, train_together, trainer_command
from support.weights import compare_weights, weights


def test_two_packed_ranks_train_what_one_padded_process_trains_and_resume_bitwise(decoder_models, reviews,
                                                                                 tmp_path):
    model = decoder_models("llama", dropout=0.0)
    steps = 24
    options = {"data.max_train_samples": 320, "train.max_steps": steps, "checkpoint.every": 5}
    packed = {"train.batch_size": 8, "data.packing": True}
    single, ranks, resumed = tmp_path / "single", tmp_path / "ranks", tmp_path / "resumed"
    runs = train_together((tiny_overrides(model, reviews, single, **options, **{"train.batch_size": 16,
                                                                               "ddp.sparse_embedding_grad": False}),
                           None),
                          (tiny_overrides(model, reviews, ranks, **options, **packed), 2))
    said = "laid end to end in rows as wide as its longest (at most 64 tokens), each sample read at its last token"
    assert said in runs[1].output, runs[1].output[-3000:]
    assert compare_weights(weights(model), weights(ranks, steps)).max_abs > 1e-2
    assert compare_weights(single, ranks, steps).max_abs <= 1e-5
    padded_eval, packed_eval = read_summary(single)["final_eval"], read_summary(ranks)["final_eval"]
    assert packed_eval.keys() == padded_eval.keys()
    for name, value in padded_eval.items():
        assert packed_eval[name] == pytest.approx(value, abs=1e-5), name

    # `evaluate` of the same final/, packed and padded: the same answer for every row, the same metrics.
    folders = {name: tmp_path / f"final-{name}" for name in ("padded", "packed")}
    for folder in folders.values():
        shutil.copytree(single / "final", folder)
    evaluated = together(*((trainer_command([*tiny_overrides(model, reviews, tmp_path / "evaluate", **options),
                                              f"data.packing={name == 'packed'}", f"checkpoint={folder}"],
                                             None, command="evaluate"), {}) for name, folder in folders.items()))
    assert all(result.returncode == 0 for result in evaluated), [r.output[-2000:] for r in evaluated]
    assert "samples laid end to end" in evaluated[1].output and "samples laid end to end" not in evaluated[0].output
    (padded_rows,), (packed_rows,) = (list(folder.glob("eval-*-rows.csv")) for folder in folders.values())
    assert packed_rows.read_text() == padded_rows.read_text()  # each row's prediction, as a CSV prints it
    reports = [json.loads(next(folder.glob("eval-*.json")).read_text()) for folder in folders.values()]
    assert reports[1]["loss"] == pytest.approx(reports[0]["loss"], abs=1e-5)

    kill_then_resume(tiny_overrides(model, reviews, resumed, **options, **packed), resumed,
                     {"TRAINER_FAULT_SIGKILL": "1:13"}, resumed_from=10)
    assert not compare_weights(ranks, resumed, steps).differing

