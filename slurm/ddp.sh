#!/bin/bash
# Multi-node DDP training on Slurm: one torchrun per node, one training process per GPU.
#
#   sbatch slurm/ddp.sh [-c CONFIG] [key=value ...]
#   sbatch --nodes=4 --gpus-per-node=4 slurm/ddp.sh -c configs/yelp_bert.yaml train.lr=3e-5
#   sbatch --partition=cpu --gpus-per-node=0 slurm/ddp.sh -c configs/demo.yaml      # CPUs, gloo
#   sbatch $(slurm/fit.sh PARTITION) slurm/ddp.sh -c CONFIG   # every CPU and GPU of the partition's nodes
#
# The #SBATCH defaults below ask for 2 nodes x 8 GPUs x 32 CPUs. On a partition whose nodes are
# smaller, Slurm queues the job anyway and it pends forever (squeue: PartitionConfig): check
# first with `sbatch --test-only ...`, or size the request with slurm/fit.sh.
#
# Submit from the repository (or any folder holding your configs): relative paths, the
# default venv and the default log file are all relative to the submit directory.
# Settings are environment variables, never edits to this file; sbatch passes your
# environment to the job. See slurm/README.md for all of them.
#
#SBATCH --job-name=trainer
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#
# --ntasks-per-node=1: srun starts ONE torchrun per node, and torchrun one process per GPU.
#   A task per GPU, each running torchrun, is how jobs die of "Duplicate GPU detected".
# --open-mode=append: a requeued job appends to its log instead of truncating it.
# --signal=B:USR1@300: 5 minutes before the time limit Slurm sends USR1 to this script only
#   (B:). The trap below turns it into "every rank checkpoints, exits, the job requeues".
#   USR1 rather than TERM, because TERM is also what scancel and preemption send, and those
#   must not requeue. Not to the training processes directly: torchrun dies of USR1 (it
#   forwards only TERM, INT, HUP and QUIT), so a relay on each node hands it on as a TERM.
set -euo pipefail

die() {
    echo "slurm/ddp.sh: error: $*" >&2
    exit 2
}

[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job; submit it with: sbatch [\$(slurm/fit.sh PARTITION)] slurm/ddp.sh [-c CONFIG] [key=value ...]"
cd "$SLURM_SUBMIT_DIR"

# --- Where the code runs: a container image, a venv, or whatever is on PATH -------------
# TRAINER_CONTAINER_IMAGE runs every step in the image built from our Dockerfile.
#   pyxis/enroot (the default runtime):  srun --container-image=IMAGE ...
#   Apptainer (TRAINER_CONTAINER_RUNTIME=apptainer, IMAGE a .sif or docker://...):
#                                        apptainer exec --nv IMAGE ...
# Either way the submit directory is mounted at the same path and is the working directory,
# so configs, data and runs on the shared filesystem are where they are outside.
srun_flags=()    # extra srun options (pyxis)
exec_prefix=()   # a command that wraps each process (Apptainer)
if [[ -n ${TRAINER_CONTAINER_IMAGE:-} ]]; then
    # The image keeps its caches and runs under /workspace (HF_HOME, WANDB_*, TRITON_CACHE_DIR, ...,
    # runs/). An image is read-only (a SIF always), so /workspace is a folder of the submit
    # directory, on the shared filesystem, created here by the submitting user.
    workspace=${TRAINER_WORKSPACE:-$SLURM_SUBMIT_DIR/.trainer-workspace}
    mkdir -p "$workspace/cache" "$workspace/runs" "$workspace/wandb" \
        || die "TRAINER_WORKSPACE=$workspace cannot be created"
    mounts="${TRAINER_CONTAINER_MOUNTS:-$SLURM_SUBMIT_DIR},$workspace:/workspace"
    case ${TRAINER_CONTAINER_RUNTIME:-pyxis} in
        pyxis)
            srun_flags=(--container-image="$TRAINER_CONTAINER_IMAGE" --container-mounts="$mounts"
                        --container-workdir="$SLURM_SUBMIT_DIR" --no-container-mount-home) ;;
        apptainer)  # --writable-tmpfs: anything else the processes write stays in memory
            exec_prefix=(apptainer exec --nv --writable-tmpfs --bind "$mounts" --pwd "$SLURM_SUBMIT_DIR"
                         "$TRAINER_CONTAINER_IMAGE") ;;
        *) die "TRAINER_CONTAINER_RUNTIME=${TRAINER_CONTAINER_RUNTIME} is not one of: pyxis, apptainer" ;;
    esac
    # The image has the package installed; a `trainer/` folder in the submit directory
    # (a repository clone) must not shadow it, which `python -m` would otherwise do.
    export PYTHONSAFEPATH=1
elif [[ -n ${TRAINER_VENV:-} || -d .venv ]]; then
    venv=${TRAINER_VENV:-.venv}
    [[ -x $venv/bin/torchrun ]] || die "TRAINER_VENV: no torchrun in $venv/bin (create it with: make install)"
    export PATH="$(cd "$venv/bin" && pwd):$PATH"
fi
if [[ -z ${TRAINER_CONTAINER_IMAGE:-} ]]; then
    command -v torchrun >/dev/null || die "torchrun not found: set TRAINER_VENV, TRAINER_CONTAINER_IMAGE, or load an environment that has it"
fi

