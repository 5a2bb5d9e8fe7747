"""`python -m trainer` and `python -m trainer.cli.torchrun` without their seconds of imports.

On this suite's 2-core machine most of the CPU a short training run takes is the interpreter's
start and its imports: 3-4 s for torch, transformers and datasets, in every process. Here one
server process imports them once, then forks a child per run. The child takes the run's module,
arguments, environment and working directory, runs the module's __main__ as `python -m` does,
and exits with its status; what it writes to stdout and stderr is the run's output. So each run
is still a process of its own, in a session of its own, with its own exit status, and nothing
it does reaches the next run; only the interpreter's start and the imports are shared. The
server only imports: it computes nothing, so it has no thread pool to fork (its one other
thread is jemalloc's, from pyarrow, whose fork handlers keep a child's allocator sound).

runs.launch runs here the usage errors, the one process that 2 ranks must equal, and
torchrun itself (trainer.cli.torchrun: the launcher's own code, forked). torchrun's workers are
forked too, from its agent (`_fork_ranks`): started fresh, each imported for 5-6 s of CPU, and
test_two_ranks_match_one_process took 47 s of CPU, against 22 s with forked workers (the e2e
tier, alone on 2 cores: 158 tests in 933 s). Torchrun's own code still starts, polls, signals
and reaps each worker, a child in a session of its own, exactly as it does a Popen's. A sweep's
one-rank runs are forked by the product itself (sweep.preload, trainer/sweep/preload.py).
Workers start as fresh interpreters, as a user's do, in the tests that start torchrun
themselves (tests/e2e/test_no_hang.py's, a frozen FSDP rank's), and in the whole system tier
(Slurm, the nodes in network namespaces, the image). A run that sets what is read at start or
import gets a fresh interpreter instead, and so do its workers.

Server protocol (JSON lines): a request {module, args, env, cwd, output} on stdin; the reply
{"pid"} as soon as the child exists, then {"returncode"} when it has ended. A server serves
one run at a time: runs at once (runs.together) take a server each.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

PRELOAD = ["torch", "datasets", "transformers", "transformers.modeling_utils", "transformers.models.bert.modeling_bert",
           "transformers.optimization", "transformers.tokenization_utils_tokenizers", "torch.profiler",
           "trainer.cli.main", "trainer.cli.run_config", "trainer.runtime.distributed", "trainer.train.build",
           "trainer.train.loop", "trainer.train.evaluation", "trainer.exit_codes",
           "trainer.strategies.registry", "trainer.tasks", "trainer.strategies.compression",
           "trainer.runtime.lease", "trainer.preflight.data_check", "trainer.preflight.memory",
           "trainer.faults.watchdog", "torch.distributed.run"]
"""What `python -m trainer` and `python -m trainer.cli.torchrun` import, the first time they use it
too (transformers.optimization, for the LR schedule, takes 0.6 s: it imports peft), and the
tiny test models' modeling code. Not trainer.cli.torchrun, which its children run as __main__:
each runs its own afresh, and runpy warns about a module it finds imported already."""

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
FORKED_RANKS_ENV = "TESTS_FORKED_RANKS"
"""Set to 1 in a `python -m trainer.cli.torchrun` run's environment: its workers are forked (`_fork_ranks`)."""
_PRISTINE_SIGNALS: dict[int, Any] = {}
"""Every signal's disposition in the server, as a fresh interpreter has it."""


def _note_pristine_signals() -> None:
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(signum) is not None:
            _PRISTINE_SIGNALS[signum] = signal.getsignal(signum)


