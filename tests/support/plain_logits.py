"""`python -m tests.support.plain_logits TEXTS_JSON MODEL_DIR ...`: each model's logits on the texts, a JSON line
each, from plain transformers in a process where peft cannot be imported: final/ must not need it.
Run forked from a tests/support/preloaded.py server (runs.run_preloaded), which imports transformers
and never peft, so the import that fails here is the one a user's would."""

import json
import sys

sys.modules["peft"] = None  # an import of peft now fails

import torch  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

if __name__ == "__main__":
    texts = json.loads(sys.argv[1])
    for model_dir in sys.argv[2:]:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        with torch.no_grad():
            print(json.dumps(model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.tolist()))
