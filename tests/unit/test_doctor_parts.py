"""trainer/preflight/doctor.py's failures, in-process: whatever breaks inside its checks is one
line on every rank and exit 1, and a save that fails is a problem in its report. The checks
themselves run under torchrun: tests/e2e/test_doctor_saves.py, tests/system/test_doctor.py."""

from __future__ import annotations

import socket

import pytest
import torch

from trainer.cli import run_config
from trainer.errors import CheckpointError
from trainer.preflight import doctor
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv


@pytest.mark.parametrize("error, line", [
    (CheckpointError("checkpoint step-0: save failed: rank 1: OSError: disk full"),
     "error: checkpoint step-0: save failed: rank 1: OSError: disk full\n"),
    (KeyError("rtt"), "error: doctor: rank 1 on {host}: KeyError: 'rtt'\n"),
], ids=["a-trainer-error", "a-crash"])
def test_a_failure_inside_doctor_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path, error, line):
    def fail(*args):
        raise error

    closed = []
    monkeypatch.setattr(distributed, "init", lambda *args: None)
    monkeypatch.setattr(distributed, "close", lambda: closed.append(True))
    monkeypatch.setattr(doctor, "_collective_checks", fail)
    monkeypatch.setattr(doctor, "check_env", lambda *args, **kwargs: doctor.Findings())  # this host's own settings
    cfg = run_config.load(None, ["model.name=bert-base-uncased", "data.path=data", "train.max_steps=1",
                             f"output_dir={tmp_path}"])
    env = DistEnv(rank=1, world_size=2, master_addr="localhost", master_port=1)
    assert doctor.run(cfg, env, torch.device("cpu"), "gloo") == 1
    assert capsys.readouterr().err == line.format(host=socket.gethostname())
    assert closed == [True]


def test_a_failed_save_check_is_a_problem_of_the_report():
    """Raised alike on every rank by the Checkpointer: the report says it, as a run's
    checkpoints would fail the same way."""
    section = doctor._grace(None, DistEnv(), [], "checkpoint step-0: save failed: rank 1: why")
    assert (section.lines, section.warnings) == ([], [])
    assert section.problems == ["the save check: checkpoint step-0: save failed: rank 1: why"]


def test_the_forecast_times_the_step_with_no_loader_worker_server_starting_beside_it(tiny_model, reviews, tmp_path,
                                                                                     monkeypatch, one_rank_group):
    """The loader workers' server imports for ~2 s of CPU a rank as it starts: started by the
    forecast's data, it ran beside the timed steps, on the cores that ranks on one host share,
    and at 4 ranks on 2 cores doubled the compute doctor timed (+20% on the step, +97% with
    PowerSGD; benchmarks/RESULTS.md, 2026-11-28). The forecast builds its data without workers."""
    from support.runs import tiny_overrides

    from trainer.data import worker_server
    from trainer.preflight import forecast

    started = []
    monkeypatch.setattr(worker_server, "start_worker_server", lambda cfg: started.append(cfg.data.num_workers))
    cfg = run_config.load(None, tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"data.num_workers": 1}))
    measured = forecast.measure(cfg, one_rank_group, torch.device("cpu"))
    assert measured.compute.forward_s > 0
    assert started in ([], [0])  # asked for none, or for a server of no workers: a no-op
