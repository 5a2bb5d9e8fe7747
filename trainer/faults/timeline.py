"""Where every attempt's time went: output_dir/timeline.jsonl.

Rank 0 appends one line per step try (its start and end, and whether it trained) and one per
phase between steps (eval, save, rollback, the end of the run's), as it happens, and never
rewrites the file: after a restart the steps redone from the checkpoint are in it twice, and a
SIGKILL loses at most the line being written. attempts.jsonl (trainer/faults/attempts.py) says
when each attempt was launched, what it resumed from and how it ended; `python -m trainer
report` (trainer/outputs/report.py) adds the two up into goodput.

A line costs one small write per step, to a file kept open (line-buffered).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from trainer import files
from trainer.runtime.environment import DistEnv

FILE = "timeline.jsonl"


class Timeline:
    def __init__(self, output_dir: Path, dist_env: DistEnv):
        self.path = output_dir / FILE
        self.enabled = dist_env.is_rank_zero
        self._file: TextIO | None = None

    def begin(self, fresh: bool) -> None:
        """Rank 0, as training starts (after attempts.begin): `fresh` (checkpoint.resume=never)
        forgets the runs before."""
        if not self.enabled:
            return
        if fresh:
            self.path.unlink(missing_ok=True)
        self._file = self.path.open("a", buffering=1)

    def step(self, step: int, started: float, taken: bool, ended: float | None = None) -> None:
        """A try of `step`, from `started` (time.time()) to `ended` (None: now)."""
        self._write({"step": step, "t0": started, "t1": time.time() if ended is None else ended,
                     **({} if taken else {"taken": False})})

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """A phase between steps (a key of watchdog.PHASES), recorded once it has ended."""
        started = time.time()
        yield
        self._write({"phase": name, "step": step, "t0": started, "t1": time.time()})

    def rollback(self, failing: int, to: int) -> None:
        """The steps after `to` done so far are undone: `failing` failed too often."""
        self._write({"rollback": to, "from": failing, "t1": time.time()})

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read(output_dir: Path) -> list[dict]:
    """The timeline's records, oldest first."""
    return files.read_jsonl(output_dir / FILE)
