"""Fine-tune examples: JSONL prompt/completion or text records -> token and loss-mask files, packed into rows.

prepare_examples tokenizes the records once (files in lm/data/meta.py); `example_iterator` packs several
examples into each row: segment_ids keep their attention apart, positions restart for each, and the loss
mask is 0 on prompts and padding. An example of n tokens takes n-1 slots of a row: its inputs are
tokens[:-1] and its targets tokens[1:], so its first token is never a target and its last is never an input.

Packing (first_fit, _Packs) lives here, not with the loaders: it is planned over the examples' offsets and
fills the rows from their masks, which only this format has.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import shlex
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grain
import numpy as np

from lm import storage
from lm.config import DataConfig
from lm.chat import MASK_VERSION, check_record, encode_chat, turn_end
from lm.data import meta as meta_lib
from lm.data.loaders import ENDLESS, Origin, batch_iterator, local_rows, splitmix64
from lm.data.meta import FORMAT_VERSION, META
from lm.data.sources import json_lines, open_input, same_file, warn_bad_utf8
from lm.errors import UserError, plural
from lm.files import copy_file, write_json
from lm.storage import atomic_open
from lm.prepared_dir import SPLITS, example_files
from lm.tokenizer import RANK_FILE, Tokenizer, file_sha256


def prepare_examples_for_config(data_cfg: DataConfig, tokenizer: Tokenizer, seed: int, progress: bool = True):
    """(prepared directory, meta) for a JSONL file of fine-tune examples (data.format=examples), tokenized
    with `tokenizer` (the starting model's) into data.cache_dir on first use."""
    if not data_cfg.path:
        raise UserError(
            f"data.format={data_cfg.format} needs data.path: a JSONL file of "
            + ("messages records" if data_cfg.format == "chat" else "prompt/completion or text records")
        )
    request = prepared_request(
        data_cfg,
        tokenizer,
        seed,
        fields=[data_cfg.prompt_field, data_cfg.completion_field, data_cfg.field],
        chat=data_cfg.format == "chat",
    )
    out_dir = meta_lib.cache_dir(data_cfg.cache_dir, data_cfg.path, "examples", "examples", request)
    meta = prepare_examples(
        data_cfg.path,
        tokenizer,
        out_dir,
        prompt_field=data_cfg.prompt_field,
        completion_field=data_cfg.completion_field,
        text_field=data_cfg.field,
        val_path=data_cfg.val_path,
        val_fraction=data_cfg.val_fraction,
        seed=seed,
        chat=data_cfg.format == "chat",
        progress=progress,
    )
    return out_dir, meta


def prepared_request(data_cfg: DataConfig, tokenizer: Tokenizer, seed: int, **settings) -> dict:
    """What a prepared directory of examples or pairs depends on (its cache key): the input files, the tokenizer,
    the held-out split, the seed, and the format's own `settings`."""
    return {
        "inputs": [storage.absolute(p) for p in (data_cfg.path, data_cfg.val_path) if p],
        "tokenizer": tokenizer.spec,
        "ranks": file_sha256(tokenizer.rank_file) if tokenizer.rank_file else None,
        "hf": meta_lib.hf_digest(tokenizer),
        "val_fraction": None if data_cfg.val_path else data_cfg.val_fraction,
        "seed": seed,
        **settings,
    }


def input_settings(tokenizer: Tokenizer, path: str, val_path: str, val_fraction: float, seed: int) -> dict:
    """The settings a prepared directory of examples or pairs records of its inputs: the tokenizer, the held-out
    split and the versions of the input files."""
    return {
        "tokenizer": tokenizer.spec,
        "rank_file_sha256": file_sha256(tokenizer.rank_file) if tokenizer.rank_file else None,
        "tokenizer_hf_sha256": meta_lib.hf_digest(tokenizer),
        "val_fraction": None if val_path else val_fraction,
        "seed": None if val_path else seed,
        "inputs": [storage.version(storage.absolute(path))],
        "val_inputs": [storage.version(storage.absolute(val_path))] if val_path else [],
    }


def prepare_examples(
    path: str,
    tokenizer: Tokenizer,
    out_dir: str,
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    text_field: str = "text",
    val_path: str = "",
    val_fraction: float = 0.1,
    seed: int = 0,
    chat: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize a JSONL file of fine-tune examples into out_dir and return its meta; do nothing if out_dir is
    already up to date.

    Each line is {prompt_field: ..., completion_field: ...} (loss on the completion and the end-of-text token
    after it; prompt and completion are encoded separately, as a prompt is encoded alone when sampling) or
    {text_field: ...} (loss on every token and the end-of-text token); a tokenizer's BOS comes first where it
    adds one. With chat, each line is {"messages": [{"role", "content"}, ...]}, rendered with the chat template
    (lm/chat.py), with loss on the assistant's turns. The validation examples are those of val_path if
    given, else a val_fraction of the examples drawn by `seed`; both splits keep file order.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    check_jsonl([path, val_path] if val_path else [path], "chat data" if chat else "fine-tune examples")
    if chat:
        turn_end(tokenizer)  # (one line where the template ends a reply with no special token to learn)
    fields = (prompt_field, completion_field, text_field)
    settings = {
        "format_version": FORMAT_VERSION,
        "kind": "examples",
        "chat": chat,
        # (task data: an empty prompt is end-of-text since 2026-11-28, before which a text's first token went unlearned)
        **({"chat_mask": MASK_VERSION} if chat else {"empty_prompt": "eot"}),
        "fields": dict(zip(("prompt", "completion", "text"), fields)),
        **input_settings(tokenizer, path, val_path, val_fraction, seed),
    }
    fingerprint = meta_lib.digest(settings)

    def make() -> dict:
        bad_utf8 = collections.Counter()
        read = lambda p: _read_examples(p, tokenizer, fields, bad_utf8, chat)
        splits, said = read_splits(read, path, val_path, val_fraction, seed)
        warn_bad_utf8(bad_utf8)
        skipped = [where for kind, where in said if kind == "skipped"]
        ends_only = [where for kind, where in said if kind == "ends_only"]
        left_out = [where for kind, where in said if kind == "text_left_out"]
        _warn_skipped(len(skipped), chat, len(ends_only), skipped[:1], ends_only[:1])
        _warn_text_left_out(len(left_out), left_out[:1], fields)

        meta = write_prepared(out_dir, splits, tokenizer, {**settings, "fingerprint": fingerprint})
        meta.update(skipped_empty=len(skipped), invalid_utf8=sum(bad_utf8.values()), ends_only=len(ends_only),
                    first_skipped=skipped[:1], first_ends_only=ends_only[:1], text_left_out=len(left_out),
                    first_text_left_out=left_out[:1])  # fmt: skip
        write_json(os.path.join(out_dir, META), meta)
        counts = meta["splits"]
        if progress:
            train, val = counts["train"], counts["val"]
            print(
                f"{out_dir}: {train['examples']:,} train and {val['examples']:,} val examples, "
                f"{train['tokens']:,} train tokens ({train['loss_tokens']:,} with loss)",
                file=sys.stderr,
            )
        return meta

    meta, made = meta_lib.prepared(out_dir, fingerprint, progress, make)
    if not made:  # (make warned as it read them) on every run that trains on them, not only the first
        _warn_skipped(meta.get("skipped_empty", 0), chat, meta.get("ends_only", 0), meta.get("first_skipped", []),
                      meta.get("first_ends_only", []))  # fmt: skip
        _warn_text_left_out(meta.get("text_left_out", 0), meta.get("first_text_left_out", []), fields)
    return meta


def _warn_text_left_out(count: int, first: list[str], fields: tuple[str, str, str]) -> None:
    """Warn of the records that hold a text beside a prompt or completion, whose text is left out (it was without a
    word), naming the first (FILE:LINE)."""
    if not count:
        return
    prompt, completion, text = fields
    at = f"{'the first ' * (count > 1)}at {first[0]}" if first else ""
    print(f"warning: {plural(count, 'example')} hold{'s' * (count == 1)} both '{text}' and '{prompt}'/'{completion}' "
          f"({at}): trained on the prompt and completion, the '{text}' left out; give each example one or the "
          "other, or name other fields with data.field, data.prompt_field, data.completion_field", file=sys.stderr)


def _warn_skipped(skipped: int, chat: bool, ends_only: int = 0, first_skipped=(), first_ends_only=()) -> None:
    """Warn of the examples skipped and of those that learn only their end token, naming the first of each
    (FILE:LINE, where known)."""
    at = lambda count, first: f"{'the first ' * (count > 1)}at {first[0]}" if first else ""
    if skipped:
        what = "a conversation without an assistant message" if chat else "no text"
        examples = "example" if skipped == 1 else "examples"
        where = "; ".join(filter(None, [what, at(skipped, first_skipped)]))
        print(f"warning: skipped {skipped} {examples} with nothing to learn ({where})", file=sys.stderr)
    if ends_only:
        what = "an empty assistant message" if chat else "an empty completion"
        have = "example has" if ends_only == 1 else "examples have"
        where = f" ({at(ends_only, first_ends_only)})" if first_ends_only else ""
        print(f"warning: {ends_only} {have} {what}{where}: each trains only its end token, to stop at once; drop "
              "them if that is not meant", file=sys.stderr)  # fmt: skip


def write_prepared(out_dir: str, splits: dict[str, list], tokenizer: Tokenizer, settings: dict) -> dict:
    """Write each split's (tokens, loss mask) sequences and the tokenizer's rank file into out_dir (started anew),
    and return the meta that describes them: `settings`, the vocabulary, the counts per split, the checksums. The
    caller adds its own fields and writes meta.json, last, so that an interrupted prepare is never current."""
    meta_lib.start_writing(out_dir)
    dtype = np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32
    counts = {split: write_examples(out_dir, split, items, dtype, tokenizer) for split, items in splits.items()}
    if tokenizer.rank_file:
        rank_file = os.path.join(out_dir, RANK_FILE)
        if os.path.abspath(tokenizer.rank_file) != os.path.abspath(rank_file):
            copy_file(tokenizer.rank_file, rank_file)
    return {
        **settings,
        "n_vocab": tokenizer.n_vocab,
        "eot": tokenizer.eot,
        "dtype": np.dtype(dtype).name,
        "splits": counts,
        "checksums": meta_lib.checksums(
            out_dir, [os.path.basename(f) for split in SPLITS for f in example_files(out_dir, split)]
        ),
    }


# The example files the bundled scripts write (the fine-tune presets read them): file name -> (script, whether its
# argument is the file, not the directory of it); each writes into data/ by default
EXAMPLE_FILES = {
    "shakespeare_replies.jsonl": ("make_finetune_example", True),
    "shakespeare_chats.jsonl": ("make_preference_example", False),
    "shakespeare_preferences.jsonl": ("make_preference_example", False),
}


def _who_writes(path: str) -> str:
    """Where a missing file is one a bundled script writes (a preset's data, before its script was run): the command
    that writes it there, from this directory."""
    if os.path.basename(path) not in EXAMPLE_FILES or "://" in path:
        return ""
    script, takes_file = EXAMPLE_FILES[os.path.basename(path)]
    where = path if takes_file else os.path.dirname(path) or "."
    default = os.path.join("data", os.path.basename(path)) if takes_file else "data"
    given = "" if os.path.normpath(where) == default else f" {shlex.quote(where)}"
    return f" (python -m lm.configs.{script}{given} writes it)"


def check_jsonl(paths: list[str], what: str) -> None:
    """One line for a path that is not a JSONL file (local or in object storage) of fine-tune data, and for
    [path, val_path] where they are one file."""
    for path in paths:
        if storage.isdir(path):
            raise UserError(f"{what} '{path}' is a directory; give one .jsonl file (a mixture of files is for text)")
        if not storage.isfile(path):
            raise UserError(f"{what} '{path}' not found; give a .jsonl file{_who_writes(path)}")
    if len(paths) == 2 and same_file(paths[0]) == same_file(paths[1]):  # (by any name: a link too)
        raise UserError(f"data.val_path '{paths[1]}' is data.path '{paths[0]}' itself: validation would be on the "
                        "training examples; give a file of other examples, or data.val_path='' to hold out "
                        "data.val_fraction of data.path's")  # fmt: skip


def read_splits(read, path: str, val_path: str, val_fraction: float, seed: int) -> tuple[dict[str, list], object]:
    """({"train": ..., "val": ...}, what `read` returns beside its items (a count or a list), summed): the items
    `read(file)` gives of val_path for validation where it is given, else held_out's share of path's."""
    items, count = read(path)
    if val_path:
        val, val_count = read(val_path)
        return {"train": items, "val": val}, count + val_count
    return held_out(items, val_fraction, seed), count


def held_out(items: list, val_fraction: float, seed: int) -> dict[str, list]:
    """{"train": ..., "val": ...}: a val_fraction of the items (at least one, where there are two) drawn by
    `seed`, for validation; both splits keep the items' order."""
    n_val = int(len(items) * val_fraction)
    if val_fraction and len(items) > 1:
        n_val = max(n_val, 1)
    chosen = np.zeros(len(items), bool)
    draws = splitmix64(np.uint64(seed % (1 << 64)), np.arange(len(items), dtype=np.uint64))
    chosen[np.argsort(draws, kind="stable")[:n_val]] = True
    return {"train": [e for e, h in zip(items, chosen) if not h], "val": [e for e, h in zip(items, chosen) if h]}


def _read_examples(
    path: str, tok: Tokenizer, fields: tuple[str, str, str], bad_utf8: collections.Counter, chat: bool = False
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[tuple[str, str]]]:
    """([(token ids, loss mask)] in file order, [(kind, FILE:LINE)] of the examples skipped for having nothing to
    learn ("skipped") and of those kept that learn only their end token ("ends_only"))."""
    prompt_field, completion_field, text_field = fields
    records, wheres, both = [], [], []  # (both: the records with a text beside a prompt or completion)
    # (a line that is no object said "'text' is missing", or "expected a 'messages' list")
    shape = "{'messages': [...]}" if chat else f"{{'{prompt_field}', '{completion_field}'}} or {{'{text_field}'}}"
    tokenized = ("messages",) if chat else fields  # (what is tokenized: a lone surrogate elsewhere is not counted)
    with open_input(path) as f:  # decompressed as its suffix says
        for lineno, record, _ in json_lines(f, path, bad_utf8, f"example a line: {shape}", tokenized):
            if "chosen" in record and "rejected" in record:  # (chat: it trained on the messages, the replies dropped)
                raise UserError(f"{path}:{lineno}: a preference pair (chosen, rejected), which "
                                f"data.format={'chat' if chat else 'examples'} does not read: give "
                                "data.format=preference to train on pairs")  # fmt: skip
            task = any(name in record for name in fields)  # (a record of the other format: the hint names it)
            if chat:
                if not isinstance(record.get("messages"), list):
                    raise UserError(f"{path}:{lineno}: expected a 'messages' list (data.format=chat)" + (
                        f"; a '{prompt_field}'/'{completion_field}' or '{text_field}' record is task data: give "
                        "data.format=examples" if task else ""))  # fmt: skip
                check_record(record, f"{path}:{lineno}")
                records.append(record["messages"])
                wheres.append(f"{path}:{lineno}")
                continue
            if isinstance(record.get("messages"), list) and not task:  # (it advised naming other fields)
                raise UserError(f"{path}:{lineno}: a conversation ('messages'), which data.format=examples does not "
                                "read: give data.format=chat to train on conversations")  # fmt: skip
            names = (prompt_field, completion_field) if prompt_field in record or completion_field in record else ()
            pair = tuple(record.get(name) for name in names) or ("", record.get(text_field))
            if not all(isinstance(x, str) for x in pair):
                wrong = [f"'{k}' " + (f"is {json.dumps(record[k])[:30]}" if k in record else "is missing")
                         for k in names or (text_field,) if not isinstance(record.get(k), str)]  # fmt: skip
                raise UserError(
                    f"{path}:{lineno}: expected string fields '{prompt_field}' and '{completion_field}', "
                    f"or '{text_field}' ({', '.join(wrong)}); name other fields with data.prompt_field, "
                    "data.completion_field, data.field"
                )
            if names and text_field in record:  # (its text was dropped without a word)
                both.append(f"{path}:{lineno}")
            records.append(pair)
            wheres.append(f"{path}:{lineno}")
    if not records:
        raise UserError(f"{path} holds no examples; give one JSON object per line")
    eot = np.array([tok.eot], np.uint32)

    def encode(pair: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
        if not any(pair):  # skipped, and counted in the warning
            return np.zeros(0, np.uint32), np.zeros(0, np.uint8)
        # an empty prompt (a text example) without BOS is end-of-text: the first token is learned, not left out
        prompt, completion = tok.encode_context(pair[0]), tok.encode_array(pair[1])
        ids = np.concatenate([prompt, completion, eot])
        mask = np.zeros(len(ids), np.uint8)
        mask[len(prompt) :] = 1
        return ids, mask

    if chat:
        encoded = []
        for messages, where in zip(records, wheres):
            if not messages:  # no assistant message, as a user's alone: skipped, and counted in the warning
                encoded.append((np.zeros(0, np.uint32), np.zeros(0, np.uint8)))
                continue
            try:
                ids, mask = encode_chat(tok, messages)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
            encoded.append((np.array(ids, np.uint32), mask))
        return _kept(encoded, wheres, path, tok)
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # tiktoken releases the GIL
        encoded = list(pool.map(encode, records, chunksize=64))
    kept, said = _kept(encoded, wheres, path, tok)
    return kept, said + [("text_left_out", where) for where in both]


def _kept(encoded: list[tuple[np.ndarray, np.ndarray]], wheres: list[str], path: str, tok: Tokenizer) -> tuple:
    kept, said = [], []
    for (ids, mask), where in zip(encoded, wheres):
        if len(ids) < 2 or not mask[1:].any():  # nothing to predict
            said.append(("skipped", where))
            continue
        kept.append((ids, mask))
        # (an empty completion or reply: what it learns is its end token alone, to stop at once; kept, and said)
        if not tok.byte_lengths[ids[1:][mask[1:] == 1]].any():
            said.append(("ends_only", where))
    if not kept:
        raise UserError(f"{path} holds only empty examples; give each some text (chat: an assistant message)")
    return kept, said


def write_examples(out_dir: str, split: str, examples: list, dtype, tok: Tokenizer) -> dict:
    """Write one split's three files (each atomically) and return its counts."""
    tokens = np.concatenate([ids for ids, _ in examples]) if examples else np.zeros(0, np.uint32)
    mask = np.concatenate([m for _, m in examples]) if examples else np.zeros(0, np.uint8)
    offsets = np.zeros(len(examples) + 1, np.int64)
    offsets[1:] = np.cumsum([len(ids) for ids, _ in examples])
    targets = np.concatenate([ids[1:][m[1:] == 1] for ids, m in examples]) if examples else tokens
    for path, array in zip(example_files(out_dir, split), (tokens.astype(dtype), mask, offsets)):
        with atomic_open(path, "wb") as f:
            if path.endswith(".npy"):
                np.save(f, array)
            else:
                array.tofile(f)
    return {
        "examples": len(examples),
        "tokens": len(tokens),
        "loss_tokens": len(targets),
        "loss_bytes": int(tok.byte_lengths[targets].sum()),  # text behind the targets, for bits per byte
    }


def load_examples(data_dir: str, split: str, meta: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, loss mask, offsets) of a split of fine-tune examples; tokens and mask memory-mapped."""
    if meta.get("kind") not in ("examples", "preference"):
        raise UserError(f"{data_dir} holds a token stream, not fine-tune examples; prepare it with prepare_examples")
    tokens_path, mask_path, idx_path = example_files(data_dir, split)
    offsets = np.load(idx_path)
    if offsets[-1] == 0:  # numpy cannot map an empty file
        return np.zeros(0, meta["dtype"]), np.zeros(0, np.uint8), offsets
    return np.memmap(tokens_path, dtype=meta["dtype"], mode="r"), np.memmap(mask_path, np.uint8, mode="r"), offsets


CUT_RULE = "2026-12-01"  # cut_starts' rule, in a fine-tune checkpoint's dataset item: another is refused or said


def count_truncated(data_dir: str, meta: dict, split: str, block_size: int, unlearned_end: bool = False) -> int:
    """Examples of a split longer than block_size + 1 tokens, which the loaders cut to fit a row (`unlearned_end`:
    those of them whose last token is not learned, which an lm before 2026-12-01 cut otherwise)."""
    _, mask, offsets = load_examples(data_dir, split, meta)
    long = np.diff(offsets) > block_size + 1
    if unlearned_end:
        long &= np.asarray(mask[offsets[1:] - 1]) == 0
    return int(np.count_nonzero(long))


def cut_starts(mask: np.ndarray, offsets: np.ndarray, block_size: int) -> np.ndarray:
    """Where each example's row window of at most block_size + 1 tokens begins, counted from the example's start:
    0 for one that fits. A longer one is cut from its prompt's start, keeping the end (the completion, a chat's
    last turns): at the first turn that then fits whole (where a prompt follows a reply), else at the latest start
    that keeps the end, but never past the token before its last reply (a completion or last reply longer than the
    window keeps its start and one prompt token). Cutting the end instead dropped a long prompt's whole completion
    (a row with nothing to learn); a cap at the first reply kept a long chat's earliest turns instead of its last.
    The end is the last learned token's: what follows it (the chat template's text after the last reply, and any
    turns after it) is dropped before any prompt of what is learned is."""
    starts = np.zeros(len(offsets) - 1, np.int64)
    for example in np.flatnonzero(np.diff(offsets) > block_size + 1):
        begin, end = offsets[example], offsets[example + 1]
        trained = mask[begin:end] != 0  # trained[i]: token i is a target (token 0 never is)
        trained[0] = False
        learned = np.flatnonzero(trained)
        length = learned[-1] + 1 if len(learned) else end - begin  # tokens after the last target teach nothing
        keeps_end = length - (block_size + 1)  # the first start whose window reaches the last target
        if keeps_end <= 0:
            continue  # what is learned fits from the start: only the unlearned tail is cut
        replies = np.flatnonzero(trained[1:] & ~trained[:-1]) + 1  # where each run of trained tokens begins
        last = replies[-1] if len(replies) else 1
        turns = np.flatnonzero(~trained[1:] & trained[:-1]) + 1  # where each prompt after a reply begins
        whole = turns[(turns >= keeps_end) & (turns < last)]
        starts[example] = whole[0] if len(whole) else max(0, min(keeps_end, last - 1))
    return starts


def example_iterator(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    seed: int,
    epochs: int | None = None,
    rows: np.ndarray | None = None,
    verbose: bool = True,
    origin: Origin = Origin(),
) -> grain.DatasetIterator:
    """Batches of packed fine-tune examples: this process's rows of each global batch, as
    {"inputs", "targets", "positions", "segment_ids"} int32 and "loss_mask" float32, [rows, block_size].

    Several examples share a row; segment_ids number them 1, 2, ... (0 is padding) so that attention stays
    within an example, positions restart at 0 for each, and loss_mask is 0 on prompts and padding. The stream
    runs `epochs` times over the examples (None = without end), each epoch in its own shuffled order; its
    state is checkpointed like train_iterator's, and `rows` and `origin` are as for train_iterator;
    `verbose` prints how many examples are cut to fit a row.
    """
    rows = local_rows(global_batch, rows)
    if meta["splits"]["train"]["examples"] == 0:
        raise UserError(f"{data_dir} has no training examples; prepare it again with more examples")
    if verbose:
        _warn_truncated(data_dir, meta, "train", block_size)
    packs = _Packs(data_dir, "train", meta, block_size, global_batch, seed, rows, origin)
    return batch_iterator(packs, ENDLESS if epochs is None else packs.epoch_start(epochs))


def packs(
    data_dir: str, meta: dict, block_size: int, global_batch: int, seed: int, origin: Origin = Origin()
) -> _Packs:
    """The training examples' whole global batches as example_iterator packs them (from `origin`), to count by."""
    return _Packs(data_dir, "train", meta, block_size, global_batch, seed, np.arange(global_batch), origin)


def example_steps(
    data_dir: str, meta: dict, block_size: int, global_batch: int, seed: int, epochs: int, origin: Origin = Origin()
) -> int:
    """Global batches in `epochs` passes over the training examples, as example_iterator packs them."""
    return packs(data_dir, meta, block_size, global_batch, seed, origin).epoch_start(epochs)


def example_rows_before(
    data_dir: str, meta: dict, block_size: int, global_batch: int, seed: int, origin: Origin, index: int
) -> int:
    """The packed row (counted over epochs, lm.data.loaders.Origin) that batch `index` begins at."""
    stream = packs(data_dir, meta, block_size, global_batch, seed, origin)
    epoch, row = stream.locate(index)
    return sum(stream.rows_in(e) for e in range(epoch)) + row


def example_val_batches(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    n_batches: int | None = None,
    rows: np.ndarray | None = None,
    verbose: bool = True,
) -> list[dict[str, np.ndarray]]:
    """The validation examples packed in file order, the same batches every call (as example_iterator's);
    the first n_batches of them, or all for None."""
    rows = local_rows(global_batch, rows)
    if meta["splits"]["val"]["examples"] == 0:
        given = (meta.get("inputs") or [{}])[0].get("path") or data_dir  # (the user's file, not its prepared copy)
        if meta["splits"]["train"]["examples"] <= 1:  # (raising data.val_fraction, as advised, held out none)
            raise UserError(f"{given} has no validation examples: it holds one example, which is trained on (from "
                            "two on, at least one is held out); give more examples, or set data.val_path")  # fmt: skip
        raise UserError(f"{given} has no validation examples; raise data.val_fraction (from two examples on, at "
                        "least one is held out) or set data.val_path")  # fmt: skip
    if verbose:
        _warn_truncated(data_dir, meta, "val", block_size)
    packs = _Packs(data_dir, "val", meta, block_size, global_batch, None, rows)
    count = packs.epoch_start(1) if n_batches is None else min(n_batches, packs.epoch_start(1))
    return [packs(i) for i in range(count)]


def _warn_truncated(data_dir: str, meta: dict, split: str, block_size: int) -> None:
    """Say how many examples of a split are cut to fit a row: those that lose part of their prompt (or of a long
    completion), and apart from them those that lose only tokens after their last learned one (the chat template's
    text after the last reply, and any turns after it), which were counted as cut "from the prompt's start"."""
    _, mask, offsets = load_examples(data_dir, split, meta)
    long = np.flatnonzero(np.diff(offsets) > block_size + 1)
    if not len(long):
        return
    starts = cut_starts(mask, offsets, block_size)

    def teaches_in_a_row(e: int) -> bool:  # whether example e's tokens up to its last learned one fit a row
        learned = np.flatnonzero(mask[offsets[e] : offsets[e + 1]])
        return len(learned) > 0 and learned[-1] + 1 <= block_size + 1

    tails = sum(starts[e] == 0 and teaches_in_a_row(e) for e in long)
    total, cut = meta["splits"][split]["examples"], len(long) - tails
    if cut:
        print(
            f"warning: {cut} of {total} {split} examples are longer than "
            f"block_size+1 = {block_size + 1} tokens and are cut to fit, from the prompt's start (a completion longer "
            "than that keeps its start); raise data.block_size to keep them whole",
            file=sys.stderr,
        )
    if tails:
        its, runs, teach = ("its", "runs", "it teaches") if tails == 1 else ("their", "run", "they teach")
        print(f"note: {tails} of {total} {split} examples {runs} past block_size+1 = {block_size + 1} tokens only "
              f"after {its} last learned token ({its} last reply's end); what follows there (the chat template's text "
              f"after that reply, and any turns after it), which teaches nothing, is dropped: what {teach} is whole",
              file=sys.stderr)  # fmt: skip


def first_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each item when items are placed in order, each into the first row with room for it.

    A max-tree over the rows' free space finds that row in O(log n), so a plan costs O(n log n).
    """
    n = len(sizes)
    leaves = 1 << max(0, (n - 1).bit_length())  # at most one row per item
    free = [capacity] * (2 * leaves)  # free[k] = the most room in any row under node k
    rows = np.empty(n, np.int64)
    for i, size in enumerate(sizes.tolist()):
        node = 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= size else 2 * node + 1
        rows[i] = node - leaves
        free[node] -= size
        node >>= 1
        while node and free[node] != max(free[2 * node], free[2 * node + 1]):
            free[node] = max(free[2 * node], free[2 * node + 1])
            node >>= 1
    return rows


class _Packs:
    """Rows of packed examples for each epoch, and batch i of the whole stream of epochs.

    An epoch places every example once, in an order shuffled by (seed, epoch) (file order when seed is
    None), first-fit into rows of block_size slots; its last batch is filled up with empty rows. Plans are
    recomputed on demand from the seed, so only counts and the latest plans are kept. From an `origin` other
    than (0, 0), batch origin.index begins at its packed row (lm.data.loaders.Origin), and that epoch's batches
    go on from there.
    """

    def __init__(
        self, data_dir: str, split: str, meta: dict, block_size: int, global_batch: int, seed, rows, origin=Origin()
    ):
        self.data_dir, self.split, self.meta = data_dir, split, meta
        self.block_size, self.global_batch, self.seed, self.rows = block_size, global_batch, seed, rows
        _, mask, offsets = load_examples(data_dir, split, meta)
        self.starts = cut_starts(mask, offsets, block_size)  # where a longer example's window begins
        self.slots = np.minimum(np.diff(offsets) - self.starts, block_size + 1) - 1
        self._plans = {}
        # the origin's epoch and row within it; batch_starts[k] = the stream's index of epoch first_epoch + k's
        # first batch (of the origin's batch, for the first: the rest of its epoch)
        self.first_epoch, self.first_row = 0, origin.row
        while self.first_row >= self.rows_in(self.first_epoch):
            self.first_row -= self.rows_in(self.first_epoch)
            self.first_epoch += 1
        self.batch_starts = [origin.index]
        self._files = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": None, "_plans": {}, "_lock": None}  # each worker maps the files itself

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(examples ordered by row, row offsets into them) of one epoch."""
        if epoch not in self._plans:
            n = len(self.slots)
            if self.seed is None:
                order = np.arange(n)
            else:
                key = splitmix64(np.uint64(self.seed % (1 << 64)), np.array([epoch], np.uint64))[0]
                order = np.argsort(splitmix64(key, np.arange(n, dtype=np.uint64)), kind="stable")
            rows = first_fit(self.slots[order], self.block_size)
            by_row = np.argsort(rows, kind="stable")
            row_offsets = np.zeros(rows.max() + 2, np.int64)
            row_offsets[1:] = np.cumsum(np.bincount(rows))
            while len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            self._plans[epoch] = (order[by_row], row_offsets)
        return self._plans[epoch]

    def rows_in(self, epoch: int) -> int:
        return len(self.plan(epoch)[1]) - 1

    def _extend_to(self, epochs: int) -> None:
        """batch_starts for the epochs up to first_epoch + `epochs` (that many after the first)."""
        while len(self.batch_starts) <= epochs:
            epoch = self.first_epoch + len(self.batch_starts) - 1
            rows = self.rows_in(epoch) - (self.first_row if epoch == self.first_epoch else 0)
            self.batch_starts.append(self.batch_starts[-1] + -(-rows // self.global_batch))

    def epoch_start(self, epoch: int) -> int:
        """The stream's index of epoch `epoch`'s first batch (the origin's, for an epoch that began before it)."""
        if epoch <= self.first_epoch:
            return self.batch_starts[0]
        self._extend_to(epoch - self.first_epoch)
        return self.batch_starts[epoch - self.first_epoch]

    def locate(self, index: int) -> tuple[int, int]:
        """(epoch, its row that the stream's batch `index` begins at)."""
        while self.batch_starts[-1] <= index:
            self._extend_to(len(self.batch_starts))
        k = bisect.bisect_right(self.batch_starts, index) - 1
        row = (index - self.batch_starts[k]) * self.global_batch
        return self.first_epoch + k, row + (self.first_row if k == 0 else 0)

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        with self._lock:
            epoch, first = self.locate(index)
            examples, row_offsets = self.plan(epoch)
        if self._files is None:
            self._files = load_examples(self.data_dir, self.split, self.meta)
        tokens, mask, offsets = self._files
        shape = (len(self.rows), self.block_size)
        out = {
            "inputs": np.zeros(shape, np.int32),
            "targets": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, np.float32),
            "positions": np.zeros(shape, np.int32),
            "segment_ids": np.zeros(shape, np.int32),
        }
        for r, row in enumerate(first + self.rows):
            if row >= len(row_offsets) - 1:
                continue  # an empty row filling up the epoch's last batch
            at = 0
            for segment, example in enumerate(examples[row_offsets[row] : row_offsets[row + 1]], 1):
                start = offsets[example] + self.starts[example]
                n = self.slots[example]
                ids = tokens[start : start + n + 1]
                out["inputs"][r, at : at + n] = ids[:-1]
                out["targets"][r, at : at + n] = ids[1:]
                out["loss_mask"][r, at : at + n] = mask[start + 1 : start + n + 1]
                out["positions"][r, at : at + n] = np.arange(n)
                out["segment_ids"][r, at : at + n] = segment
                at += n
        return out
