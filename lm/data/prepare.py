"""Text to token shards for pretraining: inputs -> tokens-NNNNN.bin shards and meta.json (lm/data/meta.py).

The inputs are read in pieces (lm/data/sources.py) and encoded by several tokenizers at once, in threads
or in worker processes (lm/encode_workers.py), and written in order into shards of about data.shard_mb
each: the tokens are the same either way. Each shard is renamed into place when full and recorded in
progress.json, so a killed prepare, run again with the same arguments, continues after the last full shard.
"""

from __future__ import annotations

import collections
import glob
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from lm import encode_workers, storage
from lm.config import BUNDLED_CORPUS, DataConfig
from lm.data import meta as meta_lib
from lm.data import sources
from lm.data.meta import FORMAT_VERSION, META, shard_name
from lm.errors import UserError, plural
from lm.files import copy_file, read_json, write_json
from lm.storage import tmp_path
from lm.run_dir import holds_run
from lm.prepared_dir import PROGRESS, PreparedDir, checksums_problem, content_digest, record_written, strangers
from lm.tokenizer import RANK_FILE, Tokenizer, bpe_size, file_sha256, get_tokenizer, spelled_once, train_bpe

# Inputs of at least this many bytes are encoded in worker processes, smaller ones in threads: processes
# encode faster, but take longer to start than the encoding of a small input does (benchmarks/README.md).
PROCESS_MIN_BYTES = 32 << 20
BPE_SAMPLE_BYTES = 100 << 20  # a bpe:N tokenizer trains on this much text, an even share from each input
COUNT_TOKENS = 1 << 22  # tokens read at once when the validation tail is counted


