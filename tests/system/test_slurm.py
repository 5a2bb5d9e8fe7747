"""slurm/ddp.sh and slurm/submit.py on a real two-node Slurm cluster (tests/slurm_cluster.py).

Jobs are submitted exactly as a user would, from the repository with its .venv. Each node
has two fake GPUs: `--gpus-per-node=1` is scheduled as on a GPU cluster and gives one
process per node, which trains on the CPU with gloo because no CUDA driver is behind them.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import wandb_log
from conftest import BASE_ENV, PYTHON, REPO, compare_weights, failure_output, tiny_overrides
from image import dockerfile_env
from multinode import complete_steps
from slurm_cluster import CPUS_PER_NODE, GPUS_PER_NODE, SlurmCluster
from support import read_summary, wait_for
from users import UID, as_user

STEPS = 120
CPU_ON_PURPOSE = {"train.device": "cpu", "dist.backend": "gloo"}
"""No driver is behind the fake GPUs: the trainer would refuse them as a GPU job that CUDA
cannot use (test_a_gpu_job_that_cuda_cannot_use_fails_at_once), so the jobs opt in to CPU."""
OPTIONS = {"train.batch_size": 8, "train.max_steps": STEPS, "checkpoint.every": 10, "checkpoint.keep": 2,
           "train.log_every": 10, "wandb.mode": "offline", "dist.timeout_s": 60, "data.num_workers": 1,
           **CPU_ON_PURPOSE}
# One process per node, on one fake GPU each; a short wait for the nodes, a short log.
SBATCH = ["--nodes=2", "--gpus-per-node=1", "--cpus-per-task=1", "--time=10"]
JOB_ENV = {**BASE_ENV, "TRAINER_JOIN_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def cluster():
    with SlurmCluster() as running:
        yield running


def submit(cluster: SlurmCluster, tmp_path: Path, args: list[str], sbatch: list[str] = (),
           env: dict[str, str] | None = None) -> tuple[str, Path]:
    """`sbatch slurm/ddp.sh ARGS` from the repository; (job id, its log file)."""
    log = tmp_path / "job.out"
    job_id = cluster.sbatch([*SBATCH, f"--output={log}", *sbatch, "slurm/ddp.sh", *args],
                            env={**JOB_ENV, **(env or {})}, cwd=REPO)
    return job_id, log


def finished(cluster: SlurmCluster, job_id: str, log: Path, timeout: float) -> dict[str, str]:
    record = cluster.wait_job(job_id, timeout)
    record["log"] = log.read_text() if log.exists() else "(no log)"
    return record


def explain(record: dict[str, str], cluster: SlurmCluster) -> str:
    return f"{record.get('JobState')} {record.get('ExitCode')}\n{failure_output(record['log'])}\n{cluster.logs()}"


@pytest.fixture(scope="module")
def uninterrupted(cluster, reference_run, dropout_model):
    """The reference: `sbatch slurm/ddp.sh` to the end, on both nodes; (output_dir, job record)."""

    def sbatch(overrides: list[str], workdir: Path) -> dict[str, str]:
        job_id, log = submit(cluster, workdir, overrides)
        record = finished(cluster, job_id, log, timeout=180)
        assert record["JobState"] == "COMPLETED", explain(record, cluster)
        return record

    reference = reference_run(sbatch, dropout_model, **OPTIONS)
    return reference.run, reference.launched


def test_sbatch_runs_one_world_across_both_nodes(uninterrupted):
    run, record = uninterrupted
    result = read_summary(run)
    assert result["world_size"] == 2
    assert result["hosts"] == ["node1", "node2"]
    assert record["NodeList"] == "node[1-2]"
    assert "2 node(s) node[1-2] x 1 process(es), rendezvous node1:" in record["log"]


def test_a_two_node_checkpoint_resumes_in_a_one_node_job(cluster, uninterrupted, dropout_model, reviews, tmp_path):
    """The 2-node job's output_dir (a copy), then `sbatch --nodes=1 slurm/ddp.sh` on it for a
    longer run (accepted with a notice): the job resumes the 2-node checkpoint at world size 1
    with its global batch (1 x 8 x 2 micro-batches), verifies the data position, completes."""
    reference, _ = uninterrupted
    run = Path(shutil.copytree(reference, tmp_path / "run"))
    longer = {**OPTIONS, "train.max_steps": STEPS + 10}
    job_id, log = submit(cluster, tmp_path, tiny_overrides(dropout_model, reviews, run, **longer), sbatch=["--nodes=1"])
    record = finished(cluster, job_id, log, timeout=180)
    assert record["JobState"] == "COMPLETED", explain(record, cluster)
    result = read_summary(run)
    assert (result["world_size"], result["resumed_from_step"], result["steps"]) == (1, STEPS, STEPS + 10), result
    assert re.search(r"1 node\(s\) node[12] x 1 process\(es\)", record["log"]), record["log"][-3000:]
    assert ("resumed at world size 1 from a checkpoint of world size 2: the same global batch of 16, now 1 rank(s) "
            "x 2 micro-batch(es) of 8") in record["log"]
    assert "data position verified: epoch 3, 144 samples consumed" in record["log"]


def one_wandb_run(run: Path, attempts: int) -> str:
    """The single wandb run id that every attempt's offline run logged to."""
    logs = wandb_log.runs(run)
    assert len(logs) == attempts, logs
    ids = set().union(*(wandb_log.run_ids(log) for log in logs))
    assert ids == {read_summary(run)["wandb_run_id"]}
    return ids.pop()


