"""`python -m trainer {train,check,doctor,evaluate,predict} -c CONFIG [key=value ...]`, plain or
under torchrun.

    evaluate [checkpoint=PATH|final] [split=NAME]   exact metrics of a trained model on a split
    predict checkpoint=PATH|final input=FILE output=FILE   probabilities for each row of a file
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from trainer import config, errors
from trainer.errors import ConfigError, TrainerError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument("command", choices=["train", "check", "doctor", "evaluate", "predict"],
                        help="train: run the job. check: validate and print the resolved config. "
                             "doctor: preflight the cluster under the same launcher as training. "
                             "evaluate, predict: use a trained model (see above).")
    parser.add_argument("-c", "--config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.lr=1e-4")
    return parser.parse_intermixed_args(argv)


# The arguments of evaluate and predict: `name=value` like the overrides, which no config key
# can be taken for (checkpoint is a group of keys, the others are not keys).
COMMAND_ARGS = {"evaluate": {"checkpoint": "final", "split": None},
                "predict": {"checkpoint": None, "input": None, "output": None}}


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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork DataLoader workers
    if not dist_env.is_local_rank_zero:
        # By environment, read when they are imported: importing them here (~1.2 s) would
        # hold these ranks back from the rendezvous while rank 0 waits for them there.
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Everything a user can get wrong is checked here, before a process group or a file exists.
    rows = None  # predict's input
    try:
        command, overrides = command_args(args.command, args.overrides)
        if command.get("split"):
            overrides.append(f"data.eval_split={command['split']}")
        cfg = config.load(args.config, overrides)
        if args.command == "check":
            print(config.to_yaml(cfg), end="")
            return 0
        # torch is imported from here on (seconds): a config mistake is reported before it.
        from trainer import distributed, metrics

        startup = metrics.StartupClock()  # from this process's start, not from now
        dist_env = distributed.read_env()
        device, backend = distributed.pick_device(dist_env, cfg.dist.backend, cfg.train.device)
        if args.command == "train":
            from trainer import parallel

            parallel.check_world_size(cfg.train, dist_env.world_size)
        if args.command in COMMAND_ARGS:
            from trainer import model, predict

            # Resolved once: verifying a checkpoint hashes every file of it.
            command["folder"] = model.trained_folder(cfg, command["checkpoint"])
            if args.command == "predict":
                predict.file_format("output", Path(command["output"]))
                rows = predict.read_rows(Path(command["input"]), cfg.data)
    except TrainerError as e:
        return errors.report(e)

    setup_logging(dist_env)
    if args.command == "doctor":
        from trainer import doctor

        return doctor.run(cfg, dist_env, device, backend)
    if args.command in COMMAND_ARGS:
        return use_trained_model(args.command, command, cfg, dist_env, device, backend, rows)
    from trainer.faults import EXIT_PREEMPTED, Preempted
    from trainer.loop import Trainer  # the heavy imports (transformers, datasets) start here

    startup.mark("imports")
    exit_code, trainer = 1, None
    try:
        distributed.init(dist_env, device, backend, cfg.dist.init_timeout_s, Path(cfg.output_dir))
        startup.mark("rendezvous")
        trainer = Trainer(cfg, dist_env, device, startup)
        trainer.train()
        exit_code = 0
    except TrainerError as e:  # the data, the model, a checkpoint: found once they are loaded
        exit_code = errors.report(e)
    except Preempted as e:
        logging.getLogger("trainer").warning("%s; exiting with %d, relaunch to resume", e, EXIT_PREEMPTED)
        exit_code = EXIT_PREEMPTED
    except Exception as e:  # a crash or a collective timeout: explain it, then the traceback
        if trainer is not None:
            trainer.report_failure(e)
        raise
    finally:
        if trainer is not None:
            trainer.close(exit_code)
        distributed.close()
    return exit_code


def use_trained_model(name: str, command: dict, cfg, dist_env, device, backend, rows) -> int:
    """evaluate or predict: one pass over the data under any launcher, then exit."""
    from trainer import distributed, evaluation, predict

    try:
        distributed.init(dist_env, device, backend, cfg.dist.init_timeout_s, Path(cfg.output_dir))
        if name == "evaluate":
            evaluation.run(cfg, dist_env, device, command["folder"])
        else:
            predict.run(cfg, dist_env, device, command["folder"], rows, Path(command["output"]))
        return 0
    except TrainerError as e:
        return errors.report(e)
    finally:
        distributed.close()


if __name__ == "__main__":
    sys.exit(main())
