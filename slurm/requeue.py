"""The end of a Slurm job under the restart contract: its verdict, and its requeue.

    python3 slurm/requeue.py check                                   # ddp.sh, in its first seconds
    python3 slurm/requeue.py end --state DIR --srun-status N [--time-limit]   # ddp.sh, at its end

The one implementation for both Slurm launchers. slurm/ddp.sh runs it as a script on the
batch host, where only a python3 is sure to be (the trainer package may be in a container
image, not there); slurm/submit.py imports it. So it uses the standard library alone, keeps
to Python 3.8, and carries its own copy of trainer/exit_codes.py's verdicts, which
tests/unit/test_slurm_requeue.py holds equal to the package's.

A node fault (76) requeues the job without the nodes the ranks named in $TRAINER_NODE_FAULTS,
within a budget of such requeues, and only if the job's partition keeps enough nodes: a job
excluded from too many would pend for ever.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# --- The verdicts: trainer/exit_codes.py's table, which this file cannot import -------------
DONE, CRASH, USAGE, PREEMPTED, NODE_FAULT, NO_PROGRESS = 0, 1, 2, 75, 76, 77
SEVERITY = (USAGE, NO_PROGRESS, NODE_FAULT, CRASH, PREEMPTED, DONE)
"""When nodes disagree, the one that tells the launcher most comes first."""
TERMINATED = 128 + signal.SIGTERM
"""143, a torchrun stopped by TERM: it forwarded the TERM, and its ranks saved (PREEMPTED)."""
NODE_FAULTS_ENV = "TRAINER_NODE_FAULTS"
"""The file the ranks append the hostnames they suspect to, one per line, on a node fault."""


def of(code: int) -> int:
    """A node's exit code as a verdict, as trainer.exit_codes.of: 143 is PREEMPTED, a code not
    in the contract a crash."""
    if code == TERMINATED:
        return PREEMPTED
    return code if code in SEVERITY else CRASH


def worst(codes) -> int:
    """The verdict of the job: the most severe of its nodes' (DONE for none)."""
    verdicts = {of(code) for code in codes}
    return next((verdict for verdict in SEVERITY if verdict in verdicts), DONE)


# --- Slurm --------------------------------------------------------------------------------
class SlurmError(Exception):
    """A Slurm command that failed, in one line: the command and what it said."""


def _slurm(*argv: str) -> str:
    """The output of a Slurm client (scontrol, sinfo)."""
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout
    except subprocess.CalledProcessError as e:
        said = (e.stderr or "").strip().splitlines()
        raise SlurmError(f"{' '.join(argv)}: {said[-1] if said else f'exit code {e.returncode}'}") from e
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{' '.join(argv)}: {e}") from e


