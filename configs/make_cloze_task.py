"""Derive a multiple-choice task from the held-out end of the bundled tiny Shakespeare: which line comes next.

    python configs/make_cloze_task.py [OUT.jsonl] [--examples N]     (default: data/shakespeare_cloze.jsonl, 200)

It also writes that held-out end as text beside it (data/shakespeare_heldout.txt), for perplexity.

Each record is a speech's speaker and its first lines as the context, and four candidate next lines: the
true one and three lines of other speeches as long as it (or nearly), in a shuffled order (seed 0), in lm.eval's task shape:

    {"context": "ROMEO:\\nI take thee at thy word:\\n", "choices": ["Call me but love...", ...], "label": 0}

The speeches come from the last 10% of the corpus, the part a run on the bundled corpus holds out for
validation (data.val_fraction 0.1), so the task scores text the model was not trained on:

    python -m lm.eval runs/NAME --task data/shakespeare_cloze.jsonl --text data/shakespeare_heldout.txt
    python train.py train.eval_tasks=[data/shakespeare_cloze.jsonl]
"""

import argparse
import json
import os
import random

from lm.config import BUNDLED_CORPUS

HELD_OUT = 0.1  # the tail of the corpus that data.val_fraction's default keeps for validation


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) for each speech of three lines or more: a block that starts with 'NAME:' on a line of its own."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 4 and lines[0].endswith(":") and lines[0][:-1].replace(" ", "").isalpha():
            out.append((lines[0][:-1], lines[1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a which-line-comes-next task from held-out Shakespeare.")
    parser.add_argument("out", nargs="?", default=os.path.join("data", "shakespeare_cloze.jsonl"))
    parser.add_argument("--examples", type=int, default=200)
    args = parser.parse_args()
    with open(BUNDLED_CORPUS) as f:
        text = f.read()
    tail = text[int(len(text) * (1 - HELD_OUT)) :]
    held_out = speeches(tail)
    rng = random.Random(0)
    chosen = rng.sample(range(len(held_out)), min(args.examples, len(held_out)))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        for i in chosen:
            speaker, lines = held_out[i]
            cut = rng.randrange(1, len(lines) - 1)  # at least one line of context, and one to guess
            others = [j for j in range(len(held_out)) if j != i]
            # From each of three other speeches, its line closest in length to the true one: with lines of any
            # length, the log-likelihood (a sum over tokens) would mostly pick the shortest.
            closest = lambda candidates: min(candidates, key=lambda line: (abs(len(line) - len(lines[cut])), line))
            wrong = [closest(held_out[j][1]) for j in rng.sample(others, 3)]
            choices = [lines[cut], *wrong]
            rng.shuffle(choices)
            context = f"{speaker}:\n" + "\n".join(lines[:cut]) + "\n"
            f.write(json.dumps({"context": context, "choices": choices, "label": choices.index(lines[cut])}) + "\n")
    heldout_text = os.path.join(os.path.dirname(args.out), "shakespeare_heldout.txt")
    with open(heldout_text, "w") as f:
        f.write(tail)
    print(f"wrote {len(chosen)} examples to {args.out}, and the held-out text to {heldout_text}")


if __name__ == "__main__":
    main()
