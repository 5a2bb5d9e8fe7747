"""Submit the training job to Slurm from Python, with submitit.

    python slurm/submit.py -c CONFIG --nodes 2 [--gpus-per-node 8] [key=value ...]
    python slurm/submit.py -c configs/demo.yaml --nodes 2 --gpus-per-node 0 --wait   # CPUs, gloo

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
is requeued: a cancelled job stays cancelled, and Slurm requeues a preempted one itself.
Config errors are caught here, before submitting.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import submitit

from trainer import config
from trainer.__main__ import main as trainer_main
from trainer.errors import ConfigError, report
from trainer.preemption import EXIT_PREEMPTED, received_signals

# submitit's time-limit signal, USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise. The
# override goes before the user's, which may still replace it.
TIME_LIMIT_SIGNAL = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)
PREEMPT_SIGNALS = f"fault.preempt_signals=[SIGTERM,{TIME_LIMIT_SIGNAL.name}]"


class TrainJob(submitit.helpers.Checkpointable):
    """One Slurm task = one rank. Checkpointable: submitit requeues it as it was submitted,
    and the trainer itself finds its latest checkpoint in output_dir."""

    def __call__(self, trainer_args: list[str]) -> int:
        # set_cuda_visible_devices=False: each rank picks cuda:LOCAL_RANK among the node's
        # GPUs, exactly as under torchrun.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        exit_code = trainer_main(["train", *trainer_args])
        if exit_code == EXIT_PREEMPTED and TIME_LIMIT_SIGNAL.name in received_signals():
            # The checkpoint is on disk and the trainer has given the signals back to
            # submitit: replay the time-limit signal so that its handler requeues the job.
            # Global rank 0 requeues and exits; the others return, exiting 0 so that
            # --kill-on-bad-exit doesn't cut rank 0's requeue short. A TERM alone is
            # scancel's (stay cancelled) or a preemption (Slurm requeues those itself).
            signal.raise_signal(TIME_LIMIT_SIGNAL)
            return exit_code
        if exit_code == EXIT_PREEMPTED:
            return exit_code  # saved; not requeued by us
        if exit_code != 0:
            raise RuntimeError(f"python -m trainer train exited with {exit_code}; see the job's log")
        return exit_code


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python slurm/submit.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", help="YAML config file (see configs/)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="0 for a CPU partition")
    parser.add_argument("--tasks-per-node", type=int,
                        help="ranks per node (default: one per GPU, or 1 without GPUs)")
    parser.add_argument("--cpus-per-task", type=int, default=4, help="CPUs per rank")
    parser.add_argument("--time", type=int, default=24 * 60, help="time limit in minutes")
    parser.add_argument("--partition")
    parser.add_argument("--signal-delay-s", type=int, default=300,
                        help="seconds between the time-limit signal and the limit: time to save")
    parser.add_argument("--folder", default="runs/submitit/%j", help="submitit's pickles and logs")
    parser.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                        help="any other sbatch option, e.g. --sbatch account=lab --sbatch qos=high")
    parser.add_argument("--wait", action="store_true", help="wait for the job and exit with its result")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trainer_args = (["-c", args.config] if args.config else []) + [PREEMPT_SIGNALS, *args.overrides]
    try:  # the same checks as the job's own first seconds, before anything is queued
        config.load(args.config, [PREEMPT_SIGNALS, *args.overrides])
    except ConfigError as e:
        return report(e)
    extra = {}
    for option in args.sbatch:
        key, sep, value = option.partition("=")
        if not sep or not key:
            return report(f"--sbatch {option!r} is not KEY=VALUE")
        extra[key] = value

    executor = submitit.AutoExecutor(folder=args.folder, cluster="slurm")
    executor.update_parameters(
        name="trainer", nodes=args.nodes, tasks_per_node=args.tasks_per_node or max(args.gpus_per_node, 1),
        gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, timeout_min=args.time,
        slurm_partition=args.partition, slurm_signal_delay_s=args.signal_delay_s,
        # --kill-on-bad-exit: one rank that dies ends every task, instead of leaving them in a
        # collective until the timeout. --requeue: allowed even where the cluster's default is not.
        slurm_srun_args=["--kill-on-bad-exit=1"], slurm_additional_parameters={"requeue": True, **extra},
    )
    job = executor.submit(TrainJob(), trainer_args)
    print(f"submitted job {job.job_id}; logs in {Path(job.paths.stdout).parent}")
    if not args.wait:
        return 0
    try:
        job.results()
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as e:
        print(f"error: job {job.job_id} failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"job {job.job_id} completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
