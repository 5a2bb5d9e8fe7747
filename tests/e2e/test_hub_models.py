"""Models as users name them on the Hub (tests/support/fake_hub.py, on loopback): a revision pinned,
a gated repository opened by HF_TOKEN, and a repository that ships its own modeling code,
which runs only when model.trust_remote_code says so. The token reaches the Hub and nothing
else: not the log, not a file of the run."""

from __future__ import annotations

import json
import shutil

from support.fake_hub import COMMIT, FakeHub, commit
from support.outputs import model_card, read_summary
from support.runs import PYTHON, run, tiny_overrides, trainer_command

REPO, CUSTOM = "acme/tiny-bert", "acme/tiny-custom"
SECRET = "hf_NotARealTokenButSecret123"
NOTE = "lab-note-5d1e8b"


def hub_env(hub: FakeHub, tmp_path, **extra) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf-home"), **extra}


def another_revision(model, folder):
    """`model` with another classifier bias: what a newer commit of the repository holds."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    weights["classifier.bias"] = weights["classifier.bias"] + 1.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_gated_model_at_a_pinned_revision_loads_with_the_token_which_is_written_nowhere(tiny_model, reviews,
                                                                                        tmp_path):
    out = tmp_path / "run"
    overrides = tiny_overrides(REPO, reviews, out, **{"model.revision": "v2", "train.max_steps": 2})
    revisions = {"main": tiny_model, "v2": another_revision(tiny_model, tmp_path / "v2")}
    with FakeHub({REPO: revisions}, tokens={REPO: SECRET}) as hub:
        refused = run(trainer_command(overrides, None, command="check"), env=hub_env(hub, tmp_path / "no-token"))
        trained = run(trainer_command(overrides, None), env=hub_env(hub, tmp_path, HF_TOKEN=SECRET))
    # Without the token: check says why it could not plan (the job's nodes may have one).
    assert refused.returncode == 0 and (f"model.name: {REPO}: the Hub refused access (a gated or private model): set "
                                        "HF_TOKEN to a token that has been granted access to it") in refused.output
    assert trained.returncode == 0, trained.output[-3000:]
    assert read_summary(out)["model"] == {"name": REPO, "revision": "v2", "commit": commit("v2")}
    card = model_card(out / "final")
    assert card.data.base_model == REPO and f"fine-tuned from `{REPO}` at commit `{commit('v2')}`" in card.text
    assert hub.downloads[f"{REPO}@v2/model.safetensors"] == 1 and f"{REPO}/model.safetensors" not in hub.downloads
    assert hub.authorizations == {f"Bearer {SECRET}"}
    assert SECRET not in trained.output
    written = [path for path in out.rglob("*") if path.is_file()]
    assert len(written) > 10 and not [path for path in written if SECRET.encode() in path.read_bytes()]


def with_own_code(model, folder):
    """`model` as a repository of a new architecture: its config names classes in Python files
    the repository ships (auto_map), as models newer than transformers are published."""
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny-custom", architectures=["TinyForSequenceClassification"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyConfig",
                            "AutoModelForSequenceClassification": "modeling_tiny.TinyForSequenceClassification"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_tiny.py").write_text(
        "from transformers import BertConfig\n\n\nclass TinyConfig(BertConfig):\n    model_type = 'tiny-custom'\n")
    (folder / "modeling_tiny.py").write_text(
        "from transformers import BertForSequenceClassification\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForSequenceClassification(BertForSequenceClassification):\n    config_class = TinyConfig\n")
    return folder


def test_a_model_that_ships_its_own_code_runs_it_only_when_trusted(tiny_model, reviews, tmp_path):
    out = tmp_path / "run"
    overrides = tiny_overrides(CUSTOM, reviews, out, **{"train.max_steps": 2})
    with FakeHub({CUSTOM: with_own_code(tiny_model, tmp_path / "custom")}) as hub:
        refused = run(trainer_command(overrides, None, command="check"), env=hub_env(hub, tmp_path))
        trusted = run(trainer_command([*overrides, "model.trust_remote_code=true"], None), env=hub_env(hub, tmp_path))
    errors = [line for line in refused.output.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and errors == [(
        f"error: model.trust_remote_code: model.name {CUSTOM} ships its own modeling code: set "
        "model.trust_remote_code=true to run it (Python from the Hub, run on every node), or use a model "
        "transformers has")], refused.output[-3000:]
    assert trusted.returncode == 0, trusted.output[-3000:]
    assert f"model.trust_remote_code: {CUSTOM} runs the modeling code its repository ships" in trusted.output
    assert read_summary(out)["model"] == {"name": CUSTOM, "revision": None, "commit": COMMIT}
    assert json.loads((out / "final" / "config.json").read_text())["auto_map"]


def files_of(folder) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_final_is_pushed_with_its_card_and_a_refused_push_at_the_end_loses_nothing(tiny_model, reviews, tmp_path):
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_model, reviews, out, **{
        "train.max_steps": 2, "model.lora.r": 4, "model.lora.alpha": 8, "checkpoint.export_adapter": True,
        "checkpoint.every": 1, "hub.push_at_end": True, "hub.repo_id": "acme/pushed",
        "wandb.name": "${oc.env:LAB_NOTE}"})  # from the environment: written as written, read as set
    push = [PYTHON, "-m", "trainer", "push", str(out), "--repo-id"]
    with FakeHub({}, uploads=tmp_path / "hub", write_token=SECRET) as hub:
        at_end = run(trainer_command(overrides, None), env=hub_env(hub, tmp_path, LAB_NOTE=NOTE))  # no HF_TOKEN
        token = hub_env(hub, tmp_path, HF_TOKEN=SECRET)
        secret_in_config = run(trainer_command([*overrides, "wandb.name=${oc.env:HF_TOKEN}"], None),
                               env={**token, "LAB_NOTE": NOTE})
        later = run([*push, "acme/pushed", "--revision", "v1"], env=token)
        adapter = run([*push, "acme/pushed-adapter", "--adapter", "--public"], env=token)
    # Refused at the end: one error line, the run done all the same, final/ kept.
    assert at_end.returncode == 0, at_end.output[-3000:]
    errors = [line for line in at_end.output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "push: acme/pushed: " in errors[0] and "401" in errors[0], at_end.output[-3000:]
    assert errors[0].endswith(f"final/ is kept: upload it with python -m trainer push {out} --repo-id acme/pushed")
    hub_summary = read_summary(out)["hub"]
    assert hub_summary["commit_url"] is None and hub_summary["error"].startswith("push: acme/pushed: ")
    assert (out / "final" / "model.safetensors").is_file()
    # Pushed later: every file of final/ (its card, the adapter's folder) in one commit on the branch,
    # private unless --public says otherwise.
    assert later.returncode == 0 and adapter.returncode == 0, later.output[-3000:] + adapter.output[-3000:]
    assert later.output.strip().splitlines()[-1].startswith(f"{hub.endpoint}/acme/pushed/commit/")
    assert files_of(tmp_path / "hub" / "acme" / "pushed" / "v1") == files_of(out / "final")
    assert {"README.md", "model.safetensors", "adapter/README.md"} <= files_of(out / "final").keys()
    assert files_of(tmp_path / "hub" / "acme" / "pushed-adapter" / "main") == files_of(out / "final" / "adapter")
    assert hub.created == {"acme/pushed": "private", "acme/pushed-adapter": "public"}
    assert [entry[:2] for entry in hub.commits] == [("acme/pushed", "v1"), ("acme/pushed-adapter", "main")]
    # The value from the environment is in no file of the run, nor pushed: each says ${oc.env:LAB_NOTE}.
    written = [path for folder in (out, tmp_path / "hub") for path in folder.rglob("*") if path.is_file()]
    assert len(list(out.glob("checkpoints/step-*/config.yaml"))) >= 2, sorted(map(str, written))
    assert [path for path in written if NOTE.encode() in path.read_bytes()] == []
    assert "name: ${oc.env:LAB_NOTE}" in (out / "final" / "README.md").read_text()
    # A secret from the environment is refused in one line, before a file is written or the token shown.
    refusals = [line for line in secret_in_config.output.splitlines() if line.startswith("error: ")]
    assert secret_in_config.returncode == 2 and refusals == [(
        "error: wandb.name: ${oc.env:HF_TOKEN} would write a secret into config.yaml, the checkpoints, the model "
        "card and wandb; no key takes one (HF_TOKEN and WANDB_API_KEY are read from the environment as they "
        "are): remove it")], secret_in_config.output[-3000:]
    assert SECRET not in secret_in_config.output
    assert [path for path in written if SECRET.encode() in path.read_bytes()] == []
