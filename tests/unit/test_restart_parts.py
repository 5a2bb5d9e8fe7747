"""The restart contract's parts: verdicts, the attempts history, the grace budget, the driver floor."""

from __future__ import annotations

import json

import pytest
import torch

from trainer import exit_codes
from trainer.cli import torchrun
from trainer.errors import NoProgress
from trainer.exit_codes import Exit
from trainer.faults import attempts, watchdog
from trainer.preflight import grace
from trainer.runtime import devices


@pytest.mark.parametrize("codes, verdict", [
    ([75, 1], Exit.CRASH),  # the preempted rank was only stopped; the crash is the news
    ([1, 76], Exit.NODE_FAULT),
    ([76, 2], Exit.USAGE),  # a usage error on one rank is the job's
    ([77, 76], Exit.NO_PROGRESS),
    ([-9], Exit.CRASH),  # killed by a signal (the OOM killer): retryable
    ([75, 75], Exit.PREEMPTED),
    ([3], Exit.CRASH),  # not one of ours
])
def test_the_job_verdict_is_its_most_severe_workers(codes, verdict):
    assert exit_codes.worst(codes) == verdict


def test_a_launchers_retry_code_replaces_only_the_retryable_verdicts():
    pytorchjob = {exit_codes.RETRYABLE_ENV: "138"}
    assert [exit_codes.for_launcher(v, pytorchjob) for v in Exit] == [0, 138, 2, 138, 138, 77]
    assert [exit_codes.for_launcher(v, {}) for v in Exit] == [0, 1, 2, 75, 76, 77]


def test_the_torchrun_wrapper_refuses_a_bad_retry_code(monkeypatch, capsys):
    monkeypatch.setenv(exit_codes.RETRYABLE_ENV, "retry")
    assert torchrun.main(["--standalone", "x.py"]) == Exit.USAGE
    assert capsys.readouterr().err == "error: TRAINER_RETRYABLE_EXIT_CODE='retry' is not an exit code from 1 to 255\n"


@pytest.mark.parametrize("argv, environ, world_size", [
    (["--nnodes=2", "--nproc-per-node=3"], {}, 6),
    (["--nnodes", "1:4", "--nproc_per_node", "2"], {}, 2),  # elastic: the fewest nodes, the memory plan's worst
    ([], {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "4"}, 12),  # the Kubeflow operators' environment
    (["--nproc-per-node=gpu"], {}, None),  # a host without a GPU to count
    (["--nnodes=1:2:3"], {}, None),  # torchrun refuses it, in its own words, when it runs
])
def test_the_checked_launch_plans_for_the_world_size_torchrun_starts(monkeypatch, argv, environ, world_size):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("PET_NNODES", "PET_NPROC_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert torchrun.launch_world_size([*argv, "-m", "trainer", "train", "-c", "x.yaml"]) == world_size


def test_suspects_go_to_the_launchers_file_when_it_gave_one(tmp_path):
    faults = tmp_path / "faults"
    exit_codes.record_suspect("node3", {})
    assert not faults.exists()
    for host in ("node3", "node5"):
        exit_codes.record_suspect(host, {exit_codes.NODE_FAULTS_ENV: str(faults)})
    assert faults.read_text() == "node3\nnode5\n"


# --- attempts ---------------------------------------------------------------------------


def attempt(output_dir, step: int, max_stalled: int, fresh: bool = False) -> None:
    """An attempt's start, as the Trainer makes it: the check first, the record once it trains."""
    attempts.check(output_dir, step, max_stalled, fresh)
    attempts.begin(output_dir, step, fresh)


def test_attempts_failing_from_one_checkpoint_stop_the_job_and_progress_resets_the_count(tmp_path):
    for _ in range(2):
        attempt(tmp_path, 40, max_stalled=2)
        attempts.end(tmp_path, Exit.CRASH)
    with pytest.raises(NoProgress, match=r"^the last 2 attempts all resumed from step 40 and failed; not "
                                         r"retrying \(fault.max_stalled_restarts=2\)"):
        attempts.check(tmp_path, 40, max_stalled=2, fresh=False)
    attempt(tmp_path, 40, max_stalled=0)  # 0: never refuses
    attempt(tmp_path, 60, max_stalled=2)  # a later checkpoint: progress
    assert [a["resumed_from"] for a in attempts.read(tmp_path)] == [40, 40, 40, 60]
    assert [a.get("exit") for a in attempts.read(tmp_path)] == [1, 1, None, None]  # a kill records no end


def test_preempted_attempts_do_not_count_and_a_fresh_run_forgets(tmp_path):
    for _ in range(3):  # preempted before the next checkpoint, three times
        attempt(tmp_path, 40, max_stalled=1)
        attempts.end(tmp_path, Exit.PREEMPTED)
    attempt(tmp_path, 40, max_stalled=1)  # killed: no end
    with pytest.raises(NoProgress, match=r"^the last attempt resumed from step 40"):
        attempts.check(tmp_path, 40, max_stalled=1, fresh=False)
    attempt(tmp_path, 0, max_stalled=1, fresh=True)  # checkpoint.resume=never
    assert attempts.read(tmp_path) == [{**attempts.read(tmp_path)[0], "resumed_from": 0}]


def test_the_check_writes_nothing(tmp_path):
    """A start refused for any reason, this one included, leaves output_dir as it was."""
    attempts.check(tmp_path / "run", 0, max_stalled=3, fresh=False)
    assert not (tmp_path / "run").exists()


def test_a_record_cut_short_by_a_kill_is_skipped_and_the_next_starts_a_line_of_its_own(tmp_path):
    attempt(tmp_path, 8, max_stalled=3)
    with (tmp_path / attempts.FILE).open("a") as f:
        f.write(json.dumps({"exit": 75, "ended": 1.0})[:-1])  # all but its closing brace
    assert [a["resumed_from"] for a in attempts.read(tmp_path)] == [8]
    assert "exit" not in attempts.read(tmp_path)[0]
    attempt(tmp_path, 8, max_stalled=3)  # not refused, nor an error: the torn line is skipped
    attempts.end(tmp_path, Exit.CRASH)
    assert [(a["resumed_from"], a.get("exit")) for a in attempts.read(tmp_path)] == [(8, None), (8, 1)]


def test_judging_a_gpu_error_names_this_node_to_the_launcher(monkeypatch, tmp_path):
    monkeypatch.setattr(watchdog.socket, "gethostname", lambda: "node7")
    monkeypatch.setenv(exit_codes.NODE_FAULTS_ENV, str(tmp_path / "faults"))
    assert watchdog.judge(RuntimeError("CUDA error: uncorrectable ECC error encountered"), set()) == Exit.NODE_FAULT
    assert watchdog.judge(RuntimeError("a bug"), set()) == Exit.CRASH
    assert (tmp_path / "faults").read_text() == "node7\n"


# --- what a failure means ------------------------------------------------------------------


@pytest.mark.parametrize("error, silent, verdict, suspects", [
    (RuntimeError("[gloo] Timed out waiting 10000ms for recv"), {"node1", "node0"}, Exit.NODE_FAULT,
     ["node0", "node1"]),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), set(), Exit.NODE_FAULT, ["this"]),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), set(), Exit.CRASH, []),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error (run with NCCL_DEBUG=INFO "
                  "for details), NCCL version 2.27.5"), set(), Exit.NODE_FAULT, ["this"]),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a network "
                  "error, NCCL version 2.27.5"), set(), Exit.CRASH, []),  # most often a crashed peer
    (RuntimeError("Connection closed by peer [10.0.0.2]:4312"), set(), Exit.CRASH, []),  # a peer crashed
])
def test_a_failed_step_is_a_node_fault_only_on_evidence(monkeypatch, error, silent, verdict, suspects):
    monkeypatch.setattr(watchdog.socket, "gethostname", lambda: "this")
    assert watchdog.verdict(error, silent) == (verdict, suspects)


