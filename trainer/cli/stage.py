"""Put a dataset, and a Hub model, where the job's pods read them:
`python -m trainer.cli.stage [--to DEST SOURCE ...] [--model ORG/NAME [--revision REV]]`.

Each SOURCE is a file's https URL, or a file or folder on a mounted volume (a folder's files
are copied, its subfolders with them). DEST becomes a folder holding them all, whole or absent
(`files.rename_into_place`): a download cut short leaves no DEST, and the next try starts over. A DEST that
exists is left as it is ("already staged", exit 0), so running the staging again changes
nothing; delete DEST to stage anew. `data.path: DEST` then reads the folder as `datasets` reads
a Hub dataset's files: each file a split named by its file name (train, validation, test; one
file of any other name is train).

What a source can do to the pod that stages it is bounded (k8s/README.md, "Your job"): a URL
names its file by its last part, a plain file name, never a path, so nothing is written outside
DEST; each download is capped (`--max-bytes`) and all files are written by a deadline
(`--deadline-s`), however slowly a server sends; a `URL#sha256=HEX` is refused unless its file
has that digest; plain `http://`, which anyone on the way can read and change, only with
`--allow-http`; and a symbolic link in a copied folder is followed only to a file or folder
inside that folder, so that a link to /proc/self/environ or a secret's mount never copies what
it names.

`--model` downloads a Hub model's files at `--revision` into the Hugging Face cache (HF_HOME,
with HF_TOKEN for a gated one: huggingface_hub's snapshot_download), so that pods without
internet load it with HF_HUB_OFFLINE=1. k8s/stage-data/ runs all of this as a Kubernetes Job.

Exit codes are the trainer's (trainer/exit_codes.py), so that a Job's podFailurePolicy can tell
them apart: 2 for a source that will never be right (an HTTP 4xx, a missing path, two files of
one name, no data file at all, a file over the cap or not matching its pin; a model the Hub
refuses or does not have) and for a full disk, 1 for what a retry may mend (an HTTP 5xx, the
network, the deadline).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import http.client
import os
import re
import shutil
import stat
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from trainer import errors, files
from trainer.errors import TrainerError
from trainer.exit_codes import Exit

DATA_SUFFIXES = (".csv", ".json", ".jsonl", ".parquet")
"""The files data.path reads (trainer/data/reading.py)."""
TIMEOUT_S = 60
"""A connection that sends nothing for this long fails (exit 1), rather than holding the Job for ever."""
DEADLINE_S = 2 * 3600
"""All of one staging's files are written within this (--deadline-s), or it fails with exit 1. TIMEOUT_S
bounds each read only: a server that sends a byte a minute would hold the Job for ever."""
MAX_BYTES = 50 * 10**9
"""The most one download may write (--max-bytes): a server that never stops sending fills no volume."""
CHUNK = 1 << 20
PIN = re.compile(r"sha256=([0-9a-fA-F]{64})")
"""A URL's fragment that pins its file's digest, as pip reads one: `URL#sha256=HEX`."""


class SourceError(TrainerError):
    """A source that cannot be staged as given: retrying will not help."""


class Unreachable(TrainerError):
    """A source that could not be fetched this time: the network, the server's own error, the deadline."""

    exit_code = Exit.CRASH


class DiskFull(TrainerError):
    """DEST's volume has no room left (or the quota is spent): a retry would fill it again."""


@dataclass
class Limits:
    """What every download and copy of one staging is held to."""

    deadline_s: float = DEADLINE_S
    max_bytes: int = MAX_BYTES
    allow_http: bool = False
    ends: float = field(init=False)

    def __post_init__(self) -> None:
        self.ends = time.monotonic() + self.deadline_s

    def left_s(self) -> float:
        return self.ends - time.monotonic()

    def check(self, source: str, written: int) -> None:
        if self.left_s() <= 0:
            raise Unreachable(f"{source}: not staged within the deadline of {self.deadline_s:g} s "
                              f"({written} bytes written): a server sending too slowly? (--deadline-s)")


def _full(e: OSError) -> bool:
    """A full volume, or a spent quota: not the network. Reported as "unreachable" (exit 1), the
    Job would fill it again on every try."""
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def is_url(source: str) -> bool:
    return urlparse(source).scheme in ("http", "https")


