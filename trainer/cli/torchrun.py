"""`python -m trainer.cli.torchrun ARGS`: torchrun, with an exit code that says what went wrong.

torchrun exits 1 whatever its workers' exit codes were, so a scheduler cannot tell a config
error (never retry) from a preemption (restart) or a lost node (retry elsewhere). This runs
torch's own torchrun in this process, with the same arguments and the same signal handling,
and exits with the most severe of the failed workers' verdicts (trainer/exit_codes.py), or
128+N when torchrun itself was stopped by signal N, as a shell would report it; a failure of
torchrun's own (its rendezvous) is a crash, retryable.

With TRAINER_CHECK=1 (the Kubernetes manifests set it) a training launch first runs `python -m
trainer check` on the same config and overrides, in this process: the data read and checked,
the labels resolved, the memory plan made for the launch's world size, before any rank starts.
A mistake is one line and exit 2 (never retried), not a pod of ranks that each fail after the
rendezvous.
TRAINER_CHECK=no-data checks everything but the data.
"""

from __future__ import annotations

import os
import sys
import traceback

from trainer import errors
from trainer.exit_codes import MEANING, RETRYABLE_ENV, Exit, for_launcher, of, worst

CHECK_ENV = "TRAINER_CHECK"
CHECKS = {"1": [], "no-data": ["--no-data"]}


def training_args(argv: list[str]) -> list[str] | None:
    """What follows `-m trainer train` in torchrun's arguments (the config and overrides), or
    None for another program."""
    for i in range(len(argv) - 2):
        if argv[i:i + 3] in (["-m", "trainer", "train"], ["--module", "trainer", "train"]):
            return argv[i + 3:]
    return None


def check_first(argv: list[str], environ=os.environ) -> int:
    """TRAINER_CHECK: `python -m trainer check` on the training launch's arguments; its exit code."""
    setting = environ.get(CHECK_ENV, "")
    if not setting or setting == "0":
        return 0
    if setting not in CHECKS:
        return errors.report(f"{CHECK_ENV}={setting!r}: expected 1, no-data or 0")
    args = training_args(argv)
    if args is None:  # doctor, or a script: nothing of ours to check
        return 0
    from trainer.cli.main import main as trainer_main

    world_size = launch_world_size(argv)
    sized = [] if world_size is None else [f"world_size={world_size}"]
    return trainer_main(["check", *args, *sized, *CHECKS[setting]])


def launch_world_size(argv: list[str]) -> int | None:
    """The ranks this launch starts, as torchrun reads its arguments (and their PET_*
    environment defaults, which the Kubeflow operators set): nodes (the least of an elastic
    MIN:MAX, the memory plan's worst case) times processes per node. None where torchrun
    would count devices this host may not have (--nproc-per-node=gpu on a CPU host), or would
    refuse the arguments itself: it says why when it runs."""
    from torch.distributed.run import determine_local_world_size, get_args_parser, parse_min_max_nnodes

    launch = get_args_parser().parse_args(argv)
    try:
        return parse_min_max_nnodes(launch.nnodes)[0] * determine_local_world_size(launch.nproc_per_node)
    except Exception:  # noqa: BLE001  (RuntimeError, ValueError: torchrun's own answer to them follows)
        return None


def main(argv: list[str] | None = None) -> int:
    retryable_as = os.environ.get(RETRYABLE_ENV, "")
    if retryable_as and not (retryable_as.isdigit() and 0 < int(retryable_as) < 256):
        return errors.report(f"{RETRYABLE_ENV}={retryable_as!r} is not an exit code from 1 to 255")
    checked = check_first(sys.argv[1:] if argv is None else argv)
    if checked:
        code = for_launcher(of(checked))
        print(f"trainer.cli.torchrun: exiting with {code}: the check failed ({MEANING[of(checked)]}); no rank started",
              file=sys.stderr, flush=True)
        return code

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        # torchrun's own report (each failed rank, its exit code, its error file), without
        # the traceback through torchrun's internals that an uncaught exception would add.
        print(e.format_msg(), file=sys.stderr)
        verdict = worst(failure.exitcode for failure in e.failures.values())
        code = for_launcher(verdict)
        print(f"trainer.cli.torchrun: exiting with {code}: {MEANING[verdict]}", file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        # The workers got the same signal and, for a stop signal, saved before exiting.
        return 128 + int(e.sigval)
    except Exception:  # noqa: BLE001
        # torchrun's own failure, before or between its workers: a rendezvous that timed out
        # waiting for a node still pending, a store lost with its node. Retryable, and it must
        # read so in the launcher's dialect: a PyTorchJob's ExitCode policy takes a plain 1 as
        # permanent and would fail the job for a peer that was only late.
        traceback.print_exc()
        code = for_launcher(Exit.CRASH)
        print(f"trainer.cli.torchrun: exiting with {code}: torchrun failed, {MEANING[Exit.CRASH]}", file=sys.stderr,
              flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
