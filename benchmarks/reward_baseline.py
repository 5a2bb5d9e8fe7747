"""The baseline for reward-model training: TRL's RewardTrainer when it is importable, else a
plain-PyTorch Bradley-Terry loop, on a JSON-lines file of {"prompt", "chosen", "rejected"} pairs.

What our reward training is compared against, on the same model, data, steps and batch (B
pairs a step, fp32, one process, seed 0, AdamW lr 2e-5, weight decay 0.01, linear schedule
with 6% warmup, grad norm 1.0). Writes to --out: "baseline" (which one ran), "samples_per_s"
(pairs/s over the steps after --warmup), "accuracy" (held-out pairs with r_chosen >
r_rejected strictly, from --eval; a tie counts wrong), "launch_s" (--started-unix, the
driver's launch of this process, else the start of main(), to the end of the first optimizer
step) and "steps".

How each side makes its sequences (the sides differ here; neither is adjusted to the other):
- TRL (1.16): prompt + answer as one string, no separator, with the tokenizer's EOS text
  appended; no truncation: a pair with either side over --max-length is dropped from
  training. A tokenizer without an EOS token (BERT's) makes it fail, so its SEP is the EOS
  here. Two RewardConfig defaults that would change what is measured are turned off: bf16
  and gradient (activation) checkpointing. Dropout stays off, its default.
- plain: tokenizer(prompt, answer) as a text pair, truncated to --max-length; dropout on.
Accuracy scores the held-out pairs as each side trained, truncated rather than dropped, so
every pair counts.

`--smoke`: 1 + 2 steps of the drivers' tiny random-init BERT on 16 of the demo's pairs: proves it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

PLAIN = "plain PyTorch Bradley-Terry"
# The loader's worker is forked after the tokenizer ran; without this every run warns.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Clock:
    """Step ends: the first (launch time) and the last, from the end of step `warmup` on."""

    def __init__(self, warmup: int):
        self.warmup, self.first_step_end, self.warm_start, self.last = warmup, 0.0, 0.0, 0.0

    def tick(self, step: int) -> None:
        now = time.time()
        if step == 1:
            self.first_step_end = now
        if step == self.warmup:
            self.warm_start = now
        self.last = now


def read_pairs(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_trl(args, model, tokenizer, rows: list[dict], clock: Clock) -> tuple[str, Callable, int]:
    import datasets
    import trl
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            clock.tick(state.global_step)

    with tempfile.TemporaryDirectory(prefix="reward-baseline-") as output_dir:
        config = trl.RewardConfig(
            output_dir=output_dir, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
            learning_rate=2e-5, weight_decay=0.01, warmup_steps=0.06, lr_scheduler_type="linear", max_grad_norm=1.0,
            max_length=args.max_length, bf16=False, seed=0,
            # TRL's gradient_checkpointing=True default is transformers 5's deprecated alias of this: the new name wins.
            activation_checkpointing=False,
            eos_token=tokenizer.eos_token or tokenizer.sep_token,  # TRL appends EOS text: None fails
            eval_strategy="no", save_strategy="no", report_to="none", logging_steps=10_000, disable_tqdm=True,
            dataloader_num_workers=1, dataloader_persistent_workers=True, dataloader_drop_last=True,
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = trl.RewardTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                                    processing_class=tokenizer, callbacks=[StepClock()])
        kept = len(trainer.train_dataset)
        trainer.train()
    eos = tokenizer.eos_token

    def encode(row: dict, answer: str) -> dict:  # as RewardTrainer._prepare_dataset, truncating
        text = (row.get("prompt") or "") + answer
        text = text if text.endswith(eos) else text + eos
        return {"input_ids": tokenizer(text, truncation=True, max_length=args.max_length)["input_ids"]}

    return f"trl {trl.__version__}", encode, kept


def train_plain(args, model, tokenizer, rows: list[dict], clock: Clock) -> tuple[str, Callable, int]:
    def encode(row: dict, answer: str) -> dict:
        if row.get("prompt"):
            return tokenizer(row["prompt"], answer, truncation=True, max_length=args.max_length)
        return tokenizer(answer, truncation=True, max_length=args.max_length)

    pairs = [(encode(row, row["chosen"]), encode(row, row["rejected"])) for row in rows]
    # Chosen then rejected in one batch of 2B, one forward pass, as TRL's collator does.
    loader = torch.utils.data.DataLoader(
        pairs, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0),
        collate_fn=lambda batch: tokenizer.pad([c for c, _ in batch] + [r for _, r in batch], return_tensors="pt"),
        num_workers=1, persistent_workers=True,
    )
    # transformers.Trainer's optimizer: no decay on biases and norms, fused AdamW (its default on torch >= 2.8).
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n.lower()]
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "norm" in n.lower())]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=2e-5, fused=True)
    warmup = math.ceil(0.06 * args.steps)  # Trainer's warmup_steps=0.06
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: s / warmup if s < warmup else
                                                 max(0.0, (args.steps - s) / max(1, args.steps - warmup)))
    model.train()
    step = 0
    while step < args.steps:
        for batch in loader:
            chosen, rejected = model(**batch.to(model.device)).logits.squeeze(-1).chunk(2)
            loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            clock.tick(step)
            if step == args.steps:
                break
    return PLAIN, encode, len(pairs)


@torch.no_grad()
def accuracy(model, tokenizer, encode: Callable, rows: list[dict], batch_size: int) -> float:
    model.eval()
    right = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        features = [encode(row, row["chosen"]) for row in chunk] + [encode(row, row["rejected"]) for row in chunk]
        batch = tokenizer.pad(features, return_tensors="pt").to(model.device)
        chosen, rejected = model(**batch).logits.squeeze(-1).chunk(2)
        right += int((chosen > rejected).sum())
    return right / len(rows)


def smoke_inputs(work: Path) -> tuple[str, str]:
    """The drivers' tiny random-init BERT (its head replaced by one output, as for any model
    here) and 16 of the demo's preference pairs."""
    from benchmarks import smoke
    from trainer.data import demo

    return smoke.tiny_model(work), str(demo.preferences(work / "pairs", 16, seed=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="required but for --smoke")
    parser.add_argument("--data", help="training pairs, JSON lines; required but for --smoke")
    parser.add_argument("--eval", help="held-out pairs for the accuracy (none: accuracy null)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps in all, warmup included")
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs a step")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--baseline", choices=["auto", "trl", "plain"], default="auto",
                        help="auto: TRL's RewardTrainer if importable, else the plain loop")
    parser.add_argument("--started-unix", type=float,
                        help="launch time (Unix) for launch_s; default: when main() starts")
    parser.add_argument("--out", help="result JSON; required but for --smoke")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random-init model for 1 + 2 steps, results under a temporary folder: "
                             "proves the driver runs, measures nothing")
    args = parser.parse_args()
    started = args.started_unix or time.time()
    if args.smoke:
        from benchmarks import smoke

        args.model, args.data = smoke_inputs(smoke.folder())
        args.eval, args.out = args.data, str(smoke.results_path("reward_baseline.json", smoke=True))
        args.steps, args.warmup, args.batch_size, args.max_length = 3, 1, 4, 32
    missing = [f"--{name}" for name in ("model", "data", "out") if getattr(args, name) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    use_trl = args.baseline == "trl" or (args.baseline == "auto" and importlib.util.find_spec("trl") is not None)

    torch.manual_seed(0)  # the new reward head's initial weights: the same on both sides
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # A new one-output head (a classifier of other labels' is replaced, as the trainer replaces it).
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, id2label={0: "reward"},
                                                               label2id={"reward": 0}, ignore_mismatched_sizes=True,
                                                               dtype=torch.float32)
    if tokenizer.pad_token is None:  # as RewardTrainer does: a decoder's EOS pads
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id  # where a decoder's classifier finds the last token
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(args.warmup)
    baseline, encode, train_pairs = (train_trl if use_trl else train_plain)(
        args, model, tokenizer, read_pairs(args.data), clock)
    result = {
        "baseline": baseline,
        "samples_per_s": (args.steps - args.warmup) * args.batch_size / (clock.last - clock.warm_start),
        "accuracy": accuracy(model, tokenizer, encode, read_pairs(args.eval), args.batch_size) if args.eval else None,
        "launch_s": clock.first_step_end - started,
        "steps": args.steps,
        "timed_steps": args.steps - args.warmup,
        "train_pairs": train_pairs,  # TRL's: those left after dropping pairs over --max-length
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
