"""Text to token files (prepare), and the grain datasets that read them for training.

A prepared directory holds:

    train.bin, val.bin   token ids, uint16 when n_vocab <= 65536 else uint32; every document is followed
                         by the end-of-text token
    meta.json            tokenizer, dtype, counts per split, the inputs and their fingerprint (written last)
    tokenizer.tiktoken   the rank file of bpe:N and .tiktoken tokenizers

    python -m lm.data prepare INPUT... --tokenizer SPEC --out DIR [--val INPUT...] [--val-fraction F]
                              [--field NAME] [--workers N] [--quiet]

Training batches are random windows of block_size + 1 tokens (inputs, and targets shifted by one) from
a memory-mapped train.bin; the start of each window is a hash of (seed, its row in the whole stream of
batches), so every process computes just its own rows of each global batch.

Checkpointing the train iterator (lm/checkpoint.py): `train_iterator` returns a grain DatasetIterator
whose state is `{"next_index": batches_taken}`. With an orbax CheckpointManager, save it as one more item
and restore it into a fresh iterator built with the same arguments:

    manager.save(step, args=ocp.args.Composite(..., data=grain.checkpoint.CheckpointSave(iterator)))
    manager.restore(step, args=ocp.args.Composite(..., data=grain.checkpoint.CheckpointRestore(iterator)))

grain.checkpoint.CheckpointHandler writes one process_<i>-of-<n>.json per JAX process. Without orbax:
`json.dumps(iterator.get_state())`, then `iterator.set_state(json.loads(saved))`.

Fine-tuning reads JSONL examples ({"prompt", "completion"} or {"text"}) tokenized once by prepare_examples
into flat token and loss-mask files; `example_iterator` packs several examples into each row (segment_ids
keep their attention apart, positions restart for each) and is checkpointed the same way.
"""

from __future__ import annotations

import bisect
import collections
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import grain
import numpy as np
from tqdm import tqdm

from lm import encode_workers
from lm.config import BUNDLED_CORPUS, DataConfig
from lm.encode_workers import encode_pieces
from lm.errors import ArgumentParser, UserError, cli
from lm.tokenizer import (
    RANK_FILE,
    Tokenizer,
    bpe_size,
    file_sha256,
    get_tokenizer,
    train_bpe,
)

FORMAT_VERSION = 1
SPLITS = ("train", "val")
CHUNK_BYTES = 1 << 20  # text per encoding task: large enough to amortise overheads, small enough to stream
# Inputs of at least this many bytes are encoded in worker processes (lm/encode_workers.py), smaller ones in
# threads. Processes encode faster (2 run 1.95x one thread, 2 threads 1.3-1.45x) but take 0.1-0.2 s to start
# and fill: on 2 cores they overtake 2 threads at about 8 MB for bpe:4096 and 24 MB for cl100k_base.
PROCESS_MIN_BYTES = 32 << 20
BPE_SAMPLE_BYTES = 100 << 20  # a bpe:N tokenizer trains on this much text, an even share from each input
# Cutting text at these places never changes its tokens, for GPT-2's, cl100k's, o200k's and our split
# patterns: no pre-tokenizer piece crosses "x\nY" (x a printable ASCII character, Y an ASCII letter or digit)
# or "a b" (ASCII letters), and the piece before the cut ends the same way at the end of a string.
SAFE_CUT = re.compile(rb"(?<=[!-~]\n)(?=[A-Za-z0-9])|(?<=[A-Za-z])(?= [A-Za-z])")
ENDLESS = 1 << 40  # batches in the train stream: unbounded in practice
# The first bytes of compressed files, which are text only once decompressed.
COMPRESSED = {b"\x1f\x8b": "gzip", b"PK\x03\x04": "zip", b"\xfd7zXZ\x00": "xz", b"(\xb5/\xfd": "zstd"}


# ---------------------------------------------------------------------------------------------- prepare


