"""`StartupClock`: launch to first optimizer step, phase by phase, from the processes' start
times in /proc. `Prefetch`: imports a rank needs later, done while it waits for its peers."""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class StartupClock:
    """Launch to first optimizer step, phase by phase: where a job's first seconds go.

    Each mark names the phase that ends there. The launch is the launcher's start when
    under torchrun (its agent's own start-up is the "launcher" phase), else this process's.
    """

    def __init__(self) -> None:
        started = _process_start(os.getpid())
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is the parent
            self.marks = [("launch", _process_start(os.getppid())), ("launcher", started)]
        else:
            self.marks = [("launch", started)]

    @property
    def launched(self) -> float | None:
        """When this attempt was launched (Unix time): the launch, or in workers that torchrun
        restarted (its agent started long before), their own start."""
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        return self.marks[1 if restarted and len(self.marks) > 1 else 0][1]

    def mark(self, phase: str) -> float:
        """End `phase` now; returns now as Unix time."""
        now = time.time()
        self.marks.append((phase, now))
        return now

    def phases(self) -> dict[str, float]:
        """Seconds per phase; phases whose start is unknown are left out."""
        return {
            phase: end - start
            for (_, start), (phase, end) in itertools.pairwise(self.marks)
            if start is not None and end is not None
        }


class Prefetch:
    """Imports a rank will need later, one module a call: work for the time it would spend
    waiting at a barrier for its peers (distributed.meanwhile). A module imported there is not
    imported again when the code that needs it runs, so the rank gets there sooner; the
    modules must be ones the run imports anyway, or the wait buys nothing."""

    def __init__(self, modules: Iterable[str]) -> None:
        self.pending = deque(modules)

    def __call__(self) -> bool:
        """Import the next module not imported yet; False when none is left, or one failed
        (its error is left to the import that needs it, where it says what needed it)."""
        while self.pending:
            name = self.pending.popleft()
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 (not ours to report: the import that needs it will)
                log.debug("prefetching %s: %s", name, e)
                self.pending.clear()
                return False
            return True
        return False


def _process_start(pid: int) -> float | None:
    """A process's start as Unix time, to the kernel's 10 ms tick, or None off Linux.

    Not psutil's create_time(): it adds the start tick to /proc/stat's boot time, which is
    whole seconds, so a phase measured from it is off by up to a second. The age of the
    process on the boot clock, subtracted from now, has no such rounding.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
    except (OSError, ValueError, IndexError):
        return None
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age
