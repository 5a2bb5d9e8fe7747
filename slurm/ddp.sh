#!/bin/bash
# Multi-node DDP training on Slurm: one torchrun per node, one training process per GPU.
#
#   sbatch slurm/ddp.sh [-c CONFIG] [key=value ...]
#   sbatch --nodes=4 --gpus-per-node=4 slurm/ddp.sh -c configs/yelp_bert.yaml train.lr=3e-5
#   sbatch --partition=cpu --gpus-per-node=0 slurm/ddp.sh -c configs/demo.yaml      # CPUs, gloo
#   sbatch $(slurm/fit.sh PARTITION) slurm/ddp.sh -c CONFIG   # the partition's GPUs and MaxTime
#
# Scoring a corpus is this script too: slurm/score.sh (a job array) runs `slurm/ddp.sh score ...`.
#
# The #SBATCH defaults below ask for 2 whole nodes with 8 GPUs each, all their CPUs and
# memory, for 24 hours. A node with fewer GPUs is refused at submit ("Requested node
# configuration is not available"); a --time above the partition's MaxTime pends for ever
# (squeue: PartitionTimeLimit), so slurm/fit.sh prints a --time that fits.
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
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
# Many sites refuse a job without an account, and some have no default partition: pass them
# on the command line (sbatch --account=LAB --partition=gpu ...), or export SBATCH_ACCOUNT and
# SBATCH_PARTITION once, or remove one "#" from these lines and fill them in:
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_PARTITION
#
# --ntasks-per-node=1: srun starts ONE torchrun per node, and torchrun one process per GPU.
#   A task per GPU, each running torchrun, is how jobs die of "Duplicate GPU detected".
# --exclusive --mem=0: the whole node, whatever its CPU count and memory (NeMo's defaults).
#   A fixed --cpus-per-task fits some nodes and pends for ever on the others; the per-rank
#   threads are derived below from what the job really got.
# --open-mode=append: a requeued job appends to its log instead of truncating it.
# --signal=B:USR1@300: 5 minutes before the time limit Slurm sends USR1 to this script only
#   (B:). The trap below turns it into "every rank checkpoints, exits, the job requeues".
#   USR1 rather than TERM, because TERM is also what scancel and preemption send, and those
#   must not requeue. Not to the training processes directly: torchrun dies of USR1 (it
#   forwards only TERM, INT, HUP and QUIT), so a relay on each node hands it on as a TERM.
#   Slurm does not tell the job this lead: if you change @300, export TRAINER_SIGNAL_LEAD_S.
set -euo pipefail

die() {
    echo "slurm/ddp.sh: error: $*" >&2
    exit 2
}