def prepare(
    inputs: list[str],
    tokenizer: str,
    out_dir: str,
    val_inputs: list[str] = (),
    val_fraction: float = 0.1,
    field: str = "text",
    workers: int = 0,
    shard_mb: float = 256,
    progress: bool = True,
    held_out: list[str] = (),
    look: bool = False,
    field_optional: bool = False,
) -> dict | None:
    """Tokenize inputs into shards in out_dir and return its meta; do nothing if out_dir is already up to date,
    and continue where a killed prepare of the same inputs stopped (`look`: only the meta of an out_dir up to
    date, else None).

    Inputs are text files (one document each), .jsonl files (one document per line, text under `field`),
    Parquet files (a document per row of column `field`), any of the first two compressed (.gz, .zst, .xz, .bz2),
    directories (their such files, recursively) and globs; a file is read once however many inputs name it.
    The validation split is val_inputs if given (never trained on, though a directory of the inputs holds
    them), else the last val_fraction of the train inputs' token stream; `held_out` files (another mixture
    source's validation inputs) are never trained on either. A `field` for inputs that hold no records is refused
    (it does nothing), unless `field_optional` (a mixture's data.field, for those of its sources that hold them).
    Shards hold about shard_mb MB of tokens each.
    `workers` tokenizers (0 = one per CPU core) encode in parallel: worker processes when the inputs reach
    PROCESS_MIN_BYTES, threads otherwise (and for workers=1, or where processes cannot start).
    """
    for name, given in (("inputs", inputs), ("val_inputs", val_inputs), ("held_out", held_out)):
        if isinstance(given, (str, os.PathLike)):  # (its characters were read as inputs: '/' the whole filesystem)
            raise UserError(f"{name} is a list of paths, not one path; write [{str(given)!r}]")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if workers < 0:
        raise UserError(f"workers must be >= 0 (0 = one per CPU core), got {workers}")
    if not 0 < shard_mb < math.inf:
        raise UserError(f"shard_mb must be a finite number > 0 (MB of tokens per shard), got {shard_mb}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is a file, not a directory for prepared data; choose another output directory")
    if _foreign_meta(out_dir):
        raise UserError(
            f"{os.path.join(out_dir, META)} is not a manifest lm wrote, and preparing into {out_dir} would replace "
            "it; choose another output directory (a new or empty one)"
        )
    for given in [*inputs, *val_inputs]:  # (made a prepared directory: data.path on it read old tokens, not the text)
        local = not storage.is_url(given) and os.path.isdir(given) and os.path.isdir(out_dir)
        if local and os.path.samefile(given, out_dir):
            raise UserError(f"--out {out_dir} is the input directory {given}; prepare into a directory of its own")
    tokenizer = spelled_once(tokenizer)  # (bpe:0600 is bpe:600, as the config spells it: meta.json records that)
    val_files = sources.distinct(sources.expand(val_inputs)) if val_inputs else []
    files = sources.distinct(sources.expand(inputs), held_out=val_files)
    if field != "text" and not field_optional and not any(map(sources.holds_records, [*files, *val_files])):
        raise UserError(
            f"field '{field}' names the text of .jsonl and .parquet inputs, and {', '.join(inputs)} holds only text "
            f"files (each read whole): leave out {sources.FIELD}, or give the records' files"
        )
    if not storage.is_url(out_dir) and os.path.isdir(out_dir):
        # (inputs named as files or a glob: corpus/*.txt --out corpus made corpus a prepared directory)
        parents: dict[str, str] = {}  # each input directory, once (not a stat per file), with its first file
        for f in [*files, *val_files]:
            if not storage.is_url(f):
                parents.setdefault(os.path.dirname(f) or ".", f)
        inside = next((f for parent, f in parents.items() if os.path.samefile(parent, out_dir)), None)
        if inside is not None:
            raise UserError(f"--out {out_dir} is the directory of the input {inside}; prepare into a directory of "
                            "its own")  # fmt: skip
    others = strangers(out_dir)  # (a run's directory, a corpus's, data.cache_dir: deleted train.bin, tokens-*.bin)
    if others:
        what = (f"is a run's directory ({_first_few(others)})" if holds_run(out_dir) else  # (lm wrote those, as a run)
                f"holds files lm did not write ({_first_few(others)})")  # fmt: skip
        raise UserError(f"--out {out_dir} {what}, which preparing there could replace or delete; give --out a new or "
                        "empty directory")  # fmt: skip
    if held_out:
        others = sources.distinct(sources.expand(held_out))
        said = (f"every training input of {', '.join(inputs)} is another data source's validation input (its "
                "val_path); give it training text of its own")
        files = sources.distinct(files, others, said)
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
        "shard_mb": float(shard_mb),  # (the CLI's 256 and the config's 256.0 are one setting: one fingerprint)
        "inputs": [storage.version(f) for f in files],
        "val_inputs": [storage.version(f) for f in val_files],
    }
    fingerprint = meta_lib.digest(settings)
    if look:
        return meta_lib.up_to_date(out_dir, fingerprint, progress)
    build = lambda: PreparedDir(out_dir).build(
        lambda directory: _tokenize(directory, settings, fingerprint, files, val_files, workers, progress),
        lambda directory, meta=None: meta_lib.up_to_date(directory, fingerprint, False, meta),
        fingerprint,
        progress,
    )
    return meta_lib.prepared(out_dir, fingerprint, progress, build)[0]


