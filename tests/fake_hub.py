"""A Hugging Face Hub on loopback, serving model folders, recording who fetched what, when.

Enough of the Hub's HTTP API for `from_pretrained` (`HF_ENDPOINT=http://127.0.0.1:PORT`): a
file's metadata (HEAD, with the commit and ETag headers huggingface_hub reads), its bytes
(GET), a 404 with the Hub's error code for files a repository does not have, and the model
info endpoint. It listens on 127.0.0.1 only and serves until closed.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path], delay_s: float = 0.0):
        self.repos = repos  # "org/name" -> folder
        self.delay_s = delay_s  # before each file's bytes: a hub over a real network is slow
        self.downloads: Counter[str] = Counter()  # "org/name/file" -> GETs of its bytes
        self.requests: list[tuple[str, float, float]] = []
        """(client session, start, end) of every file request: huggingface_hub names its
        process's session in the User-Agent."""
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _file(self, repo: str, name: str) -> Path | None:
        folder = self.repos.get(repo)
        path = folder / name if folder is not None else None
        return path if path is not None and path.is_file() else None

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send_json(self, payload: dict, status: int = 200) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _resolve(self, with_body: bool) -> None:
                started = time.monotonic()
                try:
                    self._serve_file(with_body)
                finally:
                    session = re.search(r"session_id/(\w+)", self.headers.get("User-Agent", ""))
                    with hub._lock:
                        hub.requests.append((session.group(1) if session else "?", started, time.monotonic()))

            def _serve_file(self, with_body: bool) -> None:
                match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path.split("?")[0])
                if not match:
                    return self._send_json({"error": "not found"}, 404)
                repo, _, name = match.groups()
                path = hub._file(repo, name)
                if path is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if repo in hub.repos else "RepoNotFound")
                    self.send_header("X-Error-Message", f"{name} not found")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if with_body:
                    with hub._lock:
                        hub.downloads[f"{repo}/{name}"] += 1
                    time.sleep(hub.delay_s)
                    self.wfile.write(data)

            def do_HEAD(self) -> None:
                self._resolve(with_body=False)

            def do_GET(self) -> None:
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)(/revision/[^/]+)?", self.path.split("?")[0])
                if match:
                    repo = match.group(1)
                    if repo not in hub.repos:
                        return self._send_json({"error": "Repository not found"}, 404)
                    root = hub.repos[repo]
                    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
                    return self._send_json({"id": repo, "modelId": repo, "sha": COMMIT,
                                            "siblings": [{"rfilename": f} for f in files]})
                self._resolve(with_body=True)

        return Handler

    def sessions(self) -> list[tuple[float, float]]:
        """Each client session's first request start and last request end, in start order."""
        spans: dict[str, list[float]] = {}
        for session, start, end in self.requests:
            if session == "?":  # the API calls name no session
                continue
            first, last = spans.setdefault(session, [start, end])
            spans[session] = [min(first, start), max(last, end)]
        return sorted(tuple(span) for span in spans.values())
