#!/bin/bash
# The sbatch options that fit slurm/ddp.sh to a partition: every CPU and GPU of its smallest
# node. slurm/ddp.sh's #SBATCH defaults (32 CPUs, 8 GPUs per node) fit a typical GPU node,
# but Slurm queues a request that fits no node of the partition and leaves it pending
# forever (Reason=PartitionConfig); `sbatch --test-only` says so at once.
#
#   sbatch $(slurm/fit.sh [PARTITION]) slurm/ddp.sh -c CONFIG     # default: the default partition
#   sbatch --test-only $(slurm/fit.sh gpu) slurm/ddp.sh           # check without submitting
set -euo pipefail

partition=${1:-$(sinfo -h -o %P | sed -n 's/\*$//p' | head -n 1)}
[[ -n $partition ]] || { echo "slurm/fit.sh: error: no default partition; name one" >&2; exit 2; }
nodes=$(sinfo -h -N -p "$partition" -o "%c %G")
[[ -n $nodes ]] || { echo "slurm/fit.sh: error: partition $partition has no nodes" >&2; exit 2; }
# The smallest node decides: the job must fit whichever nodes it gets.
read -r cpus gres < <(sort -n <<<"$nodes" | head -n 1)
gpus=$(grep -o 'gpu:[^(,]*' <<<"$gres" | head -n 1 | awk -F: '{print $NF}' || true)
echo "--partition=$partition --cpus-per-task=$cpus --gpus-per-node=${gpus:-0}"
