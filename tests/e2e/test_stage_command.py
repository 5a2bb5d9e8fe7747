"""`python -m trainer.cli.stage` as a process of its own, where the claim needs one: a full disk
(a tmpfs in a mount namespace of the test's own) and huggingface_hub, which reads HF_ENDPOINT
and HF_HOME once, when imported. The rest of staging, in process: tests/unit/test_stage.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.web import CSV, web


def in_small_disk(small: Path, command: list[str], **env) -> subprocess.CompletedProcess:
    """`command` with `small` a 64 KB tmpfs, in a mount namespace of its own (no root needed)."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1) for a tmpfs of the test's own")
    return subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                           'mount -t tmpfs -o size=64k tmpfs "$1" && shift && exec "$@"', "sh", str(small), *command],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **env})


def test_a_full_disk_is_reported_as_one_and_not_retried(tmp_path):
    """A real ENOSPC, DEST (then HF_HOME) on a tmpfs too small for the file: exit 2, a line that
    says the volume is full, not "unreachable" with exit 1, which the Job would retry."""
    from support.fake_hub import FakeHub

    small = tmp_path / "small"
    small.mkdir()
    dest = small / "data"
    with web({"train.csv": CSV.encode() * 1000}) as url:  # 361 KB
        result = in_small_disk(small, [sys.executable, "-m", "trainer.cli.stage", "--allow-http", "--to", str(dest),
                                       f"{url}/train.csv"])
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: {dest}: its volume is full (OSError: [Errno 28] No space left on device): "
                             "free space there, or stage to a larger volume\n")

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 300_000)
    with FakeHub({"acme/big": model}) as hub:
        result = in_small_disk(small, [sys.executable, "-m", "trainer.cli.stage", "--model", "acme/big"],
                               HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.endpoint, HF_HOME=str(small / "hf"))
    assert result.returncode == 2, result.stderr
    # huggingface_hub's progress bars and its warning share stderr: the error is one line of it.
    said = ("error: --model acme/big: the HF cache's volume is full (OSError: [Errno 28] No space left on device): "
            "free space there (HF_HOME), or give it a larger volume")
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [said], result.stderr


def stage_command(args: list[str], hub, hf_home: Path, **env) -> subprocess.CompletedProcess:
    """`python -m trainer.cli.stage` in a process of its own: huggingface_hub reads HF_ENDPOINT and
    HF_HOME once, when imported."""
    return subprocess.run([sys.executable, "-m", "trainer.cli.stage", *args], capture_output=True, text=True,
                          timeout=60,
                          env={**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint,
                               "HF_HOME": str(hf_home), **env})


def test_a_hub_model_is_cached_at_its_revision_for_offline_pods_with_the_token(tmp_path):
    """--model: what `from_pretrained` reads offline (the revision's files, not other
    frameworks' weights), for a gated model only with HF_TOKEN; a refusal is one line, exit 2."""
    from support.fake_hub import FakeHub, commit

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