def _restore_pristine_signals() -> None:
    """In a fork about to become another program: the dispositions a fresh interpreter has
    (its parent's handlers would raise in the parent's loop), and an empty signal mask."""
    for signum, disposition in _PRISTINE_SIGNALS.items():
        signal.signal(signum, disposition)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _preload() -> None:
    """Import PRELOAD (once: again, each is a lookup)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    transformers = sys.modules["transformers"]
    for name in ("AutoConfig", "AutoModelForSequenceClassification", "AutoTokenizer"):
        getattr(transformers, name)  # resolved lazily, on first use: the imports that take the time


def run_once(module: str, args: list[str]) -> None:
    """`python preloaded.py --run trainer.cli.torchrun ARGS`: no server, this process becomes the
    launcher, and forks its workers (`_fork_ranks`, as the environment asks).
    For a launcher that must be a process of its own making, in a place a server cannot reach:
    a node in a network namespace (support/multinode.py) starts it there. It imports when it
    starts its first worker (a launcher that never gets that far, its rendezvous failed, never
    does), for as long as a fresh worker would; each worker it starts, and restarts, then
    saves them."""
    _note_pristine_signals()
    sys.path[0] = os.getcwd()  # where `python -m` looks first
    code = 1
    try:
        code = _become(module, args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    _note_pristine_signals()
    _preload()

    # What a run leaves behind when it exits (a rank's loader worker; torchrun's workers each
    # have a session of their own) is reparented to this server, not to init: the run has
    # ended when the last of them has, as runs.run waits for the last holder of its pipe.
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()  # nothing buffered may be written twice, by the child too
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(ChildProcessError):
            while True:
                os.waitpid(-1, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict) -> None:
    """Become `python -m trainer ARGS`: never returns."""
    code = 1
    try:
        os.setsid()  # its own session, like runs.run's: a kill reaches whatever it starts
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # where `python -m` looks first (this file's folder, here)
        code = _become(request["module"], request["args"])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _become(module: str, args: list[str]) -> int:
    """Run `python -m MODULE ARGS` in this process, to its exit status: torchrun's
    workers forked from it (`_fork_ranks`), where the environment asks for forks."""
    if (os.environ.get(FORKED_RANKS_ENV) == "1" and module == "trainer.cli.torchrun"
            and os.environ.get("TRAINER_CHECK", "") in ("", "0")):
        _fork_ranks()  # not with trainer/cli/torchrun.py's check, which computes in the agent
    return _run_module(module, args)


def _run_module(module: str, args: list[str]) -> int:
    """`python -m MODULE ARGS` in this process, to its exit status."""
    code = 1
    sys.argv = [module, *args]  # run_module sets argv[0] to the module's file
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # the interpreter's rules for sys.exit's argument
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (any failure is the run's output, as python -m would print it)
        traceback.print_exc()
    # What the interpreter does before it exits, which os._exit skips: wait for non-daemon
    # threads (a checkpoint writer), then run the atexit hooks (wandb's teardown).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


def _fork_ranks() -> None:
    """torchrun's workers, `python -u -m trainer ...`, forked from this process (a fork of the
    server, which imported everything) instead of exec'd: the same program with the same
    arguments and environment, in a session of its own as torchrun starts it, a child of
    torchrun that torchrun polls, signals and reaps as it would a Popen's.

    Safe to fork because torchrun's agent computes nothing (no thread pool exists yet) and its
    other threads (the rendezvous keep-alive, the store's) hold nothing the rank takes: the
    rank makes its own store client and process group. What a fresh interpreter would not
    have is put back: the server's signal dispositions (torchrun's handlers raise in its
    agent loop) and an empty signal mask. The agent's open files stay open in the worker, as
    across any fork: closing them under the objects that own them could close a number the
    worker has reused. A worker is exec'd as usual if it is not `-m trainer` or the agent has
    added an exit hook, which the worker would run as its own."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler_class = subprocess_handler.SubprocessHandler
    exec_popen = handler_class._popen
    exit_hooks = atexit._ncallbacks()  # type: ignore[attr-defined]

    def popen(handler, args: tuple, env: dict[str, str]):
        hooks_added = atexit._ncallbacks() != exit_hooks  # type: ignore[attr-defined]
        if list(args[:4]) != [sys.executable, "-u", "-m", "trainer"] or hooks_added:
            return exec_popen(handler, args, env)
        _preload()  # done already, but in `run_once`'s launcher
        sys.stdout.flush()
        sys.stderr.flush()
        started, ready = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(started)
                os.setsid()
                _restore_pristine_signals()
                os.close(ready)  # as Popen returns after the exec: torchrun may signal its group now
                for stream, fd in ((handler._stdout, 1), (handler._stderr, 2)):
                    if stream is not None:
                        os.dup2(stream.fileno(), fd)
                os.environ.clear()
                os.environ.update(env)
                code = _run_module("trainer", [str(arg) for arg in args[4:]])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(ready)
        os.read(started, 1)  # "": the child closed its end, or died
        os.close(started)
        return _ForkedRank(pid)

    handler_class._popen = popen


class _ForkedRank:
    """The part of a Popen that torchrun's SubprocessContext uses, for a forked child."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


class Server:
    """The client: `run(module, args, env, cwd, timeout)`, one run at a time."""

    def __init__(self, python: str, env: dict[str, str], cwd: Path):
        self.env = env
        self.proc = subprocess.Popen([python, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=cwd, start_new_session=True)
        self._buffer = b""
        self.outputs = Path(tempfile.mkdtemp(prefix="preloaded-"))
        self._runs = 0

    def run(self, module: str, args: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> tuple[int, str, bool]:
        """(exit status, output, whether it was killed for running past `timeout`)."""
        self._runs += 1
        output = self.outputs / f"run-{self._runs}.txt"
        request = {"module": module, "args": args, "env": {**self.env, **env}, "cwd": str(cwd),
                   "output": str(output)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid, timed_out = None, False
        try:
            # The first reply waits for the server's imports, once: the cost every run would pay.
            pid = self._reply(600)["pid"]
            reply = self._reply(timeout)
        except TimeoutError:
            if pid is None:
                raise
            timed_out = True
            self._kill_run(pid)
            reply = self._reply(60)
        except BaseException:  # pytest interrupted (a CI timeout): nothing of the run may outlive it
            self._kill_run(pid)
            raise
        text = output.read_text(errors="replace")
        output.unlink()
        return reply["returncode"], text, timed_out

    def _kill_run(self, pid: int | None) -> None:
        """SIGKILL the run and everything it started: the server's only children are the run's
        process and what it left (torchrun's workers are in sessions of their own). Again
        until none is left, since one may start another while the first are killed."""
        for _ in range(10):
            try:
                processes = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                break
            if not processes:
                break
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(processes, timeout=5)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if select.select([self.proc.stdout], [], [], left)[0]:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"the preloaded trainer server exited ({self.proc.wait()})")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still waiting for a run of an interrupted session
            self._kill_run(self.proc.pid)
            self.proc.wait()
        for leftover in self.outputs.iterdir():
            leftover.unlink()
        self.outputs.rmdir()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        run_once(sys.argv[2], sys.argv[3:])
    serve()
