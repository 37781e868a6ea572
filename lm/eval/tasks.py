"""Multiple-choice tasks and perplexity: reading a task file, scoring it, and the figures reported.

    task = load_task("arc_easy.jsonl")
    scores = score_task(scorer, tokenizer, task)   # {"examples", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    scores = perplexity(scorer, tokenizer, text)   # {"tokens", "bytes", "loss", "ppl", "bpb", "stride"}

A task file is JSONL, one example a line, in the common multiple-choice shape (HellaSwag, ARC, PIQA, ... as
converted for lm-evaluation-harness):

    {"context": "The capital of France is", "choices": [" Paris", " Rome", " Oslo"], "label": 0}

or already tokenized, for a task that must see exact ids: {"context_ids": [...], "choices_ids": [[...], ...],
"label": 0}; such ids must lie in the model's tokenizer (an id beyond it means the file was tokenized for
another model). Each choice is scored by its log-likelihood after the context: accuracy counts the examples
whose right choice has the highest; length-normalised accuracy divides each log-likelihood by the choice's
length in characters first (lm-evaluation-harness's acc_norm; for tokenized records, in tokens). Both come
with their standard error.

Tokenizing as lm-evaluation-harness does: whitespace that ends the context moves to the start of the choice,
the context is encoded after the tokenizer's prefix (its BOS, if it adds one), and the choice's tokens are
those of context + choice after the context's, so the boundary is tokenized as in running text (where a choice's
first characters merge into the context's last token, from the first token where any choice parts from the
context's). An empty context, text or tokens, is the prefix or, with none, end-of-text: the start of a document.
Context + choice longer than the model's window loses the start of the context (lm.eval.scoring.fit).

Perplexity: the text's tokens after the tokenizer's prefix (or end-of-text), every token scored once in
windows of the model's length (lm.eval.scoring.rolling). loss is nats a token, ppl = exp(loss), and bpb the
bits a UTF-8 byte of the text, comparable across tokenizers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence

import numpy as np

from lm import storage
from lm.data.sources import DECOMPRESSORS, open_input
from lm.errors import UserError
from lm.files import check_given
from lm.eval.scoring import Request, Scorer, fit, rolling
from lm.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Example:
    where: str  # FILE:LINE, for errors
    context: str | tuple[int, ...]
    choices: tuple[str, ...] | tuple[tuple[int, ...], ...]
    label: int


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # the file's name without .jsonl (and .gz, .zst, .xz, .bz2)
    path: str
    examples: tuple[Example, ...]


def digest(task: Task) -> str:
    """What the task's examples hold (not where they were read from), as a hex digest: a task edited, or cut by
    another limit, has another."""
    held = [(e.context, e.choices, e.label) for e in task.examples]
    return hashlib.sha256(repr(held).encode()).hexdigest()[:16]


def task_name(path: str) -> str:
    """The file's name without .jsonl and any compression suffix (arc_easy.jsonl.gz: arc_easy)."""
    name = os.path.basename(path.rstrip("/"))  # (suffixes in any case, as the files are read: TASK.JSONL.GZ)
    name = next((name[: -len(z)] for z in DECOMPRESSORS if name.lower().endswith(z)), name)
    return name[: -len(".jsonl")] if name.lower().endswith(".jsonl") else name


def name_clash(paths: Sequence[str]) -> tuple[str, str, bool] | None:
    """The first name (task_name) two of `paths` share, with the second path and whether the two are one file (given
    twice, which no renaming parts); None where every name differs."""
    names = [task_name(p) for p in paths]
    seen: dict[str, str] = {}
    for path, name in zip(paths, names):
        if name in seen:
            first = seen[name]
            same = first == path if storage.is_url(path) else os.path.realpath(first) == os.path.realpath(path)
            return name, path, same
        seen[name] = path
    return None


