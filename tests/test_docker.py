"""The Dockerfile: lint-clean, pinned to our lock, non-root, and its default command valid.

No Docker engine here: hadolint checks the file, the build context is checked against
.dockerignore's rules, and the image's default command is resolved by the trainer itself in
the layout the Dockerfile creates (tests/container.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from container import Container, Service, build_app_dir, read_dockerfile, run_services
from conftest import BASE_ENV, REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_hadolint_passes_without_warnings():
    result = subprocess.run([Path(sys.executable).with_name("hadolint"), "--no-color", "Dockerfile"],
                            cwd=REPO, capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_base_and_dependencies_match_the_lock():
    (base,) = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    lock = (REPO / "requirements.lock").read_text()
    torch_version = re.search(r"^torch==(\S+)$", lock, re.M).group(1)
    assert base.startswith(f"pytorch/pytorch:{torch_version}-cuda"), base  # CUDA + NCCL, pinned tag
    assert "latest" not in base
    installs = [line for line in DOCKERFILE.splitlines() if "pip install" in line]
    assert installs and all("-c requirements.lock" in line for line in installs)
    image = read_dockerfile()
    assert image.uid != 0, "the image runs as a non-root user"
    assert {"HF_HOME", "WANDB_DIR"} <= set(image.env)
    assert all(image.env[key].startswith("/workspace/") for key in ("HF_HOME", "WANDB_DIR"))


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins, `!` re-includes, and a
    path is matched by a pattern that matches it or any folder above it."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            ignored = not negate
    return ignored


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [src for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M) for src in line.split()[:-1]]
    for source in copied:
        assert (REPO / source).exists(), source
        assert not _ignored(source.rstrip("/") + ("/__init__.py" if source == "trainer/" else ""), patterns)
    for path in (".venv/bin/python", "runs/demo/summary.json", "data/reviews/train.jsonl",
                 "tests/conftest.py", ".git/HEAD", "trainer/__pycache__/loop.cpython-311.pyc",
                 "benchmarks/results/cpu-minilm.json"):
        assert _ignored(path, patterns), path


def test_default_command_resolves_in_the_image_layout(tmp_path):
    """The CMD's trainer arguments, run with `check` in the image's WORKDIR, give a config
    whose output lands in the writable /workspace."""
    image = read_dockerfile()
    torchrun, *torchrun_args = image.cmd[: image.cmd.index("-m")]
    assert torchrun == "torchrun" and "--nproc-per-node=gpu" in torchrun_args
    module, command, *trainer_args = image.cmd[image.cmd.index("-m") + 1:]
    assert (module, command) == ("trainer", "train")
    app_dir = build_app_dir(image, tmp_path / "app")
    container = Container(image, app_dir, tmp_path / "container")
    result = subprocess.run([sys.executable, "-m", "trainer", "check", *trainer_args], cwd=app_dir,
                            env={**BASE_ENV, **image.env}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    output_dir = re.search(r"^output_dir: (.+)$", result.stdout, re.M).group(1)
    assert output_dir.startswith("/workspace/"), output_dir
    data_path = re.search(r"^  path: (.+)$", result.stdout, re.M).group(1)
    assert (app_dir / data_path / "train.jsonl").exists(), shlex.join(image.cmd)
    assert container.host_path(output_dir).is_relative_to(tmp_path / "container/workspace")


def test_every_shipped_config_writes_under_the_workspace_in_the_image(tmp_path):
    """configs/*.yaml run in the image (WORKDIR /app, root's) write their output_dir through
    the image's runs -> /workspace/runs link, on the volume the image's user owns: as the k8s
    README's recipe does with configs/yelp_bert.yaml."""
    image = read_dockerfile()
    app_dir = build_app_dir(image, tmp_path / "app")
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert configs
    for config in configs:
        output_dir = Path(yaml.safe_load(config.read_text())["output_dir"])
        in_image = os.path.realpath(output_dir if output_dir.is_absolute() else app_dir / output_dir)
        assert in_image.startswith("/workspace/"), (config.name, in_image)


def test_a_shipped_config_runs_on_a_fresh_workspace_volume(tmp_path):
    """A fresh volume over /workspace (a new PVC, as k8s/ mounts one) is empty, so the image's
    runs -> /workspace/runs link points nowhere yet. A shipped config's `output_dir: runs/...`
    must still work there, run as the image's user: the k8s README's recipe."""
    image = read_dockerfile()
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    argv = ["python", "-m", "trainer", "train", "-c", "configs/demo.yaml", "train.max_steps=2",
            "data.max_train_samples=64", "data.max_eval_samples=32", "wandb.mode=disabled"]
    node = Service("node0", [], argv, [], image.workdir, {"/workspace": pvc}, image.uid)
    started = run_services([node], image, build_app_dir(image, tmp_path / "app"), tmp_path, timeout=240)
    assert started.codes == [0], started.logs_tail()
    summary = pvc / "runs" / "demo" / "summary.json"
    assert summary.stat().st_uid == image.uid and json.loads(summary.read_text())["steps"] == 2
