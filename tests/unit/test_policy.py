"""When the loop logs, evaluates, saves and stops, and which evaluated step is the best
(trainer/train/policy.py): the decisions step by step, in process."""

from __future__ import annotations

import json

from trainer.cli import run_config
from trainer.train.policy import Policy, Selection


def policy(max_steps=12, steps_per_epoch=4, log_every=3, eval_every=0, save_every=0,
           save_at_every_eval=False) -> Policy:
    return Policy(max_steps, steps_per_epoch, log_every, eval_every, save_every, save_at_every_eval)


def steps(decide, max_steps=12) -> list[int]:
    """The steps 1..max_steps at which `decide(step)` says yes."""
    return [step for step in range(1, max_steps + 1) if decide(step)]


def test_logs_every_log_every_steps_and_at_the_last_step():
    assert steps(policy(max_steps=10, log_every=3).log, 10) == [3, 6, 9, 10]
    assert steps(policy(max_steps=12, log_every=3).log) == [3, 6, 9, 12]


def test_evaluates_every_n_steps_or_epoch_never_at_the_last_step():
    # The final evaluation runs after the loop, so the last step is never one during training.
    assert steps(policy(eval_every=4).evaluate) == [4, 8]
    assert steps(policy(eval_every=5).evaluate) == [5, 10]
    assert steps(policy(eval_every="epoch").evaluate) == [4, 8]
    assert steps(policy(max_steps=10, eval_every="epoch").evaluate, 10) == [4, 8]
    assert steps(policy(eval_every=0).evaluate) == []


def test_saves_every_n_steps_or_epoch_and_always_at_the_last_step():
    assert steps(policy(save_every=5).save) == [5, 10, 12]
    assert steps(policy(max_steps=10, save_every="epoch").save, 10) == [4, 8, 10]
    assert steps(policy(save_every=0).save) == [12]
    # With a best_metric, every evaluated step is saved: any of them may turn out the best.
    assert steps(policy(eval_every=3, save_at_every_eval=True).save) == [3, 6, 9, 12]
    assert steps(policy(eval_every=3, save_every=4, save_at_every_eval=True).save) == [3, 4, 6, 8, 9, 12]
    assert steps(policy(eval_every=3, save_every=4).save) == [4, 8, 12]


def test_a_preemption_stops_the_run_before_its_last_step_only():
    p = policy()
    assert not p.stop_for_preemption(5, None)
    assert p.stop_for_preemption(5, "SIGTERM")
    assert not p.stop_for_preemption(12, "SIGTERM")  # the last step ends the run as usual


def cfg(*overrides: str):
    required = ["model.name=x", "data.path=x", "data.num_labels=2", "output_dir=unused", "train.max_steps=20"]
    return run_config.load(None, [*required, *overrides])


def test_from_config():
    p = Policy.from_config(cfg("train.max_steps=null", "train.epochs=3", "train.eval_every=epoch",
                               "checkpoint.every=5", "train.log_every=2", "checkpoint.best_metric=accuracy"), 4)
    assert p == Policy(12, 4, 2, "epoch", 5, True)
    assert Policy.from_config(cfg("train.max_steps=7"), 4).max_steps == 7
    assert not Policy.from_config(cfg(), 4).save_at_every_eval

    loss = Selection.from_config(cfg("checkpoint.best_metric=loss", "train.eval_every=2",
                                     "train.early_stopping_patience=3", "train.early_stopping_threshold=0.01"))
    assert (loss.metric, loss.higher_is_better, loss.patience, loss.threshold) == ("loss", False, 3, 0.01)
    assert Selection.from_config(cfg("checkpoint.best_metric=accuracy")).higher_is_better
    assert Selection.from_config(cfg("checkpoint.best_metric=loss", "checkpoint.best_mode=max")).higher_is_better
    f1_min = Selection.from_config(cfg("checkpoint.best_metric=f1_macro", "checkpoint.best_mode=min"))
    assert not f1_min.higher_is_better


