"""The sweep's core, in process: the search space expanded, the folds, the interval, and
every mistake refused in one line before a trial starts (trainer/sweep/)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from scipy import stats

from trainer.cli import run_config
from trainer.cli.main import main
from trainer.config import schema
from trainer.data import folds
from trainer.errors import ConfigError
from trainer.sweep import plan, search_space
from trainer.sweep.stats import t_interval


def test_a_grid_is_every_combination_of_lists_and_counted_ranges():
    searched = search_space.parse({"train.lr": {"low": 1e-5, "high": 1e-3, "log": True, "count": 3},
                            "train": {"batch_size": [8, 16]},  # nested, as `key=value` overrides write it
                            "train.warmup_steps": {"low": 0, "high": 10, "count": 3}}, schema.KEYS)
    assert list(searched.choices) == ["train.lr", "train.batch_size", "train.warmup_steps"]
    grid = searched.grid()
    assert grid["train.lr"] == pytest.approx([1e-5, 1e-4, 1e-3])
    assert grid["train.batch_size"] == [8, 16]
    assert grid["train.warmup_steps"] == [0, 5, 10] and all(type(v) is int for v in grid["train.warmup_steps"])
    settings = searched.settings()
    assert len(settings) == 3 * 2 * 3
    assert len({json.dumps(s, sort_keys=True) for s in settings}) == len(settings)
    assert settings[0] == {"train.lr": pytest.approx(1e-5), "train.batch_size": 8, "train.warmup_steps": 0}
    assert [searched.place(s) for s in settings] == list(range(len(settings)))  # what names a grid's folders
    assert search_space.check_size(searched, "grid", None) == 18
    assert search_space.parse({}, schema.KEYS).settings() == [{}]  # seeds or folds alone: one setting


def test_a_linear_range_is_evenly_spaced_and_sampled_between_its_ends():
    searched = search_space.parse({"train.weight_decay": {"low": 0.0, "high": 0.3, "count": 4}}, schema.KEYS)
    assert searched.grid()["train.weight_decay"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        value = searched.suggest(study.ask())["train.weight_decay"]
        assert 0.0 <= value <= 0.3


def test_overrides_read_back_as_the_same_values():
    from omegaconf import OmegaConf

    values = {"a": 1e-5, "b": "cosine", "c": True, "d": 16, "e": None, "f": 0.1}
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([search_space.override(k, v) for k, v in values.items()]))
    assert parsed == values


def test_folds_are_disjoint_covering_stratified_balanced_and_seeded():
    rng = np.random.default_rng(5)
    classes = rng.choice(4, size=503, p=[0.55, 0.3, 0.1, 0.05])
    fold_of = folds.assign(len(classes), 5, classes)
    assert fold_of.shape == (503,) and set(fold_of.tolist()) == set(range(5))  # each row in exactly one fold
    held = [folds.held_out(fold_of, k)[1] for k in range(5)]
    assert sorted(np.concatenate(held).tolist()) == list(range(503))  # covering, disjoint
    for k in range(5):
        training, validating = folds.held_out(fold_of, k)
        assert not set(training) & set(validating) and len(training) + len(validating) == 503
    sizes = np.bincount(fold_of)
    assert sizes.max() - sizes.min() <= 1
    for c in range(4):  # each class spread over the folds to within one row
        per_fold = np.bincount(fold_of[classes == c], minlength=5)
        assert per_fold.max() - per_fold.min() <= 1, (c, per_fold)
    assert np.array_equal(fold_of, folds.assign(len(classes), 5, classes))  # the same on every restart
    assert not np.array_equal(fold_of, folds.assign(len(classes), 5, classes, seed=1))
    plain = folds.assign(10, 3)
    assert np.bincount(plain).tolist() in ([4, 3, 3], [3, 4, 3], [3, 3, 4])


@pytest.mark.parametrize("values", [[0.81, 0.79, 0.86], [0.5, 0.52], [1.0, 2.0, 4.0, 8.0, 16.0], [3.0] * 2 + [3.5]])
def test_the_interval_is_scipys_t_interval(values):
    got = t_interval(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert got.n == len(values)
    assert got.mean == pytest.approx(np.mean(values), rel=1e-12)
    assert (got.low, got.high) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))


def test_one_run_has_a_mean_and_no_interval():
    one = t_interval([0.7])
    assert one.mean == 0.7 and one.n == 1 and math.isnan(one.low) and math.isnan(one.high)


@pytest.fixture
def data_file(tmp_path):
    """12 rows: class 0 has 9, class 1 has 3."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}", "label": int(i % 4 == 0)}) + "\n" for i in range(12)))
    return path


