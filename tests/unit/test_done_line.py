"""The run's last line says how the model in final/ scores, not the last step's model."""

from __future__ import annotations

from omegaconf import OmegaConf

from trainer.outputs import summary as summary_module
from trainer.tasks import registry as tasks
from trainer.tasks.space import Labels

SCORES = tasks.of(Labels("single_label", ("a", "b"), "test", "ids"), OmegaConf.create({"threshold": 0.5})).scores


def done_line(made: dict) -> str:
    return summary_module.done_line(made, SCORES)


def summary(final_step: int, steps: int, test: bool = True) -> dict:
    best = {"accuracy": 0.831422, "f1_macro": 0.8314}
    last = {"accuracy": 0.8188, "f1_macro": 0.8181}
    return {"final_model_step": final_step, "steps": steps, "best": {"metric": "accuracy"},
            "final_eval": best if final_step != steps else last, "last_step_eval": last,
            "test_eval": {"accuracy": 0.8, "f1_macro": 0.79} if test else None}


def test_with_the_best_loaded_it_reports_the_best_and_labels_the_last():
    assert done_line(summary(250, 375)) == (
        "done: final/ holds step 250 (the best by accuracy): validation accuracy 0.8314, macro F1 0.8314, "
        "test accuracy 0.8000, macro F1 0.7900; the last step, 375: validation accuracy 0.8188, macro F1 0.8181")


def test_without_selection_final_is_the_last_step():
    assert done_line(summary(375, 375, test=False)) == (
        "done: final/ holds step 375 (the last step): validation accuracy 0.8188, macro F1 0.8181")
