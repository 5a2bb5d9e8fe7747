"""Multi-node jobs on one machine: one real torchrun per host, rendezvous at node0.

Hosts are network namespaces (tests/netns.py) named node0, node1, ...; each runs
`torchrun --nnodes=N --rdzv-backend=trainer-c10d --rdzv-endpoint=node0:PORT` exactly
as a cluster node would. The output folder is shared, as a cluster's shared filesystem is.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from conftest import BASE_ENV, REPO, TORCHRUN
from netns import Network

RDZV_PORT = 29400
# As the Dockerfile and slurm/ddp.sh set it (see README, "Elastic restarts"): a fresh worker
# store per rendezvous round, so restarted workers never read their predecessors' addresses.
LAUNCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_argv(nnodes: int, nproc: int, overrides: list[str], torchrun_args: tuple[str, ...] = (),
                  run_id: str = "test", command: str = "train") -> list[str]:
    return [
        TORCHRUN, f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=trainer-c10d", f"--rdzv-endpoint=node0:{RDZV_PORT}", f"--rdzv-id={run_id}",
        *torchrun_args, "-m", "trainer", command, *overrides,
    ]


def launch(net: Network, logs: Path, overrides: list[str], nproc: int = 1, torchrun_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None, hosts: list[str] | None = None, run_id: str = "test",
           command: str = "train", binds: dict[str, dict[str, Path]] | None = None) -> dict[str, subprocess.Popen]:
    """Start `python -m trainer COMMAND` under torchrun on `hosts` (default: all), with
    per-host bind mounts `binds[host]`; logs in `logs/<host>.log`."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for host in hosts or list(net.aliases):
        argv = torchrun_argv(len(net.aliases), nproc, overrides, torchrun_args, run_id, command)
        procs[host] = net.spawn(host, argv, {**BASE_ENV, **LAUNCH_ENV, **(env or {})}, REPO,
                                binds=(binds or {}).get(host), log=logs / f"{host}.log")
    return procs


def wait_for(predicate, timeout: float, what: str, procs: dict[str, subprocess.Popen] | None = None) -> None:
    """Poll until `predicate()`; fail early if one of `procs` has already exited."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if procs and any(p.poll() is not None for p in procs.values()):
            raise AssertionError(f"a node exited while waiting for {what}: "
                                 f"{ {h: p.returncode for h, p in procs.items()} }")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def complete_steps(output_dir: Path) -> list[int]:
    """Steps of the checkpoints with a completion marker, oldest first."""
    return sorted(int(p.parent.name[5:]) for p in (output_dir / "checkpoints").glob("step-*/COMPLETE"))


def summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())
