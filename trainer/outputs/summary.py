"""What a finished run reports: summary.json's figures and the done line that ends its log.

`final_eval` and `test_eval` score the model in final/, which with load_best_at_end is the
best step's; `last_step_eval` is the last step's. The done line says which one final/ holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def done_line(summary: dict, scores: Callable[[dict], str]) -> str:
    """What the run ends with: how the model in final/ scores (in `scores`' words: the task's),
    and which step it is."""
    final_step, last = summary["final_model_step"], summary["steps"]
    which = "the last step" if final_step == last else f"the best by {summary['best']['metric']}"
    line = f"done: final/ holds step {final_step} ({which}): validation {scores(summary['final_eval'])}"
    if summary["test_eval"] is not None:
        line += f", test {scores(summary['test_eval'])}"
    if final_step != last:
        line += f"; the last step, {last}: validation {scores(summary['last_step_eval'])}"
    return line


def make(*, final: tuple[int, dict], last_eval: dict, test_eval: dict | None, best: dict | None, start_step: int,
         last: int, max_steps: int, steps_per_epoch: int, world_size: int, global_batch: int,
         run: dict[str, Any]) -> dict:
    """summary.json: where final/ and the last step stand, the run's length, and `run`'s
    facts (its parameters, precision, speed, start-up, hosts, ...) as they are."""
    return {
        "final_model_step": final[0],
        "final_eval": final[1],
        "test_eval": test_eval,
        "last_step_eval": last_eval,
        "best": best,
        "steps": last,
        "max_steps": max_steps,
        "stopped_early": last < max_steps,
        "resumed_from_step": start_step,
        "epochs": round(last / steps_per_epoch, 3),
        "world_size": world_size,
        "global_batch": global_batch,
        **run,
    }
