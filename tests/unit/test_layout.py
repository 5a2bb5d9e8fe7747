"""The package's layers, as docs/layout.md draws them, held by reading the code.

- The training path never imports trainer/preflight/ (doctor, the forecast, the memory plan,
  the network probe, the grace check), not even lazily inside a function: what only a
  preflight needs costs training nothing and cannot break it.
- Which strategy runs is asked of the strategy object (trainer/strategies/), never decided
  by comparing train.strategy with a name elsewhere, the config's checks included: a new
  strategy is a module and a line of registration. The same for the task (trainer/tasks/)
  and data.problem_type.
- Every module sits in a layer of docs/layout.md's "Layers" and imports from its own layer or
  below, counting every import; no two packages (a root module counts as one) import each
  other, even through others.
- Subpackages' __init__ files are empty: importing one of their modules imports nothing else.
- No import cycle between modules, counting every import: lazy ones and those under
  TYPE_CHECKING too, which readers and type checkers follow as well.
- Test files have unique names across the tiers: pytest imports them by basename (the tiers
  are not packages), so a second tests/*/test_x.py stops collection of the whole suite.
"""

from __future__ import annotations

import ast
import re
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
    """What `python -m trainer train` runs: trainer/cli/main.py's module level and the
    functions on the train command's way, with what they import lazily."""
    tree = ast.parse((PACKAGE / "cli" / "main.py").read_text())
    on_the_way = {"main", "_parsers", "parse_args", "command_args", "setup_logging", "launch_env", "train_preflight",
                  "run_train"}
    kept = [node for node in tree.body if not isinstance(node, ast.FunctionDef) or node.name in on_the_way]
    return {"trainer.__main__": ast.parse((PACKAGE / "__main__.py").read_text()),
            "trainer.cli.main": ast.Module(body=kept, type_ignores=[])}


def test_the_training_path_never_imports_preflight():
    reached = closure(train_entry())
    assert "trainer.train.loop" in reached and "trainer.train.build" in reached  # the walk does reach the training path
    preflight = {name: by for name, by in reached.items() if name.startswith("trainer.preflight")}
    assert not preflight, f"the training path imports preflight modules (module: imported by): {preflight}"


def compared_with_a_name(tree: ast.AST, attribute: str) -> list[int]:
    """The lines where `<x>.<attribute>` or a variable `<attribute>` is compared with a string,
    or tested against strings (`in ("ddp", "fsdp")`)."""
    def names_a_string(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(names_a_string(e) for e in node.elts)

    def is_the_key(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == attribute) or (
            isinstance(node, ast.Name) and node.id == attribute)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(is_the_key, sides)) and any(map(names_a_string, sides)):
                found.append(node.lineno)
    return found


def compared_outside(package: str, attribute: str) -> list[str]:
    return [f"{file.relative_to(PACKAGE).as_posix()}:{line}" for file in sorted(PACKAGE.rglob("*.py"))
            if not file.relative_to(PACKAGE).as_posix().startswith(f"{package}/")
            for line in compared_with_a_name(ast.parse(file.read_text()), attribute)]


def test_only_the_strategies_tell_the_strategies_apart():
    """No comparison of train.strategy with a name outside trainer/strategies/, the config's
    checks included: what a strategy asks of the config is its own rule."""
    assert not compared_outside("strategies", "strategy"), "train.strategy compared with a name"


def test_only_the_tasks_tell_the_tasks_apart():
    """No comparison of data.problem_type (a task's name) outside trainer/tasks/: what a task's
    labels are, how they are read, encoded and weighed, and what it asks of the config, the
    task says."""
    assert not compared_outside("tasks", "problem_type"), "data.problem_type compared with a name"


def test_the_name_check_sees_every_form():
    tree = ast.parse("a = cfg.train.strategy == 'ddp'\nb = 'fsdp' != x.strategy\nc = x.strategy in ('dp', 'ddp')\n"
                     "d = x.strategy == y\ne = x.other == 'ddp'\nf = strategy == 'ddp'")
    assert compared_with_a_name(tree, "strategy") == [1, 2, 3, 6]