# --- The job's layout ---------------------------------------------------------------------
# One process per allocated GPU; on CPU partitions (no GPUs) TRAINER_NPROC_PER_NODE, else 1.
nproc_per_node=${TRAINER_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
[[ $nproc_per_node =~ ^[1-9][0-9]*$ ]] || die "TRAINER_NPROC_PER_NODE=$nproc_per_node is not a positive integer"
nnodes=$SLURM_JOB_NUM_NODES
# Slurm 22.05 to 23.02: srun no longer inherits the job's --cpus-per-task, so each node's one
# task would be bound to a single CPU, torchrun, every rank and their loader workers on it.
cpus_per_task=()
[[ -z ${SLURM_CPUS_PER_TASK:-} ]] || cpus_per_task=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
# The task's CPUs split between its processes. Without this, every rank starts a thread per
# core of the node and they all thrash.
threads=$(( ${SLURM_CPUS_PER_TASK:-1} / nproc_per_node ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# Rendezvous on the allocation's first node. Never a localhost fallback: a node that can't
# find the real one would form a world of its own and wait forever for the others.
rdzv_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
[[ -n $rdzv_host ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no node"
# Derived from the job id, so two jobs whose first node is the same don't collide. Below
# 32768, the start of Linux's ephemeral range, so no outgoing connection holds it already.
rdzv_port=${TRAINER_RDZV_PORT:-$(( 20000 + SLURM_JOB_ID % 12000 ))}

# --- What runs --------------------------------------------------------------------------
# TRAINER_OUTPUT_DIR comes before your arguments: an explicit output_dir=... still wins.
args=("$@")
[[ -n ${TRAINER_OUTPUT_DIR:-} ]] && args=("output_dir=$TRAINER_OUTPUT_DIR" "${args[@]}")

torchrun_cmd=(
    torchrun --nnodes="$nnodes" --nproc-per-node="$nproc_per_node"
    --rdzv-backend=trainer-c10d --rdzv-endpoint="$rdzv_host:$rdzv_port" --rdzv-id="$SLURM_JOB_ID"
    --rdzv-conf=join_timeout="${TRAINER_JOIN_TIMEOUT:-600}" --max-restarts="${TRAINER_MAX_RESTARTS:-0}"
    -m trainer train "${args[@]}"
)
# Each node's task checks that the rendezvous host resolves there (torchrun's c10d
# would retry an unknown name for minutes), then runs torchrun under a small relay for the
# time-limit signal. torchrun and everything it starts ignore USR1 (an ignored signal stays
# ignored across fork and exec); the relay turns USR1 into a TERM to torchrun alone, which
# passes it to its workers. `scancel --signal=TERM` would reach every process of the step
# instead, wandb's service among them, which exits on TERM before the run's last records.
node_task='
getent hosts "$0" >/dev/null || { echo "slurm/ddp.sh: error: $(hostname) cannot resolve the first node $0" >&2; exit 2; }
trap "" USR1
"$@" &
child=$!
trap "kill -TERM $child" USR1
while :; do wait "$child"; status=$?; kill -0 "$child" 2>/dev/null || exit "$status"; done'
# --kill-on-bad-exit: one node's torchrun failing ends the step on every node at once,
# instead of leaving the others blocked in a collective until their timeout.
launch=(srun --kill-on-bad-exit=1 --ntasks-per-node=1 "${cpus_per_task[@]}" "${srun_flags[@]}"
        "${exec_prefix[@]}" bash -c "$node_task" "$rdzv_host" "${torchrun_cmd[@]}")

echo "slurm/ddp.sh: job $SLURM_JOB_ID (attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 ))): $nnodes node(s) $SLURM_JOB_NODELIST" \
     "x $nproc_per_node process(es), rendezvous $rdzv_host:$rdzv_port"
if [[ -n ${TRAINER_DRY_RUN:-} ]]; then  # print what would run, for checking a setup
    printf 'slurm/ddp.sh: would run:'; printf ' %q' "${launch[@]}"; echo
    exit 0
fi

# A bad config or key fails here, in seconds, with one line, before any node starts torchrun.
# Run where training runs (the venv or the image); it also logs the resolved config.
if [[ -n ${TRAINER_CONTAINER_IMAGE:-} && ${TRAINER_CONTAINER_RUNTIME:-pyxis} == pyxis ]]; then
    srun --nodes=1 --ntasks=1 --quiet "${srun_flags[@]}" python -m trainer check "${args[@]}" || exit
else
    "${exec_prefix[@]}" python -m trainer check "${args[@]}" || exit
fi

# --- Run it, and turn signals into checkpoints ---------------------------------------------
# The training processes' own handler (fault.preempt_signals, default SIGTERM) only sets a
# flag; all ranks agree on it at the next step boundary, save one checkpoint and exit. This
# script therefore must not exit early: srun runs in the background so that `wait` returns
# to the traps, and the loop goes back to waiting until the step has finished saving.
requeue_after=0
on_time_limit() {
    trap '' USR1
    echo "slurm/ddp.sh: time limit near (SIGUSR1): every rank saves at its next step, then the job requeues"
    requeue_after=1
    scancel --signal=USR1 "$SLURM_JOB_ID"  # to every node's relay (the steps, not this script)
}
on_term() {
    # scancel, or preemption: Slurm has already sent TERM to the training processes. Wait
    # for their checkpoint (until KillWait runs out); requeueing is Slurm's decision here.
    echo "slurm/ddp.sh: SIGTERM: waiting for the checkpoint before exiting"
}
trap on_time_limit USR1
trap on_term TERM

"${launch[@]}" &
srun_pid=$!
status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # a trap interrupted `wait`; the step still runs
    status=0
    wait "$srun_pid" || status=$?
done

if (( requeue_after && status != 0 )); then
    # The ranks saved and exited. Requeued, the job keeps its id, so it finds the same
    # output_dir, resumes from that checkpoint and continues the same wandb run.
    echo "slurm/ddp.sh: checkpoint saved; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
