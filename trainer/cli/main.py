"""`python -m trainer {train,check,doctor,evaluate,score} -c CONFIG [key=value ...]`, plain or
under torchrun; `python -m trainer sweep -c CONFIG [key=value ...]`, which launches its trials
under torchrun; `python -m trainer {report,plot} RUN_DIR`; `python -m trainer push RUN_DIR
--repo-id ORG/NAME [--public] [--revision BRANCH] [--adapter]`.

    check [gpu_gib=80] [world_size=N] [--no-data] [--resolved]   the data, the memory plan per GPU
    evaluate [checkpoint=PATH|final] [split=NAME]   exact metrics of a trained model on a split
    score score.input=SHARDS score.output=FOLDER [score.model=final|PATH]   each row's answer, in
        the task's terms, across any number of workers, exactly once (docs/scoring.md)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

from trainer import errors
from trainer.cli import run_config
from trainer.config import loading
from trainer.config.checks import LOCAL_PATHS
from trainer.config.schema import Config
from trainer.errors import ConfigError, TrainerError
from trainer.exit_codes import MEANING, Exit


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are the CLI's one line and exit code 2, as every
    mistake's are (`main`), not a usage text."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")


def _parsers() -> tuple[_Parser, dict[str, _Parser]]:
    """The parser of `python -m trainer`, and each command's, which takes its own flags alone."""
    top = _Parser(prog="python -m trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, required=True)
    parsers = {}
    for name, run in {**COMMANDS, **RUN_DIR_COMMANDS}.items():
        parser = parsers[name] = subparsers.add_parser(name, help=run.__doc__, description=run.__doc__)
        if name in COMMANDS:
            parser.add_argument("-c", "--config", help="YAML config file (see configs/)")
            parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.lr=1e-4")
        else:
            parser.add_argument("overrides", nargs="*", metavar="RUN_DIR", help="a run's output_dir")
    check = parsers["check"]
    check.add_argument("--no-data", action="store_true",
                       help="skip the data (for data that exists only where the job runs)")
    check.add_argument("--resolved", action="store_true",
                       help="print the resolved config as YAML, the report after it as comments")
    push = parsers["push"]
    push.add_argument("--repo-id", help="the Hub repository, ORG/NAME")
    push.add_argument("--private", action="store_true", help="create the repository private (the default)")
    push.add_argument("--public", action="store_true",
                      help="create the repository public (one that exists keeps its visibility)")
    push.add_argument("--revision", help="the branch to commit to (default main)")
    push.add_argument("--adapter", action="store_true", help="final/adapter/ alone (export_adapter)")
    return top, parsers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command and its arguments, by the command's own parser: another command's flag is
    refused in one line (a ConfigError). Intermixed, which argparse's subparsers can't be:
    overrides may stand before and after the flags, as launchers pass them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    top, parsers = _parsers()
    if argv[:1] == ["predict"]:
        raise ConfigError("predict: now `score`, for a file or a corpus: python -m trainer score -c CONFIG "
                          "score.input=FILE|FOLDER|GLOB score.output=FOLDER (docs/scoring.md)")
    if not argv or argv[0] not in parsers:
        top.parse_args(argv)  # --help, or argparse's own line: no command, or an unknown one
        raise ConfigError(f"python -m trainer: expected a command: {', '.join(parsers)}")
    args = parsers[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    for flag in ("config", "no_data", "resolved"):  # the attributes every command's caller reads
        setattr(args, flag, getattr(args, flag, None))
    return args


# The arguments of check and evaluate: `name=value` like the overrides, which no config key
# can be taken for (checkpoint is a group of keys, the others are not keys).
COMMAND_ARGS: dict[str, dict[str, str | None]] = {"check": {"gpu_gib": "80", "world_size": ""},
                "evaluate": {"checkpoint": "final", "split": None}}


def command_args(command: str, overrides: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """(the command's arguments, the config overrides left)."""
    args = dict(COMMAND_ARGS.get(command, {}))
    rest = []
    for item in overrides:
        name, eq, value = item.partition("=")
        if eq and name in args:
            args[name] = value
        else:
            rest.append(item)
    missing = [name for name, value in args.items() if value is None and name != "split"]
    if missing:
        raise ConfigError(f"{command}: missing {', '.join(f'{name}=...' for name in missing)}")
    return args, rest


def setup_logging(dist_env) -> None:
    """Rank 0 speaks at INFO; the others only warn, so a 16-rank log stays readable."""
    level = logging.INFO if dist_env.is_rank_zero else logging.WARNING
    logging.basicConfig(
        level=level, stream=sys.stderr,
        format=f"%(asctime)s [rank {dist_env.rank}] %(levelname)s %(name)s: %(message)s",
    )
    # Tokenizing a large split forks a pool (`datasets`' num_proc) after the rank's first
    # tokenizer calls; Rust threads of theirs would be copied mid-work. And tqdm would start a
    # monitor thread with the first progress bar of each of its classes.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import tqdm

    tqdm.tqdm.monitor_interval = 0
    if not dist_env.is_local_rank_zero:
        # By environment, read when they are imported: importing them here (~1.2 s) would
        # hold these ranks back from the rendezvous while rank 0 waits for them there.
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"


def log_to_stderr() -> None:
    """The commands that run in one process (sweep, push): INFO and up, on stderr."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Every command's mistakes, wherever found, are one `error:` line and their exit code:
    the config's before torch is imported (seconds), the rest in each command's preflight."""
    try:
        args = parse_args(argv)
        if args.command in RUN_DIR_COMMANDS:
            return RUN_DIR_COMMANDS[args.command](args)
        arguments, overrides = command_args(args.command, args.overrides)
        arguments["no_data"], arguments["resolved"] = args.no_data, args.resolved
        if arguments.get("split"):
            overrides.append(f"data.eval_split={arguments['split']}")
        # score reads final/ and its corpus: the training data and base model may be elsewhere;
        # check --no-data leaves the data to where the job runs.
        local_paths = () if args.command == "score" else \
            [key for key in LOCAL_PATHS if not (args.no_data and key == "data.path")]
        cfg = run_config.load(args.config, overrides, local_paths)
        arguments["config"], arguments["overrides"] = args.config, args.overrides  # sweep's: no command arguments
        return COMMANDS[args.command](cfg, arguments)
    except TrainerError as e:
        return errors.report(e)


def launch_env(cfg: Config, environ: Mapping[str, str] = os.environ):
    """(dist_env, device, backend): this process's place in the job, from the launcher's
    environment, checked before any process group. torch is imported here."""
    from trainer.runtime import devices, environment

    dist_env = environment.read_env(environ)
    device, backend = devices.pick_device(dist_env, cfg.dist.backend, cfg.train.device, environ=environ)
    return dist_env, device, backend


def train_preflight(cfg: Config, environ: Mapping[str, str] = os.environ):
    """launch_env, and whether the world size can split the global batch: all that training
    checks before the rendezvous."""
    dist_env, device, backend = launch_env(cfg, environ)
    from trainer.strategies import registry

    registry.of(cfg).check_world_size(dist_env.world_size)
    return dist_env, device, backend


def run_check(cfg: Config, arguments: dict) -> int:
    """validate the config, then report the data, its labels and the memory plan per GPU."""
    from trainer.data import labels
    from trainer.model import pretrained
    from trainer.preflight import data_check, memory
    from trainer.strategies import registry
    from trainer.tasks import space

    gpu_bytes = memory.parse_gib(str(arguments["gpu_gib"]))
    world_size, planned_by = planned_world_size(cfg, arguments)
    if arguments["world_size"]:  # the launch's own (the launchers pass it): what training would refuse
        registry.of(cfg).check_world_size(world_size)
    resolved = arguments.get("resolved")
    if resolved:  # `check --resolved > resolved.yaml` stays a config: the report follows as comments
        print(loading.to_yaml(cfg), end="", flush=True)
    lines, warnings = [f"world size {world_size} ({planned_by})"], []
    if cfg.score.input is not None:  # a scoring config: its corpus, as `score` checks it
        from trainer.scoring import command as scoring

        shards = scoring.check(cfg)
        lines.append(f"score: {len(shards)} shard(s) under {cfg.score.input}, the first with the text and carried "
                     f"columns; output to {cfg.score.output}")
    run_labels = labels.from_config(cfg.data)
    if arguments.get("no_data"):
        lines.append("data: not checked (--no-data)")
    else:
        checked = data_check.check(cfg, world_size)  # the data as training loads it (seconds, no weights)
        run_labels, warnings = checked.labels, checked.warnings
        lines += checked.lines
    if run_labels is None:  # --no-data without num_labels: a stand-in head, a few bytes off
        run_labels = space.Labels(cfg.data.problem_type, space.placeholder_names(2), "a stand-in", space.IDS)
        lines.append("memory plan: data.num_labels not given and the data not read: planned with 2 labels")
    try:
        plan = memory.make(cfg, run_labels, world_size=world_size)  # transformers, the tokenizer and config.json
        lines += [*plan.lines("a GPU with native bf16"), f"  {plan.verdict(gpu_bytes)}"]
    except ConfigError as e:
        # A hub model a login node can't reach can still train where its nodes reach the hub.
        if not pretrained.from_hub(cfg.model) or not str(e).startswith("model.name"):
            raise
        lines.append(f"memory plan: not made, model.name {cfg.model.name}'s config.json can't be read here: {e}")
    if not resolved:
        lines.append("the resolved config: check --resolved prints it as YAML")
    report = [*lines, *(f"warning: {w}" for w in warnings)]  # the warnings last: on screen after the run
    print("\n".join(f"# {line}" if resolved else line for line in report), flush=True)
    return 0  # the GPU is assumed here; doctor fails a plan that the job's real devices can't hold


def planned_world_size(cfg: Config, arguments: dict, environ: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """The world size `check` plans for, and where it comes from: check's world_size=N (the
    launchers pass theirs), dist.world_size, a launcher's WORLD_SIZE, else a node of 8 GPUs."""
    from trainer.preflight import memory

    for given, source in ((arguments["world_size"], "check's world_size"),
                          (cfg.dist.world_size, "dist.world_size"), (environ.get("WORLD_SIZE"), "WORLD_SIZE")):
        if given:
            return memory.parse_world_size(str(given)), f"from {source}"
    return memory.PLANNED_WORLD_SIZE, (f"assumed: one node of {memory.PLANNED_WORLD_SIZE} GPUs; set dist.world_size "
                                       "or check's world_size=N")


def run_doctor(cfg: Config, arguments: dict) -> int:
    """preflight the cluster under the same launcher as training."""
    dist_env, device, backend = launch_env(cfg)
    from trainer.preflight import doctor

    setup_logging(dist_env)
    return doctor.run(cfg, dist_env, device, backend)


def run_train(cfg: Config, arguments: dict) -> int:
    """run the job."""
    from trainer.runtime.startup import StartupClock

    startup = StartupClock()  # from this process's start, not from now
    dist_env, device, backend = train_preflight(cfg)

    setup_logging(dist_env)
    from trainer.data import worker_server
    from trainer.faults import watchdog
    from trainer.faults.preemption import Preempted
    from trainer.runtime import distributed, lease

    worker_server.start_worker_server(cfg)  # now: its imports run beside the rank's, not before the first batch
    from trainer.train.loop import Trainer  # the heavy imports (transformers, datasets) start here

    startup.mark("imports")
    exit_code: int = Exit.CRASH
    trainer = None
    held = None
    try:
        distributed.init(dist_env, device, backend, cfg.dist.init_timeout_s, Path(cfg.output_dir))
        startup.mark("rendezvous")
        # Before anything is written to output_dir or a checkpoint is picked to resume from:
        # a second job on the folder is refused on every rank, within seconds.
        held = distributed.rank_zero_does(dist_env, f"output_dir {cfg.output_dir}: lease",
                                          lambda: lease.hold(Path(cfg.output_dir), cfg.fault))
        trainer = Trainer(cfg, dist_env, device, startup)
        trainer.train()
        exit_code = 0
    except TrainerError as e:  # the data, the model, a checkpoint: found once they are loaded
        exit_code = errors.report(e)
    except Preempted as e:
        logging.getLogger("trainer").warning("%s; exiting with %d, relaunch to resume", e, Exit.PREEMPTED)
        exit_code = Exit.PREEMPTED
    except Exception as e:  # a crash or a collective timeout: explain it, then the traceback
        # Before the trainer exists (the process group, the weights' load) there are no peers'
        # heartbeats to judge by, but a GPU's error still names this node.
        exit_code = trainer.report_failure(e) if trainer is not None else watchdog.judge(e, set())
        if exit_code == Exit.CRASH:
            raise
        logging.getLogger("trainer").exception("exiting with %d: %s", exit_code, MEANING[exit_code])
    finally:
        if trainer is not None:
            trainer.close(exit_code)
        if held is not None:
            held.end()
        distributed.close()
    return exit_code


def run_evaluate(cfg: Config, arguments: dict) -> int:
    """exact metrics of a trained model on a split."""
    dist_env, device, backend = launch_env(cfg)
    from trainer.checkpoint import resume
    from trainer.train import evaluation

    folder = resume.trained_folder(cfg, arguments["checkpoint"])  # hashes every file of it
    return use_trained_model(cfg, dist_env, device, backend,
                             lambda: evaluation.run(cfg, dist_env, device, folder))


def run_score(cfg: Config, arguments: dict) -> int:
    """a trained model's answer for each row of a corpus (a class and the probabilities, the
    labels, or a value), written beside the columns score.carry names, each row exactly once."""
    dist_env, device, backend = launch_env(cfg)
    from trainer.checkpoint import resume
    from trainer.scoring import command

    shards = command.check(cfg)  # the shards and their columns, before any process group or weights
    folder = resume.trained_folder(cfg, cfg.score.model, key="score.model")  # hashes every file of it
    return use_trained_model(cfg, dist_env, device, backend,
                             lambda: command.run(cfg, dist_env, device, folder, shards))


def run_dir(command: str, args: argparse.Namespace) -> Path:
    """The one RUN_DIR (a run's output_dir) that report, plot and push take."""
    if len(args.overrides) != 1 or "=" in args.overrides[0]:
        raise ConfigError(f"{command}: expected one RUN_DIR (a run's output_dir), got "
                          f"{' '.join(args.overrides) or 'none'}")
    return Path(args.overrides[0])


def run_report(args: argparse.Namespace) -> int:
    """where a run's time went, across its attempts and restarts: goodput (RUN_DIR: its
    output_dir), printed and written as RUN_DIR/goodput.json and goodput.png; of a sweep's
    output_dir, each of its runs'; of a `score` output folder, its workers' counts."""
    folder = run_dir("report", args)
    from trainer.outputs import report
    from trainer.sweep import runs

    trials = folder / runs.TRIALS
    if (folder / ".score").is_dir():  # a `score` output folder
        report.run_scoring(folder)
    elif trials.is_dir():
        report.run_sweep(folder, sorted(p for p in trials.iterdir() if p.is_dir()))
    else:
        report.run(folder)
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """draw RUN_DIR/curves.png from its metrics.jsonl: loss, learning rate, throughput and
    validation by step, its restarts marked."""
    folder = run_dir("plot", args)
    from trainer.outputs import curves

    print(curves.draw(folder))
    return 0


def run_push(args: argparse.Namespace) -> int:
    """upload RUN_DIR/final/ (or its adapter alone) to the Hub repository --repo-id, with HF_TOKEN."""
    log_to_stderr()
    folder = run_dir("push", args)
    if not args.repo_id or args.repo_id.count("/") != 1:
        raise ConfigError(f"push: --repo-id: expected ORG/NAME, got {args.repo_id or 'none'}")
    if args.private and args.public:
        raise ConfigError("push: --private, --public: give one of them (private is the default)")
    from trainer.outputs import push

    # Private unless asked: a model fine-tuned on a lab's data is the lab's until it says so.
    print(push.push(push.folder_of(folder, args.adapter), args.repo_id, not args.public, args.revision))
    return 0


def use_trained_model(cfg: Config, dist_env, device, backend, one_pass: Callable[[], object]) -> int:
    """evaluate or score: `one_pass` over the data under any launcher, then exit."""
    from trainer.runtime import distributed

    setup_logging(dist_env)
    try:
        distributed.init(dist_env, device, backend, cfg.dist.init_timeout_s, Path(cfg.output_dir))
        one_pass()
        return 0
    finally:
        distributed.close()


def run_sweep(cfg: Config, arguments: dict) -> int:
    """search the sweep section's settings, seeds and folds, each trial a run (docs/sweeps.md)."""
    log_to_stderr()
    from trainer.runtime import lease
    from trainer.sweep import command, plan

    checked = plan.check(cfg, lambda more: run_config.load(arguments["config"], [*arguments["overrides"], *more]))
    held = lease.hold(Path(cfg.output_dir), cfg.fault)  # one sweep per output_dir: its trials have no process
    try:
        return command.run(cfg, checked)
    finally:
        held.end()


COMMANDS: dict[str, Callable[..., int]] = {
    "train": run_train, "check": run_check, "doctor": run_doctor, "evaluate": run_evaluate, "score": run_score,
    "sweep": run_sweep,
}
"""Each command: (the resolved config, its arguments) -> exit code. Its function imports what
it needs, so a config mistake is reported before torch is imported."""

RUN_DIR_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"report": run_report, "plot": run_plot,
                                                                    "push": run_push}
"""The commands on a run's output_dir, which take no config."""


if __name__ == "__main__":
    sys.exit(main())
