"""Text to token files for pretraining: inputs -> train.bin, val.bin and meta.json (lm/data/meta.py).

The inputs are read in pieces (lm/data/sources.py) and encoded by several tokenizers at once, in threads
or in worker processes (lm/encode_workers.py), and written in order: the tokens are the same either way.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import IO

import numpy as np
from tqdm import tqdm

from lm import encode_workers
from lm.config import BUNDLED_CORPUS, DataConfig
from lm.data import meta as meta_lib
from lm.data import sources
from lm.data.meta import FORMAT_VERSION, META, SPLITS, file_info
from lm.errors import UserError
from lm.files import atomic_open, copy_file, write_json
from lm.tokenizer import RANK_FILE, Tokenizer, bpe_size, file_sha256, get_tokenizer, train_bpe

# Inputs of at least this many bytes are encoded in worker processes, smaller ones in threads: processes
# encode faster, but take longer to start than the encoding of a small input does (benchmarks/README.md).
PROCESS_MIN_BYTES = 32 << 20
BPE_SAMPLE_BYTES = 100 << 20  # a bpe:N tokenizer trains on this much text, an even share from each input
COPY_BYTES = 16 << 20  # read at once when the validation tail moves to val.bin


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
    files, val_files = sources.expand(inputs), sources.expand(val_inputs) if val_inputs else []
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
        "inputs": [file_info(f) for f in files],
        "val_inputs": [file_info(f) for f in val_files],
    }
    fingerprint = meta_lib.digest(settings)
    meta = meta_lib.up_to_date(out_dir, fingerprint, progress)
    if meta:
        return meta
    meta_lib.start_writing(out_dir)

    tok = _tokenizer_for_prepare(tokenizer, files, field, out_dir, progress)
    dtype = np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32
    bad_utf8 = collections.Counter()
    total_bytes = sum(info["size"] for info in settings["inputs"] + settings["val_inputs"])
    with (
        atomic_open(os.path.join(out_dir, "train.bin"), "w+b") as train_file,
        atomic_open(os.path.join(out_dir, "val.bin"), "wb") as val_file,
        _encoder(tok, dtype, workers, total_bytes) as encoder,
        tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar,
    ):
        train = _encode_files(files, tok, field, encoder, train_file, bar, bad_utf8)
        if val_files:
            val = _encode_files(val_files, tok, field, encoder, val_file, bar, bad_utf8)
        else:
            val = _split_off_tail(train_file, val_file, train.tokens, int(train.tokens * val_fraction), dtype, tok)
            train = train - val
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
        "checksums": meta_lib.checksums(out_dir, [f"{split}.bin" for split in SPLITS]),
        "documents": train.documents + val.documents,
        "invalid_utf8": sum(bad_utf8.values()),
    }
    write_json(os.path.join(out_dir, META), meta)
    return meta


def prepare_for_config(data_cfg: DataConfig, progress: bool = True) -> tuple[str, dict]:
    """(prepared directory, meta) for data.path: a prepared directory as it is, anything else prepared into
    data.cache_dir on first use (and again when the inputs change)."""
    path = data_cfg.path or BUNDLED_CORPUS
    if os.path.isfile(os.path.join(path, META)):
        meta = meta_lib.load_meta(path)
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
    request = {
        "inputs": [os.path.abspath(p) for p in [path, *val_inputs]],
        "tokenizer": data_cfg.tokenizer,
        "field": data_cfg.field,
        "val_fraction": None if val_inputs else data_cfg.val_fraction,
    }
    tokenizer_name = os.path.basename(data_cfg.tokenizer).removesuffix(".tiktoken")
    out_dir = meta_lib.cache_dir(data_cfg.cache_dir, path, tokenizer_name, "data", request)
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
        return train_bpe(sources.sample(files, field, BPE_SAMPLE_BYTES), bpe_size(spec), rank_file)
    if spec.endswith(".tiktoken"):
        get_tokenizer(spec)  # a malformed file fails before it is copied
        copy_file(spec, rank_file)
        return get_tokenizer(spec, out_dir)
    return get_tokenizer(spec)


def _encode_files(files, tok, field, encoder, out: IO[bytes], bar, bad_utf8) -> _Counts:
    """Encode files with the encoder's workers, in order, into out; counts of what was written."""
    counts = _Counts()
    pending = collections.deque()
    started = time.time()

    def write_until(n_pending: int) -> None:
        while len(pending) > n_pending:
            result, n_bytes = pending.popleft()
            ids = result()
            ids.tofile(out)
            counts.add(ids, tok)
            bar.update(n_bytes)
            bar.set_postfix_str(f"{counts.tokens / (time.time() - started):,.0f} tokens/s", refresh=False)

    for pieces, n_bytes, path in sources.tasks(files, field, bad_utf8):
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
    return encode_workers.Threads(tok, dtype, workers)


def _split_off_tail(src: IO[bytes], dst: IO[bytes], n_tokens: int, n_tail: int, dtype, tok: Tokenizer) -> _Counts:
    """Move the last n_tail of the n_tokens tokens written to src into dst, and count them."""
    start = (n_tokens - n_tail) * np.dtype(dtype).itemsize
    tail = _Counts()
    src.seek(start)
    while block := src.read(COPY_BYTES):
        dst.write(block)
        tail.add(np.frombuffer(block, dtype), tok)
    src.truncate(start)
    return tail
