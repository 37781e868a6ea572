"""The export command: a checkpoint written as a Hugging Face model directory (the conversion is lm.hf).

    python -m lm.export RUN_DIR OUT_DIR [--step N | --best]
"""

from __future__ import annotations

import os
import sys

from lm.errors import ArgumentParser, UserError, cli, ctrl_c_kept
from lm import checkpoint as ckpt_lib
from lm import hf, storage
from lm.hf.files import check_new_directory
from lm.data.preference import trained_on_chats
from lm.pretrained import HF_PREFIX, checkpoint_source, hf_directory, load, sample_settings
from lm.run_dir import RunDir


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="python -m lm.export",
        description="Export a checkpoint as a Hugging Face directory: GPT-2, or Llama, Qwen2 or Qwen3.",
    )
    # (a ~ the shell left, quoted or after =, is the home directory, as in lm.data prepare: not a directory named ~)
    parser.add_argument("run_dir", type=storage.user_path, help="run, checkpoints or step directory")
    parser.add_argument("out_dir", type=storage.user_path,
        help="new directory for config.json, model.safetensors and the tokenizer files")
    parser.add_checkpoint_choice()
    args = parser.parse_args(argv)
    # (chosen once: --step or --best with hf:DIR refused)
    source = checkpoint_source(args.run_dir, args.step, args.best)
    _check_outside(source, args.out_dir)
    check_new_directory(args.out_dir)  # (before the weights are read: minutes, for a large model)
    print(f"exporting {RunDir(args.run_dir).shown(source)}", file=sys.stderr)  # (the step --best or the newest is)
    with ctrl_c_kept():  # (a Ctrl-C that orbax's reads turn into another error: not a damaged checkpoint)
        params, model_cfg, tokenizer = load(source)
    sample = sample_settings(source)  # (generation_config.json's: transformers' defaults)
    # (a run's weights trained on chats: generate stops at its template's end of a reply too, as sample.py --chat)
    chat = not source.startswith(HF_PREFIX) and trained_on_chats(ckpt_lib.load_config(*ckpt_lib.find(source)).data)
    written = hf.export(params, model_cfg, tokenizer, args.out_dir, sample, chat)
    print(f"wrote {args.out_dir}: {', '.join(written)}")
    return 0


def _check_outside(source: str, out_dir: str) -> None:
    """Refuse an out_dir that is, or holds, the checkpoint being exported: "remove that one first", new_directory's
    advice for a directory with files in it, would delete the weights the export reads (a run's checkpoints)."""
    path = hf_directory(source) if source.startswith(HF_PREFIX) else source  # (hf:~/x as load reads it)
    if not out_dir or storage.is_url(out_dir) or storage.is_url(path):
        return
    out, src = os.path.realpath(out_dir), os.path.realpath(path)
    if src == out or src.startswith(out.rstrip(os.sep) + os.sep):
        raise UserError(f"{out_dir} holds the checkpoint being exported ({path}); give the path of a new directory "
                        "outside it")


if __name__ == "__main__":
    sys.exit(main())
