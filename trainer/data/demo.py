"""Small, deterministic, learnable review datasets: the offline demo's, and one of each shape
users bring (README, "Your own data"; docs/tasks.md).

`python -m trainer.data.demo [OUT_DIR]` writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl
(OUT_DIR: data/reviews, where configs/demo.yaml reads them) with {"text", "label"} rows, label
0..4 for 1..5 stars. The folder loads through
`datasets.load_dataset(OUT_DIR)` exactly like a hub dataset's data files.

`--shape` writes one file of another shape instead, with no validation split, as most of
them come:
- `sentiment`: OUT_DIR/reviews.csv, columns review and sentiment (negative, neutral or
  positive, as names; imbalanced, 60% positive);
- `complaints`: OUT_DIR/complaints.jsonl, columns text and complaints, the list of the
  topics the review complains about (multi_label; none for a happy review);
- `score`: OUT_DIR/scores.jsonl, columns text and score, the stars as a number from 1.0 to
  5.0 with a little noise (regression);
- `preferences`: OUT_DIR/preferences.jsonl, preference pairs (pairwise): a prompt asking
  about a topic, a chosen answer about that topic, and a rejected one that is off the topic
  or dismissive; each answer padded with filler so that the chosen one is the longer in
  about half the pairs (length alone predicts nothing);
- `chat-preferences`: OUT_DIR/chat-preferences.jsonl, the same pairs as conversations:
  chosen and rejected each a list of {role, content} messages, the user's question first
  (no prompt column, as conversational preference sets come).

Each review mixes sentences in the voice of its own rating with sentences from neighbouring
ratings and neutral filler, so the classes overlap (as real star ratings do): a model must
weigh the evidence, and a bag of single keywords is not enough for full marks.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from collections.abc import Iterable
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
        rows = [{"text": review(rng, i % 5), "label": i % 5} for i in range(count)]  # balanced classes
        rng.shuffle(rows)
        _write_jsonl(out / f"{split}.jsonl", rows)
    return out


SENTIMENT = {0: "negative", 1: "negative", 2: "neutral", 3: "positive", 4: "positive"}
COMPLAINED = ["food", "service", "price", "delivery", "staff"]


def sentiment(out_dir: str | Path, rows: int = 4000, seed: int = 0) -> Path:
    """reviews.csv: review, sentiment (names), 60% positive, 25% negative, 15% neutral."""
    rng = random.Random(seed)
    path = Path(out_dir) / "reviews.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "sentiment"])
        for _ in range(rows):
            rating = rng.choices([0, 1, 2, 3, 4], weights=[12, 13, 15, 30, 30])[0]
            writer.writerow([review(rng, rating), SENTIMENT[rating]])
    return path


def complaints(out_dir: str | Path, rows: int = 4000, seed: int = 0) -> Path:
    """complaints.jsonl: text, complaints (the topics a review speaks ill of; a list)."""
    rng = random.Random(seed)
    return _write_jsonl(Path(out_dir) / "complaints.jsonl", (_complaint(rng) for _ in range(rows)))


def _complaint(rng: random.Random) -> dict:
    sentences, complained = [], []
    for topic in rng.sample(COMPLAINED, rng.randint(1, 3)):
        rating = rng.choice([0, 1, 3, 4])
        sentences.append(f"The {topic} {rng.choice(VOICE[rating])}.")
        if rating <= 1:
            complained.append(topic)
    if rng.random() < 0.3:
        sentences.insert(rng.randrange(len(sentences) + 1), _filler(rng))
    return {"text": " ".join(sentences), "complaints": sorted(complained)}


def score(out_dir: str | Path, rows: int = 4000, seed: int = 0) -> Path:
    """scores.jsonl: text, score (the stars, 1.0 to 5.0, with noise of +-0.5)."""
    rng = random.Random(seed)
    return _write_jsonl(Path(out_dir) / "scores.jsonl", (_score(rng) for _ in range(rows)))


def _score(rng: random.Random) -> dict:
    rating = rng.randrange(5)
    return {"text": review(rng, rating), "score": round(min(5.0, max(1.0, rating + 1 + rng.uniform(-0.5, 0.5))), 2)}


DISMISSIVE = ["Why do you care about the {topic}? Ask someone else.", "No idea, I was not paying attention.",
              "Whatever, it does not matter.", "I would rather not talk about the {topic}.",
              "Look it up yourself.", "Who knows. Next question."]


def _preference(rng: random.Random) -> dict:
    """A prompt about a topic; the chosen answer speaks of it, the rejected one is off the
    topic (half the pairs) or dismissive; filler on either side evens out the lengths."""
    topic = rng.choice(TOPICS)
    chosen = [f"The {topic} {rng.choice(VOICE[rng.randrange(5)])}."]
    if rng.random() < 0.5:
        other = rng.choice([t for t in TOPICS if t != topic])
        rejected = [f"The {other} {rng.choice(VOICE[rng.randrange(5)])}."]
    else:
        rejected = [rng.choice(DISMISSIVE).format(topic=topic)]
    for answer in (chosen, rejected):
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            answer.insert(rng.randrange(len(answer) + 1), _filler(rng))
    return {"prompt": f"What did you think of the {topic}?", "chosen": " ".join(chosen),
            "rejected": " ".join(rejected)}


def preferences(out_dir: str | Path, rows: int = 4000, seed: int = 0) -> Path:
    """preferences.jsonl: prompt, chosen, rejected (texts)."""
    rng = random.Random(seed)
    return _write_jsonl(Path(out_dir) / "preferences.jsonl", (_preference(rng) for _ in range(rows)))


def chat_preferences(out_dir: str | Path, rows: int = 4000, seed: int = 0) -> Path:
    """chat-preferences.jsonl: chosen, rejected (conversations, the question in each)."""
    rng = random.Random(seed)

    def conversation(pair: dict, side: str) -> list[dict]:
        return [{"role": "user", "content": pair["prompt"]}, {"role": "assistant", "content": pair[side]}]

    pairs = (_preference(rng) for _ in range(rows))
    return _write_jsonl(Path(out_dir) / "chat-preferences.jsonl",
                        ({"chosen": conversation(p, "chosen"), "rejected": conversation(p, "rejected")} for p in pairs))


def _write_jsonl(path: Path, records: Iterable[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


SHAPES = {"sentiment": sentiment, "complaints": complaints, "score": score, "preferences": preferences,
          "chat-preferences": chat_preferences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="default: data/reviews, or data/SHAPE for --shape")
    parser.add_argument("--shape", choices=["reviews", *SHAPES], default="reviews",
                        help="reviews: the demo's train.jsonl and test.jsonl; the others: one file")
    parser.add_argument("--train", type=int, default=4000, help="rows (train rows, for reviews)")
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out_dir = args.out_dir or f"data/{args.shape}"
    if args.shape == "reviews":
        print(generate(args.out_dir, args.train, args.test, args.seed))
    else:
        print(SHAPES[args.shape](args.out_dir, args.train, args.seed))


if __name__ == "__main__":
    main()
