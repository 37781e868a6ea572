"""The export command: a checkpoint written as a Hugging Face GPT-2 directory (the conversion is lm.hf).

    python -m lm.export RUN_DIR OUT_DIR [--step N | --best]
"""

from __future__ import annotations

import sys

from lm.errors import ArgumentParser, cli
from lm.hf import export_hf_gpt2
from lm.pretrained import load


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="python -m lm.export",
        description="Export a checkpoint as a Hugging Face GPT-2 (GPT2LMHeadModel) directory.",
    )
    parser.add_argument("run_dir", help="run, checkpoints or step directory")
    parser.add_argument("out_dir", help="directory for config.json, model.safetensors, vocab.json, merges.txt")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    which.add_argument("--best", action="store_true", help="the checkpoint with the lowest validation loss")
    args = parser.parse_args(argv)
    params, model_cfg, tokenizer = load(args.run_dir, args.step, args.best)
    written = export_hf_gpt2(params, model_cfg, tokenizer, args.out_dir)
    print(f"wrote {args.out_dir}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
