"""The sample command: read a prompt and settings, load a checkpoint, print or stream its samples.

    python sample.py [RUN_DIR] --prompt "ROMEO:" --num-samples 3 [--stream] [--stop STR]...
    python sample.py [RUN_DIR] --prompt "ROMEO:" --prompt "JULIET:"     # a batch: one row per prompt and sample
    python sample.py hf:DIR --chat "What is 2+2?" [--system "Answer briefly."]

Settings not given come from the checkpoint's config (its sample section). Without
--max-new-tokens, the config's default is lowered to the room the prompt leaves in the context
window; a given length that does not fit is an error, as in generate.
"""

from __future__ import annotations

import argparse
import io
import os
import sys

from tqdm import tqdm

from lm import checkpoint as ckpt_lib
from lm import runs as runs_lib
from lm import compile_cache, sharding, storage
from lm.chat import encode_chat, turn_end
from lm.config import MeshConfig, SampleConfig
from lm.errors import ArgumentParser, UserError, cli, ctrl_c_kept, fits_in_memory, plural
from lm.files import read_user_text
from lm.pretrained import HF_PREFIX, checkpoint_source, config_and_tokenizer, hf_sample_settings, load
from lm.run_dir import RunDir
from lm.sampling.loop import cache_bytes, check_fits, check_settings, generate, longest_prompt, stream

SEPARATOR = "-" * 40


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="sample.py",
        description="Sample text from a trained model. Settings not given come from the checkpoint's "
        "config (its sample section), or an hf:DIR's generation_config.json over lm's defaults.",
    )
    p.add_argument("run_dir", nargs="?", type=storage.user_path,
        help="run, checkpoints or step directory, or hf:DIR (default: the newest run in runs/)")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt",
        action="append",
        help="text to continue; - reads stdin; repeat for a batch (default: start from end-of-text)",
    )
    source.add_argument("--prompt-file", action="append", type=storage.user_path,
        help="read a prompt from this file; repeat for a batch")
    source.add_argument(
        "--chat",
        action="append",
        metavar="MESSAGE",
        help="a user message, formatted with the model's chat template; - reads stdin; prints the reply; repeat for "
        "a batch",
    )
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each")
    p.add_argument("--max-new-tokens", type=int, help="tokens per sample (default: the config's, as far as they fit)")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 = off")
    p.add_argument(
        "--top-p", type=float, help="nucleus sampling mass in [0, 1]; 1 = off, 0 = the most likely token only"
    )
    p.add_argument(
        "--num-samples", type=int, default=1, help="samples per prompt; the r-th printed (from 0) uses seed + r"
    )
    p.add_argument("--seed", type=int, default=0, help="the first row's seed (default 0); row r draws with seed + r")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="end a sample at this string; repeat for several (a newline in bash: $'\\n')",
    )
    p.add_argument("--stream", action="store_true", help="print text as it is generated, one sample at a time")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the samples: no notes on stderr")
    p.add_checkpoint_choice()
    compile_cache.add_option(p)
    return p


def _read_prompts(args) -> list[str]:
    """The prompts' texts, in the order given; [""] (start from end-of-text) only when no prompt is given, as an empty
    one given is a slip (an unset shell variable, an empty pipe)."""
    if args.prompt_file is not None:
        if "-" in args.prompt_file and not os.path.exists("-"):  # (it said "cannot read prompt file -")
            raise UserError("--prompt-file - reads no standard input; use --prompt - for a prompt on standard input")
        return [
            read_user_text(f, "prompt file", "drop --prompt-file to start from end-of-text") for f in args.prompt_file
        ]
    if args.prompt is None:
        return [""]
    if args.prompt.count("-") > 1:
        raise UserError(
            "--prompt - (standard input) is given more than once; give it once, or put the prompts in files"
        )
    texts = []
    for given in args.prompt:
        text = _read_stdin("the prompt", "--prompt -") if given == "-" else _utf8(given, "--prompt")
        if not text:
            where = "standard input (--prompt -)" if given == "-" else "--prompt"
            raise UserError(f"the prompt from {where} is empty; give text, or drop --prompt to start from end-of-text")
        texts.append(text)
    return texts


