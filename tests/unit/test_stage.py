"""`python -m trainer.stage` (trainer/stage.py): a dataset staged from URLs and a mounted folder is
what `datasets` reads as the data.path folder, staging again changes nothing, and a source that
fails leaves no folder behind, with the exit code that says whether a retry can help."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import datasets
import pytest

from trainer import stage

CSV = "text,label\n" + "".join(f"review {i},{i % 3}\n" for i in range(30))


@contextmanager
def web(files: dict[str, bytes], cut_short: str | None = None):
    """An HTTP server on loopback serving `files` by name; 404 for others, 503 for `/busy`, and
    `cut_short` sent with a Content-Length it never fills, as a dropped connection ends."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            if name == "busy":
                self.send_error(503)
                return
            if name not in files:
                self.send_error(404)
                return
            body = files[name]
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


def test_urls_and_a_mounted_folder_become_one_data_folder_staged_once(tmp_path, capsys):
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "test.csv").write_text(CSV)
    dest = tmp_path / "workspace/data/reviews"
    with web({"data/train.csv": CSV.encode(), "data/validation.csv": "\n".join(CSV.splitlines()[:6]).encode()}) as url:
        assert stage.main(["--to", str(dest), f"{url}/data/train.csv", f"{url}/data/validation.csv",
                           str(volume)]) == 0
        assert sorted(path.name for path in dest.iterdir()) == ["test.csv", "train.csv", "validation.csv"]
        read = datasets.load_dataset(str(dest))
        assert {split: read[split].num_rows for split in read} == {"train": 30, "validation": 5, "test": 30}
        assert capsys.readouterr().out.endswith(f"staged 3 file(s), 0.0 MB, in {dest}: data.path: {dest}\n")
        # Again (a Job run twice): nothing is fetched or changed.
        before = {path.name: path.stat().st_mtime_ns for path in dest.iterdir()}
        assert stage.main(["--to", str(dest), f"{url}/gone.csv"]) == 0
    assert f"{dest}: already staged; delete it to stage again" in capsys.readouterr().out
    assert {path.name: path.stat().st_mtime_ns for path in dest.iterdir()} == before
    assert [path.name for path in dest.parent.iterdir()] == ["reviews"]


@pytest.mark.parametrize("source, code, says", [
    ("{url}/missing.csv", 2, "{url}/missing.csv: HTTP 404 Not Found"),
    ("{url}/busy", 1, "{url}/busy: HTTP 503 Service Unavailable"),
    ("{url}/short.csv", 1, "{url}/short.csv: the connection ended after 361 of 3610 bytes"),
    ("http://127.0.0.1:9/test.csv", 1, "http://127.0.0.1:9/test.csv: ConnectionRefusedError: "),
    ("{url}/", 2, "{url}/: the URL names no file"),
    ("{tmp}/no-volume", 2, "{tmp}/no-volume: no such file or folder (is its volume mounted?)"),
    ("s3://bucket/test.csv", 2, "s3://bucket/test.csv: only http(s) URLs and paths on a mounted volume can be staged"),
])
def test_a_source_that_fails_stages_nothing_and_says_if_a_retry_can_help(tmp_path, capsys, source, code, says):
    dest = tmp_path / "data/reviews"
    # train.csv first: what it wrote is dropped with the rest when the source after it fails.
    with web({"train.csv": CSV.encode(), "short.csv": CSV.encode(), "notes.txt": b"hello"},
             cut_short="short.csv") as url:
        fill = {"url": url, "tmp": tmp_path}
        assert stage.main(["--to", str(dest), f"{url}/train.csv", source.format(**fill)]) == code
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 1 and errors[0].startswith(f"error: {says.format(**fill)}"), errors
    assert list(dest.parent.iterdir()) == []  # no DEST, and no partial folder


def test_sources_without_a_data_file_are_refused(tmp_path, capsys):
    with web({"notes.txt": b"hello"}) as url:
        assert stage.main(["--to", str(tmp_path / "data"), f"{url}/notes.txt"]) == 2
    assert capsys.readouterr().err == \
        f"error: {url}/notes.txt: no data file (.csv, .json, .jsonl, .parquet) among what was staged\n"
    assert not Path(tmp_path / "data").exists()


def test_two_sources_with_one_file_name_are_refused(tmp_path, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        (folder / "train.csv").write_text(CSV)
    assert stage.main(["--to", str(tmp_path / "data"), str(one), str(two)]) == 2
    assert f"error: {two}: a second file named train.csv" in capsys.readouterr().err
    assert not Path(tmp_path / "data").exists()


def stage_command(args: list[str], hub, hf_home: Path, **env) -> subprocess.CompletedProcess:
    """`python -m trainer.stage` in a process of its own: huggingface_hub reads HF_ENDPOINT and
    HF_HOME once, when imported."""
    return subprocess.run([sys.executable, "-m", "trainer.stage", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint,
                               "HF_HOME": str(hf_home), **env})


def test_a_hub_model_is_cached_at_its_revision_for_offline_pods_with_the_token(tmp_path):
    """--model: what `from_pretrained` reads offline (the revision's files, not other
    frameworks' weights), for a gated model only with HF_TOKEN; a refusal is one line, exit 2."""
    from fake_hub import FakeHub, commit

    repos = {}
    for branch in ("main", "v2"):
        folder = tmp_path / branch
        folder.mkdir()
        (folder / "config.json").write_text(f'{{"branch": "{branch}"}}')
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / "model.onnx").write_bytes(b"other weights")
        repos[branch] = folder
    hf_home = tmp_path / "hf"
    with FakeHub({"acme/gated": repos}, tokens={"acme/gated": "hf_Secret"}) as hub:
        refused = stage_command(["--model", "acme/gated", "--revision", "v2"], hub, hf_home)
        missing = stage_command(["--model", "acme/gated", "--revision", "v3"], hub, hf_home, HF_TOKEN="hf_Secret")
        cached = stage_command(["--model", "acme/gated", "--revision", "v2"], hub, hf_home, HF_TOKEN="hf_Secret")
    assert refused.returncode == 2 and refused.stderr == (
        "error: --model acme/gated: the Hub refused access (a gated or private model): set HF_TOKEN to a token that "
        "has been granted access to it\n")
    assert missing.returncode == 2
    assert missing.stderr == "error: --revision v3: not a branch, tag or commit of acme/gated\n"
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout == f"cached acme/gated at commit {commit('v2')}: model.name: acme/gated, model.revision: v2\n"
    snapshot = hf_home / "hub/models--acme--gated/snapshots" / commit("v2")
    assert sorted(path.name for path in snapshot.iterdir()) == ["config.json", "model.safetensors"]
    assert (snapshot / "config.json").read_text() == '{"branch": "v2"}'
    assert (hf_home / "hub/models--acme--gated/refs/v2").read_text() == commit("v2")  # how offline finds "v2"
