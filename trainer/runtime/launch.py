"""This trainer's torchrun command line, stated once for the tests and the benchmarks.

Each real launcher states it once in its own language: the Makefile, the Dockerfile's CMD,
docker-compose.yml's `x-node`, slurm/ddp.sh, the Kubernetes manifests. Everything written in
Python builds it here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

TORCHRUN = (sys.executable, "-m", "trainer.cli.torchrun")
"""torchrun with the restart contract's exit codes (trainer/cli/torchrun.py), in this Python
environment (not whichever is first on PATH)."""


def trainer_program(command: str = "train", config: str | None = None, overrides: Sequence[str] = ()) -> list[str]:
    """`-m trainer COMMAND [-c CONFIG] key=value ...`"""
    return ["-m", "trainer", command, *(["-c", config] if config else []), *overrides]


def torchrun_argv(nproc: int, program: list[str], *, nnodes: int | str = 1, rdzv_endpoint: str | None = None,
                  rdzv_id: str = "trainer", torchrun_args: tuple[str, ...] = (),
                  torchrun: Sequence[str] = TORCHRUN) -> list[str]:
    """`torchrun ... PROGRAM` (a `trainer_program`, or a script and its arguments): one node
    on its own (--standalone), or one of `nnodes` nodes (a count, or elastic `MIN:MAX`)
    meeting through the trainer-c10d rendezvous at `rdzv_endpoint` (host:port)."""
    if rdzv_endpoint is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={nnodes}", "--rdzv-backend=trainer-c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                      f"--rdzv-id={rdzv_id}"]
    return [*torchrun, *rendezvous, f"--nproc-per-node={nproc}", *torchrun_args, *program]