def prepare(
    inputs: list[str],
    tokenizer: str,
    out_dir: str,
    val_inputs: list[str] = (),
    val_fraction: float = 0.1,
    field: str = "text",
    workers: int = 0,
    progress: bool = True,
) -> dict:
    """Tokenize inputs into out_dir and return its meta; do nothing if out_dir is already up to date.

    Inputs are text files (one document each), .jsonl files (one document per line, text under `field`),
    directories (their .txt and .jsonl files, recursively) and globs. The validation split is val_inputs
    if given, else the last val_fraction of the train inputs' token stream. `workers` tokenizers (0 = one per
    CPU core) encode in parallel: worker processes when the inputs reach PROCESS_MIN_BYTES, threads otherwise
    (and for workers=1, or where processes cannot start); the tokens are the same either way.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if workers < 0:
        raise UserError(f"workers must be >= 0 (0 = one per CPU core), got {workers}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is a file, not a directory for prepared data; choose another output directory")
    files, val_files = _expand(inputs), _expand(val_inputs) if val_inputs else []
    if tokenizer.startswith("bpe:"):
        bpe_size(tokenizer)
    else:
        get_tokenizer(tokenizer)  # a bad spec, rank file or unreachable download fails before any work
    source_rank_file = tokenizer if tokenizer.endswith(".tiktoken") else None
    settings = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "source_rank_file_sha256": file_sha256(source_rank_file) if source_rank_file else None,
        "field": field,
        "val_fraction": None if val_files else val_fraction,
        "inputs": [_file_info(f) for f in files],
        "val_inputs": [_file_info(f) for f in val_files],
    }
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    meta_path = os.path.join(out_dir, "meta.json")
    meta = _read_meta(out_dir)
    if meta and meta.get("fingerprint") == fingerprint and not _size_mismatch(out_dir, meta):
        if progress:
            print(f"{out_dir} is up to date", file=sys.stderr)
        return meta
    if os.path.exists(meta_path):
        os.remove(meta_path)  # until the new meta.json exists, the directory must not look prepared
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out_dir}: {e.strerror or e}; choose another output directory") from None

    tok = _tokenizer_for_prepare(tokenizer, files, field, out_dir, progress)
    dtype = np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32
    tmp = {split: os.path.join(out_dir, f".{split}.bin.{os.getpid()}.tmp") for split in SPLITS}
    bad_utf8 = collections.Counter()
    total_bytes = sum(info["size"] for info in settings["inputs"] + settings["val_inputs"])
    try:
        with (
            _encoder(tok, dtype, workers, total_bytes) as encoder,
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar,
        ):
            train = _encode_files(files, tok, field, encoder, tmp["train"], bar, bad_utf8)
            if val_files:
                val = _encode_files(val_files, tok, field, encoder, tmp["val"], bar, bad_utf8)
            else:
                n_val = int(train.tokens * val_fraction)
                val = _split_off_tail(tmp["train"], tmp["val"], train.tokens, n_val, dtype, tok)
                train = train - val
        for split in SPLITS:
            os.replace(tmp[split], os.path.join(out_dir, f"{split}.bin"))
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)
    if bad_utf8:
        first = next(iter(bad_utf8))
        print(
            f"warning: replaced {sum(bad_utf8.values())} invalid UTF-8 sequences with U+FFFD in "
            f"{len(bad_utf8)} file(s), first in {first}",
            file=sys.stderr,
        )
    meta = {
        **settings,
        "fingerprint": fingerprint,
        "rank_file_sha256": file_sha256(tok.rank_file) if tok.rank_file else None,
        "n_vocab": tok.n_vocab,
        "eot": tok.eot,
        "dtype": np.dtype(dtype).name,
        "splits": {"train": asdict(train), "val": asdict(val)},
        "checksums": _checksums(out_dir, [f"{split}.bin" for split in SPLITS]),
        "documents": train.documents + val.documents,
        "invalid_utf8": sum(bad_utf8.values()),
    }
    _write_json(meta_path, meta)
    return meta


def prepare_for_config(data_cfg: DataConfig, progress: bool = True) -> tuple[str, dict]:
    """(prepared directory, meta) for data.path: a prepared directory as it is, anything else prepared into
    data.cache_dir on first use (and again when the inputs change)."""
    path = data_cfg.path or BUNDLED_CORPUS
    if os.path.isfile(os.path.join(path, "meta.json")):
        meta = load_meta(path)
        if meta.get("kind") == "examples":
            raise UserError(
                f"{path} holds fine-tune examples, not a token stream to pretrain on; point data.path at text"
            )
        if meta["tokenizer"] != data_cfg.tokenizer:
            raise UserError(
                f"{path} was prepared with tokenizer {meta['tokenizer']}, not data.tokenizer={data_cfg.tokenizer}; "
                f"set data.tokenizer={meta['tokenizer']} or point data.path at the text to prepare it again"
            )
        return path, meta
    val_inputs = [data_cfg.val_path] if data_cfg.val_path else []
    # Named by what is asked for, not by the inputs' contents, so changed inputs re-prepare in place.
    request = {
        "inputs": [os.path.abspath(p) for p in [path, *val_inputs]],
        "tokenizer": data_cfg.tokenizer,
        "field": data_cfg.field,
        "val_fraction": None if val_inputs else data_cfg.val_fraction,
    }
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:8]
    name = _slug(os.path.splitext(os.path.basename(path.rstrip("/")))[0]) or "data"
    tokenizer_name = _slug(os.path.basename(data_cfg.tokenizer).removesuffix(".tiktoken"))
    out_dir = os.path.join(data_cfg.cache_dir, f"{name}-{tokenizer_name}-{key}")
    meta = prepare(
        [path],
        data_cfg.tokenizer,
        out_dir,
        val_inputs=val_inputs,
        val_fraction=data_cfg.val_fraction,
        field=data_cfg.field,
        workers=data_cfg.workers,
        progress=progress,
    )
    return out_dir, meta


def prepare_examples_for_config(data_cfg: DataConfig, tokenizer: Tokenizer, seed: int, progress: bool = True):
    """(prepared directory, meta) for a JSONL file of fine-tune examples (data.format=examples), tokenized
    with `tokenizer` (the starting model's) into data.cache_dir on first use."""
    if not data_cfg.path:
        raise UserError("data.format=examples needs data.path: a JSONL file of prompt/completion or text records")
    request = {
        "inputs": [os.path.abspath(p) for p in (data_cfg.path, data_cfg.val_path) if p],
        "tokenizer": tokenizer.spec,
        "ranks": file_sha256(tokenizer.rank_file) if tokenizer.rank_file else None,
        "fields": [data_cfg.prompt_field, data_cfg.completion_field, data_cfg.field],
        "val_fraction": None if data_cfg.val_path else data_cfg.val_fraction,
        "seed": seed,
    }
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:8]
    name = _slug(os.path.splitext(os.path.basename(data_cfg.path.rstrip("/")))[0]) or "examples"
    out_dir = os.path.join(data_cfg.cache_dir, f"{name}-examples-{key}")
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
        progress=progress,
    )
    return out_dir, meta


def load_meta(data_dir: str) -> dict:
    """meta.json of a prepared directory, after checking that its token files are the ones it describes."""
    meta = _read_meta(data_dir)
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


