"""`python -m trainer score`: a trained model applied to a corpus, across any number of workers
(torchrun's ranks, a Slurm array's tasks, a Kubernetes Indexed Job's pods), each row scored
and written exactly once whatever stops (docs/scoring.md).

What a worker checks before the model loads (and `check` with score.input set): the shards
are there, the first has the text and carried columns, and the output folder is this job's or
a job's with the same model and settings, which this one joins.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from trainer.config.schema import Config
from trainer.errors import ConfigError
from trainer.runtime.environment import DistEnv
from trainer.scoring import corpus
from trainer.scoring.ledger import Ledger, worker_name

log = logging.getLogger(__name__)


def check(cfg: Config) -> list[corpus.Shard]:
    """score.input's shards, the first one's columns checked; score.output given."""
    score_cfg = cfg.score
    if not score_cfg.input:
        raise ConfigError("score.input: missing: the corpus to score (a file, a folder or a glob of shards)")
    if not score_cfg.output:
        raise ConfigError("score.output: missing: the folder the scored shards go to")
    shards = corpus.shards(score_cfg.input, Path(score_cfg.output))
    corpus.Reader(shards[0], score_cfg.chunk_rows, cfg.data.text_field, cfg.data.text_pair_field, score_cfg.carry,
                  skip=score_cfg.bad_rows == "skip").check_columns()
    return shards


def manifest(cfg: Config, model: Path, shards: list[corpus.Shard]) -> dict:
    """What decides the answers and how they are cut: a job that differs in any of it may not
    add its chunks to this output."""
    model_files = sorted((str(p.relative_to(model)), p.stat().st_size, p.stat().st_mtime_ns)
                         for p in model.rglob("*") if p.is_file())
    return {"model": str(model.resolve()), "model_files": model_files, "text_field": cfg.data.text_field,
            "text_pair_field": cfg.data.text_pair_field, "max_length": cfg.data.max_length,
            "threshold": cfg.data.threshold, "precision": cfg.train.precision, "carry": list(cfg.score.carry),
            "format": cfg.score.format, "chunk_rows": cfg.score.chunk_rows, "bad_rows": cfg.score.bad_rows,
            "shards": [[s.name, str(s.path.resolve()), s.path.stat().st_size] for s in shards]}


def first_shard(dist_env: DistEnv, shards: int, environ=os.environ) -> int:
    """Where this worker starts, so that workers begin on different shards: by its place among
    all the job's workers (a Slurm array's or an Indexed Job's index, then its rank)."""
    index = int(environ.get("SLURM_ARRAY_TASK_ID") or environ.get("JOB_COMPLETION_INDEX") or 0)
    tasks = int(environ.get("SLURM_ARRAY_TASK_COUNT") or environ.get("TRAINER_SCORE_TASKS") or 1)
    return (index * dist_env.world_size + dist_env.rank) * shards // max(1, tasks * dist_env.world_size) % shards


def run(cfg: Config, dist_env: DistEnv, device: torch.device, model: Path, shards: list[corpus.Shard]) -> None:
    """Score `shards` (`check`'s) with the trained model in `model`, as one worker."""
    from trainer.scoring.work import Worker
    from trainer.train import build

    began = time.monotonic()
    output = Path(cfg.score.output or "")
    ledger = Ledger(output, worker_name(dist_env.rank), cfg.score.lease_s)
    ledger.join(manifest(cfg, model, shards))
    trained = build.trained(cfg, dist_env, device, model, exact=False)
    answers = set(trained.task.predictions(torch.zeros(1, trained.task.labels.num_labels))[0])
    if clash := sorted(answers & set(cfg.score.carry)):
        raise ConfigError(f"score.carry: {', '.join(clash)}: the answer's own column; carry it under another name")
    ledger.start_heartbeat()
    try:
        worker = Worker(cfg, trained, device, ledger, shards, first_shard(dist_env, len(shards)))
        counts = worker.run()
        seconds = time.monotonic() - began
        summary = {"worker": ledger.name, "rows": counts.rows, "chunks": counts.chunks, "truncated": counts.truncated,
                   "skipped": len(counts.skipped), "skipped_rows": counts.skipped[:1000],
                   "scored_twice": ledger.committed_twice, "shards_published": counts.shards_published,
                   "shards_skipped": counts.shards_skipped,
                   "seconds": round(seconds, 2), "rows_per_s": round(counts.rows / max(seconds, 1e-9), 1)}
        ledger.write_summary(summary)
        log.info("score: done: %s", json.dumps(summary | {"skipped_rows": counts.skipped[:3]}))
    finally:
        ledger.end()
