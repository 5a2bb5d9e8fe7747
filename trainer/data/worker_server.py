"""The train loader's workers' server: a forkserver, so that no worker is a fork of its rank."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

from trainer.config.schema import Config

WORKER_SERVER_PRELOAD = ["trainer.data.worker_server_setup", "trainer.data.loaders", "datasets"]
"""The server's set-up (trainer/data/worker_server_setup.py), then what a worker unpickles its loader
with: imported once by the server, each worker, its fork, starts with it imported."""


def start_worker_server(cfg: Config) -> None:
    """Start the server that the train loader's workers are forked from (data.num_workers > 0).

    A worker is never a fork of its rank. By the first step each rank runs threads that Python
    does not see: gloo's connection loops (NCCL's on GPUs), torch's pools. A lock one of them
    holds at the fork instant stays held in the child for good, and a worker that needs it
    never delivers its first batch: its rank waits in the loader, its peers in the first
    all-reduce, and only the 30-minute init timeout ends it. multiprocessing's forkserver
    (Python 3.14's default) is a fresh program, exec'd, that only forks: it holds none of the
    rank's locks, and none of its sockets either, so a SIGKILLed rank's peers see its
    connections close at once.

    The preemption signals (fault.preempt_signals) stay blocked in the server and its workers,
    and in multiprocessing's resource tracker (which ignores SIGTERM itself): launchers signal
    whole process groups (torchrun) or every process of a job step (Slurm), and a server that
    died would take the workers with it, failing the rank ("DataLoader worker exited
    unexpectedly") before it saves. A signal mask is inherited through fork and exec alike,
    from the instant the server starts, where a handler would be set only once it has
    imported; the workers still exit with their rank (init_worker).

    Idempotent. Call it early (run_train does): the server imports WORKER_SERVER_PRELOAD
    (~2 s of CPU) while the rank loads its data and model.
    """
    if cfg.data.num_workers == 0:
        return
    from multiprocessing import forkserver, resource_tracker

    multiprocessing.get_context("forkserver").set_forkserver_preload(WORKER_SERVER_PRELOAD)
    preemption = {getattr(signal, name) for name in cfg.fault.preempt_signals}
    # The tracker first, on its own: starting, it unblocks SIGTERM in this process again.
    for helper in (resource_tracker, forkserver):
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, preemption)
        try:  # a signal sent meanwhile still reaches this rank: blocked, not ignored
            helper.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def init_worker(worker_id: int) -> None:
    """A worker ends the moment its rank does, SIGKILL and the OOM killer included. torch's own
    check watches the worker's parent, which is the server, not the rank; and the server
    outlives its rank while any worker lives (each worker holds a copy of the pipe whose
    closing tells the server to exit), so the two would wait on each other forever, holding
    the job's output open. The pipe this worker was started through closes when the rank dies,
    whatever killed it: a thread waits for that."""
    rank = multiprocessing.parent_process()
    if rank is None:
        raise RuntimeError("a loader worker is a multiprocessing child of its rank")
    threading.Thread(target=_exit_when_closed, args=(rank.sentinel,), name="exit-with-rank", daemon=True).start()


def _exit_when_closed(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(0)  # now, even mid-batch: the batch has no reader left