def requeue(job_id: str) -> None:
    """`scontrol requeue`. Slurm then TERMs every process of the job, this one and the scontrol
    it runs next included: ignore TERM from here on, so that what follows the requeue is done
    (an ignored signal stays ignored in the commands started after)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _slurm("scontrol", "requeue", job_id)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def requeue_without_suspects(job_id: str, state: Path, budget: int, budget_setting: str, prefix: str = "") -> bool:
    """Requeue the job after a node fault without the nodes the ranks named: within `budget`
    such requeues, and only if the partition keeps enough nodes for the job. False if it did
    not (it says why). `budget_setting` names the budget and `prefix` starts each line, as the
    launcher spells them.

    The budget: `state` holds one record per attempt (SLURM_RESTART_COUNT) that asked for a
    node-fault requeue, created exclusively: of several callers in one attempt (submitit's
    ranks) the first decides and the others return True, finding it done; the requeues used
    are the earlier attempts' records. The suspects file is deleted once read: the next
    attempt's ranks start a new one, and an absent file names no node."""
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    try:
        os.close(os.open(state / f"fault-requeue.{attempt}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return True
    used = len(list(state.glob("fault-requeue.*"))) - 1
    if used >= budget:
        _say(f"{prefix}node fault (76) after {used} requeue(s) for node faults ({budget_setting}={budget}): "
             "not requeueing")
        return False
    faults = Path(os.environ[NODE_FAULTS_ENV])  # both launchers set it
    # Hostnames, as the ranks saw them: Slurm's node names are the short ones.
    suspects = {line.split(".")[0] for line in faults.read_text().split()} if faults.exists() else set()
    try:
        shown = dict(field.split("=", 1) for field in _slurm("scontrol", "show", "job", "-o", job_id).split()
                     if "=" in field)
        excluded = set(suspects)
        if shown.get("ExcNodeList", "(null)") != "(null)":
            excluded |= set(_slurm("scontrol", "show", "hostnames", shown["ExcNodeList"]).split())
        partition, nodes = shown["Partition"], int(shown["NumNodes"])
        left = len(set(_slurm("sinfo", "-h", "-N", "-p", partition, "-o", "%N").split()) - excluded)
    except SlurmError as e:
        _say(f"{prefix}node fault (76): not requeueing: {e}")
        return False
    if left < nodes:
        _say(f"{prefix}node fault (76): without {','.join(sorted(excluded))}, partition {partition} has "
             f"{left} node(s) for a job of {nodes}: not requeueing")
        return False
    _say(f"{prefix}node fault (76): requeueing job {job_id} without {','.join(sorted(suspects)) or '(no node named)'}")
    faults.unlink(missing_ok=True)
    # Requeue first, then exclude: Slurm refuses a running job's ExcNodeList, and the requeued
    # job cannot start again before this job's processes have ended.
    try:
        requeue(job_id)
    except SlurmError as e:
        _say(f"{prefix}node fault (76): not requeued: {e}")
        return False
    if excluded:
        try:  # requeued whatever follows: a refused exclusion must not fail the job (nor reset the budget)
            _slurm("scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(sorted(excluded))}")
        except SlurmError as e:
            _say(f"{prefix}warning: requeued, but Slurm refused ExcNodeList={','.join(sorted(excluded))}: {e}")
    return True


# --- slurm/ddp.sh's end -------------------------------------------------------------------
DDP_SH = "slurm/ddp.sh: "
BUDGET_ENV = "TRAINER_MAX_FAULT_REQUEUES"
DEFAULT_BUDGET = "3"


def _budget() -> int | None:
    value = os.environ.get(BUDGET_ENV, DEFAULT_BUDGET)
    return int(value) if value.isdecimal() else None


def recorded_codes(state: Path) -> list[int]:
    """The codes the nodes' relays recorded (exit.NODE); what is not a number counts as a crash."""
    words = [word for path in sorted(state.glob("exit.*")) for word in path.read_text().split()]
    return [int(word) if word.lstrip("-").isdecimal() else CRASH for word in words]


def end(state: Path, srun_status: int, time_limit: bool) -> int:
    """ddp.sh's verdict and what follows it: the code the batch script exits with."""
    job_id = os.environ["SLURM_JOB_ID"]
    verdict = worst(recorded_codes(state) or [srun_status])
    if verdict in (USAGE, NO_PROGRESS):  # the same job would fail the same way, even after the time-limit signal
        _say(f"{DDP_SH}exit {verdict}: not requeueing")
    elif verdict == NODE_FAULT:
        if requeue_without_suspects(job_id, state, _budget(), BUDGET_ENV, DDP_SH):
            return 0  # the job's folder stays: it holds the budget
    elif time_limit and srun_status != 0:
        # The ranks saved and exited. Requeued, the job keeps its id, so it finds the same
        # output_dir, resumes from that checkpoint and continues the same wandb run.
        _say(f"{DDP_SH}checkpoint saved; requeueing job {job_id}")
        try:
            requeue(job_id)
            return 0
        except SlurmError as e:
            _say(f"{DDP_SH}not requeued: {e}")
    # Otherwise not requeued: 0 done; 1 a crash, whose budget is torchrun's own --max-restarts
    # (TRAINER_MAX_RESTARTS), as a requeue would most often meet the same bug; 75 without the
    # time-limit signal: scancel (stays cancelled) or a preemption (Slurm requeues it itself,
    # as the same job: its folder stays, with its node-fault budget).
    if verdict != PREEMPTED:
        shutil.rmtree(state, ignore_errors=True)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slurm/requeue.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", help=f"check ddp.sh's settings ({BUDGET_ENV})")
    ending = commands.add_parser("end", help="the job's verdict, a requeue; exits with the job's code")
    ending.add_argument("--state", type=Path, required=True, help="the job's folder, where the nodes record codes")
    ending.add_argument("--srun-status", type=int, required=True, help="srun's exit code, if no node recorded one")
    ending.add_argument("--time-limit", action="store_true", help="the time-limit signal came")
    args = parser.parse_args(argv)
    if _budget() is None:
        _say(f"{DDP_SH}error: {BUDGET_ENV}={os.environ[BUDGET_ENV]} is not a number of requeues (0 or more)")
        return USAGE
    if args.command == "end":
        return end(args.state, args.srun_status, args.time_limit)
    return DONE


if __name__ == "__main__":
    sys.exit(main())
