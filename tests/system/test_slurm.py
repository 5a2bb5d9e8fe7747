"""slurm/ddp.sh and slurm/submit.py on a real two-node Slurm cluster (tests/support/slurm_cluster.py).

Jobs are submitted exactly as a user would, from the repository with its .venv. Each node
has two fake GPUs: `--gpus-per-node=1` is scheduled as on a GPU cluster and gives one
process per node, which trains on the CPU with gloo because no CUDA driver is behind them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import pickle
import random
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
from support import wandb_log
from support.image import dockerfile_env
from support.outputs import complete_steps, read_summary
from support.processes import wait_for
from support.runs import BASE_ENV, PYTHON, REPO, failure_output, launch, tiny_overrides, trainer_command
from support.slurm_cluster import CPUS_PER_NODE, GPUS_PER_NODE, NODES, SHORT_MAX_TIME, SlurmCluster
from support.slurm_stand_ins import fake_apptainer, fake_venv, recorded_env
from support.users import UID, as_user
from support.weights import compare_weights

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
    # The time limits submitit still allows (slurm_max_num_timeout, 3 unless set), as its
    # USR2 handler reads them. It counts a USR2 in a job's last 10 minutes as a time limit, and
    # with --time 10 every USR2 is: this one spent one of the 100.
    with open(tmp_path / "submitit" / f"{job_id}_submitted.pkl", "rb") as f:
        assert pickle.load(f)._timeout_countdown == 99
    assert 0 < read_summary(run)["resumed_from_step"] < STEPS
    assert compare_weights(reference, run, STEPS).differing == []
    one_wandb_run(run, attempts=2)


@pytest.fixture
def stand_in(tmp_path):
    """(the env that runs ddp.sh's jobs with the fake venv of tests/support/slurm_stand_ins.py, the
    folder where its torchrun records each call)."""
    out = tmp_path / "recorded"
    out.mkdir()
    return {"TRAINER_VENV": str(fake_venv(tmp_path / "venv")), "FAKE_OUT": str(out)}, out


def test_the_defaults_run_on_small_nodes_and_fit_keeps_the_time_within_max_time(cluster, stand_in, tmp_path):
    """A plain `sbatch slurm/ddp.sh` (2 nodes x 8 GPUs, --exclusive --mem=0, 24 h) on nodes of
    4 CPUs runs, its task on each node given the node's 4 CPUs; more GPUs than a node has are
    refused at submit. The `short` partition's MaxTime is below 24 h: sbatch --test-only
    accepts the job there and it would pend for ever; slurm/fit.sh cuts --time to MaxTime (a
    TIME given above it is refused in one line), and the fitted job runs. The trainer is the
    stand-in: what is tested is the script and the cluster's scheduling."""
    env, recorded = stand_in
    log = tmp_path / "job.out"
    job_id = cluster.sbatch([f"--output={log}", "slurm/ddp.sh", "-c", "configs/demo.yaml"], env=env, cwd=REPO)
    record = finished(cluster, job_id, log, timeout=60)
    assert (record["JobState"], record["NodeList"]) == ("COMPLETED", "node[1-2]"), explain(record, cluster)
    assert f"{CPUS_PER_NODE} CPU(s) a node, OMP_NUM_THREADS=1;" in record["log"]  # 4 CPUs, 8 ranks
    for node in NODES:
        argv, task_env = recorded_env(recorded / f"torchrun.0.{node}")
        assert f"--nnodes=2 --nproc-per-node={GPUS_PER_NODE} " in argv, argv
        assert (task_env["SLURM_CPUS_PER_TASK"], task_env["SLURM_GPUS_ON_NODE"]) == (str(CPUS_PER_NODE), "8")
        # The grace after --signal=B:USR1@300: torchrun SIGKILLs its workers 270 s after the
        # relay's TERM (not 30), and the ranks are told the launcher's 300 s.
        assert (task_env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], task_env["TRAINER_GRACE_S"]) == ("270", "300")
        assert "TRAINER_RETRYABLE_EXIT_CODE" not in task_env

    refused = cluster.client(["sbatch", f"--gpus-per-node={GPUS_PER_NODE * 2}", "slurm/ddp.sh"], check=False,
                             env=env, cwd=REPO)
    assert refused.returncode != 0 and "Requested node configuration is not available" in refused.stderr

    assert cluster.client(["sbatch", "--test-only", "--partition=short", "slurm/ddp.sh"], check=False,
                          env=env, cwd=REPO).returncode == 0  # --test-only does not see MaxTime
    pending = cluster.sbatch([f"--output={tmp_path / 'pending.out'}", "--partition=short", "slurm/ddp.sh"],
                             env=env, cwd=REPO)
    try:
        wait_for(lambda: cluster.job(pending).get("Reason") == "PartitionTimeLimit", 20, "PartitionTimeLimit")
        assert cluster.job(pending)["JobState"] == "PENDING"
    finally:
        cluster.client(["scancel", pending])

    fit = cluster.client(["slurm/fit.sh", "short"], env=env, cwd=REPO)
    assert fit.stdout.split() == ["--partition=short", f"--gpus-per-node={GPUS_PER_NODE}", f"--time={SHORT_MAX_TIME}"]
    assert fit.stderr.strip() == (f"slurm/fit.sh: partition short allows at most {SHORT_MAX_TIME}; "
                                  "asking for that instead of ddp.sh's 24:00:00")
    assert cluster.client(["slurm/fit.sh"], env=env, cwd=REPO).stdout.split() == [
        "--partition=debug", f"--gpus-per-node={GPUS_PER_NODE}", "--time=24:00:00"]
    too_long = cluster.client(["slurm/fit.sh", "short", "1-00:00"], check=False, env=env, cwd=REPO)
    assert (too_long.returncode, too_long.stderr.strip()) == (2, (
        f"slurm/fit.sh: error: --time=1-00:00 is above partition short's MaxTime {SHORT_MAX_TIME}: "
        "the job would pend for ever"))
    log = tmp_path / "fitted.out"
    job_id = cluster.sbatch([f"--output={log}", *fit.stdout.split(), "--nodes=1", "slurm/ddp.sh"], env=env, cwd=REPO)
    record = finished(cluster, job_id, log, timeout=60)
    assert (record["JobState"], record["TimeLimit"]) == ("COMPLETED", "00:30:00"), explain(record, cluster)


