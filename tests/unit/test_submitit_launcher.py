"""slurm/submit.py's own arithmetic, without a cluster (its jobs run in tests/system/test_slurm.py)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import SimpleNamespace

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


def test_a_refused_exclusion_leaves_the_node_fault_requeue_standing(submit, monkeypatch, tmp_path, capsys):
    """Slurm accepted the requeue, then refused ExcNodeList: the job is requeued all the same
    (as slurm/ddp.sh does), with a warning, not failed by the exception."""
    calls = []

    def scontrol(*args):
        calls.append(args[0])
        if args[:2] == ("show", "job"):
            return "JobId=7 Partition=debug NumNodes=1 ExcNodeList=(null)"
        if args[0] == "update":
            raise subprocess.CalledProcessError(1, ["scontrol", *args])
        return ""

    monkeypatch.setattr(submit, "_scontrol", scontrol)
    monkeypatch.setattr(subprocess, "run", lambda argv, **_: SimpleNamespace(stdout="node1\nnode2\n"))  # sinfo
    monkeypatch.setattr(submit.signal, "signal", lambda *_: None)  # pytest keeps its TERM
    faults = tmp_path / "node-faults"
    faults.write_text("node1.cluster.example\n")
    monkeypatch.setenv(submit.NODE_FAULTS_ENV, str(faults))
    assert submit.requeue_without_suspects("7", tmp_path, budget=3) is True
    assert calls == ["show", "requeue", "update"]
    assert "warning: requeued, but Slurm refused ExcNodeList=node1" in capsys.readouterr().err
