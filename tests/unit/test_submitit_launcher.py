"""slurm/submit.py's own arithmetic, without a cluster (its jobs run in tests/system/test_slurm.py)."""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import cloudpickle
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def submit():
    spec = importlib.util.spec_from_file_location("submit", REPO / "slurm" / "submit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpus_of_a_partition_are_its_smallest_nodes_the_default_one_found_by_its_name_too(submit, monkeypatch):
    """sinfo's %P marks the default partition "debug*": `--partition debug` must find it."""
    def sinfo(argv, **_):
        assert argv == ["sinfo", "-h", "-N", "-o", "%P %c"]
        return SimpleNamespace(stdout="debug* 8\ndebug* 4\nshort 2\nshort 16\n")
    monkeypatch.setattr(subprocess, "run", sinfo)
    assert [submit.node_cpus(p) for p in ("debug", None, "short", "gpu")] == [4, 4, 2, None]


def test_the_pickled_job_loads_on_a_node_where_slurm_is_not_importable(submit, monkeypatch):
    """submitit pickles the job, and each task loads it in a Python whose path has the submit
    directory, not slurm/: the requeue shared with ddp.sh (slurm/requeue.py) must travel in
    the pickle, not be imported there by name."""
    pickled = cloudpickle.dumps(submit.TrainJob(grace_s=60, max_fault_requeues=5))
    monkeypatch.delitem(sys.modules, "requeue")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != REPO / "slurm"])
    loaded = pickle.loads(pickled)
    assert (loaded.grace_s, loaded.max_fault_requeues) == (60, 5)
    assert "requeue" not in sys.modules


class FakeExecutor:
    """submitit.AutoExecutor's part that submit.py calls, recording the array it is given."""

    arrays: ClassVar[list] = []

    def __init__(self, **options):
        self.options = options

    def update_parameters(self, **parameters):
        self.parameters = parameters

    def map_array(self, fn, tasks):
        FakeExecutor.arrays.append((self, fn, list(tasks)))
        paths = SimpleNamespace(stdout=Path("runs/submitit/7_0/7_0_log.out"))
        return [SimpleNamespace(job_id=f"7_{i}", paths=paths) for i in range(len(tasks))]


def test_a_sweep_is_a_job_array_of_its_trial_runs_each_a_train_job(submit, monkeypatch, tiny_model, reviews, tmp_path,
                                                                  capsys):
    """--sweep: one array task per run of the grid (settings x seeds x folds), each the
    TrainJob a single job is (requeue, node faults), with the sweep's config file and the
    run's overrides in its own folder, named as `python -m trainer sweep` names it."""
    monkeypatch.setattr(submit.submitit, "AutoExecutor", FakeExecutor)
    monkeypatch.setattr(FakeExecutor, "arrays", [])
    out = tmp_path / "sweep"
    overrides = [f"model.name={tiny_model}", f"data.path={reviews}", "data.num_labels=5", "train.max_steps=2",
                 f"output_dir={out}", "sweep.parameters={train.lr: [0.001, 0.01]}", "sweep.seeds=2", "sweep.folds=2"]
    assert submit.main(["--sweep", "--nodes", "1", "--gpus-per-node", "0", "--no-data", *overrides]) == 0
    [(executor, job, tasks)] = FakeExecutor.arrays
    assert isinstance(job, submit.TrainJob) and executor.parameters["nodes"] == 1
    assert "8 trials" in capsys.readouterr().out
    config_file = out / "sweep.yaml"
    assert config_file.is_file() and "SIGUSR2" in config_file.read_text()
    assert len(tasks) == 2 * 2 * 2
    first = tasks[0]
    assert first[:2] == ["-c", str(config_file)]
    assert first[2:] == ["train.lr=0.001", "seed=42", "data.folds=2", "data.fold=0",
                         f'output_dir="{out / "trials" / "000-seed42-fold0"}"']
    assert tasks[-1][-1] == f'output_dir="{out / "trials" / "001-seed43-fold1"}"'


def test_a_sweep_array_refuses_what_the_sweep_refuses_before_submitting(submit, monkeypatch, tiny_model, reviews,
                                                                        tmp_path, capsys):
    monkeypatch.setattr(submit.submitit, "AutoExecutor", FakeExecutor)
    monkeypatch.setattr(FakeExecutor, "arrays", [])
    base = [f"model.name={tiny_model}", f"data.path={reviews}", "data.num_labels=5", "train.max_steps=2",
            f"output_dir={tmp_path / 'sweep'}"]
    for wrong, expected in ((["sweep.method=random", "sweep.trials=2", "sweep.parameters={train.lr: [0.1, 0.2]}"],
                             "error: sweep.method: a job array runs a grid"),
                            (["sweep.parameters={train.lrr: [0.1]}"], "error: sweep.parameters.train.lrr")):
        assert submit.main(["--sweep", "--nodes", "1", "--gpus-per-node", "0", "--no-data", *base, *wrong]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected)
    assert FakeExecutor.arrays == []


def test_score_is_a_job_array_of_score_jobs_its_corpus_checked_before_submitting(submit, monkeypatch, tiny_model,
                                                                               tmp_path, capsys):
    """--score TASKS: TASKS array tasks, each the same `python -m trainer score` job on one node
    (they share the corpus through score.output's ledger), with submitit's own signal handling
    (no preempt_signals override: a scoring worker has nothing to save). The corpus is checked
    first: a missing column is one line, and nothing is submitted."""
    monkeypatch.setattr(submit.submitit, "AutoExecutor", FakeExecutor)
    monkeypatch.setattr(FakeExecutor, "arrays", [])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": 1, "text": "fine"}\n')
    overrides = ["-c", str(REPO / "configs" / "demo.yaml"), f"model.name={tiny_model}", f"score.model={tiny_model}",
                 f"score.input={corpus}", f"score.output={tmp_path / 'out'}", "score.carry=[id]"]
    assert submit.main(["--score", "3", "--gpus-per-node", "0", *overrides]) == 0
    [(executor, job, tasks)] = FakeExecutor.arrays
    assert isinstance(job, submit.TrainJob) and job.command == "score"
    assert (executor.parameters["nodes"], executor.parameters["name"]) == (1, "trainer-score")
    assert tasks == [overrides] * 3
    assert "submitted job array 7: 3 scoring tasks" in capsys.readouterr().out

    assert submit.main(["--score", "3", "--gpus-per-node", "0", *overrides, "data.text_field=review"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: score.input: {corpus}: no column 'review' (its first row has id, text)")
    assert submit.main(["--score", "0", *overrides]) == 2
    assert len(FakeExecutor.arrays) == 1
