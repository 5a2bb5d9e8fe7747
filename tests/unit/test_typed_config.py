"""The code reads the config as the schema's types (trainer/config/schema.py), so that mypy
(`make lint`) checks every key it reads: a misspelled one fails the lint, not a run hours in."""

from __future__ import annotations

import ast
from pathlib import Path

from mypy import api

import trainer
from trainer.config import schema

PACKAGE = Path(trainer.__file__).parent
SECTIONS = {name for name, value in vars(schema).items() if isinstance(value, type) and name.endswith("Config")}


def test_every_config_parameter_is_typed_by_the_schema():
    """A function parameter holding the config or a section of it (`cfg`, `data_cfg`, ...) is
    annotated with the schema's class: unannotated, or as OmegaConf's untyped DictConfig, mypy
    would check none of its keys. trainer/config/ itself loads and checks the DictConfig that becomes one."""
    untyped = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                    if arg.arg.endswith("cfg"):
                        names = set() if arg.annotation is None else \
                            {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}
                        if not names & SECTIONS:
                            shown = "unannotated" if arg.annotation is None else ast.unparse(arg.annotation)
                            untyped.append(f"{file.relative_to(PACKAGE)}:{node.lineno} {arg.arg}: {shown}")
    assert len(SECTIONS) > 10
    assert not untyped, "config parameters mypy cannot check:\n" + "\n".join(untyped)


def test_a_misspelled_key_fails_the_type_check(monkeypatch):
    """trainer/train/policy.py as it is, then with one key misspelled: mypy passes the first
    and names the key in the second."""
    source = (PACKAGE / "train" / "policy.py").read_text()
    assert "train.log_every" in source
    misspelled = source.replace("train.log_every", "train.log_evry", 1)
    line = misspelled[:misspelled.index("train.log_evry")].count("\n") + 1
    monkeypatch.chdir(PACKAGE.parent)  # where mypy finds `trainer`
    # Not pyproject.toml's settings: they name the files to check, and -c checks a text.
    options = ["--no-incremental", "--config-file=", "--python-version=3.11", "--follow-imports=silent"]
    assert api.run([*options, "-c", source])[2] == 0
    report, _, status = api.run([*options, "-c", misspelled])
    assert status == 1
    assert f'<string>:{line}: error: "TrainConfig" has no attribute "log_evry"' in report, report