def sweep_plan(data_file, tmp_path, *overrides: str) -> plan.Plan:
    base = [f"data.path={data_file}", "model.name=org/model", "train.max_steps=2", f"output_dir={tmp_path / 'out'}"]
    load = lambda more: run_config.load(None, [*base, *overrides, *more])  # noqa: E731
    return plan.check(load([]), load)


BAD_SWEEPS = [
    ("not-a-key", ["sweep.parameters={train.lrr: [0.1]}"], "sweep.parameters.train.lrr: train.lrr is not a config key"),
    ("set-by-the-sweep", ["sweep.parameters={seed: [1, 2]}"], "sweep.parameters.seed: seed is set by the sweep"),
    ("value-refused", ["sweep.parameters={train.lr: [1e-4, 5]}"],
     "sweep.parameters.train.lr: 5 is refused: train.lr: must be in (0, 1)"),
    ("range-end-refused", ["sweep.parameters={train.warmup_ratio: {low: 0.0, high: 2.0}}", "sweep.method=random",
                           "sweep.trials=3"], "sweep.parameters.train.warmup_ratio: 2.0 is refused"),
    ("wrong-choice", ["sweep.parameters={train.lr_scheduler: [linear, sideways]}"],
     "sweep.parameters.train.lr_scheduler: 'sideways' is refused"),
    ("not-a-list", ["sweep.parameters={train.lr: 0.1}"], "sweep.parameters.train.lr: expected a list of values"),
    ("bad-range", ["sweep.parameters={train.lr: {low: 0.1, high: 0.01}}"], "low below high"),
    ("grid-needs-count", ["sweep.parameters={train.lr: {low: 0.01, high: 0.1}}"], "a range needs `count`"),
    ("grid-over-trials", ["sweep.parameters={train.lr: [0.1, 0.2, 0.3]}", "sweep.trials=2"],
     "sweep.trials: the grid has 3 settings, more than sweep.trials=2"),
    ("random-needs-trials", ["sweep.method=random"], "sweep.trials: sweep.method=random needs"),
    ("metric-of-another-task", ["sweep.metric=mse"], "sweep.metric: mse is not a metric of data.problem_type"),
    ("too-many-folds", ["sweep.folds=4"], "sweep.folds: 4 folds need 4 rows of each class in the train split; class 1"),
    ("folds-of-a-subsample", ["sweep.folds=2", "data.max_eval_samples=4"],
     "sweep.folds: out-of-fold predictions need every row of each fold, and data.max_eval_samples=4"),
    ("ranks-below-parallel", ["sweep.parallel=3", "sweep.ranks=2"], "sweep.ranks: 3 trials at once"),
    ("bad-method", ["sweep.method=bayes"], "sweep.method:"),
    ("bad-pruner", ["sweep.pruner=median"], "sweep.pruner:"),
    ("one-fold", ["sweep.folds=1"], "sweep.folds: must be >= 2 or null"),
    ("halving-without-evaluations", ["sweep.pruner=halving"],
     ("sweep.pruner: halving judges each setting by its runs' evaluations during training, at steps it knows "
      "before they start; train.eval_every is 0: set it to a step count")),
    ("halving-at-epochs", ["sweep.pruner=halving", "train.eval_every=epoch"], "train.eval_every is epoch"),
]