def _tokenize(
    out_dir: str, settings: dict, fingerprint: str, files: list[str], val_files: list[str], workers: int, progress: bool
) -> dict:
    """Tokenize the inputs as `settings` say into out_dir, continuing a killed prepare of the same fingerprint
    there; the meta written."""
    tokenizer, field = settings["tokenizer"], settings["field"]
    state = _resume_point(out_dir, fingerprint)
    if state and progress:
        done = sum(s["tokens"] for s in state["shards"])
        print(f"{out_dir}: continuing a prepare that stopped after {len(state['shards'])} shards ({done:,} tokens)",
              file=sys.stderr)
    if state is None:
        meta_lib.start_writing(out_dir)
        tok = _tokenizer_for_prepare(tokenizer, files, field, out_dir, progress)
        state = {"fingerprint": fingerprint, "shards": [], "checksums": {}, "positions": {}, "bad_utf8": {},
                 "skipped": {}, "input_bytes": 0,
                 "rank_file_sha256": file_sha256(tok.rank_file) if tok.rank_file else None}
    else:
        tok = get_tokenizer(tokenizer, out_dir)
    dtype = np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32
    shard_tokens = max(1, int(settings["shard_mb"] * (1 << 20)) // np.dtype(dtype).itemsize)
    shards = _Shards(out_dir, state, shard_tokens, tok, dtype)
    bad_utf8 = collections.Counter(state["bad_utf8"])
    skipped = collections.Counter(state.get("skipped", {}))  # records of no text, per file (an older state lacks it)
    total_bytes = sum(info["size"] for info in settings["inputs"] + settings["val_inputs"])
    with (
        _encoder(tok, dtype, workers, total_bytes) as encoder,
        tqdm(total=total_bytes, initial=state["input_bytes"], unit="B", unit_scale=True, desc="tokenizing",
             disable=not progress) as bar,
    ):
        try:
            for split, split_files in (("train", files), ("val", val_files)):
                _encode_files(split, split_files, field, encoder, shards, bar, bad_utf8, skipped)
        except BaseException:
            shards.discard_open()  # the recorded shards stay, for a rerun to continue after them
            raise
    _refuse_inputs_changed_since(settings["inputs"] + settings["val_inputs"])
    for split, split_files in (("train", files), ("val", val_files)):  # records whose text is all empty
        if split_files and not any(s["tokens"] for s in state["shards"] if s["split"] == split):
            named = _first_few(split_files)
            if not any(sources.holds_records(f) for f in split_files):  # text files, compressed and empty inside
                raise UserError(f"{named}: no text to tokenize (empty once decompressed, or a byte order mark alone); "
                                "give inputs that hold text")
            raise UserError(
                f"{named}: no text to tokenize, every record's '{field}' is empty or null; choose the field that holds "
                f"the text with {sources.FIELD}"
            )
    splits = shards.splits(settings["val_fraction"])  # None with val inputs
    sources.warn_bad_utf8(bad_utf8)
    if skipped:  # (empty or null text, JSONL and Parquet alike: no document, but said, not silent)
        print(
            f"warning: skipped {plural(sum(skipped.values()), 'record')} whose '{field}' is empty or null in "
            f"{plural(len(skipped), 'file')}, first in {next(iter(skipped))}",
            file=sys.stderr,
        )
    meta = {
        **settings,
        "fingerprint": fingerprint,
        "rank_file_sha256": state["rank_file_sha256"],
        "n_vocab": tok.n_vocab,
        "eot": tok.eot,
        "dtype": np.dtype(dtype).name,
        "shards": [{"name": s["name"], "tokens": s["tokens"]} for s in state["shards"]],
        "splits": splits,
        "checksums": state["checksums"],
        "documents": splits["train"]["documents"] + splits["val"]["documents"],
        "invalid_utf8": sum(bad_utf8.values()),
        "skipped_records": sum(skipped.values()),
    }
    write_json(os.path.join(out_dir, META), meta)
    os.remove(os.path.join(out_dir, PROGRESS))
    return meta


def held_out_by(meta: dict) -> str:
    """What a prepared directory holds out for validation, as its meta.json's val_fraction says."""
    own = meta.get("val_fraction")
    return f"the last {own} of its tokens" if own else ("its --val inputs" if own is None else "none")


def prepare_source(
    data_cfg: DataConfig,
    path: str,
    val_path: str = "",
    progress: bool = True,
    publisher: bool = True,
    held_out: list[str] = (),
    look: bool = False,
    field_optional: bool = False,
) -> tuple[str, dict | None]:
    """(prepared directory, meta) for one source of token stream: a prepared directory (local or a URL) as it
    is, anything else prepared into data.cache_dir on first use (and again when the inputs change). path "" is
    the bundled corpus. `held_out`: the other sources' validation inputs, left out of this one's training text.
    With a data.cache_dir in object storage, only the `publisher` process prepares; the others read what it
    published. `look`: the meta only if the directory is prepared and up to date, else None; nothing is written.
    `field_optional`: as for prepare."""
    path = path or BUNDLED_CORPUS
    if storage.isfile(os.path.join(path, META)):
        if val_path:
            key = _key(data_cfg, path)  # (data.path, or a mixture's data.sources[i].path)
            raise UserError(
                f"{key.removesuffix('path')}val_path={val_path} is given, but {key}={path} is already prepared, with "
                f"its own validation split; drop {key.removesuffix('path')}val_path, or prepare both together "
                "(python -m lm.data prepare TEXT --val VAL_TEXT --out DIR)"
            )
        meta = meta_lib.load_meta(path)
        key = _key(data_cfg, path)
        share, own = data_cfg.val_fraction, meta.get("val_fraction")
        if not data_cfg.sources and share not in (DataConfig().val_fraction, own):  # (ignored, without a word)
            raise UserError(
                f"data.val_fraction={share:g} is given, but data.path={path} is already prepared, with its own "
                f"validation split ({held_out_by(meta)}); drop data.val_fraction"
                # (prepared again with --val-fraction 0, it would hold no validation data to evaluate on)
                + f", or prepare it again (python -m lm.data prepare TEXT --val-fraction {share:g} --out DIR)"
                * bool(share)
            )
        if meta.get("kind") in ("examples", "preference"):
            raise UserError(f"{path} holds fine-tune examples, not a token stream to pretrain on; point {key} at text")
        same_ranks = (  # data.tokenizer the rank file that directory was prepared with (its tokenizer.tiktoken)
            data_cfg.tokenizer.endswith(".tiktoken") and os.path.isfile(data_cfg.tokenizer)
            and meta.get("rank_file_sha256") == file_sha256(data_cfg.tokenizer)
        )  # fmt: skip
        if spelled_once(meta["tokenizer"]) != spelled_once(data_cfg.tokenizer) and not same_ranks:
            # (a mixture's bpe:N would train one for each unprepared source: its rank file names this one's)
            mixed_bpe = len(data_cfg.sources) > 1 and meta["tokenizer"].startswith("bpe:")
            spec = os.path.join(path, RANK_FILE) if mixed_bpe else meta["tokenizer"]
            raise UserError(
                f"{path} was prepared with tokenizer {meta['tokenizer']}, not data.tokenizer={data_cfg.tokenizer}; "
                f"set data.tokenizer={spec} or point {key} at the text to prepare it again"
            )
        return path, meta
    val_inputs = [val_path] if val_path else []
    # (only those the source holds: the other sources' val_paths change nothing else, nor where it is prepared)
    held_out = sources.among(sources.distinct(sources.expand(held_out)), [path]) if held_out else []
    request = {
        "inputs": [storage.absolute(p) for p in [path, *val_inputs]],
        "tokenizer": data_cfg.tokenizer,
        "field": data_cfg.field,
        "val_fraction": None if val_inputs else data_cfg.val_fraction,
        **({"held_out": [storage.absolute(p) for p in held_out]} if held_out else {}),
    }
    tokenizer_name = os.path.basename(data_cfg.tokenizer).removesuffix(".tiktoken")
    out_dir = meta_lib.cache_dir(data_cfg.cache_dir, path, tokenizer_name, "data", request)
    if PreparedDir(out_dir).shared and not publisher:  # published by another process
        return out_dir, meta_lib.read_meta(out_dir) if look else meta_lib.load_meta(out_dir)
    try:
        meta = prepare(
            [path],
            data_cfg.tokenizer,
            out_dir,
            val_inputs=val_inputs,
            val_fraction=data_cfg.val_fraction,
            field=data_cfg.field,
            workers=data_cfg.workers,
            shard_mb=data_cfg.shard_mb,
            progress=progress,
            held_out=list(held_out),
            look=look,
            field_optional=field_optional,
        )
    except sources.MissingInput as e:  # (deleted once prepared: a resume can go on from the tokens)
        if not storage.isfile(os.path.join(out_dir, META)):
            raise
        also = " (without a val_path)" if val_path else ""
        raise UserError(
            f"input '{e.given}' {e.what}; the tokens prepared from it before are in {out_dir}: put the input back, "
            f"or set {_key(data_cfg, path)}={out_dir}{also} to train on them"
        ) from None
    return out_dir, meta


def _foreign_meta(out_dir: str) -> bool:
    """Whether a local out_dir holds a meta.json that lm did not write (preparing there would replace it): JSON that
    is not a manifest of any format or kind, or a file that is not JSON where no token files lie beside it (one lm
    wrote and something damaged is prepared again)."""
    path = os.path.join(out_dir, META)
    if storage.is_url(out_dir) or not os.path.isfile(path):
        return False
    meta = read_json(path)
    if meta is None:
        return not glob.glob(os.path.join(out_dir, "*.bin"))
    return not (isinstance(meta, dict) and any(k in meta for k in ("format_version", "fingerprint", "splits", "kind")))


def _key(data_cfg: DataConfig, path: str) -> str:
    """The config key that names the source at `path`: data.path, or data.sources[i].path."""
    return next((f"data.sources[{i}].path" for i, s in enumerate(data_cfg.sources) if s.path == path), "data.path")


@dataclass
class _Counts:
    tokens: int = 0
    bytes: int = 0  # UTF-8 bytes of text behind the tokens, for bits per byte
    documents: int = 0  # end-of-text tokens

    def add(self, ids: np.ndarray, tok: Tokenizer) -> None:
        self.tokens += len(ids)
        self.bytes += int(tok.byte_lengths[ids].sum())
        self.documents += int(np.count_nonzero(ids == tok.eot))

    def __add__(self, other: _Counts) -> _Counts:
        return _Counts(self.tokens + other.tokens, self.bytes + other.bytes, self.documents + other.documents)

    def __sub__(self, other: _Counts) -> _Counts:
        return _Counts(self.tokens - other.tokens, self.bytes - other.bytes, self.documents - other.documents)


def _first_few(names: list[str]) -> str:
    """The first three of `names`, and how many more: for a line that names what it is about."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _refuse_inputs_changed_since(recorded: list[dict]) -> None:
    """One line for a local input whose size or modification time is no longer the one recorded before it was read
    (a file still being written): its tokens would match neither the recorded file nor the file now."""
    for info in recorded:
        if storage.is_url(info["path"]):  # (an object is read at its recorded version)
            continue
        try:
            now = storage.version(info["path"])
        except OSError:
            now = None
        if now != info:
            state = "it is gone" if now is None else f"written to: {info['size']:,} bytes then, {now['size']:,} now"
            raise UserError(
                f"{info['path']} changed after prepare began ({state}); prepare again once nothing writes to it, "
                "or prepare a copy of it"
            )


def _resume_point(out_dir: str, fingerprint: str) -> dict | None:
    """What a killed prepare of the same inputs left in out_dir (progress.json), if its shards are intact."""
    state = read_json(os.path.join(out_dir, PROGRESS))
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        return None
    if not meta_lib.rank_file_intact(out_dir, state["rank_file_sha256"]):
        return None
    # (a shard's stat unchanged since this prepare recorded it is not read again: record_written)
    names = [s["name"] for s in state["shards"]]
    if not all(os.path.isfile(os.path.join(out_dir, n)) for n in names):
        return None
    if checksums_problem(out_dir, {n: state["checksums"][n] for n in names}):
        return None
    return state


class _Shards:
    """The token shards of a prepare: written in order, each renamed into place when it holds shard_tokens
    tokens (at the end of an encoding task) and recorded, with the input position after it, in progress.json."""

    def __init__(self, out_dir: str, state: dict, shard_tokens: int, tok: Tokenizer, dtype):
        self.out_dir, self.state, self.shard_tokens, self.tok, self.dtype = out_dir, state, shard_tokens, tok, dtype
        self.file, self.counts = None, _Counts()
        names = {s["name"] for s in state["shards"]}
        for stale in glob.glob(os.path.join(out_dir, "tokens-*.bin")) + glob.glob(os.path.join(out_dir, ".tokens-*")):
            if os.path.basename(stale) not in names:
                os.remove(stale)  # written by the killed prepare after its last recorded shard

    def write(self, ids: np.ndarray, split: str, position: tuple[int, int], n_bytes: int) -> None:
        """Append ids (an encoding task's tokens); close the shard if it is full, recording `position`."""
        if self.file is None:
            self.file = open(tmp_path(self._path(len(self.state["shards"]))), "wb")
        self.file.write(np.ascontiguousarray(ids).data)  # (tofile's error on a full disk names no cause)
        self.counts.add(ids, self.tok)
        self.state["input_bytes"] += n_bytes
        if self.counts.tokens >= self.shard_tokens:
            self.close(split, position)

    def close(self, split: str, position: tuple[int, int]) -> None:
        """Rename the open shard into place (one that holds no tokens is dropped) and record it."""
        if self.file is not None:
            # (no longer open once closed: a Ctrl-C from here on left discard_open removing a file renamed away, and
            # its FileNotFoundError was "cannot write prepared data ...: free space"; a rerun removes what is left)
            file, counts, self.file, self.counts = self.file, self.counts, None, _Counts()
            file.close()
            path = self._path(len(self.state["shards"]))
            if counts.tokens:
                os.replace(file.name, path)
                name = os.path.basename(path)
                self.state["shards"].append({"name": name, "split": split, **asdict(counts)})
                self.state["checksums"][name] = content_digest(path)
                record_written(path, self.state["checksums"][name])
            else:
                os.remove(file.name)
        self.state["positions"][split] = list(position)
        write_json(os.path.join(self.out_dir, PROGRESS), self.state)

    def discard_open(self) -> None:
        """Delete the shard being written (not yet recorded): a prepare that fails leaves no temporary file."""
        if self.file is not None:
            self.file.close()
            os.remove(self.file.name)
            self.file, self.counts = None, _Counts()

    def splits(self, val_fraction: float | None) -> dict:
        """Train and val as ranges [shard, start, stop] of the shards: the val shards, or else the last
        val_fraction of the train shards' tokens (nothing moves: the ranges say where the split falls)."""
        shards = self.state["shards"]
        ranges = {"train": [], "val": []}
        counts = {"train": _Counts(), "val": _Counts()}
        for i, shard in enumerate(shards):
            ranges[shard["split"]].append([i, 0, shard["tokens"]])
            counts[shard["split"]] += _Counts(shard["tokens"], shard["bytes"], shard["documents"])
        if val_fraction is not None:
            n_val = int(counts["train"].tokens * val_fraction)
            tail, left = [], n_val
            while left:
                i, start, stop = ranges["train"][-1]
                take = min(left, stop - start)
                tail.insert(0, [i, stop - take, stop])
                ranges["train"][-1][2] -= take
                if ranges["train"][-1][2] == start:
                    ranges["train"].pop()
                left -= take
            ranges["val"] = tail
            counts["val"] = self._count(tail)
            counts["train"] = counts["train"] - counts["val"]
        return {split: {**asdict(counts[split]), "ranges": ranges[split]} for split in ranges}

    def _count(self, ranges: list) -> _Counts:
        counts = _Counts()
        for i, start, stop in ranges:
            tokens = np.memmap(os.path.join(self.out_dir, self.state["shards"][i]["name"]), self.dtype, mode="r")
            for at in range(start, stop, COUNT_TOKENS):
                counts.add(np.asarray(tokens[at : min(stop, at + COUNT_TOKENS)]), self.tok)
        return counts

    def _path(self, index: int) -> str:
        return os.path.join(self.out_dir, shard_name(index))


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


def _encode_files(
    split: str, files: list[str], field, encoder, shards: _Shards, bar, bad_utf8, skipped
) -> None:
    """Encode a split's files with the encoder's workers, in order, into shards, from where a killed prepare
    stopped; the split's last shard is closed at its end, so no shard holds two splits."""
    done = shards.state["positions"].get(split, [0, 0])
    if done[0] >= len(files):
        return
    for path in files[done[0] :]:
        bad_utf8.pop(path, None)  # read again (that file from its start) and counted again
        skipped.pop(path, None)
    pending = collections.deque()
    started, written = time.time(), 0

    def write_until(n_pending: int) -> None:
        nonlocal written
        while len(pending) > n_pending:
            result, n_bytes, position = pending.popleft()
            ids = result()
            shards.state["bad_utf8"], shards.state["skipped"] = dict(bad_utf8), dict(skipped)
            shards.write(ids, split, position, n_bytes)
            written += len(ids)
            bar.update(n_bytes)
            bar.set_postfix_str(f"{written / (time.time() - started):,.0f} tokens/s", refresh=False)

    # A shard ends at the end of a task: tasks of at most a quarter of a shard keep small shards near their size.
    chunk_bytes = min(sources.CHUNK_BYTES, max(1 << 12, shards.shard_tokens * np.dtype(shards.dtype).itemsize // 4))
    for pieces, n_bytes, path, position in sources.tasks(files, field, bad_utf8, tuple(done), chunk_bytes, skipped):
        pending.append((encoder.submit(pieces, path), n_bytes, position))
        write_until(2 * encoder.workers)  # bounded read-ahead keeps memory flat on any corpus
    write_until(0)
    shards.close(split, (len(files), 0))


def _encoder(tok: Tokenizer, dtype, workers: int, total_bytes: int):
    """Worker processes for large inputs, where they are possible; threads otherwise, and for one worker."""
    workers = workers or os.cpu_count() or 1
    if workers > 1 and total_bytes >= PROCESS_MIN_BYTES:
        try:
            return encode_workers.Processes(tok, dtype, workers)
        except OSError as e:
            print(f"warning: tokenizer worker processes cannot start ({e}); tokenizing in threads", file=sys.stderr)
    return encode_workers.Threads(tok, dtype, workers)

