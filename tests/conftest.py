"""Fixtures: a tiny random-init BERT, small generated data, and the real entry point.

The tests are in tiers, one folder each, marked by it (pytest -m unit|e2e|system):
- tests/unit: in process (no Python program started: `_unit_tests_start_no_program`), seconds
  in all, no root (`make test-unit`);
- tests/e2e: `python -m trainer` as a subprocess, under real torchrun with gloo ranks where
  it says so, as a user would, but with the processes forked from an interpreter that imported
  everything once (tests/support/preloaded.py);
- tests/system: Slurm, container images, network namespaces and pods (root, `make system`).
The helpers are tests/support's modules, importable from every tier (pyproject's pythonpath);
this file holds the fixtures and the hooks that order and mark the tiers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import image, runs
from support.models import LABEL_NAMES, make_tiny_model
from support.processes import kill_tree
from support.runs import PYTHON, TESTS, Reference, Run, run_preloaded, tiny_overrides, train
from support.weights import EXACT_STEPS, weights

from trainer.runtime.launch import trainer_program

TIERS = ("unit", "e2e", "system")
"""tests/<tier>/: each test is marked with its folder's name, and the tiers run in this order."""


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"pytest got {signal.Signals(signum).name}")


# A CI timeout or `kill` sends SIGTERM, which would end pytest without running a single
# fixture's teardown: namespaces, Slurm daemons and jobs would outlive the run. As an
# interrupt, pytest stops the test and tears everything down.
signal.signal(signal.SIGTERM, _interrupt)


# The image is built in the background from the start of the run (about 4 minutes cold, mostly
# downloads and disk), so that the tests before the first one that needs it overlap the build.
_image_build: tuple[image.Engine, subprocess.Popen] | None = None


def tier(item: pytest.Item) -> str:
    """The tier of a test under tests/: the folder it is in."""
    path = Path(item.path)
    parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test belongs in tests/unit, tests/e2e or tests/system")
    return parts[0]


def needs_image(item: pytest.Item) -> bool:
    return "app_image" in getattr(item, "fixturenames", ())


@pytest.fixture(autouse=True)
def _unit_tests_start_no_program(request, monkeypatch):
    """The unit tier runs in process: a test that starts a Python program (a trainer command,
    torchrun, a script) fails here, and belongs in tests/e2e. A tool the product itself runs
    (git for the card's commit, Slurm's sinfo) may run, and forks are not programs: a
    DataLoader's worker, or multiprocessing's forkserver, which does not go through Popen."""
    if request.node.get_closest_marker("unit") is None:
        return
    start = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def refuse_python(self, args, *rest, **kwargs):
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        name = Path(os.fsdecode(program).split()[0]).name
        if name.startswith("python") or name == "torchrun" or os.fsdecode(program) == sys.executable:
            raise AssertionError(f"a unit test starts a Python program ({args}): it belongs in tests/e2e")
        return start(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse_python)


def pytest_collection_modifyitems(items):
    """Each test is marked with its tier. The tiers run in order, the fast one first; the
    tests that need the image run last (in their files' order), so the whole build overlaps
    the others."""
    for item in items:
        item.add_marker(tier(item))
    items.sort(key=lambda item: (needs_image(item), TIERS.index(tier(item))))


def pytest_collection_finish(session):
    global _image_build
    # Only a system test may need the image: the other tiers never start its build (root).
    needed = any(needs_image(item) and item.get_closest_marker("system") for item in session.items)
    if needed and not session.config.option.collectonly and not image.missing_tools():
        engine = image.Engine.create()
        engine.lock()
        engine.remove_containers()  # what a killed run left
        build = [PYTHON, "-m", "support.image", str(engine.run_dir)]
        _image_build = engine, subprocess.Popen(build, cwd=TESTS, env=engine.env, stdin=subprocess.DEVNULL,
                                                start_new_session=True)


def pytest_sessionfinish(session):
    if _image_build:
        engine, build = _image_build
        kill_tree(build)
        build.wait()
        engine.close()


@pytest.fixture(scope="session")
def engine() -> image.Engine:
    """podman and buildah, as tests/support/image.py sets them up. Their absence fails the test:
    `make test` installs them."""
    if _image_build is None:
        pytest.fail(f"the image tests need {', '.join(image.missing_tools())}; `make test` installs them")
    return _image_build[0]


