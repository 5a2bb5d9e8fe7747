"""slurm/requeue.py on a bare python, as slurm/ddp.sh runs it on a batch host: no site-packages,
no trainer package. Its verdicts and requeues, in process: tests/unit/test_slurm_requeue.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "requeue.py"


def test_the_script_runs_on_a_bare_python_without_the_package(tmp_path):
    """ddp.sh runs it with the batch host's python3: no site-packages (-S), no trainer."""
    (tmp_path / "exit.node1").write_text("77\n")
    done = subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), "end", "--state", str(tmp_path),
                           "--srun-status", "77"], capture_output=True, text=True, cwd=tmp_path,
                          env={"SLURM_JOB_ID": "7", "PATH": os.environ["PATH"]}, timeout=60)
    assert (done.returncode, done.stderr) == (77, "slurm/ddp.sh: exit 77: not requeueing\n")