def test_scancel_of_a_submitit_job_saves_and_stays_cancelled(cluster, dropout_model, reviews, tmp_path):
    """scancel sends TERM: the ranks save and stop, and nothing requeues the job (only the
    time-limit signal does, above; Slurm requeues a preempted job by itself)."""
    run = tmp_path / "run"
    argv = [PYTHON, "slurm/submit.py", "--nodes", "2", "--gpus-per-node", "1",
            "--time", "10", "--folder", str(tmp_path / "submitit"),
            *tiny_overrides(dropout_model, reviews, run, **OPTIONS)]
    submitted = cluster.client(argv, env=JOB_ENV, cwd=REPO)
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    # Whole nodes, as ddp.sh takes them, and without --cpus-per-task each node's one rank is
    # given the node's CPUs.
    sbatch_lines = (tmp_path / "submitit" / f"{job_id}_submission.sh").read_text().splitlines()
    assert {"#SBATCH --exclusive", "#SBATCH --mem=0", f"#SBATCH --cpus-per-task={CPUS_PER_NODE}"} <= set(sbatch_lines)
    wait_for(lambda: complete_steps(run), 120, "the first checkpoint")
    cluster.client(["scancel", job_id])
    record = cluster.wait_job(job_id, timeout=120)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "submitit").glob(f"{job_id}_*_log.*")))
    assert (record["JobState"], record["Restarts"]) == ("CANCELLED", "0"), logs[-5000:]
    assert re.search(r"preempted by SIGTERM: saved the checkpoint of step \d+", logs), logs[-5000:]
    assert "requeu" not in logs.lower(), logs[-5000:]


ARRAY_STEPS = 40


