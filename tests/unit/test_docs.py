"""The docs hold together: the config reference is the schema's, and every relative link and
every section that code names ("docs/faults.md, "Hangs and lost nodes"") exists."""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_table", REPO / "docs" / "gen_config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markdown_files() -> list[Path]:
    """README.md, every doc in docs/, and the launchers' READMEs (slurm/, k8s/)."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted(REPO.glob("*/README.md"))]


def _strip_fences(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)


def _prose(markdown: str) -> str:
    """Markdown without its fenced code blocks and code spans, where `](` is not a link."""
    return re.sub(r"`[^`\n]*`", "", _strip_fences(markdown))


def _headings(markdown: str) -> list[str]:
    return [h.replace("`", "") for h in re.findall(r"^#{1,6}\s+(.*?)\s*$", _strip_fences(markdown), flags=re.M)]


def _anchors(markdown: str) -> set[str]:
    """GitHub's ids for a file's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in _headings(markdown)}


def test_config_reference_is_generated_from_the_schema():
    generator = _generator()
    current = generator.DOC.read_text()
    wanted = generator.rendered_doc(current)
    diff = "".join(list(difflib.unified_diff(current.splitlines(True), wanted.splitlines(True),
                                             "docs/config.md", "generated", n=0))[:40])
    assert current == wanted, f"docs/config.md is out of date: run python docs/gen_config_table.py\n{diff}"


def test_every_schema_key_is_in_the_reference():
    from omegaconf import OmegaConf

    from trainer.config.schema import Config

    table = _generator().render()
    missing = [key for key in _flat_keys(OmegaConf.to_container(OmegaConf.structured(Config)))
               if f"| `{key}` |" not in table]
    assert not missing, f"keys missing from the generated reference: {missing}"


def _flat_keys(container: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in container.items():
        keys += _flat_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [f"{prefix}{name}"]
    return keys


def test_relative_links_resolve():
    broken = []
    for doc in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(REPO)}: ({target})"
            if not file.exists():
                broken.append(f"{where}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{where}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


# `(docs/faults.md, "Hangs and lost nodes")` in a log message, a comment or a docstring.
SECTION_REFERENCE = re.compile(r"(docs/[\w.-]+\.md)(?:,\s*\\?\"([^\"\\\n]+)\\?\")?")


def test_sections_named_in_code_exist():
    sources = [*REPO.glob("trainer/**/*.py"), *REPO.glob("benchmarks/**/*.py"), *REPO.glob("configs/*.yaml"),
               *REPO.glob("k8s/**/*.yaml"), *REPO.glob("slurm/*"), *REPO.glob("docker-compose*.yml"),
               REPO / "Dockerfile", REPO / "Makefile"]
    broken = []
    for source in sources:
        if not source.is_file():
            continue
        for doc, section in SECTION_REFERENCE.findall(source.read_text(errors="ignore")):
            where = f"{source.relative_to(REPO)}: {doc}" + (f', "{section}"' if section else "")
            if not (REPO / doc).is_file():
                broken.append(f"{where}: no such file")
            elif section and not any(h.startswith(section) for h in _headings((REPO / doc).read_text())):
                broken.append(f"{where}: no such section")
    assert not broken, "references to missing docs:\n" + "\n".join(broken)


# `trainer/faults/watchdog.py`, `docs/config.md`: a repository path in a code span; `test_resume.py`: a test
# file named by its name alone, wherever its tier puts it.
REPO_PATH = re.compile(r"`((?:trainer|tests|configs|slurm|k8s|benchmarks|docs)/[\w./-]+\.(?:py|md|ya?ml|sh|json))`")
TEST_FILE = re.compile(r"`(test_\w+\.py)`")


def test_files_the_docs_name_exist():
    tests = {path.name for path in (REPO / "tests").rglob("test_*.py")}
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = doc.read_text()
        missing += [f"{doc.relative_to(REPO)}: {path}" for path in REPO_PATH.findall(text)
                    if not (REPO / path).exists()]
        missing += [f"{doc.relative_to(REPO)}: {name}" for name in TEST_FILE.findall(text) if name not in tests]
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_demo_data_commands_the_readme_shows_run_as_written(tmp_path, monkeypatch):
    """The README's `python -m trainer.data.demo` (the demo's, without its folder) and its
    "Your own data" ones, run with their arguments as shown."""
    import sys

    from trainer.data import demo

    commands = re.findall(r"python -m trainer\.data\.demo([^`#\n]*)", (REPO / "README.md").read_text())
    assert [args.split() for args in commands] == [[], ["data/sentiment", "--shape", "sentiment"],
                                                   ["data/preferences", "--shape", "preferences"]]
    monkeypatch.chdir(tmp_path)
    for args in commands:
        monkeypatch.setattr(sys, "argv", ["python -m trainer.data.demo", *args.split()])
        demo.main()
    assert (tmp_path / "data" / "reviews" / "train.jsonl").is_file()
    assert (tmp_path / "data" / "sentiment" / "reviews.csv").is_file()
    assert (tmp_path / "data" / "preferences" / "preferences.jsonl").is_file()


def test_the_readme_lists_the_configs_as_they_are():
    """Every config in configs/, and every model folder under configs/models/, is named in the
    README's list of them; and the README names none that is not there."""
    text = (REPO / "README.md").read_text()
    start = text.index("`configs/`: ")
    listing = text[start:text.index("Every\nkey", start)]
    shipped = {path.name for path in (REPO / "configs").glob("*.yaml")}
    shipped |= {f"models/{path.name}/" for path in (REPO / "configs/models").iterdir()}
    named = set(re.findall(r"`((?:models/[\w.-]+/)|[\w.-]+\.yaml)`", listing))
    assert named == shipped


def test_results_names_files_and_commands_that_still_exist_or_the_commit_they_ran_at():
    """benchmarks/RESULTS.md's figures are reproduced by the commands and read in the files it
    names: each `python -m benchmarks.X` is a driver here, each of its flags one that driver
    takes, and each trainer/ path a file here, unless the line names the commit it was at."""
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    stale = []
    for number, line in enumerate(results.splitlines(), start=1):
        at_a_commit = re.search(r"\b[0-9a-f]{7,40}\b", line) is not None
        stale += [f"line {number}: {path}" for path in re.findall(r"\btrainer/[\w/]+\.py\b", line)
                  if not (REPO / path).is_file() and not at_a_commit]
        for module, args in re.findall(r"python -m benchmarks\.(\w+)((?: +--?[\w-]+(?: [^-`\s][^\s`]*)*)*)", line):
            driver = REPO / "benchmarks" / f"{module}.py"
            if not driver.is_file():
                stale.append(f"line {number}: benchmarks.{module}")
                continue
            source = driver.read_text()
            for helper in re.findall(r"^from benchmarks\.(\w+) import", source, flags=re.M):  # a shared main's flags
                source += (REPO / "benchmarks" / f"{helper}.py").read_text()
            stale += [f"line {number}: benchmarks.{module} {flag}" for flag in re.findall(r"--[\w-]+", args)
                      if f'"{flag}"' not in source]
    assert results.count("python -m benchmarks") > 20  # the commands are read
    assert not stale, "RESULTS.md names what is no longer there:\n" + "\n".join(stale)
