"""What of the config the run writes down (config.yaml, each checkpoint's, the model card, wandb's
config): every value resolved, except one taken from the environment, which is written as
`${oc.env:NAME}` and read as set; and an environment variable named like a secret refused.
That no file of a run (the pushed ones too) holds such a value: tests/e2e/test_hub_models.py."""

from __future__ import annotations

import sys
import types

import pytest
from omegaconf import OmegaConf
from support.runs import tiny_overrides

from trainer.checkpoint.resume import config_changes
from trainer.cli import run_config
from trainer.config import loading
from trainer.errors import ConfigError
from trainer.runtime.environment import DistEnv
from trainer.train import tracking

MARK = "lab-note-7f3a9c"


@pytest.mark.parametrize(("variable", "override", "key"), [
    ("HF_TOKEN", "wandb.name=${oc.env:HF_TOKEN}", "wandb.name"),
    ("WANDB_API_KEY", "wandb.tags=[run, '${oc.env:WANDB_API_KEY}']", "wandb.tags"),
    ("AWS_SECRET_ACCESS_KEY", "data.name=${oc.env:AWS_SECRET_ACCESS_KEY,none}", "data.name"),
    ("DB_PASSWORD", "wandb.project=p-${oc.env:DB_PASSWORD}", "wandb.project"),
])
def test_a_secret_from_the_environment_is_refused_in_one_line_naming_the_key(tiny_model, reviews, tmp_path,
                                                                            monkeypatch, variable, override, key):
    monkeypatch.setenv(variable, MARK)
    with pytest.raises(ConfigError) as refused:
        run_config.load(None, [*tiny_overrides(tiny_model, reviews, tmp_path / "run"), override])
    message = str(refused.value)
    assert message.startswith(f"{key}: ${{oc.env:{variable}}} would write a secret") and "\n" not in message
    assert MARK not in message


def test_a_value_from_the_environment_is_read_as_set_and_written_as_written(tiny_model, reviews, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("LAB_NOTE", MARK)
    monkeypatch.setenv("MAX_LENGTH", "64")
    overrides = [*tiny_overrides(tiny_model, reviews, tmp_path / "run"), "train.eval_batch_size=4"]
    cfg = run_config.load(None, [*overrides, "wandb.name=${oc.env:LAB_NOTE}", "wandb.project=p-${wandb.name}",
                             "wandb.tags=[run, '${oc.env:LAB_NOTE}']", "data.max_length=${oc.env:MAX_LENGTH}",
                             "train.batch_size=${train.eval_batch_size}"])
    assert (cfg.wandb.name, cfg.wandb.project, list(cfg.wandb.tags)) == (MARK, f"p-{MARK}", ["run", MARK])
    assert cfg.data.max_length == 64 and loading.to_dict(cfg)["wandb"]["project"] == f"p-{MARK}"
    written = loading.to_yaml(cfg)
    assert MARK not in written and MARK not in repr(loading.written_dict(cfg))
    assert loading.written_dict(cfg)["wandb"] == {**loading.to_dict(cfg)["wandb"], "name": "${oc.env:LAB_NOTE}",
                                                 "project": "p-${wandb.name}", "tags": ["run", "${oc.env:LAB_NOTE}"]}
    assert "max_length: ${oc.env:MAX_LENGTH}" in written and "  batch_size: 4" in written  # the rest resolved
    # What was written is a config again, read in this environment; a resume from it changes nothing.
    (tmp_path / "written.yaml").write_text(written)
    assert loading.to_dict(run_config.load(str(tmp_path / "written.yaml"))) == loading.to_dict(cfg)
    assert config_changes(OmegaConf.create(written), cfg) == ([], [])
    # The variable gone, and the value given instead: the saved key is compared as written.
    monkeypatch.delenv("MAX_LENGTH")
    refused, _ = config_changes(OmegaConf.create(written), run_config.load(None, [*overrides, "data.max_length=64"]))
    assert [tuple(change) for change in refused] == [("data.max_length", "${oc.env:MAX_LENGTH}", 64)]


def test_wandb_gets_the_config_as_written(tiny_model, reviews, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_NOTE", MARK)
    started: dict = {}
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: started.update(kwargs)  # type: ignore[attr-defined]
    wandb.Settings = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = run_config.load(None, [*tiny_overrides(tiny_model, reviews, tmp_path / "run"), "wandb.mode=offline",
                             "data.name=${oc.env:LAB_NOTE}"])
    tracking.Tracker(cfg, DistEnv()).start("run1", 0)
    assert started["config"]["data"]["name"] == "${oc.env:LAB_NOTE}" and MARK not in repr(started)
