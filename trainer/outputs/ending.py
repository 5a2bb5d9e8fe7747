"""The end of a run, after its last evaluation: final/ (the model, its card, the curves and
goodput pictures), summary.json and the done line, then final/ on the Hub. The loop hands
over what it knows (`Ending`); each part runs in the loop's phase of its name (`phase`),
which the watchdog watches and the timeline times: each but the push enters collectives."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config.schema import Config, HubConfig
from trainer.errors import describe
from trainer.exit_codes import Exit
from trainer.outputs import card, curves, push, report, summary
from trainer.outputs.export import export_final
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainer.strategies.base import Strategy

log = logging.getLogger(__name__)


@dataclass
class Ending:
    """What the run knows as it ends."""

    facts: card.Facts
    """What the model card says of the run."""
    model: PreTrainedModel
    tokenizer: Any
    strategy: Strategy
    """How the model runs across the ranks: under FSDP, final/ is gathered from its shards."""
    summary: dict[str, Any]
    """summary.json as the run knows it (summary.make): its evaluations, its length, its facts."""
    scores: Callable[[dict], str]
    """A set of metrics in the task's words, for the done line."""


def write_outputs(cfg: Config, dist_env: DistEnv, ending: Ending, phase: Callable[[str], AbstractContextManager],
            record: Callable[[dict], None]) -> dict:
    """Collective: final/, then summary.json (`record`ed) and the done line, then (rank 0,
    hub.push_at_end) the push. Returns the summary."""
    output_dir = Path(cfg.output_dir)
    with phase("export"):
        if cfg.tracking.curves and dist_env.is_rank_zero:
            _draw_pictures(output_dir)
        export_final(output_dir, ending.model, ending.tokenizer, ending.strategy, dist_env,
                     adapter=cfg.checkpoint.export_adapter, facts=ending.facts)
    with phase("gather"):
        made = dict(ending.summary)
        # Rank 0 reads the files (trainer/outputs/report.py); the summary is rank 0's to write.
        made["goodput"] = report.account(output_dir, ending=Exit.DONE) if dist_env.is_rank_zero else None
        made["hosts"] = sorted(set(distributed.all_gather(dist_env, socket.gethostname())))
        record(made)
        log.info("%s", summary.done_line(made, ending.scores))
    if cfg.hub.push_at_end and dist_env.is_rank_zero:
        # Rank 0 alone, after the last collective: an upload may take longer than any timeout.
        made["hub"] = _push(output_dir, cfg.hub)
        record(made)
    return made


def _draw_pictures(output_dir: Path) -> None:
    """tracking.curves: output_dir/curves.png, and goodput.png (`report`'s timeline of the
    attempts so far), which final/ and its card then carry. A picture that fails costs a
    warning, never the run."""
    try:
        curves.draw(output_dir)
        report.draw(output_dir, output_dir / report.PICTURE, ending=Exit.DONE)
    except Exception as e:  # noqa: BLE001 (matplotlib's failures are many; the run is done)
        log.warning("tracking.curves: a picture is missing: %s", describe(e))


def _push(output_dir: Path, hub: HubConfig) -> dict:
    """hub.push_at_end: final/ to hub.repo_id. A failure is one error line and summary.json's
    `hub.error`; final/ stays, and `python -m trainer push` uploads it later."""
    assert hub.repo_id is not None, "hub.push_at_end needs hub.repo_id: the config checks it"
    try:
        url = push.push(output_dir / "final", hub.repo_id, hub.private, hub.revision)
    except push.PushError as e:
        log.error("%s; final/ is kept: upload it with python -m trainer push %s --repo-id %s", e, output_dir,
                  hub.repo_id)
        return {"repo_id": hub.repo_id, "commit_url": None, "error": str(e)}
    return {"repo_id": hub.repo_id, "commit_url": url, "error": None}
