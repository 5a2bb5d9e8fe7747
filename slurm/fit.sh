#!/bin/bash
# The sbatch options that fit slurm/ddp.sh to a partition: the GPUs of its smallest node, and a
# --time within its MaxTime. slurm/ddp.sh's #SBATCH defaults (8 GPUs a node, 24 hours) fit a
# typical GPU partition, but a --time above the partition's MaxTime is queued and left pending
# for ever (Reason=PartitionTimeLimit), and a node with fewer GPUs refuses the job at submit.
# CPUs and memory need no sizing: the job takes whole nodes (--exclusive --mem=0).
#
#   sbatch $(slurm/fit.sh [PARTITION [TIME]]) slurm/ddp.sh -c CONFIG   # default: the default
#   sbatch --test-only $(slurm/fit.sh gpu 2-00:00:00) slurm/ddp.sh     #   partition, ddp.sh's --time
#
# TIME in any of sbatch's forms (MINUTES, HH:MM:SS, D-HH:MM, ...). Without one, ddp.sh's default
# is cut to the partition's MaxTime (with a note); a TIME above MaxTime is an error: the job
# could never start.
set -euo pipefail

die() {
    echo "slurm/fit.sh: error: $*" >&2
    exit 2
}

# Seconds in a Slurm time: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS,
# DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS; "infinite"/"UNLIMITED" as -1.
seconds() {
    local time=$1 days=0 a b c
    case ${time,,} in infinite|unlimited) echo -1; return ;; esac
    [[ $time =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$ ]] || return 1
    if [[ $time == *-* ]]; then
        days=${time%%-*}
        IFS=: read -r a b c <<<"${time#*-}"
        echo $(( 10#$days * 86400 + 10#$a * 3600 + 10#${b:-0} * 60 + 10#${c:-0} ))
        return
    fi
    IFS=: read -r a b c <<<"$time"
    if [[ -n $c ]]; then echo $(( 10#$a * 3600 + 10#$b * 60 + 10#$c ))
    else echo $(( 10#$a * 60 + 10#${b:-0} ))
    fi
}

partition=${1:-$(sinfo -h -o %P | sed -n 's/\*$//p' | head -n 1)}
[[ -n $partition ]] || die "no default partition; name one"
gres=$(sinfo -h -N -p "$partition" -o "%G")
[[ -n $gres ]] || die "partition $partition has no nodes"
# The node with the fewest GPUs decides: the job must fit whichever nodes it gets. A node's
# GRES reads "gpu:8(S:0-1)" or "gpu:a100:8,..." or "(null)".
gpus=$(awk '{ n = 0; if (match($0, /gpu:[^(,]*/)) { k = split(substr($0, RSTART, RLENGTH), f, ":"); n = f[k] } print n }' \
       <<<"$gres" | sort -n | head -n 1)

default_time=$(sed -n 's/^#SBATCH --time=//p' "$(dirname "$0")/ddp.sh" | head -n 1)
time=${2:-$default_time}
wanted=$(seconds "$time") || die "time $time is not a Slurm time (MINUTES, HH:MM:SS, D-HH:MM:SS, ...)"
max_time=$(sinfo -h -p "$partition" -o %l | head -n 1)
allowed=$(seconds "$max_time") || die "partition $partition: cannot read its MaxTime ($max_time)"
if (( allowed >= 0 && (wanted < 0 || wanted > allowed) )); then
    [[ -z ${2:-} ]] || die "--time=$time is above partition $partition's MaxTime $max_time: the job would pend for ever"
    echo "slurm/fit.sh: partition $partition allows at most $max_time; asking for that instead of ddp.sh's $time" >&2
    time=$max_time
fi
echo "--partition=$partition --gpus-per-node=${gpus:-0} --time=$time"
