"""`python -m trainer.cli.stage` (trainer/cli/stage.py): a dataset staged from URLs and a mounted folder is
what `datasets` reads as the data.path folder, staging again changes nothing, and a source that
fails leaves no folder behind, with the exit code that says whether a retry can help."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from contextlib import suppress
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import quote, unquote

import datasets
import pytest
from support.web import CSV, web

from trainer.cli import stage


def test_urls_and_a_mounted_folder_become_one_data_folder_staged_once(tmp_path, capsys):
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "test.csv").write_text(CSV)
    dest = tmp_path / "workspace/data/reviews"
    with web({"data/train.csv": CSV.encode(), "data/validation.csv": "\n".join(CSV.splitlines()[:6]).encode()}) as url:
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/data/train.csv", f"{url}/data/validation.csv",
                           str(volume)]) == 0
        assert sorted(path.name for path in dest.iterdir()) == ["test.csv", "train.csv", "validation.csv"]
        read = datasets.load_dataset(str(dest))
        assert {split: read[split].num_rows for split in read} == {"train": 30, "validation": 5, "test": 30}
        assert capsys.readouterr().out.endswith(f"staged 3 file(s), 0.0 MB, in {dest}: data.path: {dest}\n")
        # Again (a Job run twice): nothing is fetched or changed.
        before = {path.name: path.stat().st_mtime_ns for path in dest.iterdir()}
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/gone.csv"]) == 0
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
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/train.csv", source.format(**fill)]) == code
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 1 and errors[0].startswith(f"error: {says.format(**fill)}"), errors
    assert list(dest.parent.iterdir()) == []  # no DEST, and no partial folder


def test_sources_without_a_data_file_are_refused(tmp_path, capsys):
    with web({"notes.txt": b"hello"}) as url:
        assert stage.main(["--allow-http", "--to", str(tmp_path / "data"), f"{url}/notes.txt"]) == 2
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


def files_under(folder: Path) -> list[str]:
    """Every file, folder and link below `folder` (links not followed), relative to it."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


@pytest.mark.parametrize("name", ["..%2F..%2Fevil.csv", "..%5C..%5Cevil.csv", "%2e%2e", "{absolute}", "evil%00.csv"])
def test_a_url_names_a_plain_file_or_nothing_is_written(tmp_path, capsys, name):
    """`python -m trainer.cli.stage --to W/deep/dest http://HOST/a/..%2F..%2Fevil.csv` wrote W/evil.csv
    (the name was unquoted after it was taken from the path), and left it there. A name with a
    separator, `..` or an absolute path is refused, and nothing is written anywhere, not even
    where the name points (here W/abs.csv)."""
    work = tmp_path / "W"
    name = name.format(absolute=quote(str(work / "abs.csv"), safe=""))
    with web({f"a/{name}": CSV.encode()}) as url:
        code = stage.main(["--allow-http", "--to", str(work / "deep/dest"), f"{url}/a/{name}"])
    assert capsys.readouterr().err == \
        f"error: {url}/a/{name}: {unquote(name)!r} is not a plain file name (a URL's last part names the staged file)\n"
    assert code == 2
    assert files_under(work) == ["deep"]


@pytest.mark.parametrize("link, to", [("environ.csv", "/proc/self/environ"), ("sub/secrets", "{tmp}/secrets"),
                                      ("sub/up", "..")])
def test_a_copy_never_follows_a_link_out_of_its_source(tmp_path, capsys, link, to):
    """On a shared volume anyone may leave a link to the pod's environment (its HF_TOKEN) or to
    a secret's mount: a link that leads out of the source is refused by name, and nothing of
    what it names reaches DEST. A link inside the source is copied as what it names, unless
    it is a loop."""
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets/token.csv").write_text("hf_Secret\n")
    volume = tmp_path / "volume"
    (volume / "sub").mkdir(parents=True)
    (volume / "sub/notes.txt").write_text("notes")
    (volume / "train.csv").write_text(CSV)
    (volume / "latest.csv").symlink_to("train.csv")
    (volume / link).symlink_to(to.format(tmp=tmp_path))
    before = files_under(tmp_path)
    dest = tmp_path / "data"
    assert stage.main(["--to", str(dest), str(volume)]) == 2
    error = capsys.readouterr().err
    if to == "..":  # the source folder itself: inside it, but a loop
        assert error == f"error: {volume / link}: a symbolic link to a folder that holds it (a loop), not staged\n"
    else:
        target = Path(to.format(tmp=tmp_path)).resolve()
        assert error == (f"error: {volume / link}: a symbolic link out of {volume} (to {target}), not staged: copy "
                         "what it names into the source, or name it as a source of its own\n")
    assert files_under(tmp_path) == before  # no DEST, nothing left beside it

    (volume / link).unlink()
    assert stage.main(["--to", str(dest), str(volume)]) == 0
    assert files_under(dest) == ["latest.csv", "sub", "sub/notes.txt", "train.csv"]
    assert (dest / "latest.csv").read_text() == CSV and not (dest / "latest.csv").is_symlink()


