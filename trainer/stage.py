"""Put a dataset, and a Hub model, where the job's pods read them:
`python -m trainer.stage [--to DEST SOURCE ...] [--model ORG/NAME [--revision REV]]`.

Each SOURCE is a file's http(s) URL, or a file or folder on a mounted volume (a folder's files
are copied, its subfolders with them). DEST becomes a folder holding them all, whole or absent
(`files.publish`): a download cut short leaves no DEST, and the next try starts over. A DEST that
exists is left as it is ("already staged", exit 0), so running the staging again changes
nothing; delete DEST to stage anew. `data.path: DEST` then reads the folder as `datasets` reads
a Hub dataset's files: each file a split named by its file name (train, validation, test; one
file of any other name is train).

`--model` downloads a Hub model's files at `--revision` into the Hugging Face cache (HF_HOME,
with HF_TOKEN for a gated one: huggingface_hub's snapshot_download), so that pods without
internet load it with HF_HUB_OFFLINE=1. k8s/stage-data/ runs all of this as a Kubernetes Job.

Exit codes are the trainer's (trainer/exit_codes.py), so that a Job's podFailurePolicy can tell
them apart: 2 for a source that will never be right (an HTTP 4xx, a missing path, two files of
one name, no data file at all; a model the Hub refuses or does not have), 1 for what a retry
may mend (an HTTP 5xx, the network).
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

from trainer import errors, files
from trainer.errors import TrainerError
from trainer.exit_codes import Exit

DATA_SUFFIXES = (".csv", ".json", ".jsonl", ".parquet")
"""The files data.path reads (trainer/data.py)."""
TIMEOUT_S = 60
"""A connection that sends nothing for this long fails (exit 1), rather than holding the Job for ever."""


class SourceError(TrainerError):
    """A source that cannot be staged as given: retrying will not help."""


class Unreachable(TrainerError):
    """A source that could not be fetched this time: the network, or the server's own error."""

    exit_code = Exit.CRASH


def is_url(source: str) -> bool:
    return urlparse(source).scheme in ("http", "https")


def _download(url: str, folder: Path) -> Path:
    name = unquote(Path(urlparse(url).path).name)
    if not name:
        raise SourceError(f"{url}: the URL names no file")
    target = folder / name
    if target.exists():
        raise SourceError(f"{url}: a second file named {name}")
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(target, "wb") as out:
            shutil.copyfileobj(response, out, length=1 << 20)
            # http.client ends a body that the connection cut short without a word.
            length, got = response.headers.get("Content-Length"), out.tell()
            if length is not None and got != int(length):
                raise Unreachable(f"{url}: the connection ended after {got} of {length} bytes")
    except urllib.error.HTTPError as e:
        kind = SourceError if 400 <= e.code < 500 else Unreachable
        raise kind(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # DNS, refused, cut short, timed out
        raise Unreachable(f"{url}: {errors.describe(getattr(e, 'reason', e))}") from None
    return target


def _copy(source: str, folder: Path) -> list[Path]:
    if len(urlparse(source).scheme) > 1:  # s3://, gs://, ... (one letter would be a Windows drive)
        raise SourceError(f"{source}: only http(s) URLs and paths on a mounted volume can be staged")
    path = Path(source).expanduser()
    if not path.exists():
        raise SourceError(f"{source}: no such file or folder (is its volume mounted?)")
    entries = sorted(path.iterdir()) if path.is_dir() else [path]
    copied = []
    for entry in entries:
        target = folder / entry.name
        if target.exists():
            raise SourceError(f"{source}: a second file named {entry.name}")
        if entry.is_dir():
            shutil.copytree(entry, target)
        else:
            shutil.copy2(entry, target)
        copied.append(target)
    return copied


def stage(sources: list[str], dest: Path) -> list[Path]:
    """DEST's files, staged from `sources` now, or as an earlier staging left them."""
    if dest.exists():
        print(f"{dest}: already staged; delete it to stage again", flush=True)
    else:
        _stage_anew(sources, dest)
    return sorted(f for f in dest.rglob("*") if f.is_file())


def _stage_anew(sources: list[str], dest: Path) -> None:
    """`sources` into DEST, whole or not at all: built beside it, then published."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.staging")
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed try left
    tmp.mkdir()
    try:
        for source in sources:
            staged = [_download(source, tmp)] if is_url(source) else _copy(source, tmp)
            print(f"{source}: {', '.join(path.name for path in staged) or 'nothing'}", flush=True)
        data = [f for f in tmp.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES]
        if not data:
            raise SourceError(f"{' '.join(sources)}: no data file ({', '.join(DATA_SUFFIXES)}) among what was staged")
        files.publish(tmp, dest)
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
        raise Unreachable(f"--model {name}: {errors.describe(e)}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.stage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", type=Path, metavar="DEST", help="the folder data.path will name")
    parser.add_argument("sources", nargs="*", metavar="SOURCE", help="an http(s) URL of a file, or a mounted path")
    parser.add_argument("--model", metavar="ORG/NAME", help="a Hub model to download into the HF cache (model.name)")
    parser.add_argument("--revision", help="--model's branch, tag or commit (model.revision; default main)")
    args = parser.parse_args(argv)
    if bool(args.to) != bool(args.sources) or not (args.to or args.model) or (args.revision and not args.model):
        parser.error("give --to DEST with its SOURCEs, --model ORG/NAME [--revision REV], or both")
    try:
        if args.to:
            staged = stage(args.sources, args.to)
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
