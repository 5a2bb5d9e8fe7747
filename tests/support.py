"""What tests of every tier do alike: read a run's outputs, wait against a deadline, end a
process group, serve files over loopback HTTP. Plain functions, no fixtures (those are
conftest.py's)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil


def read_summary(output_dir: Path) -> dict:
    """The run's summary.json: what rank 0 writes once the run has ended."""
    return json.loads((Path(output_dir) / "summary.json").read_text())


def read_metrics(output_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one record per line, in the order written."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def model_card(folder: Path):
    """huggingface_hub's reading of the model card in `folder` (final/, final/adapter/)."""
    from huggingface_hub import ModelCard

    return ModelCard.load(Path(folder) / "README.md")


def complete_steps(output_dir: Path) -> list[int]:
    """Steps of the checkpoints with a completion marker, oldest first."""
    return sorted(int(p.parent.name[5:]) for p in (output_dir / "checkpoints").glob("step-*/COMPLETE"))


def wait_for(predicate, timeout: float, what, procs: dict[str, subprocess.Popen] | None = None,
             interval: float = 0.2):
    """Poll until `predicate()` returns something truthy, and return it. Fails at `timeout`
    saying `what` it waited for (a string, or a callable that describes the state then), and
    fails early if one of `procs` has already exited."""
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        if procs and any(p.poll() is not None for p in procs.values()):
            raise AssertionError(f"a process exited while waiting for {_text(what)}: "
                                 f"{ {name: p.returncode for name, p in procs.items()} }")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {_text(what)}")
        time.sleep(interval)
    return found


def _text(what) -> str:
    return what() if callable(what) else what


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """The exit codes of `procs` in order, all waited for against one deadline `timeout`
    seconds from now; None for each still running then (left running)."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def signals_in(pid: int, *masks: str) -> set[int]:
    """The signals set in any of the /proc/PID/status `masks` (SigBlk: blocked; SigPnd and
    ShdPnd: pending for the thread, for the process)."""
    status = Path(f"/proc/{pid}/status").read_text()
    bits = 0
    for mask in masks:
        bits |= int(re.search(rf"^{mask}:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
    return {signum for signum in signal.valid_signals() if bits >> (signum - 1) & 1}


def killpg(pgid: int) -> None:
    """SIGKILL the process group `pgid` (a process started with start_new_session=True has
    its pid as its group's), if anything of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process group and every descendant: torchrun starts each worker in a
    session of its own, and a hung worker would hold the output pipe open forever."""
    descendants = []
    if proc.poll() is None:  # once it is reaped, its pid may be another process's
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants = psutil.Process(proc.pid).children(recursive=True)
    killpg(proc.pid)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


CSV = "text,label\n" + "".join(f"review {i},{i % 3}\n" for i in range(30))


@contextmanager
def web(files: dict[str, bytes | Callable[[BaseHTTPRequestHandler], None]], cut_short: str | None = None,
        asked: list[str] | None = None):
    """An HTTP server on loopback serving `files` by name (a callable answers the request
    itself); 404 for others, 503 for `/busy`, and `cut_short` sent with a Content-Length it
    never fills, as a dropped connection ends. The paths asked for are appended to `asked`."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            if asked is not None:
                asked.append(self.path)
            if callable(files.get(name)):
                files[name](self)  # type: ignore[operator]
                return
            if name == "busy":
                self.send_error(503)
                return
            if name not in files:
                self.send_error(404)
                return
            body = files[name]
            assert isinstance(body, bytes)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body) * (10 if name == cut_short else 1)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