def test_plain_http_only_when_asked_for_and_redirects_only_to_https(tmp_path, capsys):
    """http:// can be read and changed by anyone on the way: refused before any request unless
    --allow-http says the server is trusted. A redirect may not lead from the scheme asked for
    to another (ftp here; https down to http the same way)."""
    asked: list[str] = []

    def moved(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", "ftp://127.0.0.1:9/train.csv")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    dest = tmp_path / "data"
    with web({"train.csv": CSV.encode(), "moved.csv": moved}, asked=asked) as url:
        assert stage.main(["--to", str(dest), f"{url}/train.csv"]) == 2
        assert capsys.readouterr().err == (f"error: {url}/train.csv: plain http can be read and changed on the way: "
                                           "use https, or --allow-http for a server you trust (with a #sha256= pin)\n")
        assert asked == []
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/moved.csv"]) == 2
        assert capsys.readouterr().err == (f"error: {url}/moved.csv: redirected to ftp://127.0.0.1:9/train.csv, "
                                           "which is not https (--allow-http allows http)\n")
        assert files_under(tmp_path) == []
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/train.csv"]) == 0
    assert asked == ["/moved.csv", "/train.csv"]


def test_a_pinned_download_is_staged_only_with_its_digest(tmp_path, capsys):
    """`URL#sha256=HEX`: a file whose digest differs (changed on the server, or on the way) is
    refused, exit 2, and is not left in DEST; a fragment that is not a pin is refused too."""
    digest = hashlib.sha256(CSV.encode()).hexdigest()
    other = hashlib.sha256(b"another file").hexdigest()
    dest = tmp_path / "data"
    with web({"train.csv": CSV.encode()}) as url:
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/train.csv#sha256={other}"]) == 2
        assert capsys.readouterr().err == (f"error: {url}/train.csv#sha256={other}: its file's sha256 is {digest}, "
                                           "not the one pinned: the file changed, or is not the one meant\n")
        assert files_under(tmp_path) == []
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/train.csv#md5=0"]) == 2
        assert capsys.readouterr().err == \
            f"error: {url}/train.csv#md5=0: #md5=0 is not a pin: give #sha256=<64 hex digits>, or no #\n"
        assert files_under(tmp_path) == []
        assert stage.main(["--allow-http", "--to", str(dest), f"{url}/train.csv#sha256={digest.upper()}"]) == 0
    assert (dest / "train.csv").read_text() == CSV


def endless(handler: BaseHTTPRequestHandler) -> None:
    """A body with no Content-Length that never ends: sent until the client hangs up."""
    handler.send_response(200)
    handler.end_headers()
    with suppress(OSError):
        while True:
            handler.wfile.write(b"x" * 65536)


def test_a_download_stops_at_its_size_cap(tmp_path, capsys):
    """--max-bytes: a file that says it is larger is refused before a byte is written, and one
    that never says (a body that never ends) is cut at the cap; exit 2 either way, no DEST."""
    dest = tmp_path / "data"
    with web({"big.csv": CSV.encode() * 10, "endless.csv": endless}) as url:
        assert stage.main(["--allow-http", "--max-bytes", "1000", "--to", str(dest), f"{url}/big.csv"]) == 2
        assert capsys.readouterr().err == f"error: {url}/big.csv: {10 * len(CSV)} bytes, more than --max-bytes 1000\n"
        assert stage.main(["--allow-http", "--max-bytes", "300000", "--to", str(dest), f"{url}/endless.csv"]) == 2
        assert capsys.readouterr().err == f"error: {url}/endless.csv: more than --max-bytes 300000 bytes\n"
    assert files_under(tmp_path) == []


def test_a_server_that_trickles_is_stopped_by_the_deadline(tmp_path, capsys):
    """Each byte comes well within the per-read timeout, so only the overall deadline ends the
    download: exit 1 (the Job tries again, within its activeDeadlineSeconds), no DEST."""
    hung_up = threading.Event()

    def trickle(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(10**6))
        handler.end_headers()
        try:
            while not hung_up.wait(0.01):  # a byte every 10 ms: 10**6 of them would take hours
                handler.wfile.write(b"x")
                handler.wfile.flush()
        except OSError:
            pass

    dest = tmp_path / "data"
    start = time.monotonic()
    with web({"slow.csv": trickle}) as url:
        try:
            code = stage.main(["--allow-http", "--deadline-s", "1", "--to", str(dest), f"{url}/slow.csv"])
        finally:
            hung_up.set()
    assert code == 1
    assert re.fullmatch(rf"error: {url}/slow.csv: not staged within the deadline of 1 s( \(\d+ bytes written\))?: "
                        r"a server sending too slowly\? \(--deadline-s\)\n", capsys.readouterr().err)
    assert time.monotonic() - start < 1 + stage.TIMEOUT_S / 2  # by the deadline, not by a read's timeout
    assert files_under(tmp_path) == []