def _utf8(text: str, option: str) -> str:
    """An option's text, refused where the command line held bytes that are not UTF-8 (Python keeps them as lone
    surrogates, which the tokenizer would have turned into U+FFFD: text the user did not write)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"the text of {option} is not UTF-8 (character {e.start}); give UTF-8 text") from None
    return text


def _read_stdin(what: str, option: str) -> str:
    """Standard input as UTF-8 text (whatever the locale), as a prompt file is read; `option`: the one that reads it.
    At a terminal, a line on stderr says how to end it (a read there waited with no sign of what for)."""
    if sys.stdin.isatty():
        print(f"{option}: reading {what} from the terminal; end it with Ctrl-D on a line of its own", file=sys.stderr)
    try:
        text = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", newline="").read()
    except UnicodeDecodeError as e:
        raise UserError(
            f"{what} on standard input ({option}) is not UTF-8 (byte {e.start}); give UTF-8 text"
        ) from None
    if "\0" in text:
        raise UserError(f"{what} on standard input ({option}) is binary (it holds NUL bytes); give UTF-8 text")
    return text.removeprefix("\ufeff")  # (a file some editor saved with a byte order mark, piped in: no text)


def _encode_chat(tokenizer, chat: list[dict]) -> list[int]:
    """The prompt's ids of a --chat message (after --system's); a template that refuses a system message (Gemma's,
    Mistral's), or would drop it, says so in a line that names --system, where its own words did not."""
    try:
        return encode_chat(tokenizer, chat, add_generation_prompt=True)[0]
    except UserError as e:
        if chat[0]["role"] != "system":
            raise
        try:
            encode_chat(tokenizer, chat[1:], add_generation_prompt=True)
        except UserError:
            raise e from None
        failed = "the chat template failed: "  # (its own raise_exception's words), else it would drop the message
        why = str(e)[len(failed) :] if str(e).startswith(failed) else "it writes none"
        raise UserError(f"--system: the model's chat template takes no system message ({why}); drop --system, or put "
                        "its text in the --chat message") from None  # fmt: skip


@cli
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    if (args.chat or []).count("-") > 1:
        raise UserError("--chat - (standard input) is given more than once; give it once")
    if "-" in (args.chat or ()):  # (a message on standard input, as --prompt - reads one, its closing line ends dropped
        # as the shell's $(...) drops them: `echo Hi |` chatted about "Hi\n", a turn unlike --chat Hi's)
        piped = _read_stdin("the message", "--chat -").rstrip("\r\n")
        if not piped:  # (`echo "$UNSET" |`: a line end alone was taken as a message)
            raise UserError("the message on standard input (--chat -) is empty (an unset shell variable?); give text")
        args.chat = [piped if message == "-" else message for message in args.chat]
    if "" in (args.chat or ()):  # before any checkpoint is read
        raise UserError("--chat needs a message, and the one given is empty (an unset shell variable?)")
    if args.system == "":  # (an empty system turn was sent, where an empty --chat is refused)
        raise UserError("--system needs text, and the one given is empty (an unset shell variable?); drop --system "
                        "for no system message")  # fmt: skip
    for option, texts in (("--chat", args.chat or []), ("--system", [args.system]), ("--stop", args.stop)):
        for text in texts:
            if text is not None:
                _utf8(text, option)
    target = runs_lib.given_or_latest(args.run_dir)
    mesh = sharding.make_mesh(MeshConfig())
    if target.startswith(HF_PREFIX):  # a Hugging Face directory: its generation_config.json's settings over lm's
        checkpoint_source(target, args.step, args.best)  # (--step or --best with it is one line)
        sample_cfg, notes = hf_sample_settings(target)
        for note in notes if not args.quiet else ():
            print(f"note: {note}", file=sys.stderr)
        model_cfg, tokenizer = config_and_tokenizer(target)  # (the weights are read once the settings are checked)
        source = target
    else:  # read the parameters last: the settings are checked first, and that is quick
        directory, step = ckpt_lib.find(target, args.step, args.best)
        cfg = ckpt_lib.load_config(directory, step)
        model_cfg, sample_cfg, source = cfg.model, cfg.sample, f"{directory}/{step}"
        tokenizer = ckpt_lib.load_tokenizer(directory, step)
    pick = lambda given, default: default if given is None else given
    temperature = pick(args.temperature, sample_cfg.temperature)
    top_k, top_p = pick(args.top_k, sample_cfg.top_k), pick(args.top_p, sample_cfg.top_p)
    if args.system is not None and args.chat is None:
        raise UserError("--system goes with --chat MESSAGE; add --chat, or put the text in --prompt")
    stops, stop_tokens = list(args.stop), []
    if args.chat is not None:  # the replies alone are printed; each ends at the template's end of turn
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        chats = [[*system, {"role": "user", "content": message}] for message in args.chat]
        prompts, ids = [""] * len(chats), [_encode_chat(tokenizer, chat) for chat in chats]
        stop_tokens = sorted({turn_end(tokenizer, chat) for chat in chats})
    else:
        prompts = _read_prompts(args)
        ids = [tokenizer.encode_context(prompt).tolist() for prompt in prompts]
    window, (longest, which) = model_cfg.max_seq_len, longest_prompt(ids)
    if args.chat:  # (a chat's prompt is its message in the chat template, which a user does not type)
        which = which.replace("prompt", "chat") + " (the message in its template)"
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None and longest >= window:
        raise UserError(
            f"{which} is {longest} tokens, which leaves no room for a token to generate within the model's "
            f"context window of {window} tokens; shorten {'the message' if args.chat else 'the prompt'}"
        )
    if max_new_tokens is None:
        max_new_tokens = max(1, min(sample_cfg.max_new_tokens, window - longest))
    settings = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    flags = {name: "--" + name.replace("_", "-") for name in ("max_new_tokens", "temperature", "top_k", "top_p")}
    given = {name: flag for name, flag in flags.items() if getattr(args, name) is not None}
    check_settings(model_cfg, settings, stops, names={**given, "stop": "--stop"})
    no_prompt = args.chat is None and prompts == [""]
    check_fits(longest, max_new_tokens, window, no_prompt, which, "--max-new-tokens", templated=bool(args.chat))
    if max_new_tokens < sample_cfg.max_new_tokens and args.max_new_tokens is None and not args.quiet:
        tokens = "new token fills" if max_new_tokens == 1 else "new tokens fill"
        print(f"note: {max_new_tokens} {tokens} the model's {window}-token window", file=sys.stderr)
    compile_cache.for_command(args.compile_cache)
    with ctrl_c_kept():  # (a Ctrl-C that orbax's reads turn into another error: not a damaged checkpoint)
        params, loaded_cfg, _ = load(source, mesh=mesh)
    if target.startswith(HF_PREFIX):  # (as the weights' layout found it)
        model_cfg = loaded_cfg
    if not args.quiet:
        print(f"sampling {RunDir(target).shown(source)}", file=sys.stderr)  # a bucket's run: its URL, not the copy
    batch = 1 if args.stream else len(ids) * args.num_samples  # a stream draws its rows one at a time
    length = longest + max_new_tokens
    what, fix = f"sampling {plural(batch, 'row')} of {length} tokens", "lower --num-samples or --max-new-tokens"
    if len(ids) > 1:
        fix = "give fewer prompts, " + fix
    with fits_in_memory(what, fix, needed=cache_bytes(model_cfg, batch, length, mesh)):  # (refused at once beyond it)
        # Row r (prompt p, sample i: r = p * num_samples + i) draws with seed + r, as the server and generate number
        # their rows.
        rows = [p for p in range(len(ids)) for _ in range(args.num_samples)]
        if args.stream:
            for r, p in enumerate(rows):
                if r:
                    print(SEPARATOR)
                print(prompts[p], end="", flush=True)
                for deltas in stream(
                    params, model_cfg, tokenizer, [ids[p]], settings, args.seed + r, stops, stop_tokens
                ):
                    print(deltas[0].text, end="", flush=True)
                print()
        else:
            with tqdm(
                total=max_new_tokens, desc="generating", unit="step", leave=False, disable=args.quiet, file=sys.stderr
            ) as bar:
                # (with -q too: the loop comes back to the host every few steps, where a Ctrl-C is handled; in one
                # device loop it waited for the whole generation)
                progress = lambda done: bar.update(done - bar.n)
                samples = generate(
                    params, model_cfg, tokenizer, [ids[p] for p in rows], settings, args.seed, stops, progress,
                    stop_tokens,
                )
            for r, (p, s) in enumerate(zip(rows, samples)):
                if r:
                    print(SEPARATOR)
                print(prompts[p] + s.text)
    return 0