def _file_name(url: str) -> str:
    """The name a URL's file is staged under: its last part, which must be a plain file name.
    Unquoted, `..%2F..%2Fevil.csv` would be a path out of DEST."""
    name = unquote(urlparse(url).path.rsplit("/", 1)[-1])
    if not name:
        raise SourceError(f"{url}: the URL names no file")
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        raise SourceError(f"{url}: {name!r} is not a plain file name (a URL's last part names the staged file)")
    return name


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects to https only (http too with --allow-http): never from https down to http, nor to ftp."""

    def __init__(self, allow_http: bool) -> None:
        self.allow_http = allow_http

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not _allowed(newurl, self.allow_http):
            fp.close()
            raise SourceError(f"{req.full_url}: redirected to {newurl}, which is not https (--allow-http "
                              "allows http)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _allowed(url: str, allow_http: bool) -> bool:
    scheme = urlparse(url).scheme
    return scheme == "https" or (scheme == "http" and allow_http)


def _save(chunks: Iterator[bytes], target: Path, source: str, limits: Limits, cap: int | None = None) -> str:
    """`chunks` written into `target`, a new file (never one already there, nor through a link),
    within the deadline and `cap` bytes; their sha256. A write's OSError (a full disk) is the
    caller's to name."""
    digest = hashlib.sha256()
    written = 0
    with open(target, "xb") as out:
        for chunk in chunks:
            written += len(chunk)
            if cap is not None and written > cap:
                raise SourceError(f"{source}: more than --max-bytes {cap} bytes")
            out.write(chunk)
            digest.update(chunk)
            limits.check(source, written)
    return digest.hexdigest()


def _download(url: str, folder: Path, limits: Limits) -> Path:
    if not _allowed(url, limits.allow_http):
        raise SourceError(f"{url}: plain http can be read and changed on the way: use https, or --allow-http "
                          "for a server you trust (with a #sha256= pin)")
    address, _, fragment = url.partition("#")
    pin = PIN.fullmatch(fragment)
    if fragment and not pin:
        raise SourceError(f"{url}: #{fragment} is not a pin: give #sha256=<64 hex digits>, or no #")
    name = _file_name(address)
    target = folder / name
    if target.exists():
        raise SourceError(f"{url}: a second file named {name}")
    opener = urllib.request.build_opener(_Redirects(limits.allow_http))

    def network(e: BaseException) -> TrainerError:
        if isinstance(e, urllib.error.HTTPError):
            return (SourceError if 400 <= e.code < 500 else Unreachable)(f"{url}: HTTP {e.code} {e.reason}")
        if limits.left_s() <= 0:  # a read timed out at the deadline
            return Unreachable(f"{url}: not staged within the deadline of {limits.deadline_s:g} s: a server "
                               "sending too slowly? (--deadline-s)")
        return Unreachable(f"{url}: {errors.describe(getattr(e, 'reason', e))}")  # DNS, refused, cut short

    def body(response) -> Iterator[bytes]:
        # read1: what has arrived, at once, so the deadline is checked between a trickle's bytes.
        while True:
            try:
                chunk = response.read1(CHUNK)
            except (http.client.HTTPException, OSError) as e:
                raise network(e) from None
            if not chunk:
                return
            yield chunk

    # Each read waits TIMEOUT_S at most, and never past the deadline.
    try:
        response = opener.open(address, timeout=max(0.01, min(TIMEOUT_S, limits.left_s())))
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise network(e) from None
    with response:
        length = response.length  # Content-Length, as http.client read it (None: not given)
        if length is not None and length > limits.max_bytes:
            raise SourceError(f"{url}: {length} bytes, more than --max-bytes {limits.max_bytes}")
        digest = _save(body(response), target, url, limits, cap=limits.max_bytes)
        # http.client ends a body that the connection cut short without a word.
        got = target.stat().st_size
        if length is not None and got != length:
            raise Unreachable(f"{url}: the connection ended after {got} of {length} bytes")
    if pin and digest != pin.group(1).lower():
        raise SourceError(f"{url}: its file's sha256 is {digest}, not the one pinned: the file changed, "
                          "or is not the one meant")
    return target


def _copy(source: str, folder: Path, limits: Limits) -> list[Path]:
    if len(urlparse(source).scheme) > 1:  # s3://, gs://, ... (one letter would be a Windows drive)
        raise SourceError(f"{source}: only http(s) URLs and paths on a mounted volume can be staged")
    path = Path(source).expanduser()
    if not path.exists():
        raise SourceError(f"{source}: no such file or folder (is its volume mounted?)")
    root = path.resolve()  # the source as named, through a link if it is one: the user named it
    entries = sorted(root.iterdir()) if root.is_dir() else [root]
    copied = []
    for entry in entries:
        target = folder / entry.name
        if target.exists():
            raise SourceError(f"{source}: a second file named {entry.name}")
        _copy_entry(entry, target, root, source, limits, (root,))
        copied.append(target)
    return copied


def _copy_entry(entry: Path, target: Path, root: Path, source: str, limits: Limits, within: tuple[Path, ...]) -> None:
    """`entry`, a file or folder of the source `root`, copied as `target`. A symbolic link is
    followed only to what lies inside `root`: on a shared volume anyone may leave a link to
    /proc/self/environ (this pod's HF_TOKEN) or a mounted secret, and copying what it names
    would put that into DEST, readable by every pod of the job."""
    real = entry
    if entry.is_symlink():
        real = entry.resolve()
        if not real.is_relative_to(root):
            raise SourceError(f"{entry}: a symbolic link out of {source} (to {real}), not staged: copy what it "
                              "names into the source, or name it as a source of its own")
    if real.is_dir():
        if real in within:
            raise SourceError(f"{entry}: a symbolic link to a folder that holds it (a loop), not staged")
        target.mkdir()
        for child in sorted(real.iterdir()):
            _copy_entry(child, target / child.name, root, source, limits, (*within, real))
        return
    try:
        # O_NOFOLLOW: a file swapped for a link since the check above is refused, not followed.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise SourceError(f"{entry}: cannot be read: {errors.describe(e)}") from None
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceError(f"{entry}: not a regular file (a device, a pipe or a socket), not staged")
        _save(iter(lambda: file.read(CHUNK), b""), target, source, limits)


