"""A Hugging Face Hub on loopback, serving model folders, recording who fetched what, when.

Enough of the Hub's HTTP API for `from_pretrained` (`HF_ENDPOINT=http://127.0.0.1:PORT`): a
file's metadata (HEAD, with the commit and ETag headers huggingface_hub reads), its bytes
(GET), a 404 with the Hub's error code for files a repository does not have, and the model
info endpoint. A repository has revisions (branches, each with its commit), and may be gated:
without its token, a 401 as the Hub answers. And what huggingface_hub's create_repo,
create_branch and create_commit send, with every file "regular" (inline in the commit, no LFS
or Xet storage): repositories created and committed to in `uploads`, with the write token. It
listens on 127.0.0.1 (or `address`) and serves until closed. `python tests/support/fake_hub.py` serves one
in a process of its own, for clients in other network namespaces (main()).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""main's commit; another branch's is commit(branch)."""


def commit(branch: str) -> str:
    return COMMIT if branch == "main" else hashlib.sha1(branch.encode()).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, Path | dict[str, Path]], delay_s: float = 0.0,
                 tokens: dict[str, str] | None = None, uploads: Path | None = None, write_token: str | None = None,
                 address: tuple[str, int] = ("127.0.0.1", 0)):
        # "org/name" -> folder (main), or branch -> folder
        self.revisions = {repo: {"main": f} if isinstance(f, Path) else f for repo, f in repos.items()}
        self.tokens = tokens or {}
        """"org/name" -> the token a gated repository wants."""
        self.authorizations: set[str] = set()
        """Every Authorization header received."""
        self.uploads, self.write_token = uploads, write_token
        """Where created repositories keep their branches' files; the token writes need."""
        self.created: dict[str, str | None] = {}
        """Repositories created: "org/name" -> their visibility."""
        self.commits: list[tuple[str, str, str]] = []
        """(repository, branch, summary) of each commit."""
        self.delay_s = delay_s  # before each file's bytes: a hub over a real network is slow
        self.downloads: Counter[str] = Counter()  # "org/name/file" (main) or "org/name@branch/file" -> GETs
        self.requests: list[tuple[str, float, float]] = []
        """(client session, start, end) of every file request: huggingface_hub names its
        process's session in the User-Agent."""
        self.clients: set[tuple[str, str | None]] = set()
        """(client address, Authorization header or None) of every file and model-info request."""
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(address, self._handler())
        self.endpoint = f"http://{address[0]}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _branch(self, repo: str, revision: str) -> str | None:
        """The branch a revision (a branch's name, or its commit) names."""
        return next((b for b in self.revisions.get(repo, {}) if revision in (b, commit(b))), None)

    def _file(self, repo: str, branch: str | None, name: str) -> Path | None:
        folder = self.revisions.get(repo, {}).get(branch) if branch else None
        path = folder / name if folder is not None else None
        return path if path is not None and path.is_file() else None

    def _refused(self, repo: str, authorization: str | None) -> bool:
        if authorization:
            with self._lock:
                self.authorizations.add(authorization)
        return repo in self.tokens and authorization != f"Bearer {self.tokens[repo]}"

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

            def _seen(self) -> None:
                with hub._lock:
                    hub.clients.add((self.client_address[0], self.headers.get("Authorization")))

            def _resolve(self, with_body: bool) -> None:
                self._seen()
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
                repo, revision, name = match.groups()
                if hub._refused(repo, self.headers.get("Authorization")):
                    return self._gated(repo)
                branch = hub._branch(repo, revision)
                path = hub._file(repo, branch, name)
                if path is None:
                    return self._not_found("EntryNotFound" if repo in hub.revisions else "RepoNotFound",
                                           f"{name} not found")
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit(branch or "main"))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if with_body:
                    with hub._lock:
                        hub.downloads[f"{repo}/{name}" if branch == "main" else f"{repo}@{branch}/{name}"] += 1
                    time.sleep(hub.delay_s)
                    self.wfile.write(data)

            def _error(self, status: int, code: str, message: str) -> None:
                """An error as the Hub sends it: huggingface_hub tells a missing repository, revision
                or file, and a gated one, apart by X-Error-Code."""
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _not_found(self, code: str, message: str) -> None:
                self._error(404, code, message)

            def _gated(self, repo: str) -> None:
                self._error(401, "GatedRepo", f"Access to model {repo} is restricted.")

            def do_POST(self) -> None:
                path = self.path.split("?")[0]
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if path == "/api/validate-yaml":
                    return self._send_json({"warnings": [], "errors": []})
                authorization = self.headers.get("Authorization")
                if authorization:
                    with hub._lock:
                        hub.authorizations.add(authorization)
                if hub.uploads is None or authorization != f"Bearer {hub.write_token}":
                    return self._send_json({"error": "Invalid credentials in Authorization header"}, 401)
                if path == "/api/repos/create":
                    request = json.loads(body)
                    repo = f"{request['organization']}/{request['name']}"
                    if repo in hub.revisions:
                        return self._send_json({"error": "You already created this model repo"}, 409)
                    (hub.uploads / repo / "main").mkdir(parents=True)
                    hub.revisions[repo] = {"main": hub.uploads / repo / "main"}
                    hub.created[repo] = request.get("visibility")
                    return self._send_json({"url": f"{hub.endpoint}/{repo}"})
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/([^/]+)", path)
                if not match or match.group(1) not in hub.revisions:
                    return self._send_json({"error": "Repository not found"}, 404)
                repo, action, revision = match.groups()
                branches = hub.revisions[repo]
                if action == "branch":
                    if revision in branches:
                        return self._send_json({"error": "Reference already exists"}, 409)
                    branches[revision] = hub.uploads / repo / revision
                    shutil.copytree(branches["main"], branches[revision])
                    return self._send_json({})
                if revision not in branches:
                    return self._send_json({"error": f"Invalid rev id: {revision}"}, 404)
                if action == "preupload":
                    return self._send_json({"files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in json.loads(body)["files"]]})
                header, *operations = (json.loads(line) for line in body.splitlines() if line.strip())
                for operation in operations:  # "file": base64 content, as "regular" files are sent
                    target = branches[revision] / operation["value"]["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(base64.b64decode(operation["value"]["content"]))
                with hub._lock:
                    hub.commits.append((repo, revision, header["value"]["summary"]))
                oid = hashlib.sha1(f"{repo}@{revision}#{len(hub.commits)}".encode()).hexdigest()
                return self._send_json({"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid})

            def do_HEAD(self) -> None:
                self._resolve(with_body=False)

            def _api_root(self, repo: str, revision: str) -> tuple[Path, str] | None:
                """The folder and branch of an API request for `repo` at `revision`, or None
                once the Hub's refusal or not-found is sent."""
                self._seen()
                branch = hub._branch(repo, revision)
                if repo not in hub.revisions or branch is None:
                    known = repo in hub.revisions
                    self._not_found("RevisionNotFound" if known else "RepoNotFound",
                                    "Invalid rev id" if known else "Repository not found")
                    return None
                if hub._refused(repo, self.headers.get("Authorization")):
                    self._gated(repo)
                    return None
                return hub.revisions[repo][branch], branch

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path)
                if tree:  # snapshot_download's (`hf download`) listing of a revision's files
                    found = self._api_root(*tree.groups())
                    if found:
                        root = found[0]
                        self._send_json([{"type": "file", "path": str(p.relative_to(root)), "size": p.stat().st_size,
                                          "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                                         for p in sorted(root.rglob("*")) if p.is_file()])
                    return
                info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(/revision/[^/]+)?", path)
                if info:
                    found = self._api_root(info.group(1), (info.group(2) or "/revision/main").rsplit("/", 1)[1])
                    if found:
                        root, branch = found
                        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
                        self._send_json({"id": info.group(1), "modelId": info.group(1), "sha": commit(branch),
                                         "siblings": [{"rfilename": f} for f in files]})
                    return
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


def main() -> None:
    """Serve a hub until SIGTERM, then write what it saw (clients, downloads) as JSON to --report:
    `python tests/support/fake_hub.py --listen HOST:PORT --repo ORG/NAME[@BRANCH]=FOLDER ... [--token
    ORG/NAME=TOKEN] --report FILE`."""
    import argparse
    import signal

    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--repo", action="append", default=[])
    parser.add_argument("--token", action="append", default=[])
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args()
    repos: dict[str, dict[str, Path]] = {}
    for item in args.repo:
        name, folder = item.split("=", 1)
        repo, _, branch = name.partition("@")
        repos.setdefault(repo, {})[branch or "main"] = Path(folder)
    host, port = args.listen.rsplit(":", 1)
    hub = FakeHub(repos, tokens=dict(item.split("=", 1) for item in args.token), address=(host, int(port)))
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with hub:
        print(f"serving {hub.endpoint}", flush=True)
        stopped.wait()
    args.report.write_text(json.dumps({"clients": sorted(hub.clients, key=str), "downloads": hub.downloads}))


if __name__ == "__main__":
    main()
