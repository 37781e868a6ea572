"""What a prepared directory holds and whether it is current: meta.json, its checks and fingerprints, its name.

A directory of text prepared for pretraining holds:

    tokens-NNNNN.bin     shards of token ids, uint16 when n_vocab <= 65536 else uint32, one after another
                         the inputs' token stream; every document is followed by the end-of-text token
    meta.json            the manifest: tokenizer, dtype, the shards (names, token counts, checksums), each
                         split as ranges [shard, start, stop] of them with its counts, the inputs and their
                         fingerprint
    tokenizer.tiktoken   the rank file of bpe:N and .tiktoken tokenizers
    progress.json        only while prepare runs: the shards complete so far and where in the inputs the
                         next one starts, from which a killed prepare continues

(Format 1 held train.bin and val.bin; read_meta describes such a directory as two shards.)

A directory of fine-tune examples (meta.json has "kind": "examples") holds, per split,

    examples_<split>.bin       the token ids of every example, one after another (dtype as for train.bin)
    examples_<split>_mask.bin  uint8 per token: 1 where the token is a loss target (completion and end-of-text)
    examples_<split>_idx.npy   int64 offsets: example i is tokens[idx[i]:idx[i+1]]

beside meta.json and the rank file. A directory of preference pairs ("kind": "preference", lm/data/preference.py)
holds the same files, pair i as examples 2i (its chosen response) and 2i+1 (its rejected one). meta.json is
removed before any other file is written and written last, so a directory that has one is complete.

A prepared directory may also be a URL in object storage (lm/prepared_dir.py publishes it there, and checks it and
reads it as it does a local one): its meta.json then also records each object's size and version ("objects").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import sys
from collections.abc import Callable

from lm.errors import UserError
from lm.files import read_json, why_not_made
from lm.prepared_dir import META, SPLITS, PreparedDir, content_digest
from lm.tokenizer import HF_EXTRAS_FILE, RANK_FILE, Tokenizer, encoding_extras, file_sha256, get_tokenizer

FORMAT_VERSION = 2


def shard_name(index: int) -> str:
    return f"tokens-{index:05d}.bin"


def digest(obj) -> str:
    """The SHA-256 of obj as canonical JSON: the fingerprint of what prepare was asked to do."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def hf_digest(tokenizer: Tokenizer) -> str | None:
    """The fingerprint of an hf_bpe tokenizer's extras that change ids (lm.tokenizer.encoding_extras), for the keys
    of prepared examples and pairs; None for other tokenizers."""
    return digest(encoding_extras(tokenizer.hf)) if tokenizer.hf else None


