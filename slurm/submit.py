"""Submit the training job to Slurm from Python, with submitit.

    python slurm/submit.py -c CONFIG --nodes 2 [--gpus-per-node 8] [key=value ...]
    python slurm/submit.py -c configs/demo.yaml --nodes 2 --gpus-per-node 0 --wait   # CPUs, gloo
    python slurm/submit.py --sweep -c my.yaml --nodes 1 [key=value ...]   # a job array: a task per trial
    python slurm/submit.py --score 16 -c CONFIG score.input=SHARDS score.output=FOLDER   # 16 tasks score a corpus

The job runs the same entry point as `sbatch slurm/ddp.sh` (`python -m trainer train`'s
`main`) with the same config and overrides. What differs is who starts the processes:
submitit starts one Slurm task per GPU (or one per node on CPUs), and each task reads its
RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from Slurm through submitit's
TorchDistributedEnvironment instead of from torchrun.

Preemption and time limits: submitit asks Slurm for USR2 `--signal-delay-s` before the
limit; on preemption and on `scancel` Slurm sends TERM. The trainer takes both as a
preemption signal: its handler only sets a flag, all ranks agree at the next step boundary,
save and return 75. Then, and only after USR2, the time-limit signal is handed to submitit's
own handler, which requeues the job (this callable is a submitit Checkpointable); the
requeued job resumes from that checkpoint with the same wandb run. After TERM alone nothing
is requeued: a cancelled job stays cancelled, and Slurm requeues a preempted one itself; rank
0 exits 75 leaving no result, so that --wait does not take the attempt for the job's end.
submitit gives up after `slurm_max_num_timeout` time limits (3 by default); --max-timeouts
raises it, since a long run meets its time limit at every attempt.

The other verdicts of the restart contract (trainer/exit_codes.py): a node fault (76)
requeues the job without the nodes the ranks named (slurm/requeue.py, which slurm/ddp.sh
runs too; within --max-fault-requeues); a crash (1), a usage error (2) and no progress (77)
fail the job.
Config errors are caught here, before submitting.

--sweep: the config's sweep section (a grid) as a job array (submitit's map_array), each array
task one trial run of `python -m trainer sweep` (docs/sweeps.md), on --nodes nodes, in its own
folder, with everything above: requeued at its time limit or without a faulty node, resumed
from its checkpoints. `python -m trainer sweep` with the same config then finds the trials
finished and writes the leaderboard and final/.

--score TASKS: `python -m trainer score` (docs/scoring.md) as a job array of TASKS tasks, each on
--nodes nodes (default 1), which share the corpus through score.output's ledger: each takes the
chunks no other has claimed, and a requeued task (the same job id: the same workers) takes its
own claims back at once. A scoring worker has nothing to save: at the time-limit signal
submitit's own handler requeues the task; preempted, it scores on until Slurm stops it, losing at
most its chunk, and Slurm requeues it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import cloudpickle
import submitit

from trainer.cli.main import main as trainer_main
from trainer.errors import TrainerError, report
from trainer.exit_codes import MEANING, NODE_FAULTS_ENV, RETRYABLE_ENV, Exit
from trainer.faults.preemption import received_signals

# slurm/requeue.py, the node-fault requeue shared with slurm/ddp.sh (which runs it as a script),
# lies beside this file: importable whether this file runs as a script or is loaded by its path.
# submitit pickles the job (with cloudpickle) for the nodes, where this folder is not on the
# path: its functions travel by value.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import requeue

cloudpickle.register_pickle_by_value(requeue)

# submitit's time-limit signal, USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise. The
# override goes before the user's, which may still replace it.
TIME_LIMIT_SIGNAL = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)
PREEMPT_SIGNALS = f"fault.preempt_signals=[SIGTERM,{TIME_LIMIT_SIGNAL.name}]"


class TrainJob(submitit.helpers.Checkpointable):
    """One Slurm task = one rank of `python -m trainer COMMAND` (train, or score). Checkpointable:
    submitit requeues it as it was submitted, and the trainer itself finds its latest checkpoint
    in output_dir (a scoring worker, its own claims in score.output)."""

    def __init__(self, grace_s: int = 300, max_fault_requeues: int = 3, command: str = "train"):
        self.grace_s = grace_s
        self.max_fault_requeues = max_fault_requeues
        self.command = command

    def __call__(self, trainer_args: list[str]) -> int:
        # set_cuda_visible_devices=False: each rank picks cuda:LOCAL_RANK among the node's
        # GPUs, exactly as under torchrun.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        job = submitit.JobEnvironment()
        state = job.paths.folder / f"{job.job_id}_faults"
        state.mkdir(exist_ok=True)
        os.environ.setdefault(NODE_FAULTS_ENV, str(state / "node-faults"))
        # No torchrun between Slurm and the ranks: they have the signal's whole lead to save.
        os.environ.setdefault("TRAINER_GRACE_S", str(self.grace_s))
        os.environ.pop(RETRYABLE_ENV, None)  # the Kubernetes dialect would hide 75 and 76 here
        exit_code = trainer_main([self.command, *trainer_args])
        if exit_code == Exit.PREEMPTED and TIME_LIMIT_SIGNAL.name in received_signals():
            # The checkpoint is on disk and the trainer has given the signals back to
            # submitit: replay the time-limit signal so that its handler requeues the job.
            # Global rank 0 requeues and exits; the others return, exiting 0 so that
            # --kill-on-bad-exit doesn't cut rank 0's requeue short. A TERM alone is
            # scancel's (stay cancelled) or a preemption (Slurm requeues those itself).
            signal.raise_signal(TIME_LIMIT_SIGNAL)
            return exit_code
        if exit_code == Exit.PREEMPTED:
            # Saved; not requeued by us. Rank 0 leaves no result, as submitit's own requeue
            # leaves none (SystemExit passes its `except Exception`): the result file is what
            # tells `--wait` (submitit's job.done()) that the job has ended, and a preempted job
            # that Slurm requeues has not. Returning here ended --wait at the first attempt, and
            # `python -m trainer sweep` after it trained that array task's run beside its second.
            if job.global_rank == 0:
                sys.exit(exit_code)
            return exit_code
        if exit_code == Exit.NODE_FAULT and requeue.requeue_without_suspects(job.job_id, state, self.max_fault_requeues,
                                                                             "--max-fault-requeues"):
            return 0  # as after USR2: exiting 0 so that --kill-on-bad-exit leaves the requeue be
        if exit_code != 0:
            meaning = MEANING.get(exit_code, "crashed")
            raise RuntimeError(f"python -m trainer {self.command} exited with {exit_code} ({meaning}); see the job's "
                               "log")
        return exit_code


def node_cpus(partition: str | None) -> int | None:
    """The CPUs of the partition's smallest node (the default partition's without one), or
    None if sinfo cannot say."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rows = subprocess.run(["sinfo", "-h", "-N", "-o", "%P %c"], check=True, capture_output=True, text=True,
                              timeout=30).stdout.splitlines()
        # sinfo marks the default partition "NAME*", named or not.
        cpus = [int(cpu_count) for name, cpu_count in (row.split() for row in rows)
                if name.rstrip("*") == partition or (not partition and name.endswith("*"))]
        return min(cpus) if cpus else None
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python slurm/submit.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", help="YAML config file (see configs/)")
    parser.add_argument("--nodes", type=int, help="nodes a job (or an array's task): default 2, with --score 1")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="0 for a CPU partition")
    parser.add_argument("--tasks-per-node", type=int,
                        help="ranks per node (default: one per GPU, or 1 without GPUs)")
    parser.add_argument("--cpus-per-task", type=int,
                        help="CPUs per rank (default: the partition's smallest node's, shared by its ranks)")
    parser.add_argument("--time", type=int, default=24 * 60, help="time limit in minutes")
    parser.add_argument("--partition")
    parser.add_argument("--signal-delay-s", type=int, default=300,
                        help="seconds between the time-limit signal and the limit: time to save")
    parser.add_argument("--max-timeouts", type=int, default=100,
                        help="time limits after which submitit stops requeueing (its default is 3)")
    parser.add_argument("--max-fault-requeues", type=int, default=3,
                        help="requeues without a faulty node (exit code 76) before the job fails")
    parser.add_argument("--folder", default="runs/submitit/%j", help="submitit's pickles and logs")
    parser.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                        help="any other sbatch option, e.g. --sbatch account=lab --sbatch qos=high")
    parser.add_argument("--wait", action="store_true", help="wait for the job and exit with its result")
    parser.add_argument("--no-data", action="store_true",
                        help="check the config before submitting, but not the data (that this host can't read)")
    parser.add_argument("--sweep", action="store_true",
                        help="a job array of the sweep section's trials (a grid), a task per trial run")
    parser.add_argument("--score", type=int, metavar="TASKS",
                        help="score score.input into score.output, as a job array of TASKS tasks")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.score is not None and (args.score < 1 or args.sweep):
        return report("--score TASKS: a number of tasks, 1 or more, and not with --sweep")
    # A scoring worker saves nothing on a signal: submitit's own handlers stay (its time-limit
    # signal requeues the task).
    trainer_args = (["-c", args.config] if args.config else []) + ([] if args.score else [PREEMPT_SIGNALS]) + \
        args.overrides
    nodes = args.nodes or (1 if args.score else 2)
    tasks_per_node = args.tasks_per_node or max(args.gpus_per_node, 1)
    # `python -m trainer check` before anything is queued: the config, and the data read as the
    # job will read it (--no-data: all but the data, for data the submit host can't see), at
    # the job's world size. Scoring's data is the corpus, which check reads in any case.
    if args.score:
        checked = trainer_main(["check", *trainer_args, "--no-data"])
    else:
        checked = trainer_main(["check", *trainer_args, f"world_size={nodes * tasks_per_node}",
                                *(["--no-data"] if args.no_data else [])])
    if checked:
        return checked
    extra = {}
    for option in args.sbatch:
        key, sep, value = option.partition("=")
        if not sep or not key:
            return report(f"--sbatch {option!r} is not KEY=VALUE")
        extra[key] = value

    # Whole nodes (--exclusive --mem=0), as slurm/ddp.sh takes them; each task is bound to its
    # own --cpus-per-task, so the node's CPUs are split between its ranks.
    cpus_per_task = args.cpus_per_task or max((node_cpus(args.partition) or tasks_per_node) // tasks_per_node, 1)
    executor = submitit.AutoExecutor(folder=args.folder, cluster="slurm", slurm_max_num_timeout=args.max_timeouts)
    executor.update_parameters(
        name="trainer-score" if args.score else "trainer", nodes=nodes, tasks_per_node=tasks_per_node,
        gpus_per_node=args.gpus_per_node, cpus_per_task=cpus_per_task, timeout_min=args.time,
        slurm_partition=args.partition, slurm_signal_delay_s=args.signal_delay_s,
        slurm_exclusive=True, slurm_mem="0",
        # --kill-on-bad-exit: one rank that dies ends every task, instead of leaving them in a
        # collective until the timeout. --requeue: allowed even where the cluster's default is not.
        slurm_srun_args=["--kill-on-bad-exit=1"], slurm_additional_parameters={"requeue": True, **extra},
    )
    if args.score:
        jobs = executor.map_array(TrainJob(args.signal_delay_s, args.max_fault_requeues, "score"),
                                  [trainer_args] * args.score)
        print(f"submitted job array {jobs[0].job_id.split('_')[0]}: {len(jobs)} scoring tasks; logs in "
              f"{Path(jobs[0].paths.stdout).parent}")
        return 0 if not args.wait else _wait(jobs)
    if args.sweep:
        try:
            tasks = sweep_tasks(args)
        except TrainerError as e:
            return report(e)
        jobs = executor.map_array(TrainJob(args.signal_delay_s, args.max_fault_requeues), tasks)
        print(f"submitted job array {jobs[0].job_id.split('_')[0]}: {len(jobs)} trials; logs in "
              f"{Path(jobs[0].paths.stdout).parent}; then `python -m trainer sweep` with the same config")
        return 0 if not args.wait else _wait(jobs)
    job = executor.submit(TrainJob(args.signal_delay_s, args.max_fault_requeues), trainer_args)
    print(f"submitted job {job.job_id}; logs in {Path(job.paths.stdout).parent}")
    if not args.wait:
        return 0
    return _wait([job])


def _wait(jobs: list) -> int:
    for job in jobs:
        try:
            job.results()
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as e:
            print(f"error: job {job.job_id} failed: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        print(f"job {job.job_id} completed")
    return 0


def sweep_tasks(args: argparse.Namespace) -> list[list[str]]:
    """Each array task's `python -m trainer train` arguments: the sweep's config file (written
    into output_dir) and the trial run's overrides, every run of the grid, checked first as
    `python -m trainer sweep` checks them."""
    from trainer.cli import run_config
    from trainer.sweep import command, plan, runs

    def load(more: list[str]):
        return run_config.load(args.config, [PREEMPT_SIGNALS, *args.overrides, *more])

    cfg = load([])
    config_file, each = command.array_runs(cfg, plan.check(cfg, load))
    trials = Path(cfg.output_dir) / runs.TRIALS
    return [["-c", str(config_file), *one.overrides(trials / one.id)] for one in each]


if __name__ == "__main__":
    sys.exit(main())
