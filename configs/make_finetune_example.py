"""Derive the fine-tuning example task from the bundled tiny Shakespeare: answer a line of dialogue.

    python configs/make_finetune_example.py [OUT.jsonl]     (default: data/shakespeare_replies.jsonl)

Each record pairs two consecutive speeches: the prompt is the first speaker's name and last line plus
the next speaker's name, the completion is the next speaker's first line, e.g.

    {"prompt": "ROMEO:\nI take thee at thy word:\n\nJULIET:\n", "completion": "What man art thou...\n"}

configs/finetune_example.yaml trains on it; the loss covers the completions only.
"""

import json
import os
import sys

from lm.config import BUNDLED_CORPUS
from lm.errors import ArgumentParser, UserError, cli


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) for each speech: a block that starts with 'NAME:' on a line of its own."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and lines[0].endswith(":") and lines[0][:-1].replace(" ", "").isalpha():
            out.append((lines[0][:-1], lines[1:]))
    return out


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(description="Write the fine-tuning example task (prompt, completion) from Shakespeare.")
    default = os.path.join("data", "shakespeare_replies.jsonl")
    parser.add_argument("out", nargs="?", default=default, metavar="OUT.jsonl", help=f"the file to write ({default})")
    out = parser.parse_args(argv).out
    if os.path.isdir(out):
        raise UserError(f"{out} is a directory; give the file to write, e.g. {os.path.join(out, 'replies.jsonl')}")
    with open(BUNDLED_CORPUS) as f:
        turns = speeches(f.read())
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        for (a, a_lines), (b, b_lines) in zip(turns, turns[1:]):
            prompt = f"{a}:\n{a_lines[-1]}\n\n{b}:\n"
            f.write(json.dumps({"prompt": prompt, "completion": b_lines[0] + "\n"}) + "\n")
    print(f"wrote {len(turns) - 1} examples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