@pytest.mark.parametrize(("overrides", "expected"), [b[1:] for b in BAD_SWEEPS], ids=[b[0] for b in BAD_SWEEPS])
def test_a_bad_sweep_is_one_line_naming_the_key(data_file, tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as refused:
        sweep_plan(data_file, tmp_path, *overrides)
    assert expected in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_good_sweep_plans_its_settings_metric_and_folds(data_file, tmp_path):
    planned = sweep_plan(data_file, tmp_path, "sweep.parameters={train.lr: [1e-4, 1e-3]}", "sweep.folds=3")
    assert planned.settings == 2 and planned.metric == "accuracy" and planned.direction == "max"
    assert planned.fold_of is not None and sorted(np.bincount(planned.fold_of).tolist()) == [4, 4, 4]
    loss = sweep_plan(data_file, tmp_path, "sweep.metric=loss")
    assert loss.metric == "loss" and loss.direction == "min"


def test_an_empty_mapping_on_the_command_line_empties_the_files_grid(data_file, tmp_path):
    """OmegaConf merges a mapping into the one there, and an empty one changes nothing: a
    folds-only sweep of a config whose YAML has a grid silently ran the grid."""
    config_file = tmp_path / "sweep.yaml"
    config_file.write_text(f"data: {{path: {data_file}}}\nmodel: {{name: org/model}}\ntrain: {{max_steps: 2}}\n"
                           f"output_dir: {tmp_path / 'out'}\nsweep: {{parameters: {{train.lr: [1e-4, 1e-3]}}}}\n")
    load = lambda more: run_config.load(str(config_file), ["sweep.folds=3", *more])  # noqa: E731
    assert plan.check(load([]), load).settings == 2
    folds_only = plan.check(load(["sweep.parameters={}"]), lambda more: load(["sweep.parameters={}", *more]))
    assert folds_only.settings == 1 and folds_only.fold_of is not None
    assert load(["train={}"]).train.max_steps == 2  # a section of the schema keeps its keys


def test_data_fold_is_checked_against_data_folds(data_file, tmp_path):
    with pytest.raises(ConfigError, match=r"data.fold: must be below data.folds \(3\), got 3"):
        run_config.load(None, [f"data.path={data_file}", "model.name=org/model", "train.max_steps=2",
                           f"output_dir={tmp_path}", "data.folds=3", "data.fold=3"])


def test_a_setting_cut_short_is_asked_again_with_its_grid_point_and_number(tmp_path):
    """A sweep killed mid-trial leaves it RUNNING in the journal; the next sweep asks the same
    setting again under its first number, so its runs resume in their own folders."""
    from optuna.trial import TrialState

    from trainer.sweep import study

    searched = search_space.parse({"train.lr": [0.1, 0.2, 0.3]}, schema.KEYS)
    first = study.open_study(tmp_path, searched, "grid", "max", 0, "none")
    done, cut = first.ask(), first.ask()
    done_params, cut_params = searched.suggest(done), searched.suggest(cut)
    first.tell(done, 0.5)
    again = study.open_study(tmp_path, searched, "grid", "max", 0, "none")  # the restarted sweep
    assert study.retry_unfinished(tmp_path) == [cut.number]
    assert study.retry_unfinished(tmp_path) == []  # asked once only
    retried = again.ask()
    assert searched.suggest(retried) == cut_params != done_params
    assert study.first_trial_number(retried) == cut.number and retried.number != cut.number
    assert [t.state for t in again.trials][:2] == [TrialState.COMPLETE, TrialState.FAIL]
    assert len(study.settled(again)) == 1
    last = again.ask()  # the grid point never asked yet
    assert searched.suggest(last)["train.lr"] not in (done_params["train.lr"], cut_params["train.lr"])


def test_the_last_grid_point_cut_short_is_asked_again(tmp_path):
    """Failing it finishes the grid: told through the sweep's own study, GridSampler would stop
    the study outside `optimize`, which raises."""
    from trainer.sweep import study

    searched = search_space.parse({"train.lr": [0.1, 0.2]}, schema.KEYS)
    first = study.open_study(tmp_path, searched, "grid", "max", 0, "none")
    done, cut = first.ask(), first.ask()
    searched.suggest(done), searched.suggest(cut)
    first.tell(done, 0.5)
    again = study.open_study(tmp_path, searched, "grid", "max", 0, "none")
    assert study.retry_unfinished(tmp_path) == [cut.number]
    retried = again.ask()
    assert searched.suggest(retried) == searched.suggest(cut) and study.first_trial_number(retried) == cut.number


def test_optuna_is_quiet_only_while_the_sweep_runs():
    import warnings

    import optuna

    from trainer.sweep import study

    verbosity, filters = optuna.logging.get_verbosity(), list(warnings.filters)
    with study.quiet():
        assert optuna.logging.get_verbosity() == optuna.logging.ERROR
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("experimental", optuna.exceptions.ExperimentalWarning, stacklevel=1)
        assert caught == []
    assert optuna.logging.get_verbosity() == verbosity and warnings.filters == filters


def test_the_cli_prints_a_bad_sweep_as_one_line_and_exits_2(data_file, tmp_path, capsys):
    code = main(["sweep", f"data.path={data_file}", "model.name=org/model", "train.max_steps=2",
                 f"output_dir={tmp_path / 'out'}", "sweep.parameters={train.bogus: [1, 2]}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines()[-1] == "error: sweep.parameters.train.bogus: train.bogus is not a config key"
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_out_of_fold_rows_map_back_to_the_train_split_once_each(tmp_path):
    from trainer.sweep import results, runs

    fold_of = folds.assign(10, 3, np.array([0, 1] * 5))
    fold_runs = runs.runs_of(0, {}, 42, 1, 3)
    for run in fold_runs:
        held = np.flatnonzero(fold_of == run.fold)
        final = tmp_path / runs.TRIALS / run.id / "final"
        final.mkdir(parents=True)
        # evaluate's rows: the fold's rows by their place in it; the answer names the train row
        lines = ["row,true,label"] + [f"{i},t{train_row},p{train_row}" for i, train_row in enumerate(held)]
        (final / "eval-test-rows.csv").write_text("\n".join(lines) + "\n")
    setting = results.Setting(0, {}, "complete", [(r, {"final_eval": {"loss": 1.0}}) for r in fold_runs], "loss")
    [written] = results.out_of_fold([setting], fold_of, tmp_path)
    assert written == tmp_path / "oof" / "000-seed42.csv"
    lines = written.read_text().splitlines()
    assert lines[0] == "train_row,fold,true,label"
    assert lines[1:] == [f"{row},{fold_of[row]},t{row},p{row}" for row in range(10)]


def test_the_leaderboard_ranks_by_the_mean_in_the_metrics_direction():
    from trainer.sweep import results, runs

    def setting(number: int, lr: float, losses: list[float], state: str = "complete") -> results.Setting:
        setting_runs = runs.runs_of(number, {"train.lr": lr}, 42, len(losses), None)
        done = [(r, {"final_eval": {"loss": v}, "steps": 2}) for r, v in zip(setting_runs, losses, strict=True)]
        return results.Setting(number, {"train.lr": lr}, state, done, "loss")

    settings = [setting(0, 0.1, [0.9, 0.7]), setting(1, 0.2, [0.5, 0.6])]
    assert [s.number for s in results.ranked(settings, "min")] == [1, 0]
    assert [s.number for s in results.ranked(settings, "max")] == [0, 1]
    board = results.leaderboard(settings, "loss", "min")
    interval = t_interval([0.5, 0.6])
    assert f"| 1 | train.lr=0.2 | 0.5500 | [{interval.low:.4f}, {interval.high:.4f}] | 2 | complete |" in board
    assert "pruned" not in board
    csv_rows = results.runs_csv(settings, ["train.lr"]).splitlines()
    assert csv_rows[0] == "trial,setting,state,train.lr,seed,fold,loss,steps"
    assert csv_rows[1] == "000-seed42,0,complete,0.1,42,,0.9,2" and len(csv_rows) == 5


def test_a_pruned_setting_shows_where_it_was_stopped_after_the_complete_ones():
    """Its runs have no summary.json: the leaderboard gives the step its pruner stopped it at and
    the mean it reported there, sweep.csv each run's metric there; ranked after every complete
    setting however good that mean, the later stopped first."""
    from trainer.sweep import results, runs

    complete_runs = runs.runs_of(0, {"train.lr": 0.1}, 42, 2, None)
    complete = results.Setting(0, {"train.lr": 0.1}, "complete",
                               [(r, {"final_eval": {"loss": v}, "steps": 40}) for r, v in zip(complete_runs, [0.9, 0.7],
                                                                                               strict=True)], "loss")
    early, late = (results.Setting(n, {"train.lr": lr}, "pruned", [], "loss", at, mean,
                                   list(zip(runs.runs_of(n, {"train.lr": lr}, 42, 2, None), values, strict=True)))
                   for n, lr, at, mean, values in ((1, 1e-9, 10, 0.05, [0.04, 0.06]),
                                                   (2, 0.5, 20, 0.3, [0.2, 0.4])))
    settings = [early, complete, late]
    assert [s.number for s in results.ranked(settings, "min")] == [0, 2, 1]
    board = results.leaderboard(settings, "loss", "min")
    assert "| 2 | train.lr=0.5 | 0.3000 | (at step 20) | 2 | pruned at step 20 |" in board, board
    assert "| 3 | train.lr=1e-09 | 0.0500 | (at step 10) | 2 | pruned at step 10 |" in board, board
    assert "at the evaluation where sweep.pruner stopped them, not at their end" in board
    assert results.runs_csv(settings, ["train.lr"]).splitlines()[3:] == [
        "001-seed42,1,pruned,1e-09,42,,0.04,10", "001-seed43,1,pruned,1e-09,43,,0.06,10",
        "002-seed42,2,pruned,0.5,42,,0.2,20", "002-seed43,2,pruned,0.5,43,,0.4,20"]


class FakeTrial:
    """What the judge asks of an Optuna trial, recorded; its pruner says yes from `prune_from` on."""

    def __init__(self, prune_from: int | None = None):
        self.reports: list[tuple[int, float]] = []
        self.asked: list[int] = []
        self.prune_from = prune_from

    def report(self, value: float, step: int) -> None:
        self.reports.append((step, value))

    def should_prune(self) -> bool:
        step = self.reports[-1][0]
        self.asked.append(step)
        return self.prune_from is not None and step >= self.prune_from


def evaluated(step: int, loss: float) -> dict:
    return {"step": step, "eval/loss": loss, "eval/accuracy": 0.5}


def test_the_mean_at_a_step_is_reported_once_every_run_has_evaluated_there_and_gone_on():
    from trainer.sweep import pruning

    trial = FakeTrial()
    judge = pruning.Judge(["a", "b"], "loss", trial)
    judge.seen("a", [{"step": 2, "loss": 2.0}, evaluated(2, 1.0), {"step": 4, "loss": 1.9}, evaluated(4, 0.8),
                     {"step": 6, "loss": 1.8}])
    assert trial.reports == []  # b has not evaluated yet
    judge.seen("b", [evaluated(2, 3.0)])
    assert trial.reports == []  # b's evaluation at 2 may be its last: not judged until it goes on or ends
    judge.seen("b", [{"step": 4, "loss": 1.5}])
    assert trial.reports == [(2, 2.0)] and trial.asked == [2]
    judge.seen("b", [evaluated(4, 0.4)])
    assert trial.reports == [(2, 2.0)]
    judge.seen("a", [evaluated(8, 0.7)], ended=True)  # a's last evaluation, its run ended
    judge.seen("b", [{"step": 6, "loss": 1.0}, evaluated(8, 0.3)], ended=True)
    assert trial.reports == [(2, 2.0), (4, pytest.approx(0.6)), (8, pytest.approx(0.5))]
    assert trial.asked == [2, 4]  # the last step ends every run: nothing left to stop, the setting is complete
    assert not judge.pruned


def test_a_run_finished_before_counts_with_every_evaluation_it_wrote(tmp_path):
    """A restarted sweep reads a finished run back: its metrics.jsonl feeds the judge as the
    running one's records arrive, so the same means are reported at the same steps."""
    from trainer.sweep import pruning

    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 2, "loss": 2.0}, evaluated(2, 1.0), evaluated(4, 0.6), {"step": 6, "loss": 1.0}, evaluated(6, 0.2),
        {"step": 6, "test/loss": 0.1}]))
    assert pruning.evaluations(finished, "loss") == {2: 1.0, 4: 0.6, 6: 0.2}
    trial = FakeTrial(prune_from=4)
    judge = pruning.Judge(["finished", "running"], "loss", trial)
    judge.seen("finished", pruning.Records(finished).new(), ended=True)
    judge.seen("running", [evaluated(2, 2.0), {"step": 3, "loss": 1.0}])
    assert trial.reports == [(2, 1.5)] and not judge.pruned
    judge.seen("running", [evaluated(4, 1.4), {"step": 5, "loss": 1.0}])
    assert trial.reports[-1] == (4, pytest.approx(1.0)) and judge.pruned_at == 4 and judge.mean == pytest.approx(1.0)
    judge.seen("running", [evaluated(6, 1.0), {"step": 7, "loss": 1.0}])
    assert len(trial.reports) == 2  # pruned: nothing more is reported