@pytest.fixture(scope="session")
def app_image(engine) -> image.Image:
    """Our Dockerfile, built by buildah on the CPU base."""
    build = _image_build[1]
    code = build.wait(timeout=1500)
    log = (engine.run_dir / "build.log").read_text() if (engine.run_dir / "build.log").exists() else ""
    assert code == 0, f"the image build failed (exit {code}):\n{log[-5000:]}"
    return image.inspect(engine, (engine.run_dir / "image-id").read_text())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Random-init 2-layer BERT, hidden 32, dropout off, with MiniLM's tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bert"), dropout=0.0)


@pytest.fixture(scope="session")
def dropout_model(tmp_path_factory) -> Path:
    """The same with dropout on: a resume that lost any rank's RNG state is not bitwise exact."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-dropout"), dropout=0.1)


@pytest.fixture(scope="session")
def decoder_models(tmp_path_factory) -> Callable[[str, float], Path]:
    """`decoder_models(family, dropout)`: a tiny gpt2 or llama classifier, made once a session."""
    made: dict[tuple[str, float], Path] = {}

    def model(family: str, dropout: float) -> Path:
        if (family, dropout) not in made:
            made[family, dropout] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), dropout, family)
        return made[family, dropout]

    return model


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, in this process (no address): DDP, FSDP2 and their
    collectives are built as under torchrun. Yields that rank's DistEnv."""
    import torch.distributed as dist

    from trainer.runtime.environment import DistEnv

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistEnv(master_addr="localhost", master_port=1)
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def reviews(tmp_path_factory) -> Path:
    """600 train / 203 eval reviews: 203 is odd, so 2 ranks get unequal eval shards."""
    from trainer.data.demo import generate

    return generate(tmp_path_factory.mktemp("reviews"), num_train=600, num_test=203, seed=1)


@pytest.fixture(scope="session")
def labeled_reviews(reviews, tmp_path_factory) -> Path:
    """The test reviews as parquet, written by `datasets` with a ClassLabel label column
    named LABEL_NAMES."""
    import datasets

    out = tmp_path_factory.mktemp("labeled-reviews")
    for split in ("train", "test"):
        ds = datasets.load_dataset("json", data_files=str(reviews / f"{split}.jsonl"), split="train")
        ds.cast_column("label", datasets.ClassLabel(names=LABEL_NAMES)).to_parquet(str(out / f"{split}.parquet"))
    return out


@pytest.fixture(scope="session")
def single_process_weights(tiny_model, reviews, tmp_path_factory):
    """The reference of exact DDP: one plain process (no torchrun), batch 16, EXACT_STEPS
    steps, with the textbook dense embedding gradient (the default sends it through backward
    and DDP as sparse rows)."""
    out = tmp_path_factory.mktemp("single")
    overrides = {"train.batch_size": 16, "train.max_steps": EXACT_STEPS, "ddp.sparse_embedding_grad": False}
    train(tiny_overrides(tiny_model, reviews, out, **overrides), nproc=None)
    return weights(out, EXACT_STEPS)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, reviews):
    """`reference_run(launch, model, **options)`: an uninterrupted run of `model` on the test
    reviews, for a faulted run to be compared with. `launch(overrides, workdir)` runs the job
    to the end however the test launches it (one process, torchrun, two nodes, Slurm) and
    asserts that it succeeded."""

    def run_reference(launch: Callable[[list[str], Path], Any], model: Path, **options) -> Reference:
        work = tmp_path_factory.mktemp("reference")
        launched = launch(tiny_overrides(model, reviews, work / "run", **options), work)
        return Reference(work / "run", launched)

    return run_reference


@pytest.fixture(scope="session", autouse=True)
def _preloaded_servers_closed():
    yield
    runs.close_preloaded_servers()


@pytest.fixture(scope="session")
def usage_run() -> Callable[..., Run]:
    """`usage_run(overrides, command="train", config=None, env=None, timeout=120)`: like
    `run(trainer_command(overrides, nproc=None, ...))`, for a run that must stop at a usage
    error before it trains, forked from the preloaded server (0.3-1 s a run instead of 3-8 s)."""

    def run_cli(overrides: list[str], command: str = "train", config: str | None = None,
                env: dict | None = None, timeout: float = 120) -> Run:
        return run_preloaded("trainer", trainer_program(command, config, overrides)[2:], env, timeout)

    return run_cli
