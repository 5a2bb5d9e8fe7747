"""The train loader's worker server (worker_server.start_worker_server) on its own, with a stand-in rank:
a process that starts it and reads batches from a one-worker loader, as training does. The
trainer's runs hold the same in tests/e2e/test_no_hang.py."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

import psutil
from support.processes import signals_in

RANK = """
import sys
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from trainer.data import worker_server

cfg = OmegaConf.create({"data": {"num_workers": 1}, "fault": {"preempt_signals": ["SIGTERM", "SIGUSR1"]}})
worker_server.start_worker_server(cfg)
batches = iter(DataLoader(list(range(100)), batch_size=2, num_workers=1, persistent_workers=True,
                          multiprocessing_context="forkserver", worker_init_fn=worker_server.init_worker))
for _ in sys.stdin:  # a line asks for the next batch
    print(next(batches).tolist(), flush=True)
"""

PREEMPTION = {signal.SIGTERM, signal.SIGUSR1}


def test_the_worker_survives_preemption_signals_and_ends_with_its_rank_even_on_sigkill():
    """A server and a worker that died of a preemption signal would fail the rank before it
    saves; a worker that outlived a SIGKILLed rank would hold the job's output open forever
    (the server, its parent, waits for it)."""
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    helpers: list[psutil.Process] = []
    try:
        def batch() -> str:
            rank.stdin.write("\n")
            rank.stdin.flush()
            return rank.stdout.readline().strip()

        assert batch() == "[0, 1]"
        servers = [child for child in psutil.Process(rank.pid).children()
                   if "multiprocessing.forkserver" in " ".join(child.cmdline())]
        assert len(servers) == 1
        workers = servers[0].children()
        assert [worker.name() for worker in workers] == ["pt_data_worker"]
        helpers += [servers[0], workers[0]]
        assert signals_in(rank.pid, "SigBlk") & PREEMPTION == set()
        for helper in helpers:
            assert signals_in(helper.pid, "SigBlk") & PREEMPTION == PREEMPTION, helper
            for signum in PREEMPTION:
                helper.send_signal(signum)
        assert batch() == "[2, 3]"  # both still there, the worker still delivering

        rank.kill()  # as the OOM killer does: nothing of the rank's runs after it
        _, alive = psutil.wait_procs(helpers, timeout=30)
        assert alive == [], f"outlived their SIGKILLed rank: {alive}"
    finally:
        for process in [psutil.Process(rank.pid), *helpers]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        rank.wait()
