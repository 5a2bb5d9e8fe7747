"""final/README.md: the model card, in the Hub's format, so that a colleague (or the Hub's
page) can read what final/ is: the task and labels, the data, final/'s own metrics, how it was
trained, on what, for how long, and from which code.

The metadata (YAML front matter: base_model, datasets, metrics, pipeline_tag, library_name and
the model-index of results) is huggingface_hub's ModelCardData, so the Hub and `ModelCard.load`
read it as they read any card. trainer/outputs/export.py writes it under every strategy; an adapter's
folder (final/adapter/) gets a card of its own, for peft.
"""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import loading
from trainer.config.schema import Config
from trainer.tasks.registry import task_class
from trainer.tasks.space import Labels

PIPELINE = "text-classification"


@dataclass
class Facts:
    """What the card says of the run, as the run ends."""

    cfg: Config
    labels: Labels
    final_step: int
    final_eval: dict[str, float]
    """final/'s metrics on the validation split."""
    test_eval: dict[str, float] | None
    rows: dict[str, int]
    """Rows per split: train, validation, test."""
    world_size: int
    hardware: str
    train_seconds: float
    model_commit: str | None
    """The Hub commit model.name was loaded from (None: a local folder)."""
    dropped_rows: dict[str, dict[str, int]] = field(default_factory=dict)
    """The rows data.drop_invalid_rows dropped: split: kind: rows."""


def hardware(device_type: str) -> str:
    """What each rank ran on, in words."""
    import torch

    if device_type == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def code_commit() -> str | None:
    """The git commit of this trainer's source, when it runs from a checkout (not in the image)."""
    try:
        result = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


CAPTIONS = {"curves.png": "Loss, learning rate, throughput and validation by step",
            "goodput.png": "Where the run's time went, attempt by attempt"}


def render(facts: Facts, adapter: bool = False, pictures: tuple[str, ...] | list[str] = ()) -> str:
    """The card's text: final/'s (the merged model), or with `adapter` final/adapter/'s;
    `pictures`: the files of CAPTIONS beside it, which the card shows."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    cfg, labels = facts.cfg, facts.labels
    name = Path(cfg.output_dir).name
    from_hub = not Path(cfg.model.name).expanduser().exists()
    data_from_hub = not Path(cfg.data.path).expanduser().exists()
    results = [EvalResult(task_type=PIPELINE, dataset_type=cfg.data.path if data_from_hub else Path(cfg.data.path).name,
                          dataset_name=Path(cfg.data.path).name, dataset_split=split, metric_type=metric,
                          metric_value=value)
               for split, metrics in ((cfg.data.eval_split, facts.final_eval), (cfg.data.test_split, facts.test_eval))
               if metrics for metric, value in metrics.items() if metric != "loss"]
    data = ModelCardData(
        model_name=name, base_model=cfg.model.name if from_hub else None,
        datasets=[cfg.data.path] if data_from_hub else None, metrics=sorted(facts.final_eval.keys() - {"loss"}),
        pipeline_tag=PIPELINE, library_name="peft" if adapter else "transformers",
        tags=["text-classification", labels.problem_type.replace("_", "-"), *(["lora"] if cfg.model.lora.r else [])],
        eval_results=results or None)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_body(facts, adapter, name, pictures)}"))


def _body(facts: Facts, adapter: bool, name: str, pictures: tuple[str, ...] | list[str]) -> str:
    cfg, labels = facts.cfg, facts.labels
    kind = "reward model" if task_class(labels.problem_type).pairs else \
        f"{labels.problem_type.replace('_', '-')} text classifier"
    what = ("LoRA adapters (peft) for" if adapter else "A") + f" {kind} fine-tuned from `{cfg.model.name}`"
    revision = f" at commit `{facts.model_commit}`" if facts.model_commit else ""
    final = Path(cfg.output_dir) / "final"  # where the run wrote it; a pushed copy: its repository's id
    use = (f'PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained("{cfg.model.name}"), '
           f'"{final / "adapter"}")' if adapter else f'AutoModelForSequenceClassification.from_pretrained("{final}")')
    lines = [f"# {name}", "", f"{what}{revision}.", "", "```python", "from transformers import "
             "AutoModelForSequenceClassification" + ("\nfrom peft import PeftModel" if adapter else ""),
             f"model = {use}", "```", "", "## Labels", ""]
    pairs = task_class(labels.problem_type).pairs
    if labels.names:
        lines += [f"{i}. {label}" for i, label in enumerate(labels.names)]
    elif pairs:
        lines += [("One reward per text: a reward model, trained on preference pairs (Bradley-Terry). Its one "
                  "logit is the reward, as RewardBench reads it:"), "", "```python",
                  "from transformers import AutoTokenizer", f'tokenizer = AutoTokenizer.from_pretrained("{final}")',
                  "reward = model(**tokenizer(prompt, answer, return_tensors=\"pt\")).logits[0, 0]", "```", "",
                  ("(a conversation: the tokenizer's `apply_chat_template(messages, tokenize=False)`, tokenized with "
                  "`add_special_tokens=False`). `accuracy` is the share of pairs whose chosen answer gets the higher "
                  "reward (a tie counts wrong); `length_baseline`, that of always preferring the longer answer.")]
    else:
        lines.append("One number per text (regression).")
    rows = ", ".join(f"{split} {count:,}" for split, count in facts.rows.items() if count)
    if pairs:
        prompt, margin = cfg.data.prompt_field, cfg.data.margin_field
        read = (f": pairs of `{cfg.data.chosen_field}` over `{cfg.data.rejected_field}`" +
                (f" after `{prompt}`" if prompt else "") + (f", margins from `{margin}`" if margin else "") +
                ("" if prompt and margin else " (and a `prompt` or `margin` column where the data has one)"))
    else:
        read = (f": text from `{cfg.data.text_field}`" +
                (f" and `{cfg.data.text_pair_field}`" if cfg.data.text_pair_field else "") +
                f", labels from `{cfg.data.label_field}`")
    lines += ["", "## Data", "", f"`{cfg.data.path}`" + (f" ({cfg.data.name})" if cfg.data.name else "") +
              f"{read}; rows: {rows}." +
              "".join(f" Dropped from {split} as unusable (data.drop_invalid_rows): " +
                      ", ".join(f"{n:,} with {kind}" for kind, n in kinds.items()) + "."
                      for split, kinds in facts.dropped_rows.items()), "",
              f"## Results of this model (step {facts.final_step})", "", "| split | " +
              " | ".join(facts.final_eval) + " |", "|---|" + "---|" * len(facts.final_eval)]
    for split, metrics in ((f"validation ({cfg.data.eval_split})", facts.final_eval),
                           (f"test ({cfg.data.test_split})", facts.test_eval)):
        if metrics:
            lines.append(f"| {split} | " + " | ".join(f"{metrics.get(k, float('nan')):.4f}" for k in facts.final_eval)
                         + " |")
    commit = code_commit()
    shown = [line for picture in pictures for line in (f"![{CAPTIONS[picture]}]({picture})", "")]
    lines += ["", "## Training", "", *shown,
              f"{facts.world_size} rank(s) on {facts.hardware}, {facts.train_seconds / 60:.1f} minutes of training "
              f"(evaluation and checkpoints aside), by this project's trainer"
              + (f" at commit `{commit}`" if commit else "") + ". The resolved config (values from the environment "
              "as written):", "",
              "```yaml", loading.to_yaml(cfg).rstrip(), "```", ""]
    return "\n".join(lines)
