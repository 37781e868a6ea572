"""Preference pairs (data.format=preference): JSONL chosen/rejected records -> tokens and loss masks; batches of pairs.

A record is {"prompt": ..., "chosen": ..., "rejected": ...} (text: the prompt encoded as an examples prompt is,
with the tokenizer's BOS first, each response followed by end-of-text) or {"messages": [...], "chosen":
{"role": "assistant", "content": ...}, "rejected": {...}} (chat: the conversation plus each reply rendered with
the model's chat template exactly as data.format=chat renders it, lm/chat.py). TRL's conversational forms are
read as that chat pair: {"prompt": [messages], "chosen": [reply], "rejected": [reply]} (explicit prompt) and
{"chosen": [messages], "rejected": [messages]} (implicit prompt: the messages both begin with), each reply one
assistant message. TRL's standard implicit-prompt form, {"chosen": str, "rejected": str} (Anthropic's HH-RLHF), is
read as the text pair TRL's extract_prompt splits it into: the prompt is what both begin with, less a space that
ends it (_implicit_prompt). Each pair is tokenized once, into
the files of fine-tune examples (lm/data/meta.py): pair i is example 2i (prompt + chosen response) and 2i+1
(prompt + rejected response), each with its loss mask on the response's tokens only (with its end-of-text or
end-of-turn token; never on the prompt, nor on earlier assistant turns of a conversation). The pairs are of one
kind, text or chat: a file (with its validation file) mixing them is refused at the first pair of the other.

A pair longer than data.block_size + 1 tokens is dealt with as it is prepared (the cache is per block size):
data.pair_overflow=truncate drops tokens from the prompt's start, the same ones from both sequences, keeping at
least one prompt token; refuse stops with FILE:LINE. A response that does not fit even so always stops.

Batches hold one pair per row: {"inputs", "targets"} int32 and "loss_mask" float32, each [pairs, 2, block_size],
the chosen sequence at [:, 0] and the rejected one at [:, 1], padded at the end (a pair is never packed with
another). The training stream runs through the pairs epoch after epoch, each epoch in its own shuffled order, one
global batch of data.batch_size pairs after another with no padding pair, up to the end of data.epochs where it
is set (the last batch filled up with empty pairs, so that each pair is trained on data.epochs times, as task
data's last batch is filled with empty rows); the validation pairs come in file order, the last batch filled up
with empty pairs (no tokens: the steps leave them out).
"""

from __future__ import annotations

import collections
import json
import os
import sys

import grain
import numpy as np

from lm.chat import MASK_VERSION, check_record, encode_chat, turn_end
from lm.config import DataConfig
from lm.data import meta as meta_lib
from lm.data.examples import check_jsonl, input_settings, load_examples, prepared_request, read_splits, write_prepared
from lm.data.loaders import Origin, batch_iterator, local_rows, splitmix64
from lm.data.meta import FORMAT_VERSION, META
from lm.data.sources import json_lines, open_input, warn_bad_utf8
from lm.errors import UserError, plural
from lm.files import write_json
from lm.tokenizer import Tokenizer

FIELDS = ("chosen", "rejected")


def prepare_preference_for_config(data_cfg: DataConfig, tokenizer: Tokenizer, seed: int, progress: bool = True):
    """(prepared directory, meta) for a JSONL file of preference pairs, tokenized with `tokenizer` (the starting
    model's) into data.cache_dir on first use."""
    if not data_cfg.path:
        raise UserError(
            "data.format=preference needs data.path: a JSONL file of {prompt, chosen, rejected} or "
            "{messages, chosen, rejected} records"
        )
    request = prepared_request(
        data_cfg,
        tokenizer,
        seed,
        prompt_field=data_cfg.prompt_field,
        block_size=data_cfg.block_size,
        pair_overflow=data_cfg.pair_overflow,
    )
    out_dir = meta_lib.cache_dir(data_cfg.cache_dir, data_cfg.path, "preference", "preference", request)
    meta = prepare_preference(
        data_cfg.path,
        tokenizer,
        out_dir,
        block_size=data_cfg.block_size,
        pair_overflow=data_cfg.pair_overflow,
        prompt_field=data_cfg.prompt_field,
        val_path=data_cfg.val_path,
        val_fraction=data_cfg.val_fraction,
        seed=seed,
        progress=progress,
    )
    return out_dir, meta


