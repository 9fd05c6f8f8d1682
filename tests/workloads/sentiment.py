"""A small, deterministic sentiment dataset written as CSV or JSONL for the text workload:
each review mixes neutral filler with words that carry its label."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

POSITIVE = ["great", "excellent", "loved", "wonderful", "superb", "delightful", "fine"]
NEGATIVE = ["awful", "terrible", "hated", "boring", "dreadful", "poor", "broken"]
FILLER = [
    "the",
    "movie",
    "was",
    "a",
    "plot",
    "and",
    "actors",
    "it",
    "really",
    "film",
    "story",
    "of",
    "this",
    "with",
    "music",
    "ending",
    "i",
    "overall",
    "quite",
]


def reviews(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = "pos" if i % 2 == 0 else "neg"
        words = rng.choices(FILLER, k=rng.randint(4, 10))
        cue = POSITIVE if label == "pos" else NEGATIVE
        for _ in range(rng.randint(1, 2)):
            words.insert(rng.randrange(len(words) + 1), rng.choice(cue))
        out.append((" ".join(words).capitalize() + rng.choice([".", "!", "..."]), label))
    return out


def write(path: Path, n: int, seed: int = 0) -> Path:
    rows = reviews(n, seed)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    else:
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(rows)
    return path