def load_tokens(data_dir: str, split: str, meta: dict | None = None) -> np.ndarray:
    """The token ids of a split, memory-mapped (read on demand, never loaded whole)."""
    meta = meta or load_meta(data_dir)
    if meta["splits"][split]["tokens"] == 0:
        return np.zeros(0, meta["dtype"])  # numpy cannot map an empty file
    return np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=meta["dtype"], mode="r")


def get_tokenizer_for(data_dir: str, meta: dict) -> Tokenizer:
    """The tokenizer that prepared data_dir, checked against the rank file it recorded."""
    tok = get_tokenizer(meta["tokenizer"], data_dir)
    if tok.rank_file and file_sha256(tok.rank_file) != meta["rank_file_sha256"]:
        raise UserError(
            f"{tok.rank_file} is not the rank file {data_dir} was prepared with; prepare the data again"
        )
    return tok


@dataclass
class _Counts:
    tokens: int = 0
    bytes: int = 0  # UTF-8 bytes of text behind the tokens, for bits per byte
    documents: int = 0  # end-of-text tokens

    def add(self, ids: np.ndarray, tok: Tokenizer) -> None:
        self.tokens += len(ids)
        self.bytes += int(tok.byte_lengths[ids].sum())
        self.documents += int(np.count_nonzero(ids == tok.eot))

    def __sub__(self, other: _Counts) -> _Counts:
        return _Counts(self.tokens - other.tokens, self.bytes - other.bytes, self.documents - other.documents)


def _tokenizer_for_prepare(spec: str, files: list[str], field: str, out_dir: str, progress: bool) -> Tokenizer:
    """The tokenizer, with its rank file stored in out_dir: trained there for bpe:N, copied for a file."""
    rank_file = os.path.join(out_dir, RANK_FILE)
    if spec.startswith("bpe:"):
        if progress:
            print(f"training tokenizer {spec} on up to {BPE_SAMPLE_BYTES >> 20} MB of the inputs", file=sys.stderr)
        return train_bpe(_sample(files, field, BPE_SAMPLE_BYTES), bpe_size(spec), rank_file)
    if spec.endswith(".tiktoken"):
        get_tokenizer(spec)  # a malformed file fails before it is copied
        tmp = f"{rank_file}.{os.getpid()}.tmp"
        shutil.copyfile(spec, tmp)
        os.replace(tmp, rank_file)
        return get_tokenizer(spec, out_dir)
    return get_tokenizer(spec)


def _sample(files: list[str], field: str, budget: int) -> Iterator[str]:
    """Texts from the start of every file, each file's share of the budget proportional to its size."""
    sizes = [os.path.getsize(f) for f in files]
    share = min(1.0, budget / sum(sizes))
    for path, size in zip(files, sizes):
        taken = 0
        for text, _, n in _pieces(path, field, collections.Counter()):
            if taken >= size * share:
                break
            taken += n
            yield _without_surrogates(text)


def _without_surrogates(text: str) -> str:
    """text with lone surrogates (JSON can escape them) replaced by U+FFFD, as Tokenizer.encode_array does:
    the BPE trainer refuses them."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _encode_files(files, tok, field, encoder, out_path, bar, bad_utf8) -> _Counts:
    """Encode files with the encoder's workers, in order, into out_path; counts of what was written."""
    counts = _Counts()
    pending = collections.deque()
    started = time.time()
    with open(out_path, "wb") as f:

        def write_until(n_pending: int) -> None:
            while len(pending) > n_pending:
                result, n_bytes = pending.popleft()
                ids = result()
                ids.tofile(f)
                counts.add(ids, tok)
                bar.update(n_bytes)
                bar.set_postfix_str(f"{counts.tokens / (time.time() - started):,.0f} tokens/s", refresh=False)

        for pieces, n_bytes, path in _tasks(files, field, bad_utf8):
            pending.append((encoder.submit(pieces, path), n_bytes))
            write_until(2 * encoder.workers)  # bounded read-ahead keeps memory flat on any corpus
        write_until(0)
    return counts


def _encoder(tok: Tokenizer, dtype, workers: int, total_bytes: int):
    """Worker processes for large inputs, where they are possible; threads otherwise, and for one worker."""
    workers = workers or os.cpu_count() or 1
    if workers > 1 and total_bytes >= PROCESS_MIN_BYTES:
        try:
            return encode_workers.Processes(tok, dtype, workers)
        except OSError as e:
            print(f"warning: tokenizer worker processes cannot start ({e}); tokenizing in threads", file=sys.stderr)
    return _Threads(tok, dtype, workers)


class _Threads:
    """Encoding in this process's threads (tiktoken releases the GIL), with the interface of
    encode_workers.Processes: submit returns a callable that waits for the result."""

    def __init__(self, tok: Tokenizer, dtype, workers: int):
        self.tok, self.dtype, self.workers = tok, dtype, workers
        self._pool = ThreadPoolExecutor(workers)

    def submit(self, pieces: list[tuple[str, bool]], where: str) -> Callable[[], np.ndarray]:
        return self._pool.submit(encode_pieces, self.tok, pieces, self.dtype).result

    def __enter__(self) -> _Threads:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(cancel_futures=True)


def _tasks(files: list[str], field: str, bad_utf8: collections.Counter) -> Iterator[tuple[list, int, str]]:
    """Pieces of text grouped into tasks of at most CHUNK_BYTES (or one larger piece), with the input bytes
    each covers and the file its first piece comes from. Even tasks keep the workers equally busy to the end."""
    pieces, n_bytes, first = [], 0, None
    for path in files:
        for text, ends_document, n in _pieces(path, field, bad_utf8):
            if pieces and n_bytes + n > CHUNK_BYTES:
                yield pieces, n_bytes, first
                pieces, n_bytes, first = [], 0, None
            pieces.append((text, ends_document))
            first = first or path
            n_bytes += n
    if pieces:
        yield pieces, n_bytes, first


