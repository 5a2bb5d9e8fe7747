"""slurm/submit.py's own arithmetic, without a cluster (its jobs run in tests/system/test_slurm.py)."""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