def _ids(value, where: str, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise UserError(f"{where}: {field} must be a list of token ids")
    return tuple(value)


def _example(record, where: str) -> Example:
    if not isinstance(record, dict):
        raise UserError(f"{where}: a record must be a JSON object with context, choices and label")
    tokenized = "context_ids" in record or "choices_ids" in record
    fields = ("context_ids", "choices_ids", "label") if tokenized else ("context", "choices", "label")
    missing = [f for f in fields if f not in record]
    if missing:
        raise UserError(f"{where}: the record has no {' or '.join(missing)} (a record needs {', '.join(fields)})")
    choices = record[fields[1]]
    if not isinstance(choices, list) or not choices:
        raise UserError(f"{where}: {fields[1]} must be a non-empty list")
    if len(choices) < 2:
        raise UserError(f"{where}: {fields[1]} has one choice; a multiple-choice record needs two or more")
    if tokenized:
        context = _ids(record["context_ids"], where, "context_ids")
        choices = tuple(_ids(c, where, f"choices_ids[{i}]") for i, c in enumerate(choices))
        if any(not c for c in choices):
            raise UserError(f"{where}: a choice in choices_ids is empty")
    else:
        context = record["context"]
        if not isinstance(context, str) or not all(isinstance(c, str) for c in choices):
            raise UserError(f"{where}: context must be a string and choices a list of strings")
        if any(not c for c in choices):
            raise UserError(f"{where}: choice {choices.index('')} is empty")
        choices = tuple(choices)
    label = record["label"]
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        # (HF datasets such as HellaSwag hold the label as text, "1": a number written as text is said as such)
        as_text = isinstance(label, str) and label.isdecimal() and int(label) < len(choices)
        fix = f"write it as the number {label}" if as_text else "give the 0-based index of the right choice"
        raise UserError(f"{where}: label {json.dumps(label)} is not the index of one of its {len(choices)} choices "
                        f"(0..{len(choices) - 1}); {fix}")  # fmt: skip
    return Example(where, context, choices, label)


def load_task(path: str, limit: int = 0, fix: str = "give the path of a task file") -> Task:
    """A task file's examples (the first `limit`, if > 0), each checked; errors name FILE:LINE. `fix` ends the line
    of a file that cannot be read."""
    examples = []
    check_given(path, "task file")
    try:
        f = open_input(path)  # decompressed as its suffix says (.gz, .zst, .xz, .bz2); a misnamed file is refused
    except OSError as e:
        raise UserError(f"cannot read task file {path}: {e.strerror or e}; {fix}") from None
    with f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"task file {path} is not UTF-8 (line {number}, byte {e.start}); save it as UTF-8"
                ) from None
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte order mark, as some editors write
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not valid JSON ({e.msg}); one JSON object a line") from None
            examples.append(_example(record, where))
            if limit and len(examples) == limit:
                break
    if not examples:
        raise UserError(f"task file {path} has no examples; one JSON object a line")
    return Task(task_name(path), path, tuple(examples))


def choice_requests(tokenizer: Tokenizer, example: Example, window: int) -> list[Request]:
    """One request per choice of the example, tokenized as the module's docstring says."""
    if not isinstance(example.context, str):
        ids = [*example.context, *(t for c in example.choices for t in c)]
        if why := tokenizer.not_a_token(ids):
            raise UserError(f"{example.where}: {why}: the record was tokenized for another model")
        context = list(example.context) or list(tokenizer.prefix) or [tokenizer.eot]  # as a text context's
        return [fit(context, c, window, example.where) for c in example.choices]
    context = example.context
    spaces = len(context) - len(context.rstrip())
    context, moved = (context[:-spaces], context[-spaces:]) if spaces else (context, "")
    context_ids = tokenizer.encode_context(context).tolist()
    wholes = [tokenizer.encode_context(context + moved + choice).tolist() for choice in example.choices]
    # The choices' tokens begin where context + choice's tokens part from the context's: where a choice's first
    # characters merge into the context's last token (":" + "\n" is one token ":\n" for GPT-4's split), that token
    # is scored with the choice, for every choice alike, instead of the choice's rest after a context missing it.
    start = len(tokenizer.prefix)
    if context:
        start = min(next((i for i, (a, b) in enumerate(zip(context_ids, w)) if a != b), min(len(context_ids), len(w)))
                    for w in wholes)  # fmt: skip
    return [fit(whole[:start] or [tokenizer.eot], whole[start:], window, example.where) for whole in wholes]