def test_time_limit_signal_checkpoints_requeues_and_resumes_bitwise(cluster, uninterrupted, dropout_model,
                                                                    reviews, tmp_path):
    reference, _ = uninterrupted
    run = tmp_path / "run"
    job_id, log = submit(cluster, tmp_path, tiny_overrides(dropout_model, reviews, run, **OPTIONS))
    wait_for(lambda: complete_steps(run), 120, "the first checkpoint")
    # Exactly what `#SBATCH --signal=B:USR1@300` does five minutes before the time limit.
    cluster.client(["scancel", "--batch", "--signal=USR1", job_id])
    record = finished(cluster, job_id, log, timeout=240)
    assert record["JobState"] == "COMPLETED", explain(record, cluster)
    assert record["Restarts"] == "1", explain(record, cluster)

    # Attempt 1 saved where the ranks agreed to stop; attempt 2 resumed from there.
    saved = re.search(r"preempted by [^:]+: saved the checkpoint of step (\d+)", record["log"])
    assert saved, record["log"][-5000:]
    resumed_from = read_summary(run)["resumed_from_step"]
    assert resumed_from == int(saved.group(1)) and 0 < resumed_from < STEPS
    assert "checkpoint saved; requeueing job" in record["log"]
    assert compare_weights(reference, run, STEPS).differing == []
    assert one_wandb_run(run, attempts=2) == read_summary(run)["wandb_run_id"]


def test_submitit_job_is_requeued_on_preemption_and_matches_sbatch(cluster, uninterrupted, dropout_model,
                                                                  reviews, tmp_path):
    """`slurm/submit.py --wait`: one task per rank; TERM then USR2 mid-run, as Slurm preempts."""
    reference, _ = uninterrupted
    run = tmp_path / "run"
    argv = [PYTHON, "slurm/submit.py", "--nodes", "2", "--gpus-per-node", "1", "--cpus-per-task", "1",
            "--time", "10", "--folder", str(tmp_path / "submitit"), "--wait",
            *tiny_overrides(dropout_model, reviews, run, **OPTIONS)]
    submitter = cluster.popen(argv, env=JOB_ENV, cwd=REPO, log=tmp_path / "submit.out")
    try:
        wait_for(lambda: complete_steps(run), 120, "the first checkpoint")
        job_id = re.search(r"submitted job (\d+)", (tmp_path / "submit.out").read_text()).group(1)
        cluster.client(["scancel", "--signal=TERM", job_id])
        cluster.client(["scancel", "--signal=USR2", job_id])
        assert submitter.wait(timeout=240) == 0, (tmp_path / "submit.out").read_text()
    finally:
        submitter.kill()
    output = (tmp_path / "submit.out").read_text()
    assert f"job {job_id} completed" in output
    record = cluster.wait_job(job_id, timeout=30)  # its tasks may still be exiting
    assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), output
    # What submitit's job.results() read for submit.py --wait: each task's pickled return.
    for task in (0, 1):
        with open(tmp_path / "submitit" / f"{job_id}_{task}_result.pkl", "rb") as f:
            assert pickle.load(f) == ("success", 0)
    assert 0 < read_summary(run)["resumed_from_step"] < STEPS
    assert compare_weights(reference, run, STEPS).differing == []
    one_wandb_run(run, attempts=2)