def _pieces(path: str, field: str, bad_utf8: collections.Counter) -> Iterator[tuple[str, bool, int]]:
    """(text, ends a document, input bytes) from one file, streamed: a text file is one document read in
    chunks cut at SAFE_CUT places; a .jsonl file holds one document per line."""
    with open(path, "rb") as f:
        if path.endswith(".jsonl"):
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(_decode(line, path, bad_utf8))
                except json.JSONDecodeError as e:
                    message = f"{path}:{lineno}: not a JSON line ({e.msg}); write one JSON object a line"
                    raise UserError(message) from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise UserError(
                        f"{path}:{lineno}: no text field '{field}' (choose another with --field / data.field)"
                    )
                if record[field]:
                    yield record[field], True, len(line)
            return
        _refuse_binary(path, f.read(1 << 16))
        f.seek(0)
        carry = b""
        while block := f.read(CHUNK_BYTES):
            searched = max(0, len(carry) - 2)  # SAFE_CUT looks two bytes ahead
            carry += block
            cut = _last_safe_cut(carry, searched)
            if cut:
                yield _decode(carry[:cut], path, bad_utf8), False, cut
                carry = carry[cut:]
        yield _decode(carry, path, bad_utf8), True, len(carry)


def _refuse_binary(path: str, head: bytes) -> None:
    """Refuse a file that is not text, judged by its first bytes: tokenizing it would train on noise.

    Text never holds NUL bytes; archives, token files, images and UTF-16 text do (or start with a known magic)."""
    kind = next((name for magic, name in COMPRESSED.items() if head.startswith(magic)), None)
    if kind:
        raise UserError(f"{path} is {kind}-compressed, not text; decompress it and give the text file")
    if b"\0" not in head:
        return
    if os.path.basename(path) in {f"{split}.bin" for split in SPLITS} and _read_meta(os.path.dirname(path)):
        raise UserError(f"{path} is a prepared token file, not text; give its directory {os.path.dirname(path)}")
    raise UserError(f"{path} is binary (it holds NUL bytes), not UTF-8 text; give text or .jsonl files instead")


def _last_safe_cut(buf: bytes, start: int) -> int:
    """The last SAFE_CUT place in buf at or after start, or 0 if there is none (the caller then reads on).
    Text usually has one near its end, so the last 4 KiB are searched first."""
    for lo in (max(start, len(buf) - 4096), start):
        cuts = [m.start() for m in SAFE_CUT.finditer(buf, lo)]
        if cuts:
            return cuts[-1]
    return 0


def _decode(raw: bytes, path: str, bad_utf8: collections.Counter) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        bad_utf8[path] += text.count("\ufffd") - raw.count("\ufffd".encode())
        return text


def _split_off_tail(src: str, dst: str, n_tokens: int, n_tail: int, dtype, tok: Tokenizer) -> _Counts:
    """Move the last n_tail of the n_tokens tokens in src into dst, and count them."""
    start = (n_tokens - n_tail) * np.dtype(dtype).itemsize
    tail = _Counts()
    with open(src, "rb") as f, open(dst, "wb") as out:
        f.seek(start)
        while block := f.read(CHUNK_BYTES * 16):
            out.write(block)
            tail.add(np.frombuffer(block, dtype), tok)
    os.truncate(src, start)
    return tail


def _expand(inputs: list[str]) -> list[str]:
    """Every input file, absolute, in a stable order; empty files inside directories are skipped."""
    if not inputs:
        raise UserError("no inputs given")
    files = []
    for given in inputs:
        if os.path.isdir(given) or os.path.isfile(given):
            found = _files_under(given)
        elif any(c in given for c in "*?["):
            found = [f for match in sorted(glob.glob(given, recursive=True)) for f in _files_under(match)]
        else:
            raise UserError(f"input '{given}' not found; give an existing file, directory or glob")
        found = [os.path.abspath(f) for f in found if os.path.getsize(f) > 0]
        if not found:
            what = "is empty" if os.path.isfile(given) else "has no non-empty .txt or .jsonl files"
            raise UserError(f"input '{given}' {what}; give inputs that hold text")
        files += found
    return files


def _files_under(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    return sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(path)
        for name in names
        if name.endswith((".txt", ".jsonl"))
    )