def cache_dir(root: str, path: str, label: str, fallback: str, request: dict) -> str:
    """The directory under data.cache_dir `root` that holds `path` prepared as `request` asks: named by the
    request, not by the inputs' contents, so that changed inputs are prepared again in the same place."""
    # (each cut to 100 characters: with the digest the name stays within a filesystem's 255 bytes; no leading dot, as
    # "*.jsonl.zst" -> "_.jsonl" gave, which hid the directory from ls)
    last = os.path.basename(path.rstrip("/"))
    if last in (".", ".."):  # (named "data" while the run's config.yaml, holding its absolute path, named it
        last = os.path.basename(os.path.abspath(path))  # after the directory: resuming prepared it all again)
    name = _slug(os.path.splitext(last)[0])[:100].strip("_").lstrip(".") or fallback
    return os.path.join(root, f"{name}-{_slug(label)[:100]}-{digest(request)[:8]}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def prepared(out_dir: str, fingerprint: str, progress: bool, make: Callable[[], dict]) -> tuple[dict, bool]:
    """(out_dir's meta, whether make() wrote it just now): make() prepares it unless it is up to date, one process of
    this machine at a time (PreparedDir.one_prepare_at_a_time), asked again once this process holds it (the one it
    waited for may have prepared it), and never while a run trains on it (PreparedDir.not_being_read)."""
    meta = up_to_date(out_dir, fingerprint, progress)
    if meta:
        return meta, False
    place = PreparedDir(out_dir)
    new = not place.shared and not os.path.exists(out_dir)  # (one lm makes, to be removed if nothing comes of it)
    with place.one_prepare_at_a_time(progress):
        meta = up_to_date(out_dir, fingerprint, progress)
        if meta:
            return meta, False
        with place.not_being_read():
            try:
                return make(), True
            except OSError as e:  # writing it (a full disk, say): what is written so far stays for the next try
                written = os.path.abspath(place.staging if place.shared else out_dir)  # (a bucket's: tokenized here)
                if e.filename and not os.path.abspath(e.filename).startswith(written + os.sep):
                    raise UserError(f"cannot read {e.filename}: {e.strerror or e}") from None
                raise UserError(
                    f"cannot write prepared data to {out_dir}: {e.strerror or e}; free space (or prepare into another "
                    "directory: data.cache_dir=DIR, or --out DIR), then run the same command: it goes on from there"
                ) from None
            finally:  # (a refused file's directory held only the locks, for good: the corrected file's is another)
                if new:
                    place.remove_if_bare()


def up_to_date(out_dir: str, fingerprint: str, progress: bool, meta: dict | None = None) -> dict | None:
    """The meta of out_dir if it was prepared with this fingerprint and its files are still the ones it
    describes (then prepare has nothing to do), else None. `meta`: the one to check its files against in place of
    its meta.json (a prepare cut short as it moved its files there from .next, its meta.json still in .next)."""
    meta = read_meta(out_dir) if meta is None else meta
    if meta is None or meta.get("fingerprint") != fingerprint or PreparedDir(out_dir).problem(meta):
        return None
    if not PreparedDir(out_dir).shared and not rank_file_intact(out_dir, meta.get("rank_file_sha256")):
        return None  # (trained or copied there, and nowhere else: preparing again writes it again)
    if progress:
        print(f"{out_dir} is up to date", file=sys.stderr)
        stopped = PreparedDir(out_dir).stopped_prepare()  # (its disk was held without a word)
        if stopped:
            print(stopped, file=sys.stderr)
    return meta


def rank_file_intact(out_dir: str, sha256: str | None) -> bool:
    """Whether the rank file a local directory keeps (tokenizer.tiktoken, where its tokenizer has one: bpe:N, a
    .tiktoken file, an imported model's; `sha256` recorded) is there with those contents."""
    rank_file = os.path.join(out_dir, RANK_FILE)
    return not sha256 or (os.path.isfile(rank_file) and file_sha256(rank_file) == sha256)


def start_writing(out_dir: str) -> None:
    """Make out_dir exist without a meta.json: until the new one is written it must not look prepared."""
    for name in (META, "train.bin", "val.bin"):  # and format 1's token files, if any
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        why = why_not_made(out_dir, e)
        raise UserError(f"cannot create {out_dir}: {why}; choose another output directory") from None


def read_meta(data_dir: str) -> dict | None:
    """meta.json of data_dir, or None if it has none that can be read."""
    meta = read_json(os.path.join(data_dir, META))
    if not isinstance(meta, dict):
        return None
    if meta.get("kind") not in ("examples", "preference") and "shards" not in meta and "splits" in meta:
        splits = meta["splits"]  # format 1: train.bin and val.bin, two shards of one split each
        meta["shards"] = [{"name": f"{split}.bin", "tokens": splits[split]["tokens"]} for split in SPLITS]
        for i, split in enumerate(SPLITS):
            splits[split]["ranges"] = [[i, 0, splits[split]["tokens"]]] if splits[split]["tokens"] else []
    return meta


def load_meta(data_dir: str) -> dict:
    """meta.json of a prepared directory, after checking that its token files are the ones it describes."""
    meta = read_meta(data_dir)
    if meta is None:
        raise UserError(
            f"{data_dir} has no readable meta.json; prepare it: python -m lm.data prepare INPUT --out {data_dir}"
        )
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(f"{data_dir} was prepared by a newer lm (format {meta['format_version']}); upgrade lm")
    problem = PreparedDir(data_dir).problem(meta)
    if problem:
        raise UserError(f"{problem}: it changed after prepare; prepare it again: {_prepare_command(meta, data_dir)}")
    return meta


def _prepare_command(meta: dict, data_dir: str) -> str:
    """The command that prepares `data_dir` again as meta.json records it: its input files (up to four; more are
    INPUT), tokenizer, field and validation split (the defaults, --field text and --val-fraction 0.1, left out), so
    that following it does not change the split."""
    def named(key: str, stand_in: str, each: str = "") -> str:  # (the recorded files, `each` before every one)
        files = meta.get(key) or ()
        return " ".join(each + shlex.quote(f["path"]) for f in files) if 0 < len(files) <= 4 else each + stand_in

    flags = [f"--tokenizer {shlex.quote(str(meta.get('tokenizer')))}"]
    if meta.get("field", "text") != "text":
        flags.append(f"--field {shlex.quote(meta['field'])}")
    if meta.get("val_inputs"):
        flags.append(named("val_inputs", "VAL_INPUT", "--val "))  # (one --val each)
    elif meta.get("val_fraction") is not None and meta["val_fraction"] != 0.1:
        flags.append(f"--val-fraction {meta['val_fraction']:g}")
    return f"python -m lm.data prepare {named('inputs', 'INPUT')} {' '.join(flags)} --out {shlex.quote(data_dir)}"


def get_tokenizer_for(data_dir: str, meta: dict) -> Tokenizer:
    """The tokenizer that prepared data_dir, checked against the rank file it recorded."""
    local = PreparedDir(data_dir).local_files((RANK_FILE, HF_EXTRAS_FILE))
    if meta["tokenizer"].startswith("bpe:") and not os.path.isfile(os.path.join(local, RANK_FILE)):
        # (it said "tokenizer bpe:N is trained when the data is prepared, but ... does not exist; prepare the data
        # first", of data prepared already)
        raise UserError(f"{data_dir} has lost its {RANK_FILE}, the {meta['tokenizer']} its tokens were made with; "
                        f"prepare it again: {_prepare_command(meta, data_dir)}")  # fmt: skip
    tok = get_tokenizer(meta["tokenizer"], local)
    if tok.rank_file and file_sha256(tok.rank_file) != meta["rank_file_sha256"]:
        raise UserError(
            f"{tok.rank_file} is not the rank file {data_dir} was prepared with; prepare the data again"
        )
    return tok


def checksums(data_dir: str, names: list[str]) -> dict[str, str]:
    return {name: content_digest(os.path.join(data_dir, name)) for name in names}