def test_a_runs_metrics_are_followed_as_they_are_written_and_read_again_when_rewritten(tmp_path):
    from trainer import files
    from trainer.sweep import pruning

    records = pruning.Records(tmp_path)
    assert records.new() == []  # not written yet
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(evaluated(2, 1.0)) + "\n" + '{"step": 3, "lo')  # a line half written
    assert records.new() == [evaluated(2, 1.0)]
    with path.open("a") as f:
        f.write('ss": 1.5}\n')
    assert records.new() == [{"step": 3, "loss": 1.5}] and records.new() == []
    files.write_text(path, json.dumps(evaluated(2, 1.0)) + "\n")  # a resume from step 2 rewrites it
    assert records.new() == [evaluated(2, 1.0)]


def test_halving_rungs_fall_on_the_evaluations(tmp_path):
    """Successive halving with its first rung at train.eval_every (3), then 12, 48: a setting
    worse than the one before it at an evaluation between rungs (6) goes on to the next rung
    (12), where it is stopped; one worse at the first evaluation (3) is stopped there."""
    from optuna.trial import TrialState

    from trainer.sweep import pruning, study

    searched = search_space.parse({"train.lr": [0.1, 0.2, 0.3]}, schema.KEYS)
    sweep_study = study.open_study(tmp_path, searched, "random", "min", 0, "halving", 3)
    verdicts = []
    for losses in ({3: 1.0, 6: 0.5, 9: 0.4, 12: 0.3}, {3: 0.9, 6: 0.9, 9: 0.9, 12: 0.9}, {3: 2.0, 6: 0.1}):
        trial = sweep_study.ask()
        judge = pruning.Judge(["run"], "loss", trial)
        for step, loss in losses.items():
            judge.seen("run", [evaluated(step, loss), {"step": step + 1, "loss": loss}])
        verdicts.append(judge.pruned_at)
        if judge.pruned:
            sweep_study.tell(trial, state=TrialState.PRUNED)
        else:
            sweep_study.tell(trial, judge.mean)
    assert verdicts == [None, 12, 3]


