"""output_dir/final: the trained model as plain transformers loads it, with its tokenizer.

`AutoModelForSequenceClassification.from_pretrained("runs/x/final")` loads it without the
trainer, without peft (LoRA's adapters are merged in) and without FSDP (its shards are merged
into whole safetensors files). It is written into a temporary folder and published whole
(trainer/files.py): a crash mid-export leaves the previous final/, or none.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainer import files
from trainer.model import lora
from trainer.outputs import card, curves, report
from trainer.runtime import distributed
from trainer.runtime.environment import DistEnv

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainer.strategies.base import Strategy


def export_final(output_dir: Path, model: PreTrainedModel, tokenizer, strategy: Strategy, dist_env: DistEnv,
                 adapter: bool, facts: card.Facts) -> Path:
    """Collective: final/ (and final/adapter/, peft's format, with `adapter`), each with its
    model card (trainer/outputs/card.py) of `facts`, written by rank 0, or under FSDP by every rank's
    shards first; a failure stops every rank with the reason. The run's last use of the model:
    merging the adapters changes it in place."""
    final, tmp = output_dir / "final", output_dir / ".final.tmp"
    distributed.rank_zero_does(dist_env, f"output_dir: {tmp}", lambda: files.fresh_folder(tmp))
    if adapter:
        # First: merging consumes the adapters. Sharded, they are gathered (a collective).
        state = strategy.gathered_trained_state(model)
        distributed.rank_zero_does(dist_env, f"output_dir: {tmp / 'adapter'}",
                                   lambda: lora.save_adapter(model, tmp / "adapter", state))
    strategy.save_pretrained(lora.merged(model), tmp, dist_env)

    def move_into_place() -> None:
        tokenizer.save_pretrained(tmp)
        pictures = [name for name in (curves.FILE, report.PICTURE) if (output_dir / name).is_file()]
        for name in pictures:  # tracking.curves: the card shows them
            shutil.copyfile(output_dir / name, tmp / name)
        (tmp / "README.md").write_text(card.render(facts, pictures=pictures))
        if adapter:  # over peft's empty template
            (tmp / "adapter" / "README.md").write_text(card.render(facts, adapter=True))
        files.rename_into_place(tmp, final)

    distributed.rank_zero_does(dist_env, f"output_dir: {final}", move_into_place)
    return final
