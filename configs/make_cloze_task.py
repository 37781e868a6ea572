"""Derive a multiple-choice task from the held-out end of the bundled tiny Shakespeare: which line comes next.

    python configs/make_cloze_task.py [OUT.jsonl] [--examples N] [PRESET] [key=value ...]   (PRESET: a file or a name)
                                      (default: data/shakespeare_cloze.jsonl, 200, configs/default.yaml)

It also writes that held-out end as text beside it, for perplexity, named after OUT (data/shakespeare_cloze.jsonl:
data/shakespeare_heldout.txt; data/char.jsonl: data/char_heldout.txt).

Each record is a speech's speaker and its first lines as the context, and four candidate next lines: the
true one and three lines of other speeches as long as it (or nearly), in a shuffled order (seed 0), in lm.eval's task shape
(each a line from within its speech, never its first or last, so that where a line stands is no cue):

    {"context": "ROMEO:\\nI take thee at thy word:\\n", "choices": ["Call me but love...", ...], "label": 0}

The speeches come from the part of the corpus a run holds out for validation (the last data.val_fraction of its
tokens), so the task scores text the model was not trained on. Where that part begins depends on the tokenizer:
the data is prepared (as train.py would, into the same cache) with the PRESET and key=value settings given, those
of the run to score (train.py's own defaults if none):

    python -m lm.eval runs/NAME --task data/shakespeare_cloze.jsonl --text data/shakespeare_heldout.txt
    python train.py train.eval_tasks=[data/shakespeare_cloze.jsonl]
"""

import json
import os
import random
import sys

from lm import config as config_lib
from lm.config import BUNDLED_CORPUS
from lm.data import prepare_for_training
from lm.errors import ArgumentParser, UserError, cli


def heldout_path(out: str) -> str:
    """Where the held-out text of task file `out` goes: named after it (data/shakespeare_cloze.jsonl's is
    data/shakespeare_heldout.txt, data/char.jsonl's data/char_heldout.txt), so that each task keeps its own text."""
    stem = os.path.splitext(os.path.basename(out))[0]
    stem = stem[: -len("_cloze")] if stem.endswith("_cloze") else stem
    return os.path.join(os.path.dirname(out), f"{stem}_heldout.txt")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) for each speech of three lines or more: a block that starts with 'NAME:' on a line of its own."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 4 and lines[0].endswith(":") and lines[0][:-1].replace(" ", "").isalpha():
            out.append((lines[0][:-1], lines[1:]))
    return out


def held_out_text(preset: str | None, overrides: list[str]) -> str:
    """The bundled corpus's text behind the validation tokens of a run with these settings."""
    cfg = config_lib.load(preset or config_lib.default_preset(), overrides)
    if cfg.data.path not in ("", BUNDLED_CORPUS) or cfg.data.val_path or cfg.data.sources or cfg.data.format != "text":
        raise UserError("this task is made from the bundled tiny Shakespeare: leave data.path, data.val_path, "
                        "data.sources and data.format at their defaults")  # fmt: skip
    (source,) = prepare_for_training(cfg.data, cfg.seed).sources
    with open(BUNDLED_CORPUS, "rb") as f:
        return f.read()[source.meta["splits"]["train"]["bytes"] :].decode()


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(description="Write a which-line-comes-next task from held-out Shakespeare.")
    parser.add_argument("args", nargs="*", metavar="[OUT.jsonl] [PRESET] [key=value]")
    parser.add_argument("--examples", type=int, default=200)
    args = parser.parse_intermixed_args(argv)  # (--examples between OUT and PRESET, as the usage line has it)
    overrides = [a for a in args.args if "=" in a]
    outs = [a for a in args.args if "=" not in a and a.endswith(".jsonl")]
    presets = [a for a in args.args if a not in overrides and a not in outs]  # a file or a name, as train.py's
    if len(outs) > 1 or len(presets) > 1:
        raise UserError(f"give at most one OUT.jsonl and one PRESET, got {' '.join(outs + presets)}")
    out = outs[0] if outs else os.path.join("data", "shakespeare_cloze.jsonl")
    if args.examples < 1:
        raise UserError(f"--examples must be >= 1, got {args.examples}")
    tail = held_out_text(presets[0] if presets else None, overrides)
    held_out = speeches(tail)
    if len(held_out) < 4:  # a right line and three wrong ones, each from a speech of its own
        raise UserError(
            f"the held-out part holds {len(held_out)} speeches of three lines or more, and a question needs 4; "
            "raise data.val_fraction"
        )
    rng = random.Random(0)
    records = []
    for i in rng.sample(range(len(held_out)), min(args.examples, len(held_out))):
        speaker, lines = held_out[i]
        cut = rng.randrange(1, len(lines) - 1)  # at least one line of context, and one to guess
        others = [j for j in range(len(held_out)) if j != i]
        # From each of three other speeches, its line closest in length to the true one: with lines of any
        # length, the log-likelihood (a sum over tokens) would mostly pick the shortest. Like the true line, never
        # a speech's first or last line: a last line's end (".", "?", "!") would tell a wrong choice apart.
        closest = lambda candidates: min(candidates, key=lambda line: (abs(len(line) - len(lines[cut])), line))
        wrong = [closest(held_out[j][1][1:-1]) for j in rng.sample(others, 3)]
        choices = [lines[cut], *wrong]
        rng.shuffle(choices)
        context = f"{speaker}:\n" + "\n".join(lines[:cut]) + "\n"
        records.append({"context": context, "choices": choices, "label": choices.index(lines[cut])})
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    heldout_text = heldout_path(out)
    with open(heldout_text, "w") as f:
        f.write(tail)
    print(f"wrote {len(records)} examples to {out}, and the held-out text to {heldout_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
