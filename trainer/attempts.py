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
import os
import socket
import time
from pathlib import Path

from trainer.errors import NoProgress
from trainer.exit_codes import Exit

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
    """The attempts, oldest first: each start's record, with its end's merged in."""
    path = output_dir / FILE
    if not path.exists():
        return []
    history: list[dict] = []
    for line in path.read_text().splitlines():
        # A line cut short by a kill or a full disk mid-write is the only damage an append can
        # leave: skipped, as the end it would have recorded (the attempt then counts as failed).
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
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


def begin(output_dir: Path, step: int, fresh: bool) -> None:
    """Rank 0, once the attempt has restored its state from checkpoint `step` and starts
    training: record it. `fresh` forgets the attempts of the runs before."""
    if fresh:
        (output_dir / FILE).unlink(missing_ok=True)
    _append(output_dir, {"resumed_from": step, "started": time.time(), "host": socket.gethostname()})


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
