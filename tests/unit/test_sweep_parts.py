"""The sweep's core, in process: the search space expanded, the folds, the interval, and
every mistake refused in one line before a trial starts (trainer/sweep/)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from scipy import stats

from trainer import config, folds
from trainer.__main__ import main
from trainer.errors import ConfigError
from trainer.sweep import plan, space
from trainer.sweep.stats import t_interval


def test_a_grid_is_every_combination_of_lists_and_counted_ranges():
    searched = space.parse({"train.lr": {"low": 1e-5, "high": 1e-3, "log": True, "count": 3},
                            "train": {"batch_size": [8, 16]},  # nested, as `key=value` overrides write it
                            "train.warmup_steps": {"low": 0, "high": 10, "count": 3}}, config.KEYS)
    assert list(searched.choices) == ["train.lr", "train.batch_size", "train.warmup_steps"]
    grid = searched.grid()
    assert grid["train.lr"] == pytest.approx([1e-5, 1e-4, 1e-3])
    assert grid["train.batch_size"] == [8, 16]
    assert grid["train.warmup_steps"] == [0, 5, 10] and all(type(v) is int for v in grid["train.warmup_steps"])
    settings = searched.settings()
    assert len(settings) == 3 * 2 * 3
    assert len({json.dumps(s, sort_keys=True) for s in settings}) == len(settings)
    assert settings[0] == {"train.lr": pytest.approx(1e-5), "train.batch_size": 8, "train.warmup_steps": 0}
    assert space.check_size(searched, "grid", None) == 18
    assert space.parse({}, config.KEYS).settings() == [{}]  # seeds or folds alone: one setting


def test_a_linear_range_is_evenly_spaced_and_sampled_between_its_ends():
    searched = space.parse({"train.weight_decay": {"low": 0.0, "high": 0.3, "count": 4}}, config.KEYS)
    assert searched.grid()["train.weight_decay"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        value = searched.suggest(study.ask())["train.weight_decay"]
        assert 0.0 <= value <= 0.3


def test_overrides_read_back_as_the_same_values():
    from omegaconf import OmegaConf

    values = {"a": 1e-5, "b": "cosine", "c": True, "d": 16, "e": None, "f": 0.1}
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([space.override(k, v) for k, v in values.items()]))
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
    load = lambda more: config.load(None, [*base, *overrides, *more])  # noqa: E731
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


def test_data_fold_is_checked_against_data_folds(data_file, tmp_path):
    with pytest.raises(ConfigError, match=r"data.fold: must be below data.folds \(3\), got 3"):
        config.load(None, [f"data.path={data_file}", "model.name=org/model", "train.max_steps=2",
                           f"output_dir={tmp_path}", "data.folds=3", "data.fold=3"])


def test_a_setting_cut_short_is_asked_again_with_its_grid_point_and_number(tmp_path):
    """A sweep killed mid-trial leaves it RUNNING in the journal; the next sweep asks the same
    setting again under its first number, so its runs resume in their own folders."""
    from optuna.trial import TrialState

    from trainer.sweep import study

    searched = space.parse({"train.lr": [0.1, 0.2, 0.3]}, config.KEYS)
    first = study.open_study(tmp_path, searched, "grid", "max", 0, "none")
    done, cut = first.ask(), first.ask()
    done_params, cut_params = searched.suggest(done), searched.suggest(cut)
    first.tell(done, 0.5)
    again = study.open_study(tmp_path, searched, "grid", "max", 0, "none")  # the restarted sweep
    assert study.retry_unfinished(again) == [cut.number]
    assert study.retry_unfinished(again) == []  # asked once only
    retried = again.ask()
    assert searched.suggest(retried) == cut_params != done_params
    assert study.setting_number(retried) == cut.number and retried.number != cut.number
    assert [t.state for t in again.trials][:2] == [TrialState.COMPLETE, TrialState.FAIL]
    assert len(study.settled(again)) == 1
    last = again.ask()  # the grid point never asked yet
    assert searched.suggest(last)["train.lr"] not in (done_params["train.lr"], cut_params["train.lr"])


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
    each = runs.runs_of(0, {}, 42, 1, 3)
    for run in each:
        held = np.flatnonzero(fold_of == run.fold)
        final = tmp_path / runs.TRIALS / run.id / "final"
        final.mkdir(parents=True)
        # evaluate's rows: the fold's rows by their place in it; the answer names the train row
        lines = ["row,true,label"] + [f"{i},t{train_row},p{train_row}" for i, train_row in enumerate(held)]
        (final / "eval-test-rows.csv").write_text("\n".join(lines) + "\n")
    setting = results.Setting(0, {}, "complete", [(r, {"final_eval": {"loss": 1.0}}) for r in each], "loss")
    [written] = results.out_of_fold([setting], fold_of, tmp_path)
    assert written == tmp_path / "oof" / "000-seed42.csv"
    lines = written.read_text().splitlines()
    assert lines[0] == "train_row,fold,true,label"
    assert lines[1:] == [f"{row},{fold_of[row]},t{row},p{row}" for row in range(10)]


def test_the_leaderboard_ranks_by_the_mean_in_the_metrics_direction():
    from trainer.sweep import results, runs

    def setting(number: int, lr: float, losses: list[float], state: str = "complete") -> results.Setting:
        each = runs.runs_of(number, {"train.lr": lr}, 42, len(losses), None)
        done = [(r, {"final_eval": {"loss": v}, "steps": 2}) for r, v in zip(each, losses, strict=True)]
        return results.Setting(number, {"train.lr": lr}, state, done, "loss")

    settings = [setting(0, 0.1, [0.9, 0.7]), setting(1, 0.2, [0.5, 0.6]), setting(2, 0.3, [0.1], "pruned")]
    assert [s.number for s in results.ranked(settings, "min")] == [1, 0, 2]
    assert [s.number for s in results.ranked(settings, "max")] == [0, 1, 2]
    board = results.leaderboard(settings, "loss", "min")
    interval = t_interval([0.5, 0.6])
    assert f"| 1 | train.lr=0.2 | 0.5500 | [{interval.low:.4f}, {interval.high:.4f}] | 2 | complete |" in board
    assert "| 3 | train.lr=0.3 | 0.1000 | (one run) | 1 | pruned |" in board
    csv_rows = results.runs_csv(settings, ["train.lr"]).splitlines()
    assert csv_rows[0] == "trial,setting,state,train.lr,seed,fold,loss,steps"
    assert csv_rows[1] == "000-seed42,0,complete,0.1,42,,0.9,2" and len(csv_rows) == 6


def test_a_sweep_started_again_with_other_runs_is_refused(data_file, tmp_path):
    """Its finished runs' folders would be read as runs of the new config."""
    from trainer.sweep.command import write_config

    base = [f"data.path={data_file}", "model.name=org/model", "train.max_steps=2", f"output_dir={tmp_path / 'out'}",
            "sweep.parameters={train.lr: [0.001, 0.01]}", "sweep.seeds=2"]
    previous = write_config(config.load(None, base)).parent / "sweep.yaml"
    same = [*base, "sweep.parallel=2", "sweep.trials=5", "train.log_every=3", "checkpoint.keep=1"]
    plan.check_same_sweep(previous, config.load(None, same))  # how it runs, not what: accepted
    for changed, named in ((["sweep.parameters={train.lr: [0.001, 0.02]}"], "sweep.parameters.train.lr"),
                           (["sweep.seeds=3"], "sweep.seeds"), (["train.max_steps=3"], "train.max_steps"),
                           (["seed=1"], "seed"), (["sweep.metric=loss"], "sweep.metric")):
        with pytest.raises(ConfigError, match=re.escape(f"holds a sweep of another config ({named} changed)")):
            plan.check_same_sweep(previous, config.load(None, [*base, *changed]))
