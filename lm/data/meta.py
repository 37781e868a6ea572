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

A prepared directory may also be a URL in object storage (lm/data/published.py puts it there): its meta.json
then also records each object's size and version ("objects"), which one listing checks at every start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys

import numpy as np

from lm import storage
from lm.errors import UserError
from lm.files import read_json
from lm.tokenizer import HF_EXTRAS_FILE, RANK_FILE, Tokenizer, file_sha256, get_tokenizer

FORMAT_VERSION = 2
SPLITS = ("train", "val")
META = "meta.json"
PROGRESS = "progress.json"


def shard_name(index: int) -> str:
    return f"tokens-{index:05d}.bin"


def digest(obj) -> str:
    """The SHA-256 of obj as canonical JSON: the fingerprint of what prepare was asked to do."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def cache_dir(root: str, path: str, label: str, fallback: str, request: dict) -> str:
    """The directory under data.cache_dir `root` that holds `path` prepared as `request` asks: named by the
    request, not by the inputs' contents, so that changed inputs are prepared again in the same place."""
    name = _slug(os.path.splitext(os.path.basename(path.rstrip("/")))[0]) or fallback
    return os.path.join(root, f"{name}-{_slug(label)}-{digest(request)[:8]}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def up_to_date(out_dir: str, fingerprint: str, progress: bool) -> dict | None:
    """The meta of out_dir if it was prepared with this fingerprint and its files are still the ones it
    describes (then prepare has nothing to do), else None."""
    meta = read_meta(out_dir)
    if meta is None or meta.get("fingerprint") != fingerprint or _size_mismatch(out_dir, meta):
        return None
    if progress:
        print(f"{out_dir} is up to date", file=sys.stderr)
    return meta


def start_writing(out_dir: str) -> None:
    """Make out_dir exist without a meta.json: until the new one is written it must not look prepared."""
    for name in (META, "train.bin", "val.bin"):  # and format 1's token files, if any
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out_dir}: {e.strerror or e}; choose another output directory") from None


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
    problem = _size_mismatch(data_dir, meta)
    if problem:
        raise UserError(
            f"{problem}: it changed after prepare; prepare it again: "
            f"python -m lm.data prepare INPUT --tokenizer {meta.get('tokenizer')} --out {data_dir}"
        )
    return meta


def get_tokenizer_for(data_dir: str, meta: dict) -> Tokenizer:
    """The tokenizer that prepared data_dir, checked against the rank file it recorded."""
    tok = get_tokenizer(meta["tokenizer"], _tokenizer_files(data_dir) if storage.is_url(data_dir) else data_dir)
    if tok.rank_file and file_sha256(tok.rank_file) != meta["rank_file_sha256"]:
        raise UserError(
            f"{tok.rank_file} is not the rank file {data_dir} was prepared with; prepare the data again"
        )
    return tok


@functools.lru_cache(maxsize=None)
def _tokenizer_files(url: str) -> str:
    """A local directory holding the rank file (and an imported model's extras) of prepared data at url,
    downloaded once per process and removed at exit."""
    local = storage.temp_dir("lm-tokenizer-")
    for name in (RANK_FILE, HF_EXTRAS_FILE):
        if storage.isfile(f"{url.rstrip('/')}/{name}"):
            storage.download(f"{url.rstrip('/')}/{name}", os.path.join(local, name))
    return local


def example_files(data_dir: str, split: str) -> tuple[str, str, str]:
    """(tokens, loss mask, offsets) files of a split of fine-tune examples."""
    stem = os.path.join(data_dir, f"examples_{split}")
    return f"{stem}.bin", f"{stem}_mask.bin", f"{stem}_idx.npy"


def checksums(data_dir: str, names: list[str]) -> dict[str, str]:
    return {name: content_digest(os.path.join(data_dir, name)) for name in names}


def content_digest(path: str, samples: int = 64, sample_bytes: int = 1 << 16) -> str:
    """A SHA-256 of a file's size and `samples` evenly spaced pieces of it (all of a small file): cheap
    enough to check at every start, and changed by any edit that moves or rewrites tokens. path may be a URL
    (the pieces are read as byte ranges)."""
    size = storage.size(path)
    sha = hashlib.sha256(str(size).encode())
    if size <= samples * sample_bytes:
        starts = [0]
    else:
        starts = [(size - sample_bytes) * i // (samples - 1) for i in range(samples)]
    for piece in storage.read_ranges([path] * len(starts), starts, [min(s + sample_bytes, size) for s in starts]):
        sha.update(piece)
    return sha.hexdigest()


def _size_mismatch(data_dir: str, meta: dict) -> str | None:
    """What is wrong with the token files of a prepared directory, if anything: sizes, then contents."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    if storage.is_url(data_dir):
        return _objects_mismatch(data_dir.rstrip("/"), meta, itemsize)
    if meta.get("kind") in ("examples", "preference"):  # preference pairs are two examples each
        problem = _examples_mismatch(data_dir, meta, itemsize)
    else:
        problem = None
        for shard in meta["shards"]:
            problem = _wrong_size(os.path.join(data_dir, shard["name"]), shard["tokens"] * itemsize)
            if problem:
                break
    if problem:
        return problem
    for name, expected in meta.get("checksums", {}).items():
        if content_digest(os.path.join(data_dir, name)) != expected:
            return f"{os.path.join(data_dir, name)} does not match the checksum meta.json records"
    return None


def _objects_mismatch(url: str, meta: dict, itemsize: int) -> str | None:
    """What is wrong with the shards of prepared data at a URL: one listing compares each object's size and
    version with those meta.json records; a directory uploaded by other means (no versions recorded) has its
    content checksums checked by sampled byte ranges instead."""
    if meta.get("kind") in ("examples", "preference"):
        return f"{url} holds fine-tune examples, which lm reads from a local disk only; copy it to one"
    listed = storage.objects(url)
    recorded = meta.get("objects")
    for shard in meta["shards"]:
        name, size = shard["name"], shard["tokens"] * itemsize
        found = listed.get(name)
        if found is None or found["size"] != size:
            return f"{url}/{name} has {found['size'] if found else 'no'} bytes where meta.json records {size}"
        if recorded is not None and recorded.get(name) != found:
            return f"{url}/{name} is not the object meta.json records (it was uploaded again)"
    if recorded is None:
        for name, expected in meta.get("checksums", {}).items():
            if content_digest(f"{url}/{name}") != expected:
                return f"{url}/{name} does not match the checksum meta.json records"
    return None


def _examples_mismatch(data_dir: str, meta: dict, itemsize: int) -> str | None:
    for split in SPLITS:
        counts = meta["splits"][split]
        tokens_path, mask_path, idx_path = example_files(data_dir, split)
        for path, expected in ((tokens_path, counts["tokens"] * itemsize), (mask_path, counts["tokens"])):
            problem = _wrong_size(path, expected)
            if problem:
                return problem
        try:
            offsets = np.load(idx_path, mmap_mode="r")
        except (OSError, ValueError):
            return f"{idx_path} is missing or unreadable"
        if offsets.shape != (counts["examples"] + 1,) or offsets[-1] != counts["tokens"]:
            return f"{idx_path} does not match the {counts['examples']} examples meta.json records"
    return None


def _wrong_size(path: str, expected: int) -> str | None:
    actual = os.path.getsize(path) if os.path.exists(path) else None
    if actual == expected:
        return None
    return f"{path} has {actual if actual is not None else 'no'} bytes where meta.json records {expected}"