[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job; submit it with: sbatch [\$(slurm/fit.sh PARTITION)] slurm/ddp.sh [-c CONFIG] [key=value ...]"
cd "$SLURM_SUBMIT_DIR"

# --- The restart contract (trainer/exit_codes.py, docs/restarts.md) -----------------------
# Each node runs `python -m trainer.cli.torchrun`, which exits with its workers' verdict: 0 done,
# 1 crash, 2 usage error, 75 preempted (saved), 76 node fault, 77 no progress. srun cannot pass
# those on: with --kill-on-bad-exit the other nodes' tasks are terminated, and srun exits with
# the highest code of all, 143 (a TERM) above a node's 76. So each node's relay writes its own
# code to this job's folder on the shared submit directory, and slurm/requeue.py reads the
# verdict there and requeues what may be retried: the one implementation of both, shared with
# slurm/submit.py, that runs on this host's python3 (the package may be in an image, not here).
# It lies beside this script. sbatch runs a copy of the script, from slurmd's spool folder: the
# path it was submitted as is the job's Command (none for a script given on stdin).
state=$SLURM_SUBMIT_DIR/.trainer-workspace/slurm/$SLURM_JOB_ID
submitted=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o ' Command=/[^ ]*' | cut -d= -f2- || true)
requeue_py=${submitted:+${submitted%/*}/requeue.py}
[[ -f $requeue_py ]] || requeue_py=$SLURM_SUBMIT_DIR/slurm/requeue.py
[[ -f $requeue_py ]] || die "slurm/requeue.py is not beside ${submitted:-this script} nor in $SLURM_SUBMIT_DIR/slurm: keep the two together"
# Where the ranks name the node they suspect on a node fault (76): the requeue excludes it.
export TRAINER_NODE_FAULTS=${TRAINER_NODE_FAULTS:-$state/node-faults}
# The Kubernetes dialect (every retryable verdict as 138) would hide 75 and 76 from this script.
unset TRAINER_RETRYABLE_EXIT_CODE
# The check step below reads the data before any node starts torchrun (TRAINER_CHECK=no-data:
# all but the data, for data that exists only where the ranks run; 0: no check step). The
# nodes' torchrun must not check again: this script's step did.
check_setting=${TRAINER_CHECK:-1}
case $check_setting in 1|no-data|0) ;; *) die "TRAINER_CHECK=$check_setting is not one of: 1, no-data, 0" ;; esac
unset TRAINER_CHECK

# Grace. TRAINER_GRACE_S: the seconds from the time-limit signal to the limit (--signal's lead).
# But the relays TERM torchrun at once, and torchrun SIGKILLs its workers
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (30 by default, whatever the lead): keep it a
# little below the lead, so that the workers have the time to save and this script the time
# to requeue before the limit. `python -m trainer doctor` checks the checkpoint's save time
# against the shorter of the two.
lead=${TRAINER_SIGNAL_LEAD_S:-300}
[[ $lead =~ ^[1-9][0-9]*$ ]] || die "TRAINER_SIGNAL_LEAD_S=$lead is not a positive number of seconds"
export TRAINER_GRACE_S=${TRAINER_GRACE_S:-$lead}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$(( lead - (lead / 4 < 30 ? lead / 4 : 30) ))}

# --- Where the code runs: a container image, a venv, or whatever is on PATH -------------
# TRAINER_CONTAINER_IMAGE runs every step in the image built from our Dockerfile.
#   pyxis/enroot (the default runtime):  srun --container-image=IMAGE ...
#   Apptainer (TRAINER_CONTAINER_RUNTIME=apptainer, IMAGE a .sif or docker://...):
#                                        apptainer exec --nv --no-home --cleanenv IMAGE ...
# Either way the submit directory is mounted at the same path and is the working directory,
# so configs, data and runs on the shared filesystem are where they are outside.
srun_flags=()    # extra srun options (pyxis)
exec_prefix=()   # a command that wraps each process (Apptainer)
# What the job needs from the host environment, and all a clean container gets (Apptainer
# --cleanenv) or gets over the image's own values (pyxis --container-env); TRAINER_CONTAINER_ENV
# adds names (comma-separated). SLURM_* differ on each node, so they are read on each node.
passed_env='SLURM_*|SLURMD_NODENAME|TRAINER_*|PET_RDZV_ID|NCCL_*|GLOO_*|TORCH_*|TORCHELASTIC_*|PYTORCH_*|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS|PYTHONSAFEPATH|PYTHONNOUSERSITE|WANDB_API_KEY|WANDB_MODE|WANDB_PROJECT|WANDB_ENTITY|HF_TOKEN|FI_*|UCX_*'
if [[ -n ${TRAINER_CONTAINER_ENV:-} ]]; then
    [[ $TRAINER_CONTAINER_ENV =~ ^[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*$ ]] \
        || die "TRAINER_CONTAINER_ENV=$TRAINER_CONTAINER_ENV is not a comma-separated list of variable names"
    passed_env+="|${TRAINER_CONTAINER_ENV//,/|}"
fi
if [[ -n ${TRAINER_CONTAINER_IMAGE:-} ]]; then
    image=$TRAINER_CONTAINER_IMAGE
    # A file (a squashfs made once by `enroot import`, a .sif): pyxis takes a value that starts
    # with "/" or "." for a file, anything else for a registry image, so make it absolute.
    if [[ -f $image ]]; then
        image=$(realpath "$image")
    elif [[ $image == *.sqsh || $image == *.squashfs || $image == *.sif ]]; then
        die "TRAINER_CONTAINER_IMAGE=$image: no such file"
    fi
    # The image keeps its caches and runs under /workspace (HF_HOME, WANDB_*, TRITON_CACHE_DIR, ...,
    # runs/). An image is read-only (a SIF always), so /workspace is a folder of the submit
    # directory, on the shared filesystem, created here by the submitting user.
    workspace=${TRAINER_WORKSPACE:-$SLURM_SUBMIT_DIR/.trainer-workspace}
    mkdir -p "$workspace/cache" "$workspace/runs" "$workspace/wandb" \
        || die "TRAINER_WORKSPACE=$workspace cannot be created"
    mounts="${TRAINER_CONTAINER_MOUNTS:-$SLURM_SUBMIT_DIR},$workspace:/workspace"
    # The image has the package installed; a `trainer/` folder in the submit directory
    # (a repository clone) must not shadow it, which `python -m` would otherwise do, and
    # neither may the user's ~/.local site-packages.
    export PYTHONSAFEPATH=1 PYTHONNOUSERSITE=1
    case ${TRAINER_CONTAINER_RUNTIME:-pyxis} in
        pyxis)
            # --container-name: the check step and the training step share one container per
            # node, imported once; pyxis removes it when the job ends (a requeue included).
            # --container-env: the image's ENV would otherwise win over these host values.
            # What it names must be set: the variables this script exports, and yours.
            container_env=OMP_NUM_THREADS,PYTHONSAFEPATH,PYTHONNOUSERSITE,TORCH_ELASTIC_SHUTDOWN_TIMEOUT,TRAINER_GRACE_S,TRAINER_NODE_FAULTS
            [[ -z ${TRAINER_CONTAINER_ENV:-} ]] || container_env+=,$TRAINER_CONTAINER_ENV
            srun_flags=(--container-image="$image" --container-name="${TRAINER_CONTAINER_NAME:-trainer}"
                        --container-mounts="$mounts" --container-workdir="$SLURM_SUBMIT_DIR"
                        --no-container-mount-home --container-env="$container_env") ;;
        apptainer)
            # --no-home --cleanenv: nothing of $HOME (~/.local, caches, config) and no host
            # variable (PYTHONPATH, LD_LIBRARY_PATH, conda's) reaches the image, except those
            # that match $passed_env, handed over as APPTAINERENV_NAME on each node.
            # --writable-tmpfs: anything else the processes write stays in memory.
            # shellcheck disable=SC2016  # expanded on each node, not here
            to_container='for name in $(compgen -e); do
    [[ $name == @($1) ]] && export "APPTAINERENV_$name=${!name}"
done
shift; exec "$@"'
            exec_prefix=(bash -O extglob -c "$to_container" apptainer-env "$passed_env"
                         apptainer exec --nv --no-home --cleanenv --writable-tmpfs --bind "$mounts"
                         --pwd "$SLURM_SUBMIT_DIR" "$image") ;;
        *) die "TRAINER_CONTAINER_RUNTIME=${TRAINER_CONTAINER_RUNTIME} is not one of: pyxis, apptainer" ;;
    esac
elif [[ -n ${TRAINER_VENV:-} || -d .venv ]]; then
    venv=${TRAINER_VENV:-.venv}
    [[ -x $venv/bin/python ]] || die "TRAINER_VENV: no python in $venv/bin (create it with: make install)"
    venv_bin=$(cd "$venv/bin" && pwd)  # absolute: PATH is searched from other folders too
    export PATH="$venv_bin:$PATH"
    # The venv has the package installed (make install): as in an image, the submit directory,
    # the working directory, must not shadow it or any other package with a file of its own
    # (a `torch.py`, a `datasets/` folder), which `python -m` would otherwise import first.
    export PYTHONSAFEPATH=1
fi
if [[ -z ${TRAINER_CONTAINER_IMAGE:-} ]]; then
    command -v python >/dev/null || die "python not found: set TRAINER_VENV, TRAINER_CONTAINER_IMAGE, or load an environment that has the package"
fi
command -v python3 >/dev/null || die "python3 not found on $(uname -n): slurm/requeue.py, the job's verdict and requeue, runs on it (3.8 or later)"
python3 "$requeue_py" check || exit  # TRAINER_MAX_FAULT_REQUEUES, now rather than at the job's end

# --- The job's layout ---------------------------------------------------------------------
# One process per GPU asked for (--gpus-per-node, as TYPE:COUNT or COUNT: an --exclusive job is
# given all of the node's GPUs, but the processes are what you asked for), else per allocated
# GPU; with --gpus-per-node=0 (CPUs, even on a node that has GPUs) or on CPU partitions (no
# GPUs), TRAINER_NPROC_PER_NODE, else 1.
gpus_asked=${SLURM_GPUS_PER_NODE:-}
gpus_asked=${gpus_asked##*:}
case $gpus_asked in
    0) processes=1 ;;
    '') processes=${SLURM_GPUS_ON_NODE:-1} ;;
    *) processes=$gpus_asked ;;
esac
nproc_per_node=${TRAINER_NPROC_PER_NODE:-$processes}
[[ $nproc_per_node =~ ^[1-9][0-9]*$ ]] || die "TRAINER_NPROC_PER_NODE=$nproc_per_node is not a positive integer"
nnodes=$SLURM_JOB_NUM_NODES
# The CPUs each node's task gets: --cpus-per-task if you gave one, else every CPU the job
# got on its smallest node (SLURM_JOB_CPUS_PER_NODE: "64(x2),32"). srun is told explicitly:
# a step's task gets one CPU by default (and Slurm 22.05 to 23.02 don't pass on the job's
# --cpus-per-task), so torchrun, every rank and their loader workers would share it.
cpus=${SLURM_CPUS_PER_TASK:-$(tr ',' '\n' <<<"${SLURM_JOB_CPUS_PER_NODE:-1}" | sed 's/(.*//' | sort -n | head -n 1)}
[[ $cpus =~ ^[1-9][0-9]*$ ]] || die "cannot tell the job's CPUs per node from SLURM_JOB_CPUS_PER_NODE=${SLURM_JOB_CPUS_PER_NODE:-}"
# The task's CPUs split between its processes. Without this, every rank starts a thread per
# core of the node and they all thrash.
threads=$(( cpus / nproc_per_node ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# Rendezvous on the allocation's first node. Never a localhost fallback: a node that can't
# find the real one would form a world of its own and wait forever for the others.
rdzv_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
[[ -n $rdzv_host ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no node"
# Derived from the job id, so two jobs whose first node is the same don't collide. Below
# 32768, the start of Linux's ephemeral range, so no outgoing connection holds it already.
rdzv_port=${TRAINER_RDZV_PORT:-$(( 20000 + SLURM_JOB_ID % 12000 ))}
# The rendezvous id: a secret of this attempt of the job, never the job id that squeue shows
# every user. torchrun's store has no authentication, and its agent unpickles the rendezvous
# state kept under this id, so whoever knows it can run code on every node (slurm/README.md,
# "What the rendezvous store protects"). Made here, at each start of the batch script: every
# node's torchrun is started by the one srun below and gets it from the job's environment,
# as PET_RDZV_ID (torchrun's --rdzv-id), never on a command line, which `ps` shows to anyone
# on the node. A requeue runs this script again, for all the nodes: a new id, that they share.
PET_RDZV_ID=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
[[ ${#PET_RDZV_ID} == 32 ]] || die "cannot read 16 random bytes from /dev/urandom for the rendezvous id"
export PET_RDZV_ID

# --- What runs --------------------------------------------------------------------------
# `slurm/ddp.sh score ARGS` (slurm/score.sh's line): every node's torchrun runs `python -m trainer
# score` instead of `train`. The rest is the same: the check step, the relay, the verdict and the
# requeue. A scoring worker saves nothing on TERM: it stops at once and loses at most the chunk
# it was scoring (docs/scoring.md), so a requeue just goes on with the corpus.
command=train
if [[ ${1:-} == score ]]; then
    command=score
    shift
fi
# TRAINER_OUTPUT_DIR comes before your arguments: an explicit output_dir=... still wins.
args=("$@")
[[ -n ${TRAINER_OUTPUT_DIR:-} ]] && args=("output_dir=$TRAINER_OUTPUT_DIR" "${args[@]}")

# trainer.cli.torchrun: torchrun itself, whose exit code is the workers' verdict (torchrun's own
# is 1 whatever happened).
torchrun_cmd=(
    python -m trainer.cli.torchrun --nnodes="$nnodes" --nproc-per-node="$nproc_per_node"
    --rdzv-backend=trainer-c10d --rdzv-endpoint="$rdzv_host:$rdzv_port"
    --rdzv-conf=join_timeout="${TRAINER_JOIN_TIMEOUT:-600}" --max-restarts="${TRAINER_MAX_RESTARTS:-0}"
    -m trainer "$command" "${args[@]}"
)
# Each node's task checks that the rendezvous host resolves there (torchrun's c10d
# would retry an unknown name for minutes), then runs torchrun under a small relay for the
# time-limit signal. torchrun and everything it starts ignore USR1 (an ignored signal stays
# ignored across fork and exec); the relay turns USR1 into a TERM to torchrun alone, which
# passes it to its workers. `scancel --signal=TERM` would reach every process of the step
# instead, wandb's service among them, which exits on TERM before the run's last records.
# The relay records torchrun's exit code for the verdict. It ignores TERM (after starting
# torchrun, which keeps its own): Slurm's TERM (scancel, preemption, --kill-on-bad-exit) reaches
# every process of the step, torchrun included, and the relay waits for it to save and exit,
# records its 143, and only then ends the task. KillWait's SIGKILL ends all of them regardless.
# shellcheck disable=SC2016  # expanded on each node, not here
node_task='
record() { echo "$1" > "$state/exit.$(uname -n)"; exit "$1"; }
host=$0 state=$1
shift
getent hosts "$host" >/dev/null || { echo "slurm/ddp.sh: error: $(uname -n) cannot resolve the first node $host" >&2; record 2; }
trap "" USR1
"$@" &
child=$!
trap "kill -TERM $child" USR1
trap "" TERM
while :; do wait "$child"; status=$?; kill -0 "$child" 2>/dev/null || record "$status"; done'
# --kill-on-bad-exit: one node's torchrun failing ends the step on every node at once,
# instead of leaving the others blocked in a collective until their timeout.
launch=(srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="$cpus" "${srun_flags[@]}"
        "${exec_prefix[@]}" bash -c "$node_task" "$rdzv_host" "$state" "${torchrun_cmd[@]}")
# A bad config or key, a missing data column, split or label, fails here, in seconds, with one
# line, before any node starts torchrun. Run where training runs (the venv or the image): it
# reads the data as training will, and logs the resolved config, the labels and the memory plan.
check_args=("${args[@]}" "world_size=$(( nnodes * nproc_per_node ))")
[[ $check_setting != no-data ]] || check_args+=(--no-data)
# Scoring reads the corpus (score.input), which `check` reads with or without --no-data, and not
# the training data, which need not be there; nor does training's batch split matter.
[[ $command != score ]] || check_args=("${args[@]}" --no-data)
if [[ $check_setting == 0 ]]; then
    check=(true)
elif [[ ${#srun_flags[@]} -gt 0 ]]; then  # pyxis: in a one-task step, in the job's container
    check=(srun --nodes=1 --ntasks=1 --quiet "${srun_flags[@]}" python -m trainer check "${check_args[@]}")
else
    check=("${exec_prefix[@]}" python -m trainer check "${check_args[@]}")
fi

echo "slurm/ddp.sh: $command job $SLURM_JOB_ID${SLURM_ARRAY_TASK_ID:+ (array task ${SLURM_ARRAY_JOB_ID:-}_$SLURM_ARRAY_TASK_ID)} (attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 ))): $nnodes node(s) $SLURM_JOB_NODELIST" \
     "x $nproc_per_node process(es), rendezvous $rdzv_host:$rdzv_port"
echo "slurm/ddp.sh: $cpus CPU(s) a node, OMP_NUM_THREADS=$OMP_NUM_THREADS; after the time-limit signal, the" \
     "ranks have ${TORCH_ELASTIC_SHUTDOWN_TIMEOUT}s to save (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; TRAINER_GRACE_S=$TRAINER_GRACE_S)"
if [[ -n ${TRAINER_DRY_RUN:-} ]]; then  # print what would run, for checking a setup
    printf 'slurm/ddp.sh: would check:'; printf ' %q' "${check[@]}"; echo
    printf 'slurm/ddp.sh: would run:'; printf ' %q' "${launch[@]}"; echo
    exit 0
fi

mkdir -p "$state" || die "cannot create $state: the submit directory must be writable"
rm -f "$state"/exit.*
"${check[@]}" || { status=$?; rm -rf "$state"; exit "$status"; }

# --- Run it, and turn signals into checkpoints ---------------------------------------------
# The training processes' own handler (fault.preempt_signals, default SIGTERM) only sets a
# flag; all ranks agree on it at the next step boundary, save one checkpoint and exit. This
# script therefore must not exit early: srun runs in the background so that `wait` returns
# to the traps, and the loop goes back to waiting until the step has finished saving.
time_limit=0
saving="every rank saves at its next step" saved="the checkpoint"
[[ $command != score ]] || saving="every worker stops, losing at most its chunk" saved="the workers to stop"
on_time_limit() {
    trap '' USR1
    echo "slurm/ddp.sh: time limit near (SIGUSR1): $saving, then the job requeues"
    time_limit=1
    scancel --signal=USR1 "$SLURM_JOB_ID"  # to every node's relay (the steps, not this script)
}
on_term() {
    # scancel, or preemption: Slurm has already sent TERM to the training processes. Wait
    # for their checkpoint (until KillWait runs out); requeueing is Slurm's decision here.
    echo "slurm/ddp.sh: SIGTERM: waiting for $saved before exiting"
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

# The job's verdict and what follows (slurm/requeue.py): the most severe code a node's torchrun
# recorded (srun's own if none did); 2 and 77 never requeued; 76 requeued without the nodes the
# ranks named, within TRAINER_MAX_FAULT_REQUEUES; after the time-limit signal, the rest
# requeued. It exits with the job's code. A time-limit signal has nothing left to stop now:
# ignored (which lasts across exec), it cannot kill python3 halfway through a requeue.
trap '' USR1
ending=(end --state "$state" --srun-status "$status")
if [[ $time_limit == 1 ]]; then ending+=(--time-limit); fi
exec python3 "$requeue_py" "${ending[@]}"
