"""Files served over loopback HTTP, whole or cut short, for the data and model sources that download."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
