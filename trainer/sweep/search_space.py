"""The search space: sweep.parameters read into each key's values or range, checked against
the schema, expanded into a grid, and sampled through an Optuna trial.

A swept key must be a config key the sweep does not set itself, and each of its values (a
range's ends) must pass that key's own check: the config is loaded with it, so the schema's
checks are the only ones. All of it before any trial starts, each problem in one line.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.errors import ConfigError

Scalar = str | int | float | bool | None

SET_BY_THE_SWEEP = ("seed", "output_dir", "data.folds", "data.fold")
"""Keys each trial gets from the sweep (sweep.seeds, sweep.folds, its folder): not swept."""

RANGE_KEYS = {"low", "high", "log", "count"}


@dataclass(frozen=True)
class Range:
    """Values from low to high (ints where both ends are ints), log-spaced with `log`. A grid
    takes `count` of them, evenly spaced; random and tpe sample between the ends."""

    low: float
    high: float
    log: bool = False
    count: int | None = None

    @property
    def integer(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int)

    def points(self) -> list[Scalar]:
        assert self.count is not None
        spaced = (np.geomspace if self.log else np.linspace)(self.low, self.high, self.count)
        if self.integer:
            return list(dict.fromkeys(int(np.rint(v)) for v in spaced))
        return [float(v) for v in spaced]


@dataclass(frozen=True)
class Space:
    choices: dict[str, list[Scalar] | Range]
    """Each swept key, dotted, and its values or range, in the order written."""

    def grid(self) -> dict[str, list[Scalar]]:
        """Each key's values on the grid (a range by its `count` points)."""
        grid = {}
        for name, choice in self.choices.items():
            if isinstance(choice, Range):
                if choice.count is None:
                    raise ConfigError(f"sweep.parameters.{name}: a range needs `count` (how many points) for "
                                      "sweep.method=grid; or use method random or tpe")
                grid[name] = choice.points()
            else:
                grid[name] = list(choice)
        return grid

    def settings(self) -> list[dict[str, Scalar]]:
        """Every combination of the grid, the first key's values outermost."""
        grid = self.grid()
        return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]

    def place(self, setting: Mapping[str, Scalar]) -> int:
        """The setting's place in `settings()`, counted from each key's place among its values
        (the first key's the most significant), without building the grid's product.

        This place, not Optuna's, names a grid setting's runs' folders: a job array
        (command.array_runs) runs the grid without Optuna, and a sweep started after it must
        find those folders. GridSampler's `grid_id` is no such place: it indexes the
        sampler's own product (keys sorted by name) shuffled by its seed."""
        place = 0
        for name, values in self.grid().items():
            place = place * len(values) + values.index(setting[name])
        return place

    def suggest(self, trial) -> dict[str, Scalar]:
        """A setting from an Optuna trial (whose sampler decides: grid, random or TPE)."""
        setting: dict[str, Scalar] = {}
        for name, choice in self.choices.items():
            if isinstance(choice, list):
                setting[name] = trial.suggest_categorical(name, choice)
            elif choice.integer:
                setting[name] = trial.suggest_int(name, int(choice.low), int(choice.high), log=choice.log)
            else:
                setting[name] = trial.suggest_float(name, float(choice.low), float(choice.high), log=choice.log)
        return setting


def override(name: str, value: Scalar) -> str:
    """`name=value` as an override that reads back as the same value."""
    return f"{name}={json.dumps(value)}"


def parse(parameters: Mapping[str, Any], known_keys: Mapping[str, Any]) -> Space:
    """sweep.parameters (dotted keys, or nested as `key=value` overrides write them) as a
    Space; a key that is no config key, or is set by the sweep, or a malformed list or
    range, is a ConfigError naming it."""
    choices: dict[str, list[Scalar] | Range] = {}
    for name, spec in _leaves(parameters, ""):
        where = f"sweep.parameters.{name}"
        if name not in known_keys:
            raise ConfigError(f"{where}: {name} is not a config key")
        if name in SET_BY_THE_SWEEP or name.startswith("sweep."):
            raise ConfigError(f"{where}: {name} is set by the sweep itself (sweep.seeds, sweep.folds, its folders)")
        choices[name] = _range(where, spec) if isinstance(spec, Mapping) else _values(where, spec)
    return Space(choices)


def _leaves(node: Mapping[str, Any], prefix: str):
    for name, spec in node.items():
        dotted = f"{prefix}{name}"
        if isinstance(spec, Mapping) and not (set(spec) & RANGE_KEYS):
            yield from _leaves(spec, f"{dotted}.")
        else:
            yield dotted, spec


def _values(where: str, spec: Any) -> list[Scalar]:
    if not isinstance(spec, list | tuple) or not spec:
        raise ConfigError(f"{where}: expected a list of values or a range {{low, high, log}}, got {spec!r}")
    if not all(v is None or isinstance(v, str | int | float | bool) for v in spec):
        raise ConfigError(f"{where}: each value must be a number, a string, true/false or null, got {list(spec)!r}")
    if len(set(map(json.dumps, spec))) != len(spec):
        raise ConfigError(f"{where}: a value is listed twice: {list(spec)!r}")
    return list(spec)


def _range(where: str, spec: Mapping[str, Any]) -> Range:
    unknown = set(spec) - RANGE_KEYS
    if unknown or not {"low", "high"} <= set(spec):
        raise ConfigError(f"{where}: a range is {{low, high}} with optional log and count, got {dict(spec)!r}")
    low, high, log, count = spec["low"], spec["high"], spec.get("log", False), spec.get("count")
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high))
    if not numbers or not low < high:
        raise ConfigError(f"{where}: low and high must be numbers, low below high, got {low!r} and {high!r}")
    if not isinstance(log, bool) or (log and low <= 0):
        raise ConfigError(f"{where}: log must be true or false, and a log range must start above 0")
    if count is not None and (type(count) is not int or count < 2):
        raise ConfigError(f"{where}: count must be an integer >= 2, got {count!r}")
    return Range(low, high, log, count)


def check_values(space: Space, load: Callable[[list[str]], Any]) -> None:
    """Each value (a range's ends) loaded into the config by `load(overrides)`: a value its
    key's check or the keys around it refuse is a ConfigError naming the swept key."""
    for name, choice in space.choices.items():
        values = [choice.low, choice.high] if isinstance(choice, Range) else choice
        for value in values:
            try:
                load([override(name, value)])
            except ConfigError as e:
                raise ConfigError(f"sweep.parameters.{name}: {value!r} is refused: {e}") from None


def check_size(space: Space, method: str, trials: int | None) -> int:
    """How many settings the sweep tries: sweep.trials, or the grid's size. A grid larger than
    sweep.trials is refused (some of it would never run), as are random and tpe without a count."""
    if method == "grid":
        size = len(space.settings())
        if trials is not None and size > trials:
            raise ConfigError(f"sweep.trials: the grid has {size} settings, more than sweep.trials={trials}; "
                              f"raise it or leave it null")
        return size
    if trials is None:
        raise ConfigError(f"sweep.trials: sweep.method={method} needs a number of settings to try")
    return trials
