"""Progress across restarts: a job that keeps failing from the same checkpoint stops retrying.

Every scheduler retries a failed job under a budget (Slurm's requeue, a PyTorchJob's
backoffLimit, torchrun's --max-restarts), and none knows whether a retry got anywhere: a
bug at step 1201, or a node that corrupts every run that lands on it, burns the whole budget
and the allocation with it. Each attempt that starts training records the checkpoint step it
resumed from in output_dir/attempts.jsonl, and how it ended when it can. When the last
`fault.max_stalled_restarts` attempts all resumed from this same step and none of them was
stopped on purpose (preempted, exit 75), the job exits with Exit.NO_PROGRESS, which every
launcher takes as "do not retry" (docs/restarts.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from trainer import files
from trainer.errors import NoProgress
from trainer.exit_codes import Exit
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

log = logging.getLogger(__name__)

FILE = "attempts.jsonl"


def stalled(history: list[dict], step: int) -> int:
    """How many attempts at the end of `history` resumed from `step` and failed (neither
    preempted nor done)."""
    count = 0
    for attempt in reversed(history):
        if attempt["resumed_from"] != step or attempt.get("exit") in (Exit.PREEMPTED, Exit.DONE):
            break
        count += 1
    return count


def read(output_dir: Path) -> list[dict]:
    """The attempts, oldest first: each start's record, with its end's merged in. A line cut
    short (files.read_jsonl) leaves an attempt without its end: it then counts as failed."""
    history: list[dict] = []
    for record in files.read_jsonl(output_dir / FILE):
        if "resumed_from" in record:
            history.append(record)
        elif history:
            history[-1].update(record)
    return history


def check(output_dir: Path, step: int, max_stalled: int, fresh: bool) -> None:
    """Rank 0, before an attempt from checkpoint `step` (0: from scratch) loads anything:
    refuse when the last `max_stalled` attempts failed from this same step (0: never refuse).
    Reads only: a start refused for another reason leaves output_dir as it was. `fresh`
    (checkpoint.resume=never) starts a new history."""
    failed = 0 if fresh else stalled(read(output_dir), step)
    if max_stalled and failed >= max_stalled:
        which = "the last attempt" if failed == 1 else f"the last {failed} attempts all"
        raise NoProgress(
            f"{which} resumed from step {step} and failed; not retrying "
            f"(fault.max_stalled_restarts={max_stalled}). The job's log says why; {output_dir / FILE} "
            "lists them. Relaunch after a fix: an attempt that gets past this step counts afresh")


def begin(output_dir: Path, step: int, fresh: bool, launched: float | None = None) -> None:
    """Rank 0, once the attempt has restored its state from checkpoint `step` and starts
    training: record it, and when it was `launched` (its launcher's start, Unix time).
    `fresh` forgets the attempts of the runs before."""
    if fresh:
        (output_dir / FILE).unlink(missing_ok=True)
    _append(output_dir, {"resumed_from": step, "launched": launched, "started": time.time(),
                         "host": socket.gethostname()})


def end(output_dir: Path, exit_code: int) -> None:
    """Rank 0, as a begun attempt ends with `exit_code`: a kill leaves no record, and counts as failed."""
    _append(output_dir, {"exit": exit_code, "ended": time.time()})


def _append(output_dir: Path, record: dict) -> None:
    line = json.dumps(record).encode() + b"\n"
    with (output_dir / FILE).open("ab+") as f:
        size = f.seek(0, os.SEEK_END)
        if size and (f.seek(size - 1), f.read(1))[1] != b"\n":
            line = b"\n" + line  # after a line cut short, a line of its own
        f.write(line)


class Attempt:
    """This attempt in output_dir's history, as rank 0 keeps it: refused before anything loads
    if the attempts before it stalled (`check`), recorded once training starts (`begin`),
    and its end recorded on every way out (`end`). A start refused for a mistake (exit 2)
    writes nothing."""

    def __init__(self, output_dir: Path, dist_env: DistEnv, max_stalled: int, fresh: bool):
        self.output_dir, self.dist_env, self.max_stalled = output_dir, dist_env, max_stalled
        self.fresh = fresh
        """checkpoint.resume=never: the attempts of the runs before don't count."""
        self.begun = False

    def check(self, step: int) -> None:
        """Collective: exit 77 (NoProgress) on every rank when the job keeps failing from `step`."""
        distributed.rank_zero_does(self.dist_env, f"output_dir: {self.output_dir / FILE}",
                                   lambda: check(self.output_dir, step, self.max_stalled, self.fresh))

    def begin(self, step: int, launched: float | None) -> None:
        """Collective: training starts from checkpoint `step` (0: from scratch); the job was
        `launched` then (Unix time)."""
        distributed.rank_zero_does(self.dist_env, f"output_dir: {self.output_dir / FILE}",
                                   lambda: begin(self.output_dir, step, self.fresh, launched))
        self.begun = True

    def end(self, exit_code: int) -> None:
        """Not collective (peers may be gone): rank 0 records how a begun attempt ended."""
        if not (self.dist_env.is_rank_zero and self.begun):
            return
        try:  # a full disk must not hide the exit code, nor skip the closing after this
            end(self.output_dir, exit_code)
        except OSError as e:
            log.warning("attempt's end not recorded in %s: %s", self.output_dir / FILE, e)