def stage(sources: list[str], dest: Path, limits: Limits | None = None) -> list[Path]:
    """DEST's files, staged from `sources` now, or as an earlier staging left them."""
    if dest.exists():
        print(f"{dest}: already staged; delete it to stage again", flush=True)
    else:
        _stage_anew(sources, dest, limits or Limits())
    return sorted(f for f in dest.rglob("*") if f.is_file())


def _stage_anew(sources: list[str], dest: Path, limits: Limits) -> None:
    """`sources` into DEST, whole or not at all: built beside it, then published."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.staging")
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed try left
    try:
        tmp.mkdir()
        for source in sources:
            staged = [_download(source, tmp, limits)] if is_url(source) else _copy(source, tmp, limits)
            print(f"{source}: {', '.join(path.name for path in staged) or 'nothing'}", flush=True)
        data = [f for f in tmp.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES]
        if not data:
            raise SourceError(f"{' '.join(sources)}: no data file ({', '.join(DATA_SUFFIXES)}) among what was staged")
        files.rename_into_place(tmp, dest)
    except OSError as e:
        if not _full(e):
            raise
        raise DiskFull(f"{dest}: its volume is full ({errors.describe(e)}): free space there, or stage to a "
                       "larger volume") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


MODEL_SKIPPED = ["*.onnx", "onnx/*", "openvino/*", "coreml/*", "*.h5", "*.msgpack", "*.ot", "tf_model*",
                 "flax_model*", "rust_model*", "*.gguf"]
"""Other frameworks' copies of the weights, which transformers with torch never reads."""


def prefetch_model(name: str, revision: str | None) -> Path:
    """`name` at `revision` in the HF cache, as `from_pretrained` will look for it offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, ignore_patterns=MODEL_SKIPPED))
    except GatedRepoError:
        raise SourceError(f"--model {name}: the Hub refused access (a gated or private model): set HF_TOKEN to a "
                          "token that has been granted access to it") from None
    except RevisionNotFoundError:
        raise SourceError(f"--revision {revision}: not a branch, tag or commit of {name}") from None
    except RepositoryNotFoundError:
        raise SourceError(f"--model {name}: no such model on the Hub (or a private one: set HF_TOKEN)") from None
    except OSError as e:  # the network; huggingface_hub's HTTP errors are OSErrors too
        if _full(e):
            raise DiskFull(f"--model {name}: the HF cache's volume is full ({errors.describe(e)}): free space "
                           "there (HF_HOME), or give it a larger volume") from None
        raise Unreachable(f"--model {name}: {errors.describe(e)}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.cli.stage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", type=Path, metavar="DEST", help="the folder data.path will name")
    parser.add_argument("sources", nargs="*", metavar="SOURCE",
                        help="an https URL of a file (URL#sha256=HEX pins its digest), or a mounted path")
    parser.add_argument("--allow-http", action="store_true",
                        help="stage plain http:// URLs too (anyone on the way can read and change them)")
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES, metavar="N",
                        help=f"the most one download may write (default {MAX_BYTES})")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, metavar="S",
                        help=f"the files all staged within S seconds, or exit 1 (default {DEADLINE_S})")
    parser.add_argument("--model", metavar="ORG/NAME", help="a Hub model to download into the HF cache (model.name)")
    parser.add_argument("--revision", help="--model's branch, tag or commit (model.revision; default main)")
    args = parser.parse_args(argv)
    if bool(args.to) != bool(args.sources) or not (args.to or args.model) or (args.revision and not args.model):
        parser.error("give --to DEST with its SOURCEs, --model ORG/NAME [--revision REV], or both")
    try:
        if args.to:
            limits = Limits(deadline_s=args.deadline_s, max_bytes=args.max_bytes, allow_http=args.allow_http)
            staged = stage(args.sources, args.to, limits)
            size = sum(f.stat().st_size for f in staged)
            print(f"staged {len(staged)} file(s), {size / 1e6:.1f} MB, in {args.to}: data.path: {args.to}", flush=True)
        if args.model:
            folder = prefetch_model(args.model, args.revision)
            print(f"cached {args.model} at commit {folder.name}: model.name: {args.model}" +
                  (f", model.revision: {args.revision}" if args.revision else ""), flush=True)
    except TrainerError as e:
        return errors.report(e)
    return Exit.DONE


if __name__ == "__main__":
    sys.exit(main())
