"""The baseline: transformers.Trainer on the same model, data and global batch.

Run under torchrun by `python -m benchmarks`. Two settings:
- `default`: as the seeds use it: tokenize with padding="max_length", then Trainer with its
  default arguments (fp32, random batches).
- `best`: dynamic padding (DataCollatorWithPadding), group_by_length, one persistent loader
  worker, bf16 when asked.
`--attention eager` loads the model with eager attention (on CPU, faster than the default
SDPA under bf16): the model-side choice our trainer makes by default there. `--compile` adds
the Trainer's own torch.compile switch.

Writes {"samples_per_s", "timed_steps", "first_step_end_unix"} to --out on rank 0. Samples/s
is taken over the steps after --warmup, from a callback on step ends. `--smoke` (no other
flag needed): one process, the `best` setting, 1 + 2 steps of the tiny model on its data.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import datasets
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class StepClock(TrainerCallback):
    def __init__(self, warmup: int):
        self.warmup, self.first_step_end, self.warm_start, self.last = warmup, None, None, None

    def on_step_end(self, args, state, control, **kwargs):
        now = time.time()
        if state.global_step == 1:
            self.first_step_end = now
        if state.global_step == self.warmup:
            self.warm_start = now
        self.last = now


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="required but for --smoke")
    parser.add_argument("--data", help="required but for --smoke")
    parser.add_argument("--setting", choices=["default", "best"], help="required but for --smoke")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    parser.add_argument("--out", help="required but for --smoke")
    # Not smoke.add_flag: run as a script under torchrun, this file cannot import `benchmarks`.
    parser.add_argument("--smoke", action="store_true", help="(python -m benchmarks.hf_trainer --smoke) a tiny "
                        "random-init model for 3 steps, in one process: proves this runs, measures nothing")
    args = parser.parse_args()
    if args.smoke:  # `best`: `python -m benchmarks --smoke` runs `default`, under torchrun
        from benchmarks import smoke

        args.model, args.data = smoke.tiny_model(smoke.folder()), smoke.tiny_data(smoke.folder())
        args.out = str(smoke.results_path("hf.json", smoke=True))
        args.setting, args.batch_size, args.max_length, args.steps, args.warmup = "best", 8, 32, 2, 1
    missing = [f"--{name}" for name in ("model", "data", "setting", "out") if getattr(args, name) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=5, attn_implementation=args.attention
    )
    train = datasets.load_dataset(args.data, split="train")
    best = args.setting == "best"

    def encode(batch):
        padding = False if best else "max_length"
        return tokenizer(batch["text"], truncation=True, max_length=args.max_length, padding=padding)

    train = train.map(encode, batched=True, remove_columns=["text"])
    training_args = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.out), "hf-trainer-output"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-4,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        train_sampling_strategy="group_by_length" if best else "random",
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=1 if best else 0,
        dataloader_persistent_workers=best,  # else a new worker process every epoch
        torch_compile=args.compile,
    )
    clock = StepClock(args.warmup)
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train, processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer) if best else None, callbacks=[clock],
    )
    trainer.train()
    if trainer.is_world_process_zero():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        seconds = clock.last - clock.warm_start
        result = {
            "samples_per_s": args.steps * args.batch_size * world / seconds,
            "timed_steps": args.steps,
            "first_step_end_unix": clock.first_step_end,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
