#!/bin/bash
# A trained model over a corpus on Slurm (`python -m trainer score`, docs/scoring.md): a job
# array, each task on its own node(s), one scoring process per GPU.
#
#   sbatch --array=0-15 slurm/score.sh -c CONFIG score.input=SHARDS score.output=FOLDER [key=value ...]
#   sbatch --array=0-15 $(slurm/fit.sh PARTITION) slurm/score.sh -c CONFIG score.input=... score.output=...
#   sbatch --array=0-3 --partition=cpu --gpus-per-node=0 slurm/score.sh -c CONFIG ...   # CPUs
#
# The tasks share nothing but score.output's ledger, on a filesystem every node sees: each
# takes chunks no other has claimed, so a task that starts late, runs slow or is preempted
# holds back no other, and the last to run finishes the corpus. Each row is written once
# whatever stops. A requeued task is the same job id, so the same worker names: it takes its
# own claims back at once (another node's dead worker's after score.lease_s).
#
# This is slurm/ddp.sh, run as `slurm/ddp.sh score ARGS`: every setting of ddp.sh holds
# (TRAINER_VENV, TRAINER_CONTAINER_IMAGE, ..., slurm/README.md), with these defaults instead:
# one whole node a task, and a short time-limit lead, since a scoring worker has nothing to save.
#
#SBATCH --job-name=trainer-score
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --output=%x-%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@60
# An account or partition, if your site needs them (as in ddp.sh): on the command line, in
# SBATCH_ACCOUNT / SBATCH_PARTITION, or remove one "#" here:
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_PARTITION
#
# --output=%x-%A_%a.out: a log per array task (%A the array's id, %a the task's index),
#   appended to by its requeued attempts.
# --requeue, --signal=B:USR1@60: as in ddp.sh. Before the time limit the task's workers are
#   stopped and it is requeued; preempted (TERM), it is requeued by Slurm. Either way it loses
#   at most the chunk each worker was scoring. If you change @60, export TRAINER_SIGNAL_LEAD_S.
set -euo pipefail

[[ -n ${SLURM_JOB_ID:-} ]] || { echo "slurm/score.sh: error: not inside a Slurm job; submit it with: sbatch --array=0-N slurm/score.sh -c CONFIG score.input=... score.output=..." >&2; exit 2; }
# sbatch runs a copy of this script from slurmd's spool folder: ddp.sh is beside the script as
# it was submitted (the job's Command), else in the submit directory's slurm/.
submitted=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o ' Command=/[^ ]*' | cut -d= -f2- || true)
ddp_sh=${submitted:+${submitted%/*}/ddp.sh}
[[ -f $ddp_sh ]] || ddp_sh=$SLURM_SUBMIT_DIR/slurm/ddp.sh
[[ -f $ddp_sh ]] || { echo "slurm/score.sh: error: slurm/ddp.sh is not beside ${submitted:-this script} nor in $SLURM_SUBMIT_DIR/slurm: keep them together" >&2; exit 2; }
export TRAINER_SIGNAL_LEAD_S=${TRAINER_SIGNAL_LEAD_S:-60}  # this script's --signal lead, which Slurm does not tell the job
exec bash "$ddp_sh" score "$@"
