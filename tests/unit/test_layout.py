"""The package's layers, as docs/layout.md draws them, held by reading the code.

- The training path never imports trainer/preflight/ (doctor, the forecast, the memory plan,
  the network probe, the grace check), not even lazily inside a function: what only a
  preflight needs costs training nothing and cannot break it.
- Which strategy runs is asked of the strategy object (trainer/strategies/), never decided
  by comparing train.strategy with a name elsewhere: a new strategy is a module and a line
  of registration.
- Subpackages' __init__ files are empty: importing one of their modules imports nothing else.
- No import cycle between modules, counting every import: lazy ones and those under
  TYPE_CHECKING too, which readers and type checkers follow as well.
- Test files have unique names across the tiers: pytest imports them by basename (the tiers
  are not packages), so a second tests/*/test_x.py stops collection of the whole suite.
"""

from __future__ import annotations

import ast
from pathlib import Path

import trainer

PACKAGE = Path(trainer.__file__).parent


def module_file(name: str) -> Path | None:
    if name == "trainer":
        return PACKAGE / "__init__.py"
    relative = Path(*name.split(".")[1:])
    for candidate in (PACKAGE / relative.with_suffix(".py"), PACKAGE / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_by(tree: ast.AST) -> set[str]:
    """Every trainer module an AST imports, at the top or inside a function (the package
    imports absolutely only)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from trainer import loop`
    return {name for name in found if name.split(".")[0] == "trainer" and module_file(name)}


def closure(start: dict[str, ast.AST]) -> dict[str, str]:
    """Each trainer module reachable from `start` (module: the AST it is entered by), with one
    module that imports it."""
    reached, queue = dict.fromkeys(start, "(start)"), list(start.items())
    while queue:
        name, tree = queue.pop()
        for imported in imported_by(tree):
            if imported not in reached:
                reached[imported] = name
                file = module_file(imported)
                assert file is not None
                queue.append((imported, ast.parse(file.read_text())))
    return reached


def train_entry() -> dict[str, ast.AST]:
    """What `python -m trainer train` runs: trainer/__main__.py's module level and the
    functions on the train command's way, with what they import lazily."""
    tree = ast.parse((PACKAGE / "__main__.py").read_text())
    on_the_way = {"main", "parse_args", "command_args", "setup_logging", "launch_env", "train_preflight", "run_train"}
    kept = [node for node in tree.body if not isinstance(node, ast.FunctionDef) or node.name in on_the_way]
    return {"trainer.__main__": ast.Module(body=kept, type_ignores=[])}


def test_the_training_path_never_imports_preflight():
    reached = closure(train_entry())
    assert "trainer.loop" in reached and "trainer.build" in reached  # the walk does reach the training path
    preflight = {name: by for name, by in reached.items() if name.startswith("trainer.preflight")}
    assert not preflight, f"the training path imports preflight modules (module: imported by): {preflight}"


def test_only_the_strategies_tell_the_strategies_apart():
    """No comparison of a `.strategy` (train.strategy) with a string outside trainer/strategies/;
    the config's own cross-key checks (trainer/config.py) are the schema's."""
    compared = []
    for file in sorted(PACKAGE.rglob("*.py")):
        relative = file.relative_to(PACKAGE).as_posix()
        if relative.startswith("strategies/") or relative == "config.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "strategy"]
                strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
                if names and strings:
                    compared.append(f"{relative}:{node.lineno}")
    assert not compared, f"train.strategy compared with a name: {compared}"


def module_name(file: Path) -> str:
    parts = file.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("trainer", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_no_import_cycle_between_modules():
    graph = {module_name(file): imported_by(ast.parse(file.read_text())) for file in sorted(PACKAGE.rglob("*.py"))}
    assert len(graph) > 60 and "trainer.strategies.base" in graph["trainer.build"]  # the walk sees the package
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "on the path"
        for imported in sorted(graph[module] - {module}):
            if state.get(imported) == "on the path":
                cycles.append(" -> ".join([*path[path.index(imported):], imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_subpackages_init_files_are_empty():
    inits = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    assert inits == ["checkpoint/__init__.py", "faults/__init__.py", "preflight/__init__.py", "strategies/__init__.py",
                     "sweep/__init__.py", "tasks/__init__.py"]
    assert all(not (PACKAGE / init).read_text().strip() for init in inits)


def test_test_files_have_unique_names_across_tiers():
    tests = Path(__file__).parents[1]
    names = [p.name for p in tests.glob("*/test_*.py")]
    assert len(names) > 50
    assert sorted({n for n in names if names.count(n) > 1}) == []
