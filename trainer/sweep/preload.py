"""A sweep's one-rank runs forked from a process that has imported the training stack once
(sweep.preload), instead of each starting an interpreter and importing torch, transformers
and datasets again: seconds of every run's start-up (benchmarks/RESULTS.md).

`Preloaded` is the sweep's end. With the first run, it starts `python -m
trainer.sweep.preload`, the zygote: a fresh interpreter that imports PRELOAD and then only
forks, one child per run, each of which becomes `python -m trainer ...` with the run's
arguments, environment and log file. The sweep signals, polls and waits for each run as it
would a Popen's (`Run`); the zygote reaps them and reports their exit statuses.

What a forked run shares with the zygote is what a fresh interpreter would have built the
same way: imported modules. Nothing else is left over:
- CUDA: the zygote never touches it (importing the stack does not: a run forked on a GPU
  trains there, tests/e2e/test_cuda.py), so each run initialises its own, with its own
  CUDA_VISIBLE_DEVICES; the zygote refuses a run rather than fork after CUDA initialised.
- Threads: the zygote starts none; a fork copies only the thread that forks.
- Signals: each run gets the dispositions and the mask the zygote started with.
- Random state: Python's and numpy's global generators are seeded afresh, as at a fresh
  import; torch's is as torch left it at import (the zygote draws nothing), and the trainer
  seeds all three from `seed`, as in any run.
- Environment: the run's own. What a library reads from it at import (HF_HOME, say) was read
  by the zygote, so a run whose environment differs from the zygote's in anything but
  CUDA_VISIBLE_DEVICES is refused, and the sweep starts it fresh instead.

A run of more than one rank is torchrun's, whose workers start fresh: it is launched as
before. `atexit` hooks and non-daemon threads end as in any interpreter: the forked child
returns to this module's top level and exits from there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO

log = logging.getLogger(__name__)

PRELOAD = ("torch", "datasets", "transformers", "transformers.modeling_utils", "transformers.optimization",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.tokenization_utils_tokenizers", "torch.profiler", "trainer.cli.main",
           "trainer.cli.run_config", "trainer.runtime.distributed", "trainer.train.build", "trainer.train.loop",
           "trainer.train.evaluation", "trainer.strategies.registry", "trainer.tasks", "trainer.runtime.lease",
           "trainer.preflight.data_check", "trainer.preflight.memory", "trainer.faults.watchdog")
"""What `python -m trainer train` imports that takes its seconds (torch, transformers and its
model-loading code, datasets, the trainer's own modules). A module it needs and this list
lacks is imported by the run itself, as it would be in a fresh interpreter."""

MODULES = ("trainer",)
"""What a sweep forks: `python -m trainer ...` (train, and evaluate for a fold)."""

MAY_DIFFER = frozenset({"CUDA_VISIBLE_DEVICES"})
"""What a run's environment may change from the zygote's: read when CUDA initialises, in the run."""

HELD_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                          signal.SIGUSR2})
"""Blocked in the zygote. A scheduler that signals the sweep's whole process group must not end
the zygote while its runs save: their exit statuses reach the sweep through it. Each run
unblocks them, and any that came to it meanwhile is delivered then."""

REAP_S = 0.05
"""How often the zygote looks for runs that ended while some are alive."""


def forkable(argv: list[str]) -> bool:
    """Whether the sweep forks `argv`: `python -m trainer ...`, not torchrun."""
    return argv[:2] == [sys.executable, "-m"] and len(argv) > 2 and argv[2] in MODULES


class Refused(Exception):
    """The zygote will not fork this run; it is to be started fresh."""


class Run:
    """The part of a Popen the sweep uses (poll, wait, send_signal, pid, returncode), for a run
    the zygote forked: not the sweep's child, so its status is the one the zygote reports."""

    def __init__(self, zygote: Preloaded, pid: int):
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.ended(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.ended(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"run {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not reported reaped: the pid is still the run's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


class Preloaded:
    """The sweep's end of the zygote: `start` forks a run in it (starting the zygote first, the
    first time), or raises Refused."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._asking = threading.Lock()  # one request at a time: its reply is the next one
        self._reply: dict | None = None
        self._started: list[int] = []
        self._ended: dict[int, int] = {}
        self._gone = False
        self._changed = threading.Condition()

    def start(self, argv: list[str], env: dict[str, str], out: IO) -> Run:
        """`argv` (`python -m MODULE ...`) forked, writing to `out`, in the environment `env`."""
        if argv[:2] != [sys.executable, "-m"] or len(argv) < 3:
            raise Refused("not a `python -m MODULE` command of this interpreter")
        with self._asking:
            if self._socket is None:
                self._socket = self._zygote()
            try:
                socket.send_fds(self._socket, [json.dumps({"argv": argv, "env": env}).encode()], [out.fileno()])
            except OSError as e:
                raise Refused(f"the zygote is gone ({e})") from e
            with self._changed:
                self._changed.wait_for(lambda: self._reply is not None or self._gone)
                reply, self._reply = self._reply, None
                if reply is None:
                    raise Refused("the zygote is gone")
        if "refused" in reply:
            raise Refused(reply["refused"])
        return Run(self, reply["pid"])

    def _zygote(self) -> socket.socket:
        """Start the zygote: the first run waits for its imports, as a fresh one would for its own."""
        sweep_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its own interpreter, not a fork of the sweep: no lock of the sweep's threads, no
        # handler or logging of the sweep's, is left in it. Its environment is os.environ,
        # which runs are given, not the C library's: a library may have set more there.
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(zygote_end.fileno())],
                                        pass_fds=[zygote_end.fileno()], stdin=subprocess.DEVNULL, env=dict(os.environ))
        zygote_end.close()
        threading.Thread(target=self._read, args=(sweep_end,), name="preload-replies", daemon=True).start()
        return sweep_end

    def ended(self, pid: int, timeout: float | None) -> int | None:
        """Run `pid`'s exit status once it has ended (None if not within `timeout` s)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended, timeout)
            return self._ended.get(pid)

    def close(self) -> None:
        """No more runs: the zygote exits once the last has ended (waited for here if it has)."""
        if self._socket is None or self.process is None:
            return
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_WR)
        with self._changed:
            running = not self._gone and bool(self._running())
        if not running:
            self.process.wait()

    def _running(self) -> set[int]:
        return set(self._started) - set(self._ended)

    def _read(self, sock: socket.socket) -> None:
        """The zygote's messages: replies to requests, and runs that ended. Should it die, its
        runs' statuses are lost with it: they are killed, and reported as killed."""
        while True:
            try:
                message = sock.recv(1 << 16)
            except OSError:
                message = b""
            with self._changed:
                if not message:
                    self._gone = True
                    orphans = self._running()
                    if orphans:
                        log.error("sweep.preload: the zygote died: its runs %s are killed", sorted(orphans))
                    for pid in orphans:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        self._ended[pid] = -signal.SIGKILL
                    self._changed.notify_all()
                    return
                reply = json.loads(message)
                if "ended" in reply:
                    self._ended[reply["ended"]] = reply["returncode"]
                else:
                    if "pid" in reply:
                        self._started.append(reply["pid"])
                    self._reply = reply
                self._changed.notify_all()


@contextlib.contextmanager
def zygote(wanted: bool) -> Iterator[Preloaded | None]:
    """A zygote for the sweep's runs while the sweep runs them, where `wanted` (sweep.preload)."""
    if not wanted:
        yield None
        return
    preloaded = Preloaded()
    try:
        yield preloaded
    finally:
        preloaded.close()


# The zygote: `python -m trainer.sweep.preload FD`.

def _serve(sock: socket.socket, environment: dict[str, str], mask: set[int]) -> tuple[dict, int] | None:
    """Fork a run for each request, reporting {"pid"} (or {"refused": why}), and {"ended", "returncode"}
    for each run reaped. Returns, in a forked child only, its request and log file descriptor;
    None once the sweep has closed its end and no run is left. Cannot hang: with runs alive,
    each wait lasts at most REAP_S, and a closed socket reads as the end."""
    sweep_alive, alive = True, 0
    while sweep_alive or alive:
        readable = select.select([sock] if sweep_alive else [], [], [], REAP_S if alive else None)[0]
        if readable:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
            if not message:
                sweep_alive = False
                continue
            request = json.loads(message)
            refusal = _refusal(request, environment)
            if refusal:
                os.close(fds[0])
                sock.send(json.dumps({"refused": refusal}).encode())
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                return request, fds[0]
            os.close(fds[0])
            alive += 1
            sock.send(json.dumps({"pid": pid}).encode())
        while alive:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            alive -= 1
            with contextlib.suppress(OSError):  # the sweep is gone: no one is left to tell
                sock.send(json.dumps({"ended": pid, "returncode": os.waitstatus_to_exitcode(status)}).encode())
    return None


def _refusal(request: dict, environment: dict[str, str]) -> str | None:
    """Why the zygote must not fork this run, if it must not."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in the zygote"
    env = request["env"]
    differing = sorted(k for k in (set(env) | set(environment)) - MAY_DIFFER if env.get(k) != environment.get(k))
    if differing:
        return f"its environment differs from the sweep's at its start in {', '.join(differing)}"
    return None


def _become(request: dict, log_fd: int) -> None:
    """This forked child becomes `python -m MODULE ARGS`, writing to the run's log file."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    # Python's `random` seeds itself afresh in a forked child; numpy's global generator does not.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS, as at numpy's import
    module, args = request["argv"][2], request["argv"][3:]
    sys.argv = [module, *args]  # run_module sets argv[0] to the module's file
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(fd: int) -> None:
    import importlib

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    environment = dict(os.environ)  # before the imports, which may set some for themselves
    for name in PRELOAD:
        importlib.import_module(name)
    with socket.socket(fileno=fd) as sock:
        forked = _serve(sock, environment, mask)
    if forked is not None:
        _become(*forked)  # its exit status is the module's, as under `python -m`


if __name__ == "__main__":
    main(int(sys.argv[1]))