def _file_info(path: str) -> dict:
    stat = os.stat(path)
    return {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _size_mismatch(data_dir: str, meta: dict) -> str | None:
    """What is wrong with the token files of a prepared directory, if anything: sizes, then contents."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    if meta.get("kind") == "examples":
        problem = _examples_mismatch(data_dir, meta, itemsize)
    else:
        problem = None
        for split in SPLITS:
            path = os.path.join(data_dir, f"{split}.bin")
            expected = meta["splits"][split]["tokens"] * itemsize
            actual = os.path.getsize(path) if os.path.exists(path) else None
            if actual != expected:
                problem = f"{path} has {actual if actual is not None else 'no'} bytes where meta.json records {expected}"
                break
    if problem:
        return problem
    for name, digest in meta.get("checksums", {}).items():
        if content_digest(os.path.join(data_dir, name)) != digest:
            return f"{os.path.join(data_dir, name)} does not match the checksum meta.json records"
    return None


def content_digest(path: str, samples: int = 64, sample_bytes: int = 1 << 16) -> str:
    """A SHA-256 of a file's size and `samples` evenly spaced pieces of it (all of a small file): cheap
    enough to check at every start, and changed by any edit that moves or rewrites tokens."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= samples * sample_bytes:
            digest.update(f.read())
        else:
            for i in range(samples):
                f.seek((size - sample_bytes) * i // (samples - 1))
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()


def _checksums(data_dir: str, names: list[str]) -> dict[str, str]:
    return {name: content_digest(os.path.join(data_dir, name)) for name in names}


def _examples_mismatch(data_dir: str, meta: dict, itemsize: int) -> str | None:
    for split in SPLITS:
        counts = meta["splits"][split]
        tokens_path, mask_path, idx_path = _example_files(data_dir, split)
        for path, expected in ((tokens_path, counts["tokens"] * itemsize), (mask_path, counts["tokens"])):
            actual = os.path.getsize(path) if os.path.exists(path) else None
            if actual != expected:
                return f"{path} has {actual if actual is not None else 'no'} bytes where meta.json records {expected}"
        try:
            offsets = np.load(idx_path, mmap_mode="r")
        except (OSError, ValueError):
            return f"{idx_path} is missing or unreadable"
        if offsets.shape != (counts["examples"] + 1,) or offsets[-1] != counts["tokens"]:
            return f"{idx_path} does not match the {counts['examples']} examples meta.json records"
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def _read_meta(data_dir: str) -> dict | None:
    """meta.json of data_dir, or None if it has none that can be read."""
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ pretraining windows


class _Windows:
    """Batch i of random windows: a callable grain maps over batch indices, one numpy gather per batch."""

    def __init__(
        self, path: str, dtype: str, n_tokens: int, block_size: int, global_batch: int, seed: int, rows: np.ndarray
    ):
        self.path, self.dtype, self.n_tokens = path, dtype, n_tokens
        self.block_size, self.global_batch, self.rows = block_size, global_batch, rows
        self.seed = np.uint64(seed % (1 << 64))
        self._tokens = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}  # each worker process maps the file itself

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        rows = np.uint64(index * self.global_batch) + self.rows
        starts = _splitmix64(self.seed, rows) % np.uint64(self.n_tokens - self.block_size)
        return _gather(self._tokens, starts.astype(np.int64), self.block_size)


def train_iterator(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    rows: np.ndarray | None = None,
) -> grain.DatasetIterator:
    """Endless batches {"inputs", "targets"}: int32 [global_batch // process_count, block_size] of this
    process's rows of each global batch; windows depend only on the seed, the batch and the row.

    `rows` names this process's rows of the global batch explicitly (lm.sharding.process_rows);
    by default process p takes the p-th contiguous block."""
    rows = _local_rows(global_batch, process_index, process_count) if rows is None else rows.astype(np.uint64)
    n_tokens = _check_length(meta, "train", block_size)
    path = os.path.join(data_dir, "train.bin")
    windows = _Windows(path, meta["dtype"], n_tokens, block_size, global_batch, seed, rows)
    return _batches(windows)


def val_batches(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    n_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    rows: np.ndarray | None = None,
) -> list[dict[str, np.ndarray]]:
    """The same n_batches every call: windows evenly spaced over the validation split (rows as above)."""
    rows = _local_rows(global_batch, process_index, process_count) if rows is None else rows
    n_tokens = _check_length(meta, "val", block_size)
    starts = np.linspace(0, n_tokens - block_size - 1, n_batches * global_batch).round().astype(np.int64)
    tokens = load_tokens(data_dir, "val", meta)
    return [_gather(tokens, batch[rows], block_size) for batch in starts.reshape(n_batches, global_batch)]


def _batches(make_batch: Callable[[int], dict]) -> grain.DatasetIterator:
    """A checkpointable iterator over make_batch(0), make_batch(1), ... prepared ahead in a thread."""
    dataset = grain.MapDataset.range(ENDLESS).map(make_batch)
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


def _gather(tokens: np.ndarray, starts: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    windows = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def _local_rows(global_batch: int, process_index: int, process_count: int) -> np.ndarray:
    if global_batch % process_count:
        raise UserError(f"data.batch_size={global_batch} is not divisible by the {process_count} processes")
    local = global_batch // process_count
    return np.arange(process_index * local, (process_index + 1) * local, dtype=np.uint64)


def _check_length(meta: dict, split: str, block_size: int) -> int:
    n_tokens = meta["splits"][split]["tokens"]
    if n_tokens < block_size + 1:
        fix = "lower data.block_size or raise data.val_fraction" if split == "val" else "lower data.block_size"
        raise UserError(
            f"{split} split has {n_tokens} tokens, needs at least block_size+1 = {block_size + 1}; {fix}"
        )
    return n_tokens


def _splitmix64(seed: np.uint64, i: np.ndarray) -> np.ndarray:
    """Output i of the splitmix64 generator seeded with seed: random-access random numbers."""
    x = seed + (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# ------------------------------------------------------------------------------------- fine-tune examples
#
# prepare_examples writes, per split, three files:
#   examples_<split>.bin       the token ids of every example, one after another (dtype as for train.bin)
#   examples_<split>_mask.bin  uint8 per token: 1 where the token is a loss target (completion and end-of-text)
#   examples_<split>_idx.npy   int64 offsets: example i is tokens[idx[i]:idx[i+1]]
# and a meta.json with "kind": "examples". An example of n tokens takes n-1 slots of a row: its inputs are
# tokens[:-1] and its targets tokens[1:], so its first token is never a target and its last is never an input.


def _example_files(data_dir: str, split: str) -> tuple[str, str, str]:
    stem = os.path.join(data_dir, f"examples_{split}")
    return f"{stem}.bin", f"{stem}_mask.bin", f"{stem}_idx.npy"


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
    progress: bool = True,
) -> dict:
    """Tokenize a JSONL file of fine-tune examples into out_dir and return its meta; do nothing if out_dir is
    already up to date.

    Each line is {prompt_field: ..., completion_field: ...} (loss on the completion and the end-of-text token
    after it; prompt and completion are encoded separately, as a prompt is encoded alone when sampling) or
    {text_field: ...} (loss on every token and the end-of-text token). The validation examples are those of
    val_path if given, else a val_fraction of the examples drawn by `seed`; both splits keep file order.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    for given in [path, val_path] if val_path else [path]:
        if not os.path.isfile(given):
            raise UserError(f"fine-tune examples '{given}' not found; give a .jsonl file")
    fields = (prompt_field, completion_field, text_field)
    settings = {
        "format_version": FORMAT_VERSION,
        "kind": "examples",
        "tokenizer": tokenizer.spec,
        "rank_file_sha256": file_sha256(tokenizer.rank_file) if tokenizer.rank_file else None,
        "fields": dict(zip(("prompt", "completion", "text"), fields)),
        "val_fraction": None if val_path else val_fraction,
        "seed": None if val_path else seed,
        "inputs": [_file_info(os.path.abspath(path))],
        "val_inputs": [_file_info(os.path.abspath(val_path))] if val_path else [],
    }
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    meta_path = os.path.join(out_dir, "meta.json")
    meta = _read_meta(out_dir)
    if meta and meta.get("fingerprint") == fingerprint and not _size_mismatch(out_dir, meta):
        if progress:
            print(f"{out_dir} is up to date", file=sys.stderr)
        return meta

    bad_utf8 = collections.Counter()
    examples, skipped = _read_examples(path, tokenizer, fields, bad_utf8)
    if val_path:
        val, val_skipped = _read_examples(val_path, tokenizer, fields, bad_utf8)
        skipped += val_skipped
        splits = {"train": examples, "val": val}
    else:
        n_val = int(len(examples) * val_fraction)
        if val_fraction and len(examples) > 1:
            n_val = max(n_val, 1)
        held_out = np.zeros(len(examples), bool)
        draws = _splitmix64(np.uint64(seed % (1 << 64)), np.arange(len(examples), dtype=np.uint64))
        held_out[np.argsort(draws, kind="stable")[:n_val]] = True
        splits = {
            "train": [e for e, h in zip(examples, held_out) if not h],
            "val": [e for e, h in zip(examples, held_out) if h],
        }
    if bad_utf8:
        print(f"warning: replaced {sum(bad_utf8.values())} invalid UTF-8 sequences with U+FFFD", file=sys.stderr)

    if os.path.exists(meta_path):
        os.remove(meta_path)  # until the new meta.json exists, the directory must not look prepared
    os.makedirs(out_dir, exist_ok=True)
    dtype = np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32
    counts = {split: _write_examples(out_dir, split, items, dtype, tokenizer) for split, items in splits.items()}
    if tokenizer.rank_file:
        rank_file = os.path.join(out_dir, RANK_FILE)
        if os.path.abspath(tokenizer.rank_file) != os.path.abspath(rank_file):
            tmp = f"{rank_file}.{os.getpid()}.tmp"
            shutil.copyfile(tokenizer.rank_file, tmp)
            os.replace(tmp, rank_file)
    meta = {
        **settings,
        "fingerprint": fingerprint,
        "n_vocab": tokenizer.n_vocab,
        "eot": tokenizer.eot,
        "dtype": np.dtype(dtype).name,
        "splits": counts,
        "checksums": _checksums(
            out_dir, [os.path.basename(f) for split in SPLITS for f in _example_files(out_dir, split)]
        ),
        "skipped_empty": skipped,
        "invalid_utf8": sum(bad_utf8.values()),
    }
    _write_json(meta_path, meta)
    if progress:
        train, val = counts["train"], counts["val"]
        print(
            f"{out_dir}: {train['examples']:,} train and {val['examples']:,} val examples, "
            f"{train['tokens']:,} train tokens ({train['loss_tokens']:,} with loss)",
            file=sys.stderr,
        )
    return meta


def _read_examples(
    path: str, tok: Tokenizer, fields: tuple[str, str, str], bad_utf8: collections.Counter
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """([(token ids, loss mask)] in file order, examples skipped for having fewer than two tokens)."""
    prompt_field, completion_field, text_field = fields
    records = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(_decode(line, path, bad_utf8))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not a JSON line ({e.msg}); write one JSON object a line") from None
            if not isinstance(record, dict):
                record = {}
            if prompt_field in record or completion_field in record:
                pair = (record.get(prompt_field), record.get(completion_field))
            else:
                pair = ("", record.get(text_field))
            if not all(isinstance(x, str) for x in pair):
                raise UserError(
                    f"{path}:{lineno}: expected string fields '{prompt_field}' and '{completion_field}', "
                    f"or '{text_field}'; name other fields with data.prompt_field, data.completion_field, data.field"
                )
            records.append(pair)
    if not records:
        raise UserError(f"{path} holds no examples; give one JSON object per line")
    eot = np.array([tok.eot], np.uint32)

    def encode(pair: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
        prompt, completion = (tok.encode_array(x) for x in pair)
        ids = np.concatenate([prompt, completion, eot])
        mask = np.zeros(len(ids), np.uint8)
        mask[len(prompt) :] = 1
        return ids, mask

    with ThreadPoolExecutor(os.cpu_count()) as pool:  # tiktoken releases the GIL
        encoded = list(pool.map(encode, records, chunksize=64))
    kept = [e for e in encoded if len(e[0]) >= 2]  # a lone end-of-text token has nothing to predict
    if not kept:
        raise UserError(f"{path} holds only empty examples; give each some text")
    return kept, len(encoded) - len(kept)


def _write_examples(out_dir: str, split: str, examples: list, dtype, tok: Tokenizer) -> dict:
    """Write one split's three files (each atomically) and return its counts."""
    tokens = np.concatenate([ids for ids, _ in examples]) if examples else np.zeros(0, np.uint32)
    mask = np.concatenate([m for _, m in examples]) if examples else np.zeros(0, np.uint8)
    offsets = np.zeros(len(examples) + 1, np.int64)
    offsets[1:] = np.cumsum([len(ids) for ids, _ in examples])
    targets = np.concatenate([ids[1:][m[1:] == 1] for ids, m in examples]) if examples else tokens
    for path, array in zip(_example_files(out_dir, split), (tokens.astype(dtype), mask, offsets)):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            if path.endswith(".npy"):
                np.save(f, array)
            else:
                array.tofile(f)
        os.replace(tmp, path)
    return {
        "examples": len(examples),
        "tokens": len(tokens),
        "loss_tokens": len(targets),
        "loss_bytes": int(tok.byte_lengths[targets].sum()),  # text behind the targets, for bits per byte
    }


def load_examples(data_dir: str, split: str, meta: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, loss mask, offsets) of a split of fine-tune examples; tokens and mask memory-mapped."""
    if meta.get("kind") != "examples":
        raise UserError(f"{data_dir} holds a token stream, not fine-tune examples; prepare it with prepare_examples")
    tokens_path, mask_path, idx_path = _example_files(data_dir, split)
    offsets = np.load(idx_path)
    if offsets[-1] == 0:  # numpy cannot map an empty file
        return np.zeros(0, meta["dtype"]), np.zeros(0, np.uint8), offsets
    return np.memmap(tokens_path, dtype=meta["dtype"], mode="r"), np.memmap(mask_path, np.uint8, mode="r"), offsets


def count_truncated(data_dir: str, meta: dict, split: str, block_size: int) -> int:
    """Examples of a split longer than block_size + 1 tokens, which the loaders cut to fit a row."""
    offsets = load_examples(data_dir, split, meta)[2]
    return int(np.count_nonzero(np.diff(offsets) > block_size + 1))


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
    recomputed on demand from the seed, so only counts and the latest plans are kept.
    """

    def __init__(self, data_dir: str, split: str, meta: dict, block_size: int, global_batch: int, seed, rows):
        self.data_dir, self.split, self.meta = data_dir, split, meta
        self.block_size, self.global_batch, self.seed, self.rows = block_size, global_batch, seed, rows
        offsets = load_examples(data_dir, split, meta)[2]
        self.slots = np.minimum(np.diff(offsets), block_size + 1) - 1
        self.batch_starts = [0]  # batch_starts[e] = the stream's index of epoch e's first batch
        self._plans = {}
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
                key = _splitmix64(np.uint64(self.seed % (1 << 64)), np.array([epoch], np.uint64))[0]
                order = np.argsort(_splitmix64(key, np.arange(n, dtype=np.uint64)), kind="stable")
            rows = first_fit(self.slots[order], self.block_size)
            by_row = np.argsort(rows, kind="stable")
            row_offsets = np.zeros(rows.max() + 2, np.int64)
            row_offsets[1:] = np.cumsum(np.bincount(rows))
            while len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            self._plans[epoch] = (order[by_row], row_offsets)
        return self._plans[epoch]

    def batches_in(self, epoch: int) -> int:
        return -(-(len(self.plan(epoch)[1]) - 1) // self.global_batch)

    def locate(self, index: int) -> tuple[int, int]:
        """(epoch, batch within it) of the stream's batch `index`."""
        while self.batch_starts[-1] <= index:
            self.batch_starts.append(self.batch_starts[-1] + self.batches_in(len(self.batch_starts) - 1))
        epoch = bisect.bisect_right(self.batch_starts, index) - 1
        return epoch, index - self.batch_starts[epoch]

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        with self._lock:
            epoch, batch = self.locate(index)
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
        for r, row in enumerate(batch * self.global_batch + self.rows):
            if row >= len(row_offsets) - 1:
                continue  # an empty row filling up the epoch's last batch
            at = 0
            for segment, example in enumerate(examples[row_offsets[row] : row_offsets[row + 1]], 1):
                start = offsets[example]
                n = self.slots[example]
                ids = tokens[start : start + n + 1]
                out["inputs"][r, at : at + n] = ids[:-1]
                out["targets"][r, at : at + n] = ids[1:]
                out["loss_mask"][r, at : at + n] = mask[start + 1 : start + n + 1]
                out["positions"][r, at : at + n] = np.arange(n)
                out["segment_ids"][r, at : at + n] = segment
                at += n
        return out


def _warn_truncated(data_dir: str, meta: dict, split: str, block_size: int) -> None:
    n = count_truncated(data_dir, meta, split, block_size)
    if n:
        print(
            f"warning: {n} of {meta['splits'][split]['examples']} {split} examples are longer than "
            f"block_size+1 = {block_size + 1} tokens and are cut to fit; raise data.block_size to keep them whole",
            file=sys.stderr,
        )


def example_iterator(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    seed: int,
    epochs: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    rows: np.ndarray | None = None,
    verbose: bool = True,
) -> grain.DatasetIterator:
    """Batches of packed fine-tune examples: this process's rows of each global batch, as
    {"inputs", "targets", "positions", "segment_ids"} int32 and "loss_mask" float32, [rows, block_size].

    Several examples share a row; segment_ids number them 1, 2, ... (0 is padding) so that attention stays
    within an example, positions restart at 0 for each, and loss_mask is 0 on prompts and padding. The stream
    runs `epochs` times over the examples (None = without end), each epoch in its own shuffled order; its
    state is checkpointed like train_iterator's. `rows` and the process arguments are as for train_iterator;
    `verbose` prints how many examples are cut to fit a row.
    """
    rows = _local_rows(global_batch, process_index, process_count) if rows is None else rows
    if meta["splits"]["train"]["examples"] == 0:
        raise UserError(f"{data_dir} has no training examples; prepare it again with more examples")
    if verbose:
        _warn_truncated(data_dir, meta, "train", block_size)
    packs = _Packs(data_dir, "train", meta, block_size, global_batch, seed, np.asarray(rows, np.int64))
    length = ENDLESS if epochs is None else sum(packs.batches_in(e) for e in range(epochs))
    dataset = grain.MapDataset.range(length).map(packs)
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


def example_steps(data_dir: str, meta: dict, block_size: int, global_batch: int, seed: int, epochs: int) -> int:
    """Global batches in `epochs` passes over the training examples, as example_iterator packs them."""
    packs = _Packs(data_dir, "train", meta, block_size, global_batch, seed, np.arange(global_batch))
    return sum(packs.batches_in(e) for e in range(epochs))


def example_val_batches(
    data_dir: str,
    meta: dict,
    block_size: int,
    global_batch: int,
    n_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    rows: np.ndarray | None = None,
    verbose: bool = True,
) -> list[dict[str, np.ndarray]]:
    """The validation examples packed in file order, the same batches every call (as example_iterator's);
    the first n_batches of them, or all for None."""
    rows = _local_rows(global_batch, process_index, process_count) if rows is None else rows
    if meta["splits"]["val"]["examples"] == 0:
        raise UserError(f"{data_dir} has no validation examples; raise data.val_fraction or set data.val_path")
    if verbose:
        _warn_truncated(data_dir, meta, "val", block_size)
    packs = _Packs(data_dir, "val", meta, block_size, global_batch, None, np.asarray(rows, np.int64))
    count = packs.batches_in(0) if n_batches is None else min(n_batches, packs.batches_in(0))
    return [packs(i) for i in range(count)]


# ------------------------------------------------------------------------------------------------- CLI


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m lm.data", description="Prepare token files for training.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize text files, directories, globs or .jsonl into DIR")
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("--tokenizer", default="bytes", metavar="SPEC", help="tokenizer spec (default: bytes)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for train.bin, val.bin and meta.json")
    p.add_argument("--val", nargs="+", default=[], metavar="INPUT", help="separate validation inputs")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of the token stream held out (0.1)")
    p.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="tokenizer workers (default: one per CPU core); processes for inputs of 32 MB or more, else threads",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    meta = prepare(
        args.inputs,
        args.tokenizer,
        args.out,
        val_inputs=args.val,
        val_fraction=args.val_fraction,
        field=args.field,
        workers=args.workers,
        progress=not args.quiet,
    )
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    print(
        f"{args.out}: {train['tokens']:,} train and {val['tokens']:,} val tokens, {meta['documents']:,} documents, "
        f"tokenizer {meta['tokenizer']} ({meta['n_vocab']:,} tokens, {meta['dtype']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------ what training asks of the data (interim)


@dataclass(frozen=True)
class Prepared:
    directory: str
    meta: dict
    tokenizer: Tokenizer

    @property
    def examples(self) -> bool:
        return self.meta.get("kind") == "examples"

    def steps_for_epochs(self, data_cfg: DataConfig, seed: int) -> int:
        if not self.examples:
            raise UserError("data.epochs is for data.format=examples; set train.steps instead")
        return example_steps(self.directory, self.meta, data_cfg.block_size, data_cfg.batch_size, seed, data_cfg.epochs)

    def train_iterator(self, data_cfg: DataConfig, seed: int, rows: np.ndarray, verbose: bool = True):
        d = data_cfg
        if self.examples:
            return example_iterator(self.directory, self.meta, d.block_size, d.batch_size, seed, rows=rows, verbose=verbose)
        return train_iterator(self.directory, self.meta, d.block_size, d.batch_size, seed, rows=rows)

    def val_batches(self, data_cfg: DataConfig, n_batches: int, rows: np.ndarray, verbose: bool = True):
        d = data_cfg
        if self.examples:
            return example_val_batches(self.directory, self.meta, d.block_size, d.batch_size, n_batches, rows=rows, verbose=verbose)
        return val_batches(self.directory, self.meta, d.block_size, d.batch_size, n_batches, rows=rows)

    @property
    def val_tokens_per_byte(self) -> float:
        val = self.meta["splits"]["val"]
        tokens, n_bytes = (val["loss_tokens"], val["loss_bytes"]) if "loss_tokens" in val else (val["tokens"], val["bytes"])
        return tokens / max(n_bytes, 1)


def prepare_for_training(data_cfg: DataConfig, seed: int, trained_tokenizer: Tokenizer | None = None, progress: bool = True) -> Prepared:
    from lm.tokenizer import tokenizer_item

    if data_cfg.format == "examples":
        tok = trained_tokenizer or get_tokenizer(data_cfg.tokenizer)
        data_dir, meta = prepare_examples_for_config(data_cfg, tok, seed, progress=progress)
        return Prepared(data_dir, meta, tok)
    data_dir, meta = prepare_for_config(data_cfg, progress=progress)
    tok = get_tokenizer_for(data_dir, meta)
    if trained_tokenizer is not None and tokenizer_item(trained_tokenizer) != tokenizer_item(tok):
        raise UserError(
            f"init_from uses tokenizer {trained_tokenizer.spec} but the data is tokenized with {tok.spec}; "
            "set data.tokenizer to match (or fine-tune on data.format=examples, tokenized with the model's tokenizer)"
        )
    return Prepared(data_dir, meta, tok)