def _stderr(hits: np.ndarray) -> float | None:
    """The standard error of a mean of 0/1 hits; None (JSON's null) for one example, which has none."""
    return float(np.std(hits, ddof=1) / math.sqrt(len(hits))) if len(hits) > 1 else None


def task_requests(tokenizer: Tokenizer, task: Task, window: int) -> list[Request]:
    """The requests of every choice of every example, in order (tokenizing checks the ids: errors name the record)."""
    return [r for e in task.examples for r in choice_requests(tokenizer, e, window)]


def accuracy(task: Task, logprobs: Sequence[float]) -> dict:
    """{"examples", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} from the log-likelihood of every choice,
    in task_requests' order."""
    acc, acc_norm, at = [], [], 0
    for example in task.examples:
        lls = np.asarray(logprobs[at : at + len(example.choices)], np.float64)
        at += len(example.choices)
        lengths = np.asarray([len(c) for c in example.choices], np.float64)
        acc.append(float(np.argmax(lls) == example.label))
        acc_norm.append(float(np.argmax(lls / lengths) == example.label))
    acc, acc_norm = np.asarray(acc), np.asarray(acc_norm)
    return {
        "examples": len(task.examples),
        "acc": float(acc.mean()),
        "acc_stderr": _stderr(acc),
        "acc_norm": float(acc_norm.mean()),
        "acc_norm_stderr": _stderr(acc_norm),
    }


def score_task(
    scorer: Scorer,
    tokenizer: Tokenizer,
    task: Task,
    progress: Callable[[int], None] | None = None,
    requests: list[Request] | None = None,
) -> dict:
    """accuracy() of the task under the scorer's model; `progress(n)` is called as choices are scored. `requests`:
    the task's, made already (task_requests)."""
    requests = task_requests(tokenizer, task, scorer.window) if requests is None else requests
    return accuracy(task, [lp for lp, _ in scorer.score(requests, progress)])


def choices_scored(task: Task) -> int:
    return sum(len(e.choices) for e in task.examples)


def text_requests(tokenizer: Tokenizer, text: str, window: int, stride: int = 0) -> list[Request]:
    first = tokenizer.prefix[0] if tokenizer.prefix else tokenizer.eot
    return rolling(tokenizer.encode(text), first, window, stride)


def perplexity(
    scorer: Scorer,
    tokenizer: Tokenizer,
    text: str,
    stride: int = 0,
    progress: Callable[[int], None] | None = None,
    requests: list[Request] | None = None,
) -> dict:
    """{"tokens", "bytes", "loss", "ppl", "bpb", "stride"} of the text (see the module's docstring; "stride": the
    tokens scored a window, the window where 0). `requests`: the text's text_requests, if the caller has them
    already."""
    requests = requests if requests is not None else text_requests(tokenizer, text, scorer.window, stride)
    if not requests:
        raise UserError("the text is empty: nothing to score")
    logprob = sum(lp for lp, _ in scorer.score(requests, progress))
    tokens = sum(r.n_scored for r in requests)
    n_bytes = len(text.encode("utf-8"))
    loss = -logprob / tokens
    return {
        "tokens": tokens,
        "bytes": n_bytes,
        "loss": loss,
        "ppl": math.exp(min(loss, 700.0)),
        "bpb": -logprob / math.log(2) / n_bytes,
        "stride": stride or scorer.window,  # (a loss is comparable with another of the same stride alone)
    }
