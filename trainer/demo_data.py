"""A small, deterministic, learnable review-rating dataset for the offline demo.

`python -m trainer.demo_data OUT_DIR` writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl
with {"text", "label"} rows, label 0..4 for 1..5 stars. The folder loads through
`datasets.load_dataset(OUT_DIR)` exactly like a hub dataset's data files.

Each review mixes sentences in the voice of its own rating with sentences from neighbouring
ratings and neutral filler, so the classes overlap (as real star ratings do): a model must
weigh the evidence, and a bag of single keywords is not enough for full marks.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOPICS = ["food", "service", "room", "staff", "price", "delivery", "battery", "screen", "coffee",
          "location", "checkout", "packaging", "menu", "music", "support team", "build quality"]

VOICE = {  # rating index -> phrases in that voice
    0: ["was terrible", "was an absolute disaster", "made me angry", "was the worst I have seen",
        "was broken on arrival", "was a complete waste of money", "was rude and careless"],
    1: ["was disappointing", "was below what I expected", "felt overpriced", "was slow and sloppy",
        "let me down", "was not worth it", "had too many problems"],
    2: ["was okay", "was average", "was fine, nothing special", "was hit or miss",
        "was acceptable", "was neither good nor bad", "was about what you would expect"],
    3: ["was good", "was pleasant", "was better than expected", "was well done",
        "was friendly and quick", "was a solid choice", "was worth the money"],
    4: ["was outstanding", "was absolutely perfect", "blew me away", "was the best I have had",
        "was flawless", "exceeded every expectation", "was a delight from start to finish"],
}

FILLER = ["We came on a {day}.", "I ordered it for my {who}.", "This was my {nth} visit.",
          "We were a group of {n}.", "It took about {n} days to arrive.", "I read the reviews first."]
CLOSERS = {0: "Never again.", 1: "Probably not coming back.", 2: "Might try again.",
           3: "Would come back.", 4: "Highly recommended!"}


def _sentence(rng: random.Random, rating: int) -> str:
    return f"The {rng.choice(TOPICS)} {rng.choice(VOICE[rating])}."


def _filler(rng: random.Random) -> str:
    return rng.choice(FILLER).format(
        day=rng.choice(["Monday", "Friday", "Sunday"]), who=rng.choice(["sister", "office", "dad"]),
        nth=rng.choice(["first", "second", "tenth"]), n=rng.randint(2, 9),
    )


def review(rng: random.Random, rating: int) -> str:
    parts = []
    for _ in range(rng.randint(2, 4)):
        drift = rng.choices([0, -1, 1, -2, 2], weights=[55, 15, 15, 4, 4])[0]
        parts.append(_sentence(rng, min(4, max(0, rating + drift))))
    for _ in range(rng.randint(0, 2)):
        parts.insert(rng.randrange(len(parts) + 1), _filler(rng))
    if rng.random() < 0.5:
        parts.append(CLOSERS[min(4, max(0, rating + rng.choice([0, 0, 0, -1, 1])))])
    return " ".join(parts)


def generate(out_dir: str | Path, num_train: int = 4000, num_test: int = 1000, seed: int = 0) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, count in (("train", num_train), ("test", num_test)):
        rows = []
        for i in range(count):
            label = i % 5  # balanced classes
            rows.append(json.dumps({"text": review(rng, label), "label": label}))
        rng.shuffle(rows)
        (out / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(generate(args.out_dir, args.train, args.test, args.seed))


if __name__ == "__main__":
    main()
