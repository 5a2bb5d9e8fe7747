"""Multi-node jobs on one machine: one real torchrun per host, rendezvous at node0.

Hosts are network namespaces (tests/support/netns.py) named node0, node1, ...; each runs
`torchrun --nnodes=N --rdzv-backend=trainer-c10d --rdzv-endpoint=node0:PORT` exactly
as a cluster node would. The output folder is shared, as a cluster's shared filesystem is.
Each torchrun is support/preloaded.py's `run_once`, which forks its workers, unless
TESTS_FORKED_RANKS=0 is in the environment: then they start fresh, as a user's do.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from support import preloaded
from support.netns import Network
from support.runs import BASE_ENV, REPO
from trainer.runtime.launch import torchrun_argv, trainer_program

RDZV_PORT = 29400


def launch(net: Network, logs: Path, overrides: list[str], nproc: int = 1, torchrun_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None, hosts: list[str] | None = None, run_id: str = "test",
           command: str = "train", binds: dict[str, dict[str, Path]] | None = None,
           nnodes: str | None = None) -> dict[str, subprocess.Popen]:
    """Start `python -m trainer COMMAND` under torchrun on `hosts` (default: all), with
    per-host bind mounts `binds[host]`; logs in `logs/<host>.log`. `nnodes`: elastic
    `MIN:MAX`; default, every host of `net`."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**BASE_ENV, **(env or {})}
    procs = {}
    for host in hosts or list(net.aliases):
        argv = torchrun_argv(nproc, trainer_program(command, overrides=overrides), nnodes=nnodes or len(net.aliases),
                             rdzv_endpoint=f"node0:{RDZV_PORT}", rdzv_id=run_id, torchrun_args=torchrun_args)
        if env.get(preloaded.FORKED_RANKS_ENV, "1") == "1":
            # The launcher imports what its workers would, once; each worker, and each one it
            # restarts, is then forked from it instead of importing for 5-10 s of CPU.
            argv = [argv[0], preloaded.__file__, "--run", *argv[2:]]
            env[preloaded.FORKED_RANKS_ENV] = "1"
        procs[host] = net.spawn(host, argv, env, REPO, binds=(binds or {}).get(host), log=logs / f"{host}.log")
    return procs


def frozen(net: Network, host: str) -> int:
    """How many processes on `host` are stopped (SIGSTOP): what the freeze hook leaves."""
    def state(pid: str) -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return ""
    return sum(state(pid) == "T" for pid in net.pids(host))
