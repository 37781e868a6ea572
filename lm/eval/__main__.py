"""The command line of lm.eval: score a checkpoint on multiple-choice tasks and the perplexity of text files.

    python -m lm.eval RUN_DIR|hf:DIR --task FILE.jsonl [--task ...] [--text FILE ...] [--batch-size 16]
                      [--limit N] [--stride N] [--output FILE.json] [--step N | --best] [--quiet]

Prints a table and writes the results as JSON: to --output, else into the run's directory
(RUN_DIR/eval/step_N.json, keeping the tasks and texts an earlier lm.eval of that step wrote there); for hf:DIR,
or a step directory outside a run's checkpoints/, only with --output.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from tqdm import tqdm

from lm import runs as runs_lib
from lm import compile_cache, sharding, storage
from lm.config import MeshConfig
from lm.errors import ArgumentParser, UserError, cli, ctrl_c_kept, fits_in_memory, when_stopped
from lm.eval.scoring import Scorer
from lm.eval.tasks import (
    choices_scored, load_task, name_clash, perplexity, score_task, task_name, task_requests, text_requests,
)
from lm.files import lock_file, probe_writable, read_json, read_user_text, why_not_made, write_json
from lm.pretrained import HF_PREFIX, checkpoint_source, config_and_tokenizer, load
from lm.run_dir import RunDir


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m lm.eval",
        description="Score a trained model: accuracy on multiple-choice tasks (JSONL: context, choices, label) "
        "and perplexity / bits per byte of text files.",
    )
    p.add_argument("model", nargs="?", type=storage.user_path,
        help="run, checkpoints or step directory, or hf:DIR (default: the newest run)")
    p.add_argument("--task", action="append", default=[], type=storage.user_path, metavar="FILE.jsonl",
        help="a multiple-choice task; repeatable")
    p.add_argument("--text", action="append", default=[], type=storage.user_path, metavar="FILE",
        help="a UTF-8 text file to score; repeatable")
    p.add_argument("--batch-size", type=int, default=16, help="rows scored at once (16)")
    p.add_argument("--limit", type=int, default=0, help="score only each task's first N examples (0 = all)")
    p.add_argument(
        "--stride", type=int, default=0, help="perplexity: tokens scored per window (default: the model's window)"
    )
    p.add_argument("--output", type=storage.user_path, metavar="FILE.json",
        help="where the JSON goes (default: RUN_DIR/eval/step_N.json; none for hf:DIR, or a step directory outside "
        "a run: the table only)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_checkpoint_choice()
    compile_cache.add_option(p)
    return p


@cli
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not args.task and not args.text:
        raise UserError("nothing to evaluate: give --task FILE.jsonl and/or --text FILE")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.limit < 0:
        raise UserError(f"--limit must be >= 0 (0 = all), got {args.limit}")
    if args.limit and not args.task:  # (each option scores one kind of input: given without it, it did nothing)
        raise UserError(f"--limit {args.limit} counts a task's examples, and no --task is given; drop --limit")
    if args.stride and not args.text:
        raise UserError(f"--stride {args.stride} sets how a --text is scored, and no --text is given; drop --stride")
    if args.output == "":  # (an unset shell variable, `--output "$OUT"`: it wrote the results elsewhere, unsaid)
        raise UserError("--output is empty; give FILE.json, or leave --output out for the run's eval/step_N.json")
    target = runs_lib.given_or_latest(args.model)
    # Everything that can be checked without the weights is checked first: reading them is the slow part.
    source = checkpoint_source(target, args.step, args.best)
    model_cfg, tokenizer = config_and_tokenizer(source)
    tasks = [load_task(path, args.limit) for path in args.task]
    texts = {path: read_user_text(path, "text file", "nothing to score") for path in args.text}
    # (a file given twice counts twice: not scored once, silently; a task and a text are kept apart, by kind)
    clash = name_clash(args.task) or name_clash(args.text)
    if clash:
        name, path, same = clash
        if same:  # (renaming the one file renames both)
            raise UserError(f"{path} is given twice; give it once")
        raise UserError(f"two inputs are named {name}; rename one of the files")
    shown = RunDir(target).shown(source)  # a run in a bucket: by its URL, not the copy read
    steps_dir, _, step = shown.rpartition("/")  # (hf:DIR of a relative DIR, hf:my_model, has no "/")
    # shown: RUN_DIR/checkpoints/N (or its URL), or a step directory elsewhere, which has no run to keep its results
    # in (its grandparent's eval/ held, merged, the results of every such step N beside it): like hf:DIR, --output
    own = None
    if not source.startswith(HF_PREFIX) and steps_dir.rsplit("/", 1)[-1] == "checkpoints":
        own = f"{steps_dir.rsplit('/', 1)[0]}/eval/step_{step}.json"
    output = args.output or own
    # The run's own file of this step, also where --output names it: what earlier lm.evals of it wrote is kept
    merged = own is not None and _resolved(output) == _resolved(own)
    if output:
        _check_writable(output)  # before the scoring, which is the slow part
    # Every input's requests, before any is scored: a bad record or --stride is one line at once, not after the
    # inputs before it have been scored (and their scores lost).
    window = model_cfg.max_seq_len
    task_reqs = {task.name: task_requests(tokenizer, task, window) for task in tasks}
    text_reqs = {path: text_requests(tokenizer, text, window, args.stride) for path, text in texts.items()}
    when_stopped(f"no results were written{f' ({output} is as it was)' if output else ''}")
    mesh = sharding.make_mesh(MeshConfig())
    compile_cache.for_command(args.compile_cache)
    with ctrl_c_kept():  # (a Ctrl-C that orbax's reads turn into another error: not a damaged checkpoint)
        params, _, _ = load(source, mesh=mesh)
    scorer = Scorer(params, model_cfg, args.batch_size, mesh=mesh, n_vocab=tokenizer.n_vocab)
    results = {"model": shown, "tasks": {}, "texts": {}}
    what = f"scoring {args.batch_size} rows of up to {scorer.window} tokens at once"
    with fits_in_memory(what, "lower --batch-size"):
        for task in tasks:
            total = choices_scored(task)
            with tqdm(total=total, desc=task.name, unit="choice", disable=args.quiet, file=sys.stderr) as bar:
                scores = score_task(scorer, tokenizer, task, bar.update, task_reqs[task.name])
                results["tasks"][task.name] = {"file": task.path, **scores}
        for path, text in texts.items():
            requests = text_reqs[path]
            total = len(requests)
            with tqdm(total=total, desc=task_name(path), unit="window", disable=args.quiet, file=sys.stderr) as bar:
                scores = perplexity(scorer, tokenizer, text, args.stride, bar.update, requests)
                results["texts"][task_name(path)] = {"file": path, **scores}
    failed, kept = None, False  # the file first: an output that goes away (`| head`, a full disk) must not lose it
    if output:
        try:
            kept = _write(output, results, merged)
        except OSError as e:
            failed = e
    # (the JSON alone on standard output where it goes there: `--output /dev/stdout | jq`)
    print(table(results), flush=True, file=sys.stderr if output and storage.is_stdout(output) else sys.stdout)
    if failed is not None:  # (the table above holds the scores)
        raise UserError(f"cannot write the results to {output}: {failed.strerror or failed}; the scores are above")
    if output:
        print(f"results: {output}" + (" (with this step's earlier ones)" if kept else ""), file=sys.stderr)
    return 0


def _write(output: str, results: dict, merged: bool) -> bool:
    """Write results to output; `merged`, keep the tasks and texts the file holds that these results do not score
    again (read as it is written, under a lock of the file's directory where it is local: two lm.evals of one
    step at once keep both). Whether any were kept."""
    lock = None
    if merged and not storage.is_url(output):
        with contextlib.suppress(OSError):  # (a filesystem without locks: written without one)
            lock = lock_file(os.path.join(os.path.dirname(output), ".lock"), shared=False, wait=True)
    try:
        earlier = read_json(output) if merged else None
        kept = {kind: earlier[kind] for kind in ("tasks", "texts") if isinstance(earlier, dict)
                and isinstance(earlier.get(kind), dict)}  # fmt: skip
        write_json(output, {**results, **{kind: {**kept[kind], **results[kind]} for kind in kept}})
        return any(set(kept[kind]) - set(results[kind]) for kind in kept)
    finally:
        if lock is not None:
            os.close(lock)


def _resolved(path: str) -> str:
    """A path as the file it names (links and relative parts resolved), a URL as it is."""
    return path if storage.is_url(path) else os.path.realpath(path)


def _check_writable(output: str) -> None:
    """The results file can be written: its directory made and writable, the path itself no directory."""
    try:
        storage.makedirs(os.path.dirname(storage.absolute(output)))
        if not storage.is_url(output):
            if os.path.isdir(output):
                raise IsADirectoryError(errno.EISDIR, "it is a directory")
            probe_writable(os.path.dirname(os.path.abspath(output)))
    except OSError as e:
        why = why_not_made(output, e) if not storage.is_url(output) else e.strerror or e
        raise UserError(
            f"cannot write the results to {output}: {why}; give --output FILE.json in a writable directory"
        ) from None
    # A file that is there and holds no results (a run's config.yaml, a task's .jsonl) is not replaced by them; a
    # stream named by its device, a link to what the shell opened (`--output /dev/stdout > out.json`: out.json,
    # empty), is written into (a file in /dev/shm is a file)
    device = os.path.abspath(output)
    streamed = storage.is_stdout(output) or device.startswith(("/dev/", "/proc/")) and os.path.islink(device)
    if not storage.is_url(output) and not streamed and os.path.isfile(output) and not _is_results(read_json(output)):
        raise UserError(
            f"{output} exists and holds no lm.eval results, which would replace it; give --output a new FILE.json, "
            "or move that file away first"
        )


def _is_results(data: object) -> bool:
    """Whether `data` (a file's JSON) is what lm.eval writes: the model scored, its tasks and its texts."""
    return isinstance(data, dict) and {"model", "tasks", "texts"} <= set(data)


def table(results: dict) -> str:
    """The results as aligned text: one row a task (examples, acc, acc_norm with their standard errors), one a text."""
    lines = []
    if results["tasks"]:
        rows = [("task", "examples", "acc", "acc_norm")]
        for name, r in results["tasks"].items():
            acc, acc_norm = _with_error(r["acc"], r["acc_stderr"]), _with_error(r["acc_norm"], r["acc_norm_stderr"])
            rows.append((name, str(r["examples"]), acc, acc_norm))
        lines += _aligned(rows)
    if results["texts"]:
        lines += [""] if lines else []
        rows = [("text", "tokens", "loss", "ppl", "bpb")]
        for name, r in results["texts"].items():
            rows.append((name, str(r["tokens"]), f"{r['loss']:.4f}", f"{r['ppl']:.3f}", f"{r['bpb']:.4f}"))
        lines += _aligned(rows)
    return "\n".join(lines)


def _with_error(value: float, stderr: float | None) -> str:
    return f"{value:.4f} ± {stderr:.4f}" if stderr is not None else f"{value:.4f} ± n/a"  # (one example: none)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]


if __name__ == "__main__":
    sys.exit(main())