def prepare_preference(
    path: str,
    tokenizer: Tokenizer,
    out_dir: str,
    block_size: int,
    pair_overflow: str = "truncate",
    prompt_field: str = "prompt",
    val_path: str = "",
    val_fraction: float = 0.1,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Tokenize a JSONL file of preference pairs into out_dir and return its meta; do nothing if out_dir is
    already up to date. The validation pairs are those of val_path if given, else a val_fraction of the pairs
    drawn by `seed` (as for examples); both splits keep file order."""
    check_jsonl([path, val_path] if val_path else [path], "preference pairs")
    settings = {
        "format_version": FORMAT_VERSION,
        "kind": "preference",
        "chat_mask": MASK_VERSION,
        "empty_prompt": "eot",  # (before, the replies' first tokens went unscored)
        "prompt_field": prompt_field,
        "block_size": block_size,
        "pair_overflow": pair_overflow,
        **input_settings(tokenizer, path, val_path, val_fraction, seed),
    }
    fingerprint = meta_lib.digest(settings)

    def make() -> dict:
        bad_utf8, first = collections.Counter(), {}  # first: where the pairs' kind (text or chat) was first seen
        same_at = []  # where each pair whose responses are the same is, in file order
        read = lambda p: _read_pairs(p, tokenizer, prompt_field, block_size, pair_overflow, bad_utf8, first, same_at)
        splits, truncated = read_splits(read, path, val_path, val_fraction, seed)
        warn_bad_utf8(bad_utf8)
        _warn_truncated(truncated, block_size)
        same = sum(np.array_equal(chosen[0], rejected[0]) for chosen, rejected in splits["train"])
        if same == len(splits["train"]):
            raise UserError(
                f"every training pair of {path} has the same chosen and rejected response, from which DPO learns "
                "nothing (its loss is log 2 whatever the model); give pairs whose responses differ"
            )
        _warn_same(same, same_at[0] if same_at else "")

        sequences = {split: [sequence for pair in items for sequence in pair] for split, items in splits.items()}
        meta = write_prepared(out_dir, sequences, tokenizer, {**settings, "fingerprint": fingerprint})  # chosen at 2i
        for split, items in splits.items():
            meta["splits"][split]["pairs"] = len(items)
        meta.update(truncated=truncated, invalid_utf8=sum(bad_utf8.values()), same_responses=int(same))
        if same:
            meta["first_same"] = same_at[0]
        write_json(os.path.join(out_dir, META), meta)
        counts = meta["splits"]
        if progress:
            print(
                f"{out_dir}: {counts['train']['pairs']:,} train and {counts['val']['pairs']:,} val preference pairs",
                file=sys.stderr,
            )
        return meta

    meta, made = meta_lib.prepared(out_dir, fingerprint, progress, make)
    if not made:  # (make warned as it read them) on every run that trains on them, not only the first
        _warn_truncated(meta.get("truncated", 0), block_size)
        _warn_same(meta.get("same_responses", 0), meta.get("first_same", ""))
    return meta


def _warn_same(same: int, first: str) -> None:
    """`first`: FILE:LINE of the first such pair in the files (validation's too), to find them by."""
    if same:
        where = f" (the first in the files: {first})" if first else ""
        pairs = plural(same, "training preference pair has", "training preference pairs have")
        print(f"warning: {pairs} the same chosen and rejected response{where}; DPO "
              "learns nothing from them", file=sys.stderr)  # fmt: skip


def _warn_truncated(truncated: int, block_size: int) -> None:
    if truncated:
        print(
            f"warning: {truncated} preference pairs are longer than data.block_size+1 = {block_size + 1} tokens; "
            "their prompts were cut from the start (data.pair_overflow=refuse stops instead)",
            file=sys.stderr,
        )


Sequence = tuple[np.ndarray, np.ndarray]  # (token ids, loss mask)


def _read_pairs(
    path: str, tok: Tokenizer, prompt_field: str, block_size: int, pair_overflow: str, bad_utf8: collections.Counter,
    first: dict, same_at: list[str],
) -> tuple[list[tuple[Sequence, Sequence]], int]:
    """([(chosen, rejected)] in file order, fitted to block_size + 1 tokens; how many were truncated). Pairs of
    one kind only, text or chat, in this file and those read before with the same `first` (kind -> where seen).
    The FILE:LINE of each pair whose responses are the same is appended to `same_at`."""
    pairs, truncated, chats = [], 0, False
    with open_input(path) as f:  # decompressed as its suffix says
        # (a line that is no object said "missing 'prompt'")
        shape = "preference record a line: {'prompt', 'chosen', 'rejected'} or {'messages', ...}"
        for lineno, record, _ in json_lines(f, path, bad_utf8, shape, (prompt_field, "messages", *FIELDS)):
            where = f"{path}:{lineno}"
            chat = is_chat(record, prompt_field)
            if chat and not chats:  # (a template that ends a reply with no special token to learn)
                turn_end(tok)
                chats = True
            try:
                if chat:
                    check_record(record, where)
                    pair = _chat_pair(tok, record if "messages" in record else _from_trl(record, prompt_field), where)
                else:
                    pair = _text_pair(tok, record, prompt_field, where)
            except UserError as e:
                message = str(e)
                raise UserError(message if message.startswith(where) else f"{where}: {message}") from None
            _check_kind("chat" if chat else "text", first, where)
            pair, cut = _fit(pair, block_size, pair_overflow, where)
            if np.array_equal(pair[0][0], pair[1][0]):
                same_at.append(where)
            pairs.append(pair)
            truncated += cut
    if not pairs:
        raise UserError(f"{path} holds no preference pairs; give one JSON object per line")
    return pairs, truncated


def _check_kind(kind: str, first: dict, where: str) -> None:
    """Refuse a chat pair among text pairs or the reverse: the text ones would train the model to reply without its
    chat template, and the run's closing hint (--chat or not) follows the first pair alone."""
    other = next((k for k in first if k != kind), None)
    if other:
        raise UserError(
            f"{where}: a {kind} pair after {other} pairs ({first[other]} is one); give pairs of one kind: chat "
            "(messages: {'messages', 'chosen', 'rejected'} or TRL's lists) throughout, or text ({'prompt', 'chosen', "
            "'rejected'} strings) throughout"
        )
    first.setdefault(kind, where)


def trained_on_chats(data_cfg) -> bool:
    """Whether a run's data (its config's `data`) taught its model to chat: conversations, or preference pairs of
    them (holds_chats: False where the file is gone)."""
    return data_cfg.format == "chat" or (
        data_cfg.format == "preference" and holds_chats(data_cfg.path, data_cfg.prompt_field)
    )


def holds_chats(path: str, prompt_field: str = "prompt") -> bool:
    """Whether a preference file's first pair is a chat one (is_chat): a model aligned on such pairs is prompted
    through its chat template. False where the file cannot be read (moved since, a bucket out of reach): it only
    words the hint a finished run prints, which must not fail the run."""
    try:
        with open_input(path) as f:
            for _, record, _ in json_lines(f, path, collections.Counter()):
                return isinstance(record, dict) and is_chat(record, prompt_field)
    except Exception:
        pass
    return False


def is_chat(record: dict, prompt_field: str = "prompt") -> bool:
    """Whether a preference record is a chat pair: lm's {'messages', 'chosen', 'rejected'}, or one of TRL's
    conversational forms, whose prompt or replies are lists of messages (strings are a text pair)."""
    return "messages" in record or any(isinstance(record.get(field), list) for field in (prompt_field, *FIELDS))


TRL_FORMS = (
    "{'prompt': [messages], 'chosen': [one assistant message], 'rejected': [one assistant message]}, or "
    "{'chosen': [messages], 'rejected': [messages]} that differ only in their last message, the assistant's"
)


def _from_trl(record: dict, prompt_field: str) -> dict:
    """lm's chat pair {'messages', 'chosen', 'rejected'} of a record in one of TRL's conversational forms: explicit
    prompt (its prompt field a list of messages) or implicit (the messages chosen and rejected begin with)."""
    for field in FIELDS:
        if not isinstance(record.get(field), list) or not record[field]:
            what = "missing" if field not in record else "not a list of messages:"
            raise UserError(f"{what} '{field}': a conversational preference record is {TRL_FORMS}")
    chosen, rejected = record["chosen"], record["rejected"]
    if prompt_field in record:
        prompt = record[prompt_field]
        if not isinstance(prompt, list):
            raise UserError(f"'{prompt_field}' is not a list of messages beside 'chosen' and 'rejected' lists: a "
                            f"conversational preference record is {TRL_FORMS}")  # fmt: skip
        replies = chosen, rejected
    else:  # (a last message that is the same in both is still each one's reply: a pair the same-reply check counts)
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, replies = chosen[:shared], (chosen[shared:], rejected[shared:])
    for field, reply in zip(FIELDS, replies):
        last = reply[-1] if isinstance(reply[-1], dict) else {}
        if len(reply) > 1:
            other = FIELDS[1 - FIELDS.index(field)]
            after = "its prompt" if prompt_field in record else f"the messages it begins with as '{other}' does"
            what = f"holds {len(reply)} messages after {after}"
        elif last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            what = f"ends in {json.dumps(reply[-1])[:60]}, not an assistant message with text content"
        else:
            continue
        raise UserError(f"'{field}' {what}; DPO compares one assistant reply with another: a conversational "
                        f"preference record is {TRL_FORMS}")  # fmt: skip
    return {"messages": prompt, "chosen": replies[0][0], "rejected": replies[1][0]}


def _text_pair(tok: Tokenizer, record: dict, prompt_field: str, where: str) -> tuple[Sequence, Sequence]:
    if prompt_field not in record and all(isinstance(record.get(field), str) for field in FIELDS):
        record = _implicit_prompt(record, prompt_field)
    for field in (prompt_field, *FIELDS):
        if not isinstance(record.get(field), str):
            what = "missing" if field not in record else "not a string:"
            # (the prompt field's hint only: it was also given for a missing reply, which no prompt field fixes)
            hint = "; name another prompt field with data.prompt_field" if field == prompt_field else ""
            raise UserError(
                f"{where}: {what} '{field}'; a preference record is {{'{prompt_field}', 'chosen', 'rejected'}} "
                f"(strings) or {{'messages', 'chosen', 'rejected'}} (chat){hint}"
            )
    # an empty prompt without BOS is end-of-text, so that the replies' first tokens, which may be all that tells
    # them apart, are scored
    prompt, eot = tok.encode_context(record[prompt_field]), np.array([tok.eot], np.uint32)
    out = []
    for field in FIELDS:
        ids = np.concatenate([prompt, tok.encode_array(record[field]), eot]).astype(np.uint32)
        mask = np.zeros(len(ids), np.uint8)
        mask[len(prompt) :] = 1
        out.append((ids, mask))
    return tuple(out)


def _implicit_prompt(record: dict, prompt_field: str) -> dict:
    """The explicit record of TRL's standard implicit-prompt one, {'chosen': str, 'rejected': str} (Anthropic's
    HH-RLHF): the prompt is the longest beginning both share, less a space that ends it (left to the replies, where
    a BPE joins it to the word after), as TRL's extract_prompt splits one (where a reply is all of the other's
    beginning, TRL's split stops a character short of it; this one ends the shorter reply there, as end-of-text)."""
    chosen, rejected = record["chosen"], record["rejected"]
    n = len(os.path.commonprefix([chosen, rejected]))
    if n and chosen[n - 1] == " ":
        n -= 1
    if not n:  # (replies under a prompt field of another name, more likely than pairs meant to have no prompt)
        raise UserError(
            f"no '{prompt_field}', and 'chosen' and 'rejected' do not begin alike (TRL's implicit prompt is what both "
            f"begin with); give the prompt as '{prompt_field}' (\"\" for none), or name its field with "
            "data.prompt_field"
        )
    return {prompt_field: chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def _chat_pair(tok: Tokenizer, record: dict, where: str) -> tuple[Sequence, Sequence]:
    messages = record["messages"]
    if not isinstance(messages, list):
        raise UserError(f'{where}: \'messages\' must be a list of {{"role", "content"}} messages')
    out = []
    for field in FIELDS:
        reply = record.get(field)
        if not isinstance(reply, dict) or reply.get("role") != "assistant" or not isinstance(reply.get("content"), str):
            what = "missing" if field not in record else "not an assistant message:"
            raise UserError(
                f"{where}: {what} '{field}'; a chat preference record is {{'messages': [...], 'chosen': "
                "{'role': 'assistant', 'content': ...}, 'rejected': {...}}"
            )
        ids, mask = encode_chat(tok, [*messages, reply])
        out.append((np.array(ids, np.uint32), _last_turn(mask)))
    return tuple(out)


def _last_turn(mask: np.ndarray) -> np.ndarray:
    """The loss mask of a conversation's last assistant turn only: the earlier ones are part of the prompt."""
    ones = np.flatnonzero(mask)
    if len(ones) == 0:
        return mask
    breaks = np.flatnonzero(np.diff(ones) > 1)
    start = ones[breaks[-1] + 1] if len(breaks) else ones[0]
    out = np.zeros_like(mask)
    out[start:] = mask[start:]
    return out


def _fit(pair: tuple[Sequence, Sequence], block_size: int, pair_overflow: str, where: str):
    """(the pair cut to at most block_size + 1 tokens, its unlearned tail first, then from its prompt's start;
    whether a prompt was cut)."""
    for ids, mask in pair:
        if not mask[1:].any():
            raise UserError(f"{where}: a response has no tokens to train on")
    if max(len(ids) for ids, _ in pair) > block_size + 1:
        # What follows a response's last learned token (a chat template's newline after its end-of-turn token) is
        # no target nor the input of one: it goes before any prompt token does.
        ends = [int(np.flatnonzero(mask)[-1]) + 1 for _, mask in pair]
        pair = tuple((ids[:end], mask[:end]) for (ids, mask), end in zip(pair, ends))
    longest = max(len(ids) for ids, _ in pair)
    over = longest - (block_size + 1)
    if over <= 0:
        return pair, False
    prompt = min(int(np.argmax(mask)) for _, mask in pair)  # tokens before the response
    if over > prompt - 1:  # at least one prompt token stays, the first response token's input
        raise UserError(
            f"{where}: a response of {longest - prompt} tokens needs {longest - prompt + 1} with the prompt token "
            f"before it, more than data.block_size+1 = {block_size + 1}; raise data.block_size or shorten the response"
        )
    if pair_overflow == "refuse":
        raise UserError(
            f"{where}: the pair is {longest} tokens, longer than data.block_size+1 = {block_size + 1}; raise "
            "data.block_size, or set data.pair_overflow=truncate to cut the prompt's start"
        )
    return tuple((ids[over:], mask[over:]) for ids, mask in pair), True


class _Pairs:
    """Batch i of a stream of pairs: the given rows of its global batch of `global_batch` pairs. With a seed, pair
    k of the stream is pair order_e[k mod n] of epoch e = k div n (each epoch its own shuffled order), up to
    `epochs` epochs where given (then empty pairs); without, the stream is the pairs in file order, once, then
    empty pairs."""

    def __init__(
        self, data_dir: str, split: str, meta: dict, block_size: int, global_batch: int, seed, rows, origin=Origin(),
        epochs: int = 0,
    ):  # fmt: skip
        self.data_dir, self.split, self.meta = data_dir, split, meta
        self.block_size, self.global_batch, self.seed, self.rows = block_size, global_batch, seed, rows
        self.origin = origin
        self.n = meta["splits"][split]["pairs"]
        self.end = self.n * epochs if epochs else None  # (data.epochs' last batch: its places past them are empty)
        self._files = None
        self._order = (None, None)  # (epoch, its order): the latest one

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": None, "_order": (None, None)}  # each worker maps the files itself

    def pair(self, k: int) -> int | None:
        """The pair at place k of the stream (None: an empty one)."""
        if self.seed is None:
            return k if k < self.n else None
        if self.end is not None and k >= self.end:
            return None
        epoch, i = divmod(k, self.n)
        if self._order[0] != epoch:
            key = splitmix64(np.uint64(self.seed % (1 << 64)), np.array([epoch], np.uint64))[0]
            self._order = (epoch, np.argsort(splitmix64(key, np.arange(self.n, dtype=np.uint64)), kind="stable"))
        return int(self._order[1][i])

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        if self._files is None:
            self._files = load_examples(self.data_dir, self.split, self.meta)
        tokens, mask, offsets = self._files
        shape = (len(self.rows), 2, self.block_size)
        out = {
            "inputs": np.zeros(shape, np.int32),
            "targets": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, np.float32),
        }
        for r, k in enumerate(self.origin.first_row(index, self.global_batch) + self.rows):
            p = self.pair(int(k))
            if p is None:
                continue
            for side in (0, 1):
                start, end = offsets[2 * p + side], offsets[2 * p + side + 1]
                n = end - start - 1
                out["inputs"][r, side, :n] = tokens[start : end - 1]
                out["targets"][r, side, :n] = tokens[start + 1 : end]
                out["loss_mask"][r, side, :n] = mask[start + 1 : end]
        return out


def pair_iterator(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    seed: int,
    rows: np.ndarray | None = None,
    origin: Origin = Origin(),
    epochs: int = 0,
) -> grain.DatasetIterator:
    """The endless, checkpointable stream of this process's `rows` of each global batch of training pairs (from
    `origin`: lm.data.loaders); with `epochs` (data.epochs), empty pairs after that many passes over them."""
    if meta["splits"]["train"]["pairs"] == 0:
        raise UserError(f"{data_dir} has no training pairs; prepare it again with more pairs")
    return batch_iterator(
        _Pairs(data_dir, "train", meta, block_size, global_batch, seed, local_rows(global_batch, rows), origin, epochs)
    )


def pair_steps(meta: dict, global_batch: int, epochs: int, origin: Origin = Origin()) -> int:
    """Global batches in `epochs` passes over the training pairs (from `origin`: lm.data.loaders)."""
    left = max(0, meta["splits"]["train"]["pairs"] * epochs - origin.row)
    return origin.index + -(-left // global_batch)


def pair_val_batches(
    data_dir: str, meta: dict, block_size: int, global_batch: int, n_batches: int | None = None, rows=None
) -> list[dict[str, np.ndarray]]:
    """The validation pairs in file order, the same batches every call; the first n_batches of them, or all."""
    n = meta["splits"]["val"]["pairs"]
    if n == 0:
        raise UserError(f"{data_dir} has no validation pairs; raise data.val_fraction (from two pairs on, at least "
                        "one is held out) or set data.val_path")  # fmt: skip
    pairs = _Pairs(data_dir, "val", meta, block_size, global_batch, None, local_rows(global_batch, rows))
    count = -(-n // global_batch)
    return [pairs(i) for i in range(count if n_batches is None else min(n_batches, count))]