def module_name(file: Path) -> str:
    parts = file.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("trainer", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert len(graph) > 60 and "trainer.strategies.base" in graph["trainer.train.build"]  # the walk sees the package
    assert not cycles_in(graph), "import cycles:\n" + "\n".join(cycles_in(graph))


LAYOUT = PACKAGE.parent / "docs" / "layout.md"


def layers() -> dict[str, int]:
    """docs/layout.md's layers, from the bottom: each package (`runtime/`) or root module
    (`errors.py`, `__main__.py`) listed on the section's numbered lines, and its layer."""
    section = LAYOUT.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    listed = {}
    for line in section.splitlines():
        number, dot, rest = line.partition(". ")
        if dot and number.isdigit():
            for name in re.findall(r"`([\w.]+/|[\w.]+\.py)`", rest):
                listed[name.removesuffix("/").removesuffix(".py")] = int(number)
    return listed


def unit_of(module: str) -> str:
    """A module's package under trainer/, or the root module itself (`errors`)."""
    return module.split(".")[1]


def import_graph() -> dict[str, set[str]]:
    return {module_name(file): imported_by(ast.parse(file.read_text())) - {"trainer"}
            for file in sorted(PACKAGE.rglob("*.py")) if file != PACKAGE / "__init__.py"}


def back_edges(graph: dict[str, set[str]], layer: dict[str, int]) -> list[str]:
    return sorted(f"{module} (layer {layer[unit_of(module)]}) imports {imported} (layer {layer[unit_of(imported)]})"
                  for module, imports in graph.items() for imported in imports
                  if layer[unit_of(imported)] > layer[unit_of(module)])


def test_every_module_sits_in_a_layer_of_the_layout():
    layer, graph = layers(), import_graph()
    assert len(set(layer.values())) >= 10  # the section is read
    unplaced = sorted({unit_of(module) for module in graph} - layer.keys())
    assert not unplaced, f"in no layer of docs/layout.md: {unplaced}"
    assert not layer.keys() - {unit_of(module) for module in graph}, "docs/layout.md lists what is not there"


def test_no_import_runs_against_the_layers():
    found = back_edges(import_graph(), layers())
    assert not found, "imports against docs/layout.md's layers:\n" + "\n".join(found)


def test_the_layer_check_catches_a_back_edge():
    """What a lazy import from the loop in a low module would look like, caught."""
    layer = layers()
    graph = {"trainer.runtime.distributed": {"trainer.errors"}, "trainer.data.labels": {"trainer.train.loop"}}
    expected = f"trainer.data.labels (layer {layer['data']}) imports trainer.train.loop (layer {layer['train']})"
    assert back_edges(graph, layer) == [expected]


def test_no_import_cycle_between_packages():
    units: dict[str, set[str]] = {}
    for module, imports in import_graph().items():
        units.setdefault(unit_of(module), set()).update(unit_of(i) for i in imports if unit_of(i) != unit_of(module))
    assert not cycles_in(units), "packages that import each other:\n" + "\n".join(cycles_in(units))


def cycles_in(graph: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "on the path"
        for nxt in sorted(graph.get(node, set()) - {node}):
            if state.get(nxt) == "on the path":
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_the_cycle_check_catches_a_cycle():
    assert cycles_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert cycles_in({"a": {"b"}, "b": set()}) == []


def test_subpackages_init_files_are_empty():
    inits = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    assert inits == [f"{package}/__init__.py" for package in ("checkpoint", "cli", "config", "data", "faults", "model",
                                                              "outputs", "preflight", "runtime", "scoring",
                                                              "strategies", "sweep", "tasks", "train")]
    assert all(not (PACKAGE / init).read_text().strip() for init in inits)


def test_test_files_have_unique_names_across_tiers():
    tests = Path(__file__).parents[1]
    names = [p.name for p in tests.glob("*/test_*.py")]
    assert len(names) > 50
    assert sorted({n for n in names if names.count(n) > 1}) == []


def modules_listed() -> set[str]:
    """docs/layout.md's "The modules, layer by layer": each module named under its folder's
    heading (`**Data** (`trainer/data/`)`), as a path under trainer/."""
    section = LAYOUT.read_text().split("\n## The modules, layer by layer\n", 1)[1].split("\n## ", 1)[0]
    listed, folder = set(), None
    for line in section.splitlines():
        heading = re.match(r"\*\*[^*]+\*\* \(`trainer/([\w/]*)`", line)
        if heading:
            folder = heading.group(1)
            listed |= set(re.findall(r"`trainer/(\w+\.py)`", line))  # a root module beside the folder
        elif line.startswith("**"):
            folder = None  # outside the package
        elif folder is not None:
            listed |= {f"{folder}{name}" for name in re.findall(r"`(\w+\.py)`", line)}
    return listed


def test_docs_layout_lists_every_module_under_its_folder():
    on_disk = {str(file.relative_to(PACKAGE)) for file in PACKAGE.rglob("*.py") if file.name != "__init__.py"}
    listed = modules_listed()
    assert len(listed) > 50  # the section is read
    assert not on_disk - listed, f"not listed in docs/layout.md: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"docs/layout.md lists what is not there: {sorted(listed - on_disk)}"