def test_a_request_that_fits_no_node_is_caught_and_fit_sizes_it(cluster):
    """ddp.sh's #SBATCH defaults (8 GPUs, 32 CPUs a node) fit no node here (2 fake GPUs, 4
    CPUs): sbatch would queue the job and leave it pending (PartitionConfig); --test-only says
    so at once, and slurm/fit.sh sizes the request to the partition's nodes, which then fits."""
    refused = cluster.client(["sbatch", "--test-only", "slurm/ddp.sh"], check=False, env=JOB_ENV, cwd=REPO)
    assert refused.returncode != 0 and "Requested node configuration is not available" in refused.stderr
    fit = cluster.client(["slurm/fit.sh"], env=JOB_ENV, cwd=REPO).stdout.split()
    assert fit == ["--partition=debug", f"--cpus-per-task={CPUS_PER_NODE}", f"--gpus-per-node={GPUS_PER_NODE}"]
    fits = cluster.client(["sbatch", "--test-only", *fit, "slurm/ddp.sh"], check=False, env=JOB_ENV, cwd=REPO)
    assert fits.returncode == 0, fits.stderr


def test_scancel_of_a_submitit_job_saves_and_stays_cancelled(cluster, dropout_model, reviews, tmp_path):
    """scancel sends TERM: the ranks save and stop, and nothing requeues the job (only the
    time-limit signal does, above; Slurm requeues a preempted job by itself)."""
    run = tmp_path / "run"
    argv = [PYTHON, "slurm/submit.py", "--nodes", "2", "--gpus-per-node", "1", "--cpus-per-task", "1",
            "--time", "10", "--folder", str(tmp_path / "submitit"),
            *tiny_overrides(dropout_model, reviews, run, **OPTIONS)]
    submitted = cluster.client(argv, env=JOB_ENV, cwd=REPO)
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    wait_for(lambda: complete_steps(run), 120, "the first checkpoint")
    cluster.client(["scancel", job_id])
    record = cluster.wait_job(job_id, timeout=120)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "submitit").glob(f"{job_id}_*_log.*")))
    assert (record["JobState"], record["Restarts"]) == ("CANCELLED", "0"), logs[-5000:]
    assert re.search(r"preempted by SIGTERM: saved the checkpoint of step \d+", logs), logs[-5000:]
    assert "requeu" not in logs.lower(), logs[-5000:]


@pytest.mark.parametrize("args, expected", [
    (["-c", "configs/missing.yaml"], "error: config file configs/missing.yaml: not found"),
    (["train.learning_rate=1e-4"], "error: train.learning_rate: unknown key"),
])
def test_bad_submission_fails_in_seconds_with_one_line(cluster, tmp_path, args, expected):
    job_id, log = submit(cluster, tmp_path, args)
    record = finished(cluster, job_id, log, timeout=60)
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), explain(record, cluster)
    errors = [line for line in record["log"].splitlines() if "error" in line.lower()]
    assert errors == [expected], record["log"]
    assert "Traceback" not in record["log"]


