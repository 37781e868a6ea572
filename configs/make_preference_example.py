"""Derive the chat and preference examples from the bundled tiny Shakespeare: reply to a line of dialogue.

    python configs/make_preference_example.py [OUT_DIR]     (default: data/)

Writes two files from the same pairs of consecutive speeches (configs/make_finetune_example.py's):

    shakespeare_chats.jsonl        {"messages": [{"role": "user", "content": LINE}, {"role": "assistant", "content": REPLY}]}
    shakespeare_preferences.jsonl  {"messages": [{"role": "user", "content": LINE}],
                                    "chosen": {"role": "assistant", "content": REPLY},
                                    "rejected": {"role": "assistant", "content": REPLY with its words shuffled}}

where REPLY is the next speaker's first line. The preference is for Shakespeare's word order over the same
words scrambled (a reply of one or two words, which cannot be scrambled, is left out of the pairs).
configs/dpo_example.yaml trains on the pairs.
"""

import json
import os
import random
import sys

from lm.config import BUNDLED_CORPUS
from lm.errors import ArgumentParser, UserError, cli

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_finetune_example import speeches  # noqa: E402


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(description="Write the chat and preference examples (JSONL) from Shakespeare.")
    parser.add_argument("out", nargs="?", default="data", metavar="OUT_DIR", help="directory for the two files (data)")
    out = parser.parse_args(argv).out
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{out} is a file; give the directory to write the two files into (default: data)")
    with open(BUNDLED_CORPUS) as f:
        turns = speeches(f.read())
    rng = random.Random(0)
    os.makedirs(out, exist_ok=True)
    chats, pairs = os.path.join(out, "shakespeare_chats.jsonl"), os.path.join(out, "shakespeare_preferences.jsonl")
    n_pairs = 0
    with open(chats, "w") as c, open(pairs, "w") as p:
        for (_, a_lines), (_, b_lines) in zip(turns, turns[1:]):
            line, reply = a_lines[-1], b_lines[0]
            user = {"role": "user", "content": line}
            c.write(json.dumps({"messages": [user, {"role": "assistant", "content": reply}]}) + "\n")
            words = reply.split()
            scrambled = words[:]
            while len(set(words)) > 2 and scrambled == words:
                rng.shuffle(scrambled)
            if scrambled != words:
                chosen, rejected = ({"role": "assistant", "content": x} for x in (reply, " ".join(scrambled)))
                p.write(json.dumps({"messages": [user], "chosen": chosen, "rejected": rejected}) + "\n")
                n_pairs += 1
    print(f"wrote {len(turns) - 1} conversations to {chats} and {n_pairs} preference pairs to {pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