def array_rank(array_id: str, task: int) -> psutil.Process:
    """The rank of the job array's task `task` (one node, one rank): its submitit process. The
    nodes are hosts of this machine (tests/support/slurm_cluster.py), their processes ours to see."""
    def rank() -> psutil.Process | None:
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                env = proc.environ()
                if ((env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")) == (array_id, str(task))
                        and proc.cmdline()[1:4] == ["-u", "-m", "submitit.core._submit"]):  # not srun's
                    return proc
        return None
    return wait_for(rank, 60, f"task {task}'s rank")


def test_a_sweep_job_array_task_preempted_is_requeued_resumes_and_the_sweep_reports(cluster, dropout_model, reviews,
                                                                                    tmp_path):
    """`slurm/submit.py --sweep --wait`: a grid of two settings as a job array, a task each on
    a node of its own. Slurm preempts task 0 after its first checkpoint (`scontrol requeue`, what
    PreemptMode=REQUEUE does: SIGCONT, SIGTERM, back in the queue); it saves, runs again and
    resumes, and --wait waits for that second attempt. The key swept, train.log_every, changes
    no weight: task 1, never interrupted, is task 0's uninterrupted run. `python -m trainer
    sweep` with the same config then trains nothing and reports."""
    from omegaconf import OmegaConf

    out = tmp_path / "sweep"
    settings = tiny_overrides(dropout_model, reviews, out, **{
        "train.max_steps": ARRAY_STEPS, "train.batch_size": 8, "checkpoint.every": 4, "data.max_eval_samples": 48,
        "data.max_length": 32})
    config = tmp_path / "my.yaml"
    OmegaConf.save(OmegaConf.from_dotlist([*settings, "sweep.parameters={train.log_every: [1, 2]}",
                                           "sweep.metric=loss"]), config)
    folder, submit_out = tmp_path / "submitit", tmp_path / "submit.out"
    submitter = cluster.popen([PYTHON, "slurm/submit.py", "--sweep", "-c", str(config), "--nodes", "1",
                               "--gpus-per-node", "0", "--time", "10", "--folder", str(folder / "%j"), "--wait"],
                              env=JOB_ENV, cwd=REPO, log=submit_out)
    preempted, uninterrupted = out / "trials" / "000-seed42", out / "trials" / "001-seed42"
    array_id = None
    try:
        array_id = wait_for(lambda: re.search(r"submitted job array (\d+): 2 trials", submit_out.read_text()), 120,
                            "the array", {"submit.py": submitter}).group(1)
        rank = array_rank(array_id, 0)
        wait_for(lambda: complete_steps(preempted), 120, "task 0's first checkpoint", interval=0.05)
        # Held still (SIGSTOP) from here to the preemption, so that it lands mid-run however
        # loaded this machine is; Slurm's SIGCONT before its SIGTERM lets the rank go on to save.
        rank.suspend()
        wait_for(lambda: rank.status() == psutil.STATUS_STOPPED, 10, "task 0's rank to stop")
        assert not (preempted / "summary.json").exists()
        cluster.client(["scontrol", "requeue", f"{array_id}_0"])
        assert submitter.wait(timeout=180) == 0, submit_out.read_text()[-3000:]
        # --wait ended with every task's result: the preempted task's second attempt's, not the
        # first attempt's return at the preemption.
        assert (preempted / "summary.json").is_file(), submit_out.read_text()[-3000:]
        # submitit reports a task done once its result is written, while its processes may
        # still be exiting: wait for Slurm's own end before the scancel below, which would
        # otherwise cancel a task that was about to complete.
        records = {task: cluster.wait_job(f"{array_id}_{task}", timeout=30) for task in (0, 1)}
    finally:
        submitter.kill()
        if array_id is not None:  # a task left running (or held still) would hold its node for the next tests
            cluster.client(["scancel", array_id], check=False)
    assert {f"job {array_id}_{task} completed" for task in (0, 1)} <= set(submit_out.read_text().splitlines())
    logs = {task: "\n".join(p.read_text() for p in sorted((folder / f"{array_id}_{task}").glob("*_log.*")))
            for task in (0, 1)}
    for task, record in records.items():
        assert (record["JobState"], record["Restarts"]) == ("COMPLETED", str(1 - task)), logs[task][-5000:]
    saved = re.search(r"preempted by SIGTERM: saved the checkpoint of step (\d+)", logs[0])
    assert saved, logs[0][-5000:]
    assert f"resumed from {preempted / 'checkpoints' / f'step-{saved.group(1)}'}" in logs[0], logs[0][-5000:]
    assert 0 < read_summary(preempted)["resumed_from_step"] == int(saved.group(1)) < ARRAY_STEPS
    assert read_summary(uninterrupted)["resumed_from_step"] == 0
    assert compare_weights(uninterrupted, preempted, ARRAY_STEPS).differing == []

    # The login node, after the array: every run finished, nothing trained, the results.
    reported = cluster.client([PYTHON, "-m", "trainer", "sweep", "-c", str(config)], env=JOB_ENV, cwd=REPO,
                              timeout=120, check=False)
    output = reported.stdout + reported.stderr
    assert reported.returncode == 0, failure_output(output)
    assert output.count("finished before, not run again") == 2 and ": training (" not in output, output[-3000:]
    with (out / "sweep.csv").open() as f:
        assert sorted(row["trial"] for row in csv.DictReader(f)) == ["000-seed42", "001-seed42"]
    assert "train.log_every=1" in (out / "sweep.md").read_text()


SCORED = {"part-0": 50, "part-1": 40, "part-2": 30}
"""The corpus's shards (JSON lines) and their rows, in chunks of SCORE_CHUNK: 12 chunks."""
SCORE_CHUNK = 10


def score_worker(array_id: str, task: int, attempt: int) -> psutil.Process | None:
    """The scoring process (torchrun's worker) of the job array's task `task` in its attempt
    `attempt` (from 0) if it is held still (SIGSTOP), else None."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if ((env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_RESTART_COUNT", "0"))
                    == (array_id, str(task), str(attempt)) and proc.cmdline()[1:5] == ["-u", "-m", "trainer", "score"]
                    and proc.status() == psutil.STATUS_STOPPED):
                return proc
    return None


def test_a_score_job_array_task_preempted_is_requeued_and_no_chunk_is_written_twice(cluster, tiny_model, tmp_path):
    """`sbatch --array=0-1 slurm/score.sh`, a task a node, on a corpus of 3 shards. Task 0 runs
    first, alone, from part-0 (its first shard): it commits chunk 0 and is held still having
    scored chunk 1, its claim (TRAINER_FAULT_SCORE_SIGSTOP). Slurm preempts it there (`scontrol
    requeue`), and task 1 starts on the other node: it scores every chunk but the claimed ones
    and waits, the claim's holder being on a host whose pids it cannot see. Task 0's
    second attempt, the same job id and so the same worker, takes its claim back at once and is
    held again at the same point (the fault is in its environment too), chunk 0 not scored again.
    Let go, it finishes: every shard equals one process's run, and each chunk was committed
    once, chunk 0 by the preempted attempt and every other by the two tasks' last attempts."""
    import pyarrow.parquet as pq

    from trainer.data.demo import review
    from trainer.scoring.ledger import worker_name

    corpus, output = tmp_path / "corpus", tmp_path / "scored"
    corpus.mkdir()
    rng = random.Random(0)
    for name, rows in SCORED.items():
        (corpus / f"{name}.jsonl").write_text("".join(
            json.dumps({"id": f"{name}:{i}", "text": review(rng, i % 5)}) + "\n" for i in range(rows)))

    def settings(out: Path) -> list[str]:
        # score.lease_s: no worker takes another's claims here, whatever the pauses last; the
        # requeued task takes its own back at once, being the same job.
        return [f"model.name={tiny_model}", f"output_dir={out.parent / (out.name + '-run')}",
                f"score.model={tiny_model}", f"score.input={corpus}", f"score.output={out}", "score.carry=[id]",
                f"score.chunk_rows={SCORE_CHUNK}", "score.max_tokens=512", "data.max_length=48", "score.lease_s=600",
                "dist.init_timeout_s=60"]

    def ledger(*parts: str) -> Path:
        return output.joinpath(".score", *parts)

    def committed() -> list[str]:
        return sorted(p.relative_to(ledger("chunks")).as_posix() for p in ledger("chunks").rglob("0*.parquet"))

    # Held at submission, so that task 0 runs alone first, and its first chunks are part-0's.
    array_id = cluster.sbatch(["--array=0-1", "--hold", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
                               f"--output={tmp_path}/task-%a.out", "slurm/score.sh", "-c", "configs/demo.yaml",
                               *settings(output)],
                              env={**JOB_ENV, "TRAINER_FAULT_SCORE_SIGSTOP": "part-0:1:scored"}, cwd=REPO)
    try:
        cluster.client(["scontrol", "release", f"{array_id}_0"])
        first = wait_for(lambda: score_worker(array_id, 0, attempt=0), 120, "task 0 held still at part-0's chunk 1")
        task_env = first.environ()
        first_node = task_env["SLURMD_NODENAME"]
        name = worker_name(0, task_env)  # its job (SLURM_JOB_ID, which a requeue keeps) and rank
        claim = ledger("claims", "part-0", "00000001").read_text()
        assert committed() == ["part-0/00000000.parquet"] and claim.startswith(f"{name} "), (committed(), claim)
        # Preempted there: a TERM waits in a stopped process, so that it dies as Slurm's SIGCONT
        # reaches it, chunk 1 uncommitted, as a preemption's TERM kills a scoring worker mid-chunk.
        first.send_signal(signal.SIGTERM)
        cluster.client(["scontrol", "requeue", f"{array_id}_0"])
        # Task 1 kept off that node: there it would see the holder's pid gone and rightly take
        # chunk 1 at once, and then be held still itself by the same fault (a node has room for
        # both tasks, so Slurm's placement alone would decide, run by run).
        cluster.client(["scontrol", "update", f"JobId={array_id}_1", f"ExcNodeList={first_node}"])
        cluster.client(["scontrol", "release", f"{array_id}_1"])

        # Meanwhile (the requeue waits some seconds): the reference, one process on this host.
        reference = tmp_path / "reference"
        alone = launch(trainer_command(settings(reference), None, command="score", config="configs/demo.yaml"))
        assert alone.returncode == 0, failure_output(alone.output)

        # Slurm holds a requeued job back a while before it may start again, and then the
        # task loads the model: minutes on a busy machine.
        def stuck() -> str:
            claims = {}
            for path in ledger("claims").rglob("0*"):
                with contextlib.suppress(OSError):  # committed meanwhile
                    claims[path.relative_to(ledger("claims")).as_posix()] = path.read_text().split()[0]
            return f"task 0's second attempt held still; claims {claims}, committed {committed()}"

        second = wait_for(lambda: score_worker(array_id, 0, attempt=1), 420, stuck)
        assert worker_name(0, second.environ()) == name
        taken_back = ledger("claims", "part-0", "00000001").read_text()
        assert taken_back.startswith(f"{name} ") and taken_back != claim, (claim, taken_back)
        assert "part-0/00000001.parquet" not in committed() and not (output / "part-0.parquet").exists()
        second.resume()
        # Slurm's own end of both tasks, before the scancel below may touch them.
        records = {task: cluster.wait_job(f"{array_id}_{task}", timeout=120) for task in (0, 1)}
    finally:
        cluster.client(["scancel", array_id], check=False)  # a task left held still would hold its node
    logs = {task: (tmp_path / f"task-{task}.out").read_text() for task in (0, 1)}
    for task, record in records.items():
        assert (record["JobState"], record["Restarts"]) == ("COMPLETED", str(1 - task)), logs[task][-5000:]
    assert "(attempt 2)" in logs[0] and "slurm/ddp.sh: score job" in logs[1], logs[0][-3000:]

    for shard in SCORED:
        assert pq.read_table(output / f"{shard}.parquet").to_pylist() == \
            pq.read_table(reference / f"{shard}.parquet").to_pylist(), shard
    assert committed() == []  # every shard published, its chunks gone
    summaries = {p.stem: json.loads(p.read_text()) for p in ledger("summaries").glob("*.json")}
    job_1 = cluster.job(f"{array_id}_1")["JobId"]
    assert set(summaries) == {name, worker_name(0, {**task_env, "SLURM_JOB_ID": job_1})}
    # The preempted attempt wrote no summary; it committed chunk 0 alone, and none was committed
    # or scored twice.
    total = sum(-(-rows // SCORE_CHUNK) for rows in SCORED.values())
    assert sum(s["chunks"] for s in summaries.values()) == total - 1, summaries
    assert [s["scored_twice"] for s in summaries.values()] == [0, 0], summaries
    assert summaries[name]["chunks"] >= 1, summaries  # chunk 1 at least, taken back


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


def test_a_data_mistake_fails_the_check_step_and_no_rank_starts(cluster, tiny_model, reviews, tmp_path):
    """The check step reads the data, as training would, before any node starts torchrun: a
    label column that isn't there is one line and exit 2, with no srun of the trainer (no rank's
    line, no output_dir). TRAINER_CHECK=no-data leaves the data to the ranks."""
    overrides = tiny_overrides(tiny_model, reviews, tmp_path / "run", **{"data.label_field": "stars"})
    job_id, log = submit(cluster, tmp_path, overrides)
    record = finished(cluster, job_id, log, timeout=120)
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "2:0"), explain(record, cluster)
    errors = [line for line in record["log"].splitlines() if "error" in line.lower()]
    assert errors == ["error: data.label_field: column 'stars' not in data.train_split (columns: text, label)"], \
        record["log"]
    assert "srun" not in record["log"] and "[rank" not in record["log"] and not (tmp_path / "run").exists()
    (tmp_path / "no-data").mkdir()
    job_id, log = submit(cluster, tmp_path / "no-data", overrides, env={"TRAINER_CHECK": "no-data",
                                                                          "TRAINER_DRY_RUN": "1"})
    record = finished(cluster, job_id, log, timeout=60)
    (would_check,) = [line for line in record["log"].splitlines() if line.startswith("slurm/ddp.sh: would check:")]
    assert would_check.endswith(" world_size=2 --no-data"), record["log"]


def test_submitit_does_not_requeue_a_node_fault_that_would_leave_too_few_nodes(cluster, tmp_path):
    """submit.py's node-fault requeue (exit code 76, slurm/requeue.py as submit.py imports it),
    run in a real 2-node job: the ranks named node2, without which the partition has one node
    for a job of two, so it declines (the requeue itself, the same code, is ddp.sh's in
    test_a_node_fault_requeues_...)."""
    state = tmp_path / "faults"
    state.mkdir()
    (state / "node-faults").write_text("node2.cluster.example\n")
    code = ("import importlib.util, os, sys; from pathlib import Path; "
            "spec = importlib.util.spec_from_file_location('submit', 'slurm/submit.py'); "
            "submit = importlib.util.module_from_spec(spec); spec.loader.exec_module(submit); "
            f"requeued = submit.requeue.requeue_without_suspects(os.environ['SLURM_JOB_ID'], Path('{state}'), 3, "
            "'--max-fault-requeues'); "
            "sys.exit(0 if requeued else 76)")
    log = tmp_path / "job.out"
    job_id = cluster.sbatch(["--nodes=2", f"--output={log}", "--wrap", shlex.join([PYTHON, "-c", code])],
                            env={**JOB_ENV, "TRAINER_NODE_FAULTS": str(state / "node-faults")}, cwd=REPO)
    record = finished(cluster, job_id, log, timeout=60)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("FAILED", "76:0", "0"), \
        explain(record, cluster)
    assert record["log"].splitlines() == [
        "node fault (76): without node2, partition debug has 1 node(s) for a job of 2: not requeueing"]


@pytest.mark.parametrize("mistake, expected", [
    (["train.learning_rate=1e-4"], "error: train.learning_rate: unknown key"),
    (["data.label_field=stars"], ("error: data.label_field: column 'stars' not in data.train_split (columns: text, "
                                 "label)")),
], ids=["key", "data"])
def test_submitit_refuses_a_mistake_before_submitting(cluster, tiny_model, reviews, tmp_path, mistake, expected):
    """submit.py runs `python -m trainer check` first: the config, and the data."""
    queued = cluster.client(["squeue", "-h"]).stdout
    done = cluster.client([PYTHON, "slurm/submit.py", "--nodes", "2",
                           *tiny_overrides(tiny_model, reviews, tmp_path / "run"), *mistake],
                          check=False, env=JOB_ENV, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip() == expected
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
    # Ended within 300 s of its submission, start-up included (which a loaded machine may make
    # minutes long): so it did not wait for the 600 s timeout that began only at the kill.
    record = finished(cluster, job_id, log, timeout=300)
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


@pytest.mark.parametrize("nodes, torchrun, env, code, says", [
    (2, "0:node1=2 0:node2=hang", {}, 2, "slurm/ddp.sh: exit 2: not requeueing"),
    (2, "0:node1=77 0:node2=hang", {}, 77, "slurm/ddp.sh: exit 77: not requeueing"),
    (2, "0:node2=1 0:node1=hang", {}, 1, None),
    (2, "0:node1=76>node2 0:node2=hang", {}, 76,
     "slurm/ddp.sh: node fault (76): without node2, partition debug has 1 node(s) for a job of 2: not requeueing"),
    (1, "0:*=76>node1", {"TRAINER_MAX_FAULT_REQUEUES": "0"}, 76,
     "slurm/ddp.sh: node fault (76) after 0 requeue(s) for node faults (TRAINER_MAX_FAULT_REQUEUES=0): not requeueing"),
    # torchrun stopped by a TERM (Slurm's preemption, scancel): it forwarded it, its ranks saved.
    (2, "0:node1=143 0:node2=hang", {}, 75, None),
], ids=["usage", "no-progress", "crash", "node-fault-no-room", "node-fault-no-budget", "terminated"])
def test_the_job_ends_with_its_nodes_verdict_and_requeues_only_what_may_be_retried(
        cluster, stand_in, tmp_path, nodes, torchrun, env, code, says):
    """One node's torchrun exits with CODE and srun terminates the other's (--kill-on-bad-exit),
    which exits 143. The job ends with CODE all the same, the verdict its nodes
    recorded: 2 and 77 are never requeued, nor a crash (torchrun's --max-restarts is its
    budget), nor a node fault once its requeues are spent or the partition has too few
    other nodes, nor a preempted job without the time-limit signal (Slurm requeues those)."""
    stand_in_env, _ = stand_in
    job_id, log = submit(cluster, tmp_path, ["-c", "configs/demo.yaml"], sbatch=[f"--nodes={nodes}"],
                         env={**stand_in_env, "FAKE_TORCHRUN": torchrun, **env})
    record = finished(cluster, job_id, log, timeout=60)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("FAILED", f"{code}:0", "0"), \
        explain(record, cluster)
    node_code = re.search(r"=(\d+)", torchrun).group(1)  # srun reports the node's own code
    assert f"Exited with exit code {node_code}" in record["log"], record["log"]
    if nodes == 2:
        # The other node's task: its relay outlives srun's TERM and reports its torchrun's 143.
        assert re.search(r"srun: error: node\d: task \d: (Terminated|Exited with exit code 143)", record["log"]), \
            record["log"]
    if says:
        assert says in record["log"].splitlines(), record["log"]
    assert "requeueing job" not in record["log"]
    job_folder = REPO / ".trainer-workspace" / "slurm" / job_id
    # Kept after a preemption, whose requeue by Slurm keeps the job id and its node-fault budget.
    assert job_folder.exists() == (code == 75)
    shutil.rmtree(job_folder, ignore_errors=True)


def test_a_node_fault_requeues_the_job_without_the_node_the_ranks_named(cluster, stand_in, tmp_path):
    """A 1-node job whose torchrun exits 76 after naming its own node (as a rank does after its
    GPU's error; by its full name, which Slurm knows by the short one) is requeued, excluded
    from that node, and runs its second attempt on the other one. (Submitted with a 60 s
    --signal lead, which sets torchrun's SIGKILL 45 s after its TERM.)"""
    env, recorded = stand_in
    names_itself = " ".join(f"0:{node}=76>{node}.cluster.example" for node in NODES)
    job_id, log = submit(cluster, tmp_path, ["-c", "configs/demo.yaml"], sbatch=["--nodes=1", "--signal=B:USR1@60"],
                         env={**env, "FAKE_TORCHRUN": names_itself, "TRAINER_SIGNAL_LEAD_S": "60"})
    record = finished(cluster, job_id, log, timeout=90)
    assert (record["JobState"], record["Restarts"]) == ("COMPLETED", "1"), explain(record, cluster)
    [first] = [path.name.split(".")[-1] for path in recorded.glob("torchrun.0.*")]
    [second] = [path.name.split(".")[-1] for path in recorded.glob("torchrun.1.*")]
    assert (record["ExcNodeList"], record["NodeList"]) == (first, second) and first != second, record
    assert f"slurm/ddp.sh: node fault (76): requeueing job {job_id} without {first}" in record["log"].splitlines()
    task_env = recorded_env(recorded / f"torchrun.0.{first}")[1]
    assert (task_env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], task_env["TRAINER_GRACE_S"]) == ("45", "60")
    # The requeued job's nodes meet under a rendezvous id of their own attempt.
    assert task_env["PET_RDZV_ID"] != recorded_env(recorded / f"torchrun.1.{second}")[1]["PET_RDZV_ID"]
    faults = Path(task_env["TRAINER_NODE_FAULTS"])
    assert faults == REPO / ".trainer-workspace" / "slurm" / job_id / "node-faults"
    assert not faults.parent.exists()  # the job's folder goes when the job ends


def test_ddp_sh_submitted_from_another_folder_finds_its_verdict_script_beside_it(cluster, stand_in, tmp_path):
    """sbatch runs a copy of ddp.sh from slurmd's spool folder: slurm/requeue.py (the verdict,
    the requeue) is found beside the script as it was submitted, the job's Command, and not in
    the submit directory, which here has no slurm/."""
    env, _ = stand_in
    log = tmp_path / "job.out"
    script = REPO / "slurm" / "ddp.sh"
    job_id = cluster.sbatch([*SBATCH, "--nodes=1", f"--output={log}", str(script), "-c", "demo.yaml"],
                            env={**JOB_ENV, **env, "FAKE_TORCHRUN": "0:*=77"}, cwd=tmp_path)
    record = finished(cluster, job_id, log, timeout=60)
    assert (record["JobState"], record["ExitCode"], record["Command"]) == ("FAILED", "77:0", str(script)), \
        explain(record, cluster)
    assert "slurm/ddp.sh: exit 77: not requeueing" in record["log"].splitlines(), record["log"]


def test_the_rendezvous_id_is_a_secret_of_each_job_that_its_nodes_share(cluster, stand_in, tmp_path):
    """torchrun's rendezvous id, under which its agent unpickles what it reads from an
    unauthenticated store, is not the job id that squeue shows everyone: 16 random bytes made
    by each job, the same on every node of it, handed over in the environment (PET_RDZV_ID),
    never on a command line (`ps`) nor in the job's log. And in venv mode the submit directory,
    the working directory, shadows no installed package (PYTHONSAFEPATH)."""
    env, recorded = stand_in
    ids = []
    for job in (1, 2):
        (tmp_path / f"job{job}").mkdir()
        job_id, log = submit(cluster, tmp_path / f"job{job}", ["-c", "configs/demo.yaml"], env=env)
        record = finished(cluster, job_id, log, timeout=60)
        assert record["JobState"] == "COMPLETED", explain(record, cluster)
        calls = [recorded_env(recorded / f"torchrun.0.{node}") for node in NODES]
        [rdzv_id] = {call_env["PET_RDZV_ID"] for _, call_env in calls}  # one id, on both nodes
        assert re.fullmatch(r"[0-9a-f]{32}", rdzv_id) and rdzv_id != job_id, rdzv_id
        assert [call_env["PYTHONSAFEPATH"] for _, call_env in calls] == ["1", "1"]
        for argv, _ in calls:
            assert "--rdzv-id" not in argv and rdzv_id not in argv, argv
        assert rdzv_id not in record["log"] and "--rdzv-id" not in record["log"], record["log"]
        ids.append(rdzv_id)
        for path in recorded.iterdir():
            path.unlink()
    assert ids[0] != ids[1]


@pytest.fixture
def public():
    """A folder the image's user (uid 1000) owns: pytest's tmp folders are root's alone."""
    folder = Path(tempfile.mkdtemp(prefix="slurm-user-"))
    try:
        os.chown(folder, UID, UID)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def torchrun_line(job_id: str) -> list[str]:
    return ["python", "-m", "trainer.cli.torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=trainer-c10d",
            f"--rdzv-endpoint=node1:{20000 + int(job_id) % 12000}", "--rdzv-conf=join_timeout=60",
            "--max-restarts=0", "-m", "trainer", "train", "-c", "configs/demo.yaml"]


def dry_run(record: dict[str, str], what: str) -> list[str]:
    line = next(line for line in record["log"].splitlines() if line.startswith(f"slurm/ddp.sh: would {what}:"))
    return shlex.split(line.removeprefix(f"slurm/ddp.sh: would {what}:"))  # printed with printf %q


def test_pyxis_launch_lines(cluster, tmp_path, public):
    """No pyxis here: check the exact srun lines of a pyxis job (from a real job, TRAINER_DRY_RUN):
    a prebuilt squashfs passed as a file, one container name for the check step and the
    training step, the variables the image must not override. Submitted as the image's user
    (uid 1000), as a user submits: the workspace the script mounts at the image's /workspace,
    where the image points every cache, is that user's."""
    workspace = public / "workspace"
    image = public / "ddp-trainer.sqsh"
    image.write_bytes(b"")
    env = {"TRAINER_CONTAINER_IMAGE": str(image), "TRAINER_DRY_RUN": "1", "TRAINER_WORKSPACE": str(workspace),
           "TRAINER_CONTAINER_ENV": "MY_SETTING"}
    job_id, log = submit(cluster, public, ["-c", "configs/demo.yaml"], env=env, sbatch=[f"--uid={UID}", f"--gid={UID}"])
    record = finished(cluster, job_id, log, timeout=60)
    assert record["JobState"] == "COMPLETED", explain(record, cluster)
    pyxis = [f"--container-image={image}", "--container-name=trainer",
             f"--container-mounts={REPO},{workspace}:/workspace", f"--container-workdir={REPO}",
             "--no-container-mount-home", ("--container-env=OMP_NUM_THREADS,PYTHONSAFEPATH,PYTHONNOUSERSITE,"
                                           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT,TRAINER_GRACE_S,TRAINER_NODE_FAULTS,MY_SETTING")]
    assert dry_run(record, "check") == ["srun", "--nodes=1", "--ntasks=1", "--quiet", *pyxis,
                                        "python", "-m", "trainer", "check", "-c", "configs/demo.yaml",
                                        "world_size=2"]  # 2 nodes x 1 GPU
    argv = dry_run(record, "run")
    prefix = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=1", *pyxis, "bash", "-c"]
    assert argv[:len(prefix)] == prefix, argv
    assert argv[len(prefix) + 1:] == ["node1", str(REPO / ".trainer-workspace" / "slurm" / job_id),
                                      *torchrun_line(job_id)], argv
    cache_paths = {key: value for key, value in dockerfile_env().items() if value.startswith("/workspace/")}
    assert {"HF_HOME", "WANDB_DIR", "TRITON_CACHE_DIR"} <= set(cache_paths)
    for key, path in cache_paths.items():
        on_host = workspace / Path(path).relative_to("/workspace")
        existing = next(p for p in [on_host, *on_host.parents] if p.exists())
        assert existing.is_relative_to(workspace), (key, existing)
        writable = subprocess.run(as_user(["test", "-w", str(existing)], tmp_path / "python"))
        assert writable.returncode == 0, f"{key}={path}: {existing} is not writable by uid {UID}"


def test_apptainer_gets_a_clean_environment_with_what_the_job_needs(cluster, tmp_path):
    """A real job, with a stand-in `apptainer` that records what each call gets: the check step
    in the batch script, then each node's task. --no-home --cleanenv keep the host's home and
    environment out (a PYTHONPATH set when submitting included); what the job needs is handed
    over as APPTAINERENV_*, each node's own SLURM_* among it."""
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    image, workspace = tmp_path / "trainer.sif", tmp_path / "workspace"
    image.write_bytes(b"")
    env = {"TRAINER_CONTAINER_IMAGE": str(image), "TRAINER_CONTAINER_RUNTIME": "apptainer",
           "TRAINER_WORKSPACE": str(workspace), "FAKE_OUT": str(recorded),
           "PATH": f"{fake_apptainer(tmp_path / 'bin')}:{os.environ['PATH']}",
           "PYTHONPATH": "/home/user/.conda/lib/site-packages", "NOT_FOR_THE_JOB": "1",
           "TRAINER_CONTAINER_ENV": "MY_SETTING", "MY_SETTING": "kept"}
    job_id, log = submit(cluster, tmp_path, ["-c", "configs/demo.yaml"], env=env)
    record = finished(cluster, job_id, log, timeout=60)
    assert record["JobState"] == "COMPLETED", explain(record, cluster)
    calls = [recorded_env(path) for path in sorted(recorded.glob("apptainer.*"))]
    assert len(calls) == 3, calls  # the check, then one task a node
    rdzv_ids: set[str] = set()
    apptainer = ["exec", "--nv", "--no-home", "--cleanenv", "--writable-tmpfs",
                 "--bind", f"{REPO},{workspace}:/workspace", "--pwd", str(REPO), str(image)]
    tasks = []
    for argv_line, call_env in calls:
        argv = shlex.split(argv_line.removeprefix("argv:"))
        assert argv[:len(apptainer)] == apptainer, argv
        given = {key.removeprefix("APPTAINERENV_"): value for key, value in call_env.items()
                 if key.startswith("APPTAINERENV_")}
        assert {key: given.get(key) for key in ("PYTHONNOUSERSITE", "PYTHONSAFEPATH", "MY_SETTING",
                                               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TRAINER_GRACE_S")} == {
            "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1", "MY_SETTING": "kept",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "270", "TRAINER_GRACE_S": "300"}, given
        assert not {"PYTHONPATH", "NOT_FOR_THE_JOB", "HOME", "PATH", "LD_LIBRARY_PATH"} & set(given), given
        rdzv_ids.add(given["PET_RDZV_ID"])  # the rendezvous id, through the clean environment
        if argv[len(apptainer):len(apptainer) + 2] == ["bash", "-c"]:
            tasks.append(given)
            assert argv[len(apptainer) + 3:] == ["node1", str(REPO / ".trainer-workspace" / "slurm" / job_id),
                                                 *torchrun_line(job_id)], argv
        else:
            assert argv[len(apptainer):] == ["python", "-m", "trainer", "check", "-c", "configs/demo.yaml",
                                             "world_size=2"], argv
    assert sorted((task["SLURMD_NODENAME"], task["SLURM_NODEID"]) for task in tasks) == [("node1", "0"), ("node2", "1")]
    assert len(rdzv_ids) == 1 and re.fullmatch(r"[0-9a-f]{32}", rdzv_ids.pop())


HUB_PORT = 18080
SECRET = "hf_NotARealTokenButSecret456"


def users_folder(tmp_path: Path, reviews: Path) -> Path:
    """A user's own folder, not the repository: their config (a gated Hub model at a pinned
    revision) with paths relative to it, and their data."""
    from omegaconf import OmegaConf

    lab = tmp_path / "lab"
    shutil.copytree(reviews, lab / "data/reviews")
    overrides = tiny_overrides("acme/tiny-bert", Path("data/reviews"), Path("runs/my-job"),
                               **{"model.revision": "v2", "train.max_steps": 2, **CPU_ON_PURPOSE})
    OmegaConf.save(OmegaConf.from_dotlist(overrides), lab / "my.yaml")
    return lab


def test_a_users_own_config_and_hub_token_reach_the_ranks_and_an_offline_cache_serves_them(
        cluster, tiny_model, reviews, tmp_path):
    """slurm/README.md's ways to a gated Hub model, from a folder of the user's: nodes that reach
    the Hub get HF_TOKEN from the submitting shell (`sbatch slurm/ddp.sh -c my.yaml`); nodes that
    can't read a shared HF_HOME filled once on the login node, with HF_HUB_OFFLINE=1 (here through
    submit.py, with the Hub gone)."""
    from support.fake_hub import commit

    lab = users_folder(tmp_path, reviews)
    v2 = shutil.copytree(tiny_model, tmp_path / "v2")
    ctl = cluster.net.addresses["ctl"]
    endpoint = f"http://{ctl}:{HUB_PORT}"
    report = tmp_path / "hub.json"
    hub = cluster.popen([PYTHON, str(REPO / "tests/support/fake_hub.py"), "--listen", f"0.0.0.0:{HUB_PORT}", "--repo",
                         f"acme/tiny-bert={tiny_model}", "--repo", f"acme/tiny-bert@v2={v2}", "--token",
                         f"acme/tiny-bert={SECRET}", "--report", str(report)], env={}, cwd=REPO,
                        log=tmp_path / "hub.out")
    wait_for(lambda: "serving" in (tmp_path / "hub.out").read_text(), 30, "the hub", {"hub": hub})
    hub_env = {"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "TRAINER_VENV": str(REPO / ".venv")}
    try:
        # Online nodes: the token is exported where the job is submitted, and nowhere else.
        log = tmp_path / "online.out"
        job_id = cluster.sbatch([*SBATCH, f"--output={log}", str(REPO / "slurm/ddp.sh"), "-c", "my.yaml"],
                                env={**JOB_ENV, **hub_env, "HF_TOKEN": SECRET, "HF_HOME": str(lab / "hf")}, cwd=lab)
        record = finished(cluster, job_id, log, timeout=180)
        assert record["JobState"] == "COMPLETED", explain(record, cluster)
        # The login node's one prefetch for offline nodes, into another shared HF_HOME.
        cluster.client([str(REPO / ".venv/bin/hf"), "download", "acme/tiny-bert", "--revision", "v2", "--quiet"],
                       env={**hub_env, "HF_TOKEN": SECRET, "HF_HOME": str(lab / "hf-offline")}, cwd=lab)
    finally:
        hub.terminate()
        hub.wait(timeout=30)
    seen = json.loads(report.read_text())
    nodes = {cluster.net.addresses[node] for node in NODES}
    assert {client for client, auth in seen["clients"] if auth == f"Bearer {SECRET}"} >= nodes, seen
    assert seen["downloads"] and all(name.startswith("acme/tiny-bert@v2/") for name in seen["downloads"]), seen
    run = lab / "runs/my-job"
    summary = read_summary(run)
    assert summary["model"] == {"name": "acme/tiny-bert", "revision": "v2", "commit": commit("v2")}
    assert summary["world_size"] == 2 and len(summary["hosts"]) == 2
    written = [path for path in run.rglob("*") if path.is_file()] + [log]
    assert not [path for path in written if SECRET.encode() in path.read_bytes()]

    # Offline nodes, the Hub gone: the same config through submitit, from the shared cache.
    offline = {**JOB_ENV, "HF_HOME": str(lab / "hf-offline"), "HF_HUB_OFFLINE": "1"}
    submitted = cluster.client([PYTHON, str(REPO / "slurm/submit.py"), "-c", "my.yaml", "--nodes", "2",
                                "--gpus-per-node", "1", "--cpus-per-task", "1", "--time", "10", "--wait",
                                "output_dir=runs/offline"], env=offline, cwd=lab, timeout=180, check=False)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert read_summary(lab / "runs/offline")["model"] == summary["model"]