def test_a_sweep_started_again_with_other_runs_is_refused(data_file, tmp_path):
    """Its finished runs' folders would be read as runs of the new config."""
    from trainer.sweep.command import write_config

    base = [f"data.path={data_file}", "model.name=org/model", "train.max_steps=2", f"output_dir={tmp_path / 'out'}",
            "sweep.parameters={train.lr: [0.001, 0.01]}", "sweep.seeds=2"]
    previous = write_config(run_config.load(None, base)).parent / "sweep.yaml"
    same = [*base, "sweep.parallel=2", "sweep.trials=5", "train.log_every=3", "checkpoint.keep=1"]
    plan.check_same_sweep(previous, run_config.load(None, same))  # how it runs, not what: accepted
    for changed, named in ((["sweep.parameters={train.lr: [0.001, 0.02]}"], "sweep.parameters.train.lr"),
                           (["sweep.seeds=3"], "sweep.seeds"), (["train.max_steps=3"], "train.max_steps"),
                           (["seed=1"], "seed"), (["sweep.metric=loss"], "sweep.metric")):
        with pytest.raises(ConfigError, match=re.escape(f"holds a sweep of another config ({named} changed)")):
            plan.check_same_sweep(previous, run_config.load(None, [*base, *changed]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_trials_asked_at_once_after_a_restart_take_different_grid_points(seed, tmp_path, monkeypatch):
    """sweep.parallel trials are asked at once, from threads. Past the grid's size (a restart's
    retries took numbers) GridSampler draws each a point not yet taken, at random: two asked
    together must not draw the same one, or one setting runs twice and another never.
    Each asker, as it writes its grid point, waits for the other to come as far as it can: to
    its own write, or to the sampler's door while this one is inside. Four seeds: without the
    door some draw the same point for both."""
    import threading

    from trainer.sweep import study

    searched = search_space.parse({"train.lr": [0.1, 0.2], "train.warmup_ratio": [0.0, 0.5]}, schema.KEYS)
    killed = study.open_study(tmp_path, searched, "grid", "max", seed, "none")
    for _ in range(2):  # the killed sweep's two settings at once, left RUNNING
        searched.suggest(killed.ask())
    again = study.open_study(tmp_path, searched, "grid", "max", seed, "none")
    assert len(study.retry_unfinished(tmp_path)) == 2
    for _ in range(2):
        retried = again.ask()
        searched.suggest(retried)
        again.tell(retried, 0.5)

    progress = threading.Condition()
    counts = {"at the door": 0, "writing": 0}

    class Door:
        def __init__(self):
            self.lock = threading.Lock()

        def __enter__(self):
            with progress:
                counts["at the door"] += 1
                progress.notify_all()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    write = again._storage.set_trial_system_attr

    def rendezvous(trial_id, key, value):
        if key == "grid_id":
            with progress:
                counts["writing"] += 1
                progress.notify_all()
                assert progress.wait_for(lambda: 2 in counts.values(), timeout=60)
        write(trial_id, key, value)

    monkeypatch.setattr(again.sampler, "_choosing", Door(), raising=False)
    monkeypatch.setattr(again._storage, "set_trial_system_attr", rendezvous)
    asked: list = []
    askers = [threading.Thread(target=lambda: asked.append(searched.suggest(again.ask()))) for _ in range(2)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(asked) == 2 and asked[0] != asked[1]
    settings = [dict(t.params) for t in again.trials if t.state.name == "COMPLETE"] + asked
    assert sorted(searched.place(s) for s in settings) == [0, 1, 2, 3]