def observe_all(selection: Selection, values: dict[int, float]) -> Selection:
    for step, value in values.items():
        selection.observe(step, {selection.metric: value, "step_seen": step})
    return selection


def test_the_best_is_the_highest_and_a_tie_stays_with_the_earlier_step():
    best = observe_all(Selection("accuracy"), {2: 0.5, 4: 0.7, 6: 0.7, 8: 0.6})
    assert best.summary() == {"step": 4, "metric": "accuracy", "value": 0.7,
                              "eval": {"accuracy": 0.7, "step_seen": 4}}


def test_in_min_mode_the_best_is_the_lowest_and_a_tie_stays_with_the_earlier_step():
    best = observe_all(Selection("loss", higher_is_better=False), {2: 0.9, 4: 0.5, 6: 0.5, 8: 0.7})
    assert (best.step, best.value) == (4, 0.5)
    # The same values read as higher-is-better pick another step.
    assert observe_all(Selection("loss"), {2: 0.9, 4: 0.5, 6: 0.5, 8: 0.7}).step == 2


def test_the_best_keeps_its_own_results_not_a_later_evaluations():
    selection = Selection("accuracy")
    results = {"accuracy": 0.8, "loss": 0.3}
    selection.observe(2, results)
    results["loss"] = 9.0  # the caller reuses its dict
    assert selection.eval == {"accuracy": 0.8, "loss": 0.3}


def test_without_a_metric_nothing_is_selected_and_nothing_stops():
    selection = Selection(None, patience=1)
    selection.observe(2, {"accuracy": 0.5})
    selection.observe(4, {"accuracy": 0.4})
    assert selection.summary() is None and not selection.stop


def test_patience_counts_evaluations_in_a_row_without_an_improvement_above_the_threshold():
    selection = Selection("accuracy", patience=2, threshold=0.05)
    stops = []
    for step, value in {2: 0.50, 4: 0.53, 6: 0.60, 8: 0.58, 10: 0.62, 12: 0.61}.items():
        selection.observe(step, {"accuracy": value})
        stops.append((step, selection.evals_without_improvement, selection.stop))
    # 0.53 and 0.62 are new bests, yet gain no more than the threshold: they count against patience.
    assert stops == [(2, 0, False), (4, 1, False), (6, 0, False), (8, 1, False), (10, 2, True), (12, 3, True)]
    assert (selection.step, selection.value) == (10, 0.62)


def test_patience_in_min_mode_and_zero_patience_never_stops():
    selection = observe_all(Selection("loss", higher_is_better=False, patience=2), {2: 0.5, 4: 0.4, 6: 0.4})
    assert (selection.evals_without_improvement, selection.stop) == (1, False)
    selection.observe(8, {"loss": 0.45})
    assert selection.stop and selection.step == 4
    assert not observe_all(Selection("loss", higher_is_better=False), {2: 0.5, 4: 0.6, 6: 0.7, 8: 0.8}).stop


def test_a_resumed_selection_makes_the_uninterrupted_ones_choices():
    """The state goes through a checkpoint's JSON; the settings come from the config again."""
    settings = {"metric": "accuracy", "patience": 3, "threshold": 0.01}
    uninterrupted = observe_all(Selection(**settings), {2: 0.5, 4: 0.7, 6: 0.69})
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    assert state == {"step": 4, "value": 0.7, "eval": {"accuracy": 0.7, "step_seen": 4},
                     "evals_without_improvement": 1}
    resumed = Selection(**settings)
    resumed.load_state_dict(state)
    assert resumed == uninterrupted
    later = {8: 0.7, 10: 0.705}  # a tie, then a gain under the threshold
    for step, value in later.items():
        for selection in (uninterrupted, resumed):
            selection.observe(step, {"accuracy": value, "step_seen": step})
        assert resumed == uninterrupted and resumed.stop == uninterrupted.stop
    assert resumed.stop and resumed.summary()["step"] == 10