def test_submitit_refuses_a_bad_key_before_submitting(cluster):
    queued = cluster.client(["squeue", "-h"]).stdout
    done = cluster.client([PYTHON, "slurm/submit.py", "--nodes", "2", "train.learning_rate=1e-4"],
                          check=False, env=JOB_ENV, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: train.learning_rate: unknown key"
    assert "submitted job" not in done.stdout
    assert cluster.client(["squeue", "-h"]).stdout == queued


def test_a_failing_rank_ends_the_job_without_waiting_for_the_timeout(cluster, tiny_model, reviews, tmp_path):
    """node2's only worker is SIGKILLed at step 3 and torchrun may not restart it: srun
    --kill-on-bad-exit ends node1's task too, long before the 600 s collective timeout
    (within torchrun's 30 s grace for its worker). Submitted as to a CPU partition
    (--gpus-per-node=0): one process per node, gloo."""
    options = {**OPTIONS, "dist.timeout_s": 600, "fault.slow_step_min_s": 600}
    job_id, log = submit(cluster, tmp_path, tiny_overrides(tiny_model, reviews, tmp_path / "run", **options),
                         sbatch=["--gpus-per-node=0"],
                         env={"TRAINER_FAULT_SIGKILL": "1:3", "TRAINER_MAX_RESTARTS": "0"})
    record = finished(cluster, job_id, log, timeout=90)
    assert record["JobState"] == "FAILED", explain(record, cluster)
    # srun saw node2's torchrun fail and ended the step on node1 (--kill-on-bad-exit).
    assert "srun: error: node2: task 1: Exited with exit code 1" in record["log"], record["log"][-4000:]
    assert "_step_signal: Terminating StepId" in record["log"], record["log"][-4000:]
    assert "2 node(s) node[1-2] x 1 process(es)" in record["log"]
    assert "training " in record["log"] and "world size 2" in record["log"]


def test_a_gpu_job_that_cuda_cannot_use_fails_at_once(cluster, tiny_model, reviews, tmp_path):
    """--gpus-per-node=1 on nodes whose GPUs no driver serves (a driver too old for the
    image's CUDA looks the same to torch): every rank says why before the rendezvous, and
    the job fails, instead of training on CPU hundreds of times slower. (srun
    --kill-on-bad-exit may end the other node's rank before it has printed its line.)"""
    options = {key: value for key, value in OPTIONS.items() if key not in CPU_ON_PURPOSE}
    job_id, log = submit(cluster, tmp_path, tiny_overrides(tiny_model, reviews, tmp_path / "run", **options),
                         env={"TRAINER_MAX_RESTARTS": "0"})
    record = finished(cluster, job_id, log, timeout=90)
    assert record["JobState"] == "FAILED", explain(record, cluster)
    refusals = re.findall(r"error: train\.device: (\w+=\S+) grants this job GPUs, but torch\.cuda\.is_available\(\) "
                          r"is False", record["log"])
    assert len(refusals) in (1, 2), record["log"][-4000:]  # at most one rank on each node
    assert "training " not in record["log"] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("runtime, expected", [
    ("pyxis", ("srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=1 "
               "--container-image=registry#lab/trainer:0.1.0 --container-mounts={repo},{workspace}:/workspace "
               "--container-workdir={repo} --no-container-mount-home bash -c")),
    ("apptainer", ("srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=1 apptainer exec --nv "
                   "--writable-tmpfs --bind {repo},{workspace}:/workspace --pwd {repo} registry#lab/trainer:0.1.0 "
                   "bash -c")),
])
def test_container_launch_line(cluster, tmp_path, runtime, expected):
    """No pyxis or Apptainer here: check the exact srun line a container job runs (from a
    real job, TRAINER_DRY_RUN), around the same torchrun command as every other test.
    Submitted as the image's user (uid 1000), as a user submits: the workspace the script
    mounts at the image's /workspace, where the image points every cache, is that user's."""
    public = Path(tempfile.mkdtemp(prefix="slurm-user-"))  # pytest's tmp folders are root's alone
    try:
        os.chown(public, UID, UID)
        workspace = public / "workspace"
        env = {"TRAINER_CONTAINER_IMAGE": "registry#lab/trainer:0.1.0", "TRAINER_CONTAINER_RUNTIME": runtime,
               "TRAINER_DRY_RUN": "1", "TRAINER_WORKSPACE": str(workspace)}
        job_id, log = submit(cluster, public, ["-c", "configs/demo.yaml"], env=env,
                             sbatch=[f"--uid={UID}", f"--gid={UID}"])
        record = finished(cluster, job_id, log, timeout=60)
        assert record["JobState"] == "COMPLETED", explain(record, cluster)
        line = next(line for line in record["log"].splitlines() if line.startswith("slurm/ddp.sh: would run:"))
        argv = shlex.split(line.removeprefix("slurm/ddp.sh: would run:"))  # printed with printf %q
        prefix = expected.format(repo=REPO, workspace=workspace).split()
        assert argv[:len(prefix)] == prefix, argv
        assert argv[len(prefix) + 1:] == [
            "node1", "torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=trainer-c10d",
            f"--rdzv-endpoint=node1:{20000 + int(job_id) % 12000}", f"--rdzv-id={job_id}",
            "--rdzv-conf=join_timeout=60",
            "--max-restarts=0", "-m", "trainer", "train", "-c", "configs/demo.yaml"], argv
        cache_paths = {key: value for key, value in dockerfile_env().items() if value.startswith("/workspace/")}
        assert {"HF_HOME", "WANDB_DIR", "TRITON_CACHE_DIR"} <= set(cache_paths)
        for key, path in cache_paths.items():
            on_host = workspace / Path(path).relative_to("/workspace")
            existing = next(p for p in [on_host, *on_host.parents] if p.exists())
            assert existing.is_relative_to(workspace), (key, existing)
            writable = subprocess.run(as_user(["test", "-w", str(existing)], tmp_path / "python"))
            assert writable.returncode == 0, f"{key}={path}: {existing} is not writable by uid {UID}"
    finally:
        shutil.rmtree(public, ignore_errors=True)