# --- grace ---------------------------------------------------------------------------------


def test_the_grace_budget_is_the_shorter_of_the_launchers_and_torchruns():
    lines, warnings = grace.check(2.0, 5.0, {"TRAINER_GRACE_S": "120", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110"})
    assert lines[0].startswith("preemption grace: 110s from the stop signal to SIGKILL") and warnings == []
    # torchrun's default 30 s under a launcher that grants 300: the save doesn't fit, and why.
    lines, warnings = grace.check(10.0, 25.0, {"TRAINER_GRACE_S": "300"})
    assert lines[0].startswith("preemption grace: 30s") and "~35.0s" in lines[1]
    too_short = "TRAINER_GRACE_S=300s, but torchrun kills its workers 30s after the signal"
    assert [w.split(":")[0] for w in warnings] == ["preemption", too_short]
    lines, warnings = grace.check(1.0, 1.0, {})
    assert "the launcher's unknown (TRAINER_GRACE_S unset)" in lines[0] and warnings == []


@pytest.mark.parametrize("launcher, environ", [
    ("slurm/ddp.sh", {"TRAINER_GRACE_S": "300", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "270"}),  # --signal=B:USR1@300
    ("a short --signal lead", {"TRAINER_GRACE_S": "60", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}),
    ("the manifests and compose", {"TRAINER_GRACE_S": "110", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110"}),
])
def test_the_launchers_own_settings_draw_no_warning(launcher, environ):
    assert grace.check(1.0, 1.0, environ)[1] == [], launcher


# --- the driver floor -----------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n",
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build  (dvs-builder)\n",
])
def test_the_driver_version_is_read_from_the_kernel_module(tmp_path, text):
    (tmp_path / "version").write_text(text + "GCC version:  gcc version 12.2.0\n")
    assert devices.nvidia_driver(tmp_path / "version") == "535.104.05"
    assert devices.nvidia_driver(tmp_path / "absent") is None


def test_a_driver_older_than_the_cuda_build_needs_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    line, problem = devices.driver_check("535.104.05", {})
    assert line == "NVIDIA driver 535.104.05, torch built for CUDA 13.0 (needs 580.65.06 or newer)"
    assert problem is not None and problem.startswith("the NVIDIA driver 535.104.05 is older than 580.65.06")
    assert devices.driver_check("580.65.06", {})[1] is None
    assert devices.driver_check("575.1", {"TRAINER_MIN_CUDA_DRIVER": "570.0"})[1] is None  # the image's own
