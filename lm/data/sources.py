"""Reading prepare's inputs: files, directories and globs expanded, text refused when binary, streamed in pieces.

A text file is one document, read in chunks cut where cutting cannot change its tokens (SAFE_CUT, UNICODE_CUT);
a .jsonl file holds one document per line, its text under a field; a .parquet file one per row of that column.
Text and JSONL may be compressed (.gz, .zst, .xz, .bz2: decompressed as they are read). Invalid UTF-8 becomes U+FFFD,
counted per file.
"""

from __future__ import annotations

import bz2
import collections
import contextlib
import errno
import gzip
import io
import json
import lzma
import math
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterator
from typing import IO

import regex

from lm import storage
from lm.data.meta import META, read_meta
from lm.errors import UserError, plural
from lm.files import compression
from lm.prepared_dir import NEXT, PROGRESS
from lm.run_dir import holds_run
from lm.tokenizer import without_surrogates

# A JSON escape of a UTF-16 surrogate (a pair's, or one alone: a text cut inside an emoji), and what one alone
# decodes to (json.loads joins a pair into one character)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
CHUNK_BYTES = 1 << 20  # text per encoding task: large enough to amortise overheads, small enough to stream
# Cutting text at these places never changes its tokens, for GPT-2's, cl100k's, o200k's and our split
# patterns: no pre-tokenizer piece crosses "x\nY" (x a printable ASCII character, Y an ASCII letter or digit)
# or "a b" (ASCII letters), and the piece before the cut ends the same way at the end of a string.
SAFE_CUT = re.compile(rb"(?<=[!-~]\n)(?=[A-Za-z0-9])|(?<=[A-Za-z])(?= [A-Za-z])")
# The same places in any script, for text with none of the ASCII ones (Japanese, Russian, ...): "x\nY" (x a
# letter, number, punctuation or symbol; Y a letter or number), "a b" (letters), and "a|Pb" (letters, P one
# punctuation or symbol but the apostrophe: a CJK sentence's end, "。", or quote, "「", then its next word).
# Combining marks are none of these: o200k joins them to the letters around them.
# Each match is the character after which ("\n") or before which (" ", P) the cut is: led by a literal or a class,
# not by a lookbehind, the search runs at ~180 MB/s, not ~10, through text with few places (unicode_cuts).
UNICODE_CUT = regex.compile(
    r"\n(?<=[\p{L}\p{N}\p{P}\p{S}]\n)(?=[\p{L}\p{N}])| (?<=\p{L} )(?=\p{L})|(?<=\p{L})(?!')[\p{P}\p{S}](?=\p{L})"
)
DECOMPRESSORS = {".gz": "gzip", ".zst": "zstd", ".xz": "xz", ".bz2": "bzip2"}  # suffix -> what the first bytes must say
FIELD = "--field / data.field / a data.sources entry's field"  # where a user names the field of the text
SLICE = 1 << 10  # compressed bytes decompressed at a time: at most ~32 MB out (zstd's largest ratio)
OUT_CAP = 1 << 20  # decompressed bytes at most from one call of a decompressor that can be bounded (xz, bzip2)
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which some editors write at a file's start: no text
INPUT_SUFFIXES = tuple(f"{kind}{z}" for kind in (".txt", ".jsonl") for z in ("", *DECOMPRESSORS)) + (".parquet",)


class MissingInput(UserError):
    """An input that is not there: no file, directory or glob's match of that name."""

    def __init__(self, given: str, what: str = "not found"):
        super().__init__(f"input '{given}' {what}; give an existing file, directory or glob")
        self.given, self.what = given, what


def expand(inputs: list[str]) -> list[str]:
    """Every input file, absolute (or a URL), in a stable order; empty files inside directories are skipped."""
    if not inputs:
        raise UserError("no inputs given")
    files = []
    for given in inputs:
        if storage.isdir(given) or storage.isfile(given):
            found = _files_under(given)
        elif any(c in given for c in "*?["):
            matches = storage.glob(given)
            if not matches:  # (was "has no non-empty .txt, ... files", as if it had matched files of no text)
                several = given.startswith("[") and "," in given  # (a YAML list, kept as the text of one path)
                raise MissingInput(given, "matches no file" + " (one setting names one input: a directory or glob "
                                   "holding them all, or one data.sources entry each)" * several)  # fmt: skip
            found = [f for match in matches for f in _files_under(match)]
        elif not storage.is_url(given) and os.path.islink(given):  # (a link to nothing, or in a loop: _size says)
            found = [given]
        else:
            raise MissingInput(given)
        found = [storage.absolute(f) for f in found if _size(f) > 0]
        for f in found:  # (read as one text document: its braces and keys were trained on, without a word)
            if (kind := os.path.splitext(_inner_name(f))[1]).lower() in (".json", ".ndjson"):
                raise UserError(
                    f"input {f} is named {kind}, and only .jsonl files are read as records (a {kind} was read as "
                    "plain text, its braces and keys too); rename it .jsonl if it holds a JSON object a line (its "
                    "text under data.field), .txt to train on it as it is, or leave it out of the inputs"
                )
        # (said it had no .txt, ... files: a killed prepare's directory, given as data.path; or one killed as it
        # moved a prepare again's files into place from .next, its meta.json deleted)
        stopped = not found and storage.isdir(given) and (
            PROGRESS if storage.isfile(os.path.join(given, PROGRESS))
            else NEXT if storage.isdir(os.path.join(given, NEXT)) and not storage.isfile(os.path.join(given, META))
            else None
        )  # fmt: skip
        if stopped:
            raise UserError(
                f"input '{given}' is a prepare that did not finish ({stopped}, no {META}); run python -m lm.data "
                "prepare again with the arguments it was started with to finish it, or give the text instead"
            )
        if not found and storage.isdir(given) and read_meta(given):
            raise UserError(f"input '{given}' is a prepared directory (tokens, not text); give the text it was "
                            f"prepared from, or train on it as it is (data.path={given})")  # fmt: skip
        if not found:
            what = "is empty" if storage.isfile(given) else f"has no non-empty {', '.join(INPUT_SUFFIXES)} files"
            raise UserError(f"input '{given}' {what}; give inputs that hold text")
        files += found
    return files


def same_file(f: str):
    """What a file is, whatever it is named by: a file and every link to it, symbolic or hard, are one."""
    if storage.is_url(f):
        return f
    st = os.stat(f)
    return st.st_dev, st.st_ino


def distinct(files: list[str], held_out: list[str] = (), all_held_out: str = "") -> list[str]:
    """files in their order without repeats (a file named twice, or found by two inputs, is read once) and
    without those of held_out: the validation inputs, which a directory of the training inputs may hold.
    `all_held_out`: what to say where that leaves none."""
    seen, kept = {same_file(f) for f in held_out}, []
    for f in files:
        if (key := same_file(f)) not in seen:
            seen.add(key)
            kept.append(f)
    if not kept:
        raise UserError(
            all_held_out
            or "every training input is also a validation input; give training text apart from the validation files"
        )
    return kept


def among(files: list[str], inputs: list[str]) -> list[str]:
    """Those of `files` that `inputs` (files, directories, globs) hold, by any name."""
    held = {same_file(f) for f in expand(inputs)}
    return [f for f in files if same_file(f) in held]


def _size(path: str) -> int:
    try:
        return storage.size(path)
    except OSError as e:  # a local file (a bucket's errors are storage.call's line)
        if e.errno == errno.ELOOP:
            raise UserError(f"input {path} is a link in a loop of links (to {os.readlink(path)}, which leads back); "
                            "remove one of them")  # fmt: skip
        if os.path.islink(path) and not os.path.exists(path):
            raise UserError(
                f"input {path} is a link to {os.readlink(path)}, which does not exist; remove the link or restore "
                "what it points to"
            ) from None
        raise UserError(f"cannot read input {path}: {e.strerror or e}") from None


def _files_under(path: str) -> list[str]:
    if not storage.isdir(path):
        return [path]
    files = storage.walk_files(path, INPUT_SUFFIXES)
    if storage.is_url(path):
        return files
    # A run directory under it (runs/ in data.path=., a run.dir kept beside its corpus) holds no text: its
    # metrics.jsonl stopped the run's own resume ("no text field 'text'"), and its checkpoints' commit_success.txt
    # files were text to train on.
    runs = {}

    def in_run(directory: str) -> bool:
        if directory not in runs:
            parent = os.path.dirname(directory)
            runs[directory] = holds_run(directory) or (
                directory != os.path.normpath(path) and parent != directory and in_run(parent)
            )
        return runs[directory]
    return [f for f in files if not in_run(os.path.dirname(os.path.normpath(f)))]


def tasks(
    files: list[str],
    field: str,
    bad_utf8: collections.Counter,
    start: tuple[int, int] = (0, 0),
    chunk_bytes: int | None = None,
    skipped: collections.Counter | None = None,
) -> Iterator[tuple[list, int, str, tuple[int, int]]]:
    """Pieces of text grouped into tasks of at most chunk_bytes (CHUNK_BYTES by default; or one larger piece),
    with the input bytes
    each covers, the file its first piece comes from, and the position after it: (file index, piece index)
    of the next piece, from which `start` resumes (the files before it are not read; the pieces before it in
    its file are read again, not returned). Even tasks keep the workers equally busy to the end. `skipped` counts,
per file, the records that hold no text (pieces)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    group, n_bytes, first = [], 0, None
    for index in range(start[0], len(files)):
        path = files[index]
        for piece, (text, ends_document, n) in enumerate(pieces(path, field, bad_utf8, chunk_bytes, skipped)):
            if index == start[0] and piece < start[1]:
                continue
            if group and n_bytes + n > chunk_bytes:
                yield group, n_bytes, first, (index, piece)
                group, n_bytes, first = [], 0, None
            group.append((text, ends_document))
            first = first or path
            n_bytes += n
    if group:
        yield group, n_bytes, first, (len(files), 0)


def pieces(
    path: str,
    field: str,
    bad_utf8: collections.Counter,
    chunk_bytes: int | None = None,
    skipped: collections.Counter | None = None,
) -> Iterator[tuple[str, bool, int]]:
    """(text, ends a document, input bytes) from one file, streamed: a text file is one document read in
    chunks of about chunk_bytes (CHUNK_BYTES by default) cut at SAFE_CUT (or UNICODE_CUT) places; a .jsonl file
    holds one document per line, a .parquet file one per row of its `field` column. .gz, .zst, .xz and .bz2 files are
    read decompressed (text or JSONL inside, by the name). A record whose text is empty or null (JSONL's null, Parquet's
    missing value) is no document: it is counted under path in `skipped`, alike in both."""
    skipped = collections.Counter() if skipped is None else skipped
    if path.lower().endswith(".parquet"):
        yield from _parquet_pieces(path, field, skipped)
        return
    with open_input(path) as f:
        if _inner_name(path).lower().endswith(".jsonl"):
            shape = f"JSON object a line, its text under '{field}'"
            for lineno, record, n_bytes in json_lines(f, path, bad_utf8, shape, (field,)):
                if not isinstance(record.get(field), str) and (field not in record or record[field] is not None):
                    found = f"'{field}' is {json.dumps(record[field])[:40]}, not a string" if field in record else (
                        f"no text field '{field}'")  # fmt: skip
                    if field not in record and "chosen" in record and "rejected" in record:  # (advice: data.field)
                        raise UserError(f"{path}:{lineno}: a preference pair (chosen, rejected), not text: train "
                                        "on pairs with data.format=preference train.objective=dpo init_from=RUN")
                    head = record.get(field.split(".")[0]) if field not in record else record[field]
                    if isinstance(head, (dict, list)):  # (a nested record: no field names its text)
                        strings = [k for k, v in record.items() if isinstance(v, str)]
                        raise UserError(
                            f"{path}:{lineno}: {found}, and {FIELD} names a top-level field only, never one inside "
                            f"an object: " + (f"choose one of {', '.join(strings)}, or " if strings else "")
                            + "write each record's text as a top-level string field"
                        )
                    raise UserError(f"{path}:{lineno}: {found} (choose another with {FIELD})")
                if record[field]:
                    yield record[field], True, n_bytes
                else:  # "" or null (a missing value, as Hugging Face's to_json writes one), as Parquet's
                    skipped[path] += 1
            return
        _refuse_binary(path, f.peek(1 << 16)[: 1 << 16])
        carry = f.read(3)  # (peek may see fewer bytes than a byte order mark's three)
        carry = b"" if carry == BOM else carry  # (which some editors write: it was trained on as the first character)
        read = len(carry)
        while block := f.read(chunk_bytes or CHUNK_BYTES):
            searched = max(0, len(carry) - 2)  # SAFE_CUT looks two bytes ahead
            carry, read = carry + block, read + len(block)
            cut = _last_safe_cut(carry, searched)
            if cut:
                yield decode(carry[:cut], path, bad_utf8), False, cut
                carry = carry[cut:]
        if read:  # (a compressed file of no text is no document, as an empty file is none)
            yield decode(carry, path, bad_utf8), True, len(carry)


def holds_records(path: str) -> bool:
    """Whether a file holds records (JSONL lines, Parquet rows) whose field is the text, not text itself."""
    return path.lower().endswith(".parquet") or _inner_name(path).lower().endswith(".jsonl")


def _inner_name(path: str) -> str:
    """The name of what a file holds: without a compression suffix. Suffixes are read in any case (.JSONL, .GZ)."""
    for suffix in DECOMPRESSORS:
        if path.lower().endswith(suffix):
            return path[: -len(suffix)]
    return path


def open_input(path: str) -> io.BufferedReader:
    """path opened for reading bytes, decompressed as its suffix says; refused where the suffix and the first
    bytes disagree (a .gz that is not gzip), so a wrong name never feeds compressed bytes to the tokenizer."""
    suffix = next((s for s in DECOMPRESSORS if path.lower().endswith(s)), None)
    with storage.open_bytes(path) as f:
        head = f.read(16)
    kind = compression(head)
    if suffix is None:
        if kind:
            raise UserError(
                f"{path} is {kind}-compressed, not text; name it with its suffix ({', '.join(DECOMPRESSORS)}) "
                "or decompress it"
            )
        return io.BufferedReader(storage.open_bytes(path), CHUNK_BYTES)
    if kind != DECOMPRESSORS[suffix]:
        raise UserError(f"{path} is not {DECOMPRESSORS[suffix]} data, though its name says so; rename or recompress it")
    source = storage.open_bytes(path)
    return io.BufferedReader(_decompressing(source, suffix, path), CHUNK_BYTES)


def _decompressing(source, suffix: str, path: str) -> _Decompressing:
    """The file object `source` (of `path`) read decompressed by its suffix's decompressor."""
    errors = ()
    if suffix == ".gz":
        stream = gzip.open(source, "rb")
    elif suffix == ".xz":  # (xz pads between streams with NUL bytes)
        stream = _Frames(source, lzma.LZMADecompressor, padding=4, bounded=True)
    elif suffix == ".bz2":  # (streams one after another, as pbzip2 writes them)
        stream = _Frames(source, bz2.BZ2Decompressor, bounded=True)
    else:
        import zstandard  # a dependency of lm, imported when a .zst input is read

        stream, errors = _Frames(source, zstandard.ZstdDecompressor().decompressobj), (zstandard.ZstdError,)
    return _Decompressing(stream, source, path, DECOMPRESSORS[suffix], errors)


class _Frames(io.RawIOBase):
    """The frames (zstd) or streams (xz, bzip2) of a file, one after another, decompressed by a `new_frame()` each; data
    that ends inside one is an EOFError, and data after one that does not start another is the decompressor's
    error. (zstandard's stream_reader ended quietly inside a frame, and lzma.open at data after a stream that is
    not one: a cut-short .zst or a damaged .xz was half a corpus, and no error.) What one call holds stays small,
    whatever the ratio (a 64 KiB read of a repetitive file was gigabytes at once): a decompressor that takes a
    `max_length` (`bounded`: xz's, bzip2's, which expands data up to ~1,000,000 times) gives at most OUT_CAP bytes a
    call; zstd's, which cannot be bounded, is given SLICE compressed bytes a call (~32 MB out at most)."""

    def __init__(self, source, new_frame: Callable, padding: int = 0, bounded: bool = False):
        self._source, self._new_frame, self._bounded = source, new_frame, bounded
        self._padding, self._padded = padding, 0  # NUL bytes between frames: their unit (0: none), and how many now
        self._frame, self._inside = new_frame(), False
        self._compressed, self._fed = b"", 0  # read from the file, and how much of it was decompressed
        self._out, self._at = b"", 0  # decompressed bytes, and how much of them was read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view, filled = memoryview(buffer).cast("B"), 0
        while filled < len(view) and (self._at < len(self._out) or self._refill()):
            n = min(len(view) - filled, len(self._out) - self._at)
            view[filled : filled + n] = self._out[self._at : self._at + n]
            self._at += n
            filled += n
        return filled

    def _refill(self) -> bool:
        """The next decompressed bytes into _out; False at the end of the file."""
        while True:
            if self._bounded and self._inside and not self._frame.needs_input:  # output it holds back: no input
                piece = b""
            else:
                if self._fed == len(self._compressed):
                    self._compressed, self._fed = self._source.read(1 << 16), 0
                    if not self._compressed:
                        if self._inside:
                            raise EOFError("the data ends inside a frame")
                        self._check_padding()
                        return False
                piece = self._compressed[self._fed : self._fed + SLICE]
                self._fed += len(piece)
            self._out, self._at = self._decompressed(piece), 0
            if self._out:
                return True

    def _decompressed(self, compressed: bytes) -> bytes:
        """One decompressor call on `compressed`; where its frame ends there, what follows it goes back in front of
        the compressed bytes still to feed, for the next frame."""
        if not self._inside and self._padding:
            stripped = compressed.lstrip(b"\0")
            self._padded += len(compressed) - len(stripped)
            compressed = stripped
            if not compressed:
                return b""
            self._check_padding()
        out = self._frame.decompress(compressed, OUT_CAP) if self._bounded else self._frame.decompress(compressed)
        self._inside = not self._frame.eof
        if not self._inside:  # the next frame's start, if any
            self._compressed, self._fed = self._frame.unused_data + self._compressed[self._fed :], 0
            self._frame = self._new_frame()
        return out

    def _check_padding(self) -> None:
        if self._padding and self._padded % self._padding:
            raise OSError(f"{self._padded} NUL bytes after a stream, not a multiple of {self._padding}")
        self._padded = 0


class _Decompressing(io.RawIOBase):
    """A decompressing stream that closes the file under it too (gzip and lzma leave a file object they are given
    open), and whose damaged or cut-short data is one line naming the file, wherever it is read."""

    def __init__(self, stream, source, path: str, kind: str, errors: tuple = ()):
        self._stream, self._source, self._path, self._kind = stream, source, path, kind
        # (gzip's BadGzipFile is an OSError; its damaged deflate data is a zlib.error, which is not)
        self._errors = (EOFError, OSError, zlib.error, lzma.LZMAError, *errors)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            return self._stream.readinto(buffer)
        except self._errors as e:
            raise UserError(
                f"{self._path} cannot be decompressed ({self._kind}: {e}); it is cut short or damaged, so copy it "
                "again"
            ) from None

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            self._source.close()
            super().close()


def _parquet_pieces(path: str, field: str, skipped: collections.Counter) -> Iterator[tuple[str, bool, int]]:
    """The `field` column of a Parquet file, a row a document, read a batch of rows at a time (a row whose text is
    empty or null counted in `skipped`)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path} is Parquet, which needs pyarrow: pip install 'lm[parquet]' (or pyarrow)") from None
    try:
        # Buffered, not pre-buffered: a row group's column is then read a megabyte at a time, where pyarrow's
        # default reads it whole first (a file written as one row group took its whole size in memory).
        table = pq.ParquetFile(storage.open_bytes(path), buffer_size=1 << 20, pre_buffer=False)
    except UserError:
        raise
    except Exception as e:  # pyarrow raises its own error types for damaged files
        raise UserError(f"cannot read {path} as Parquet: {str(e).splitlines()[0]}") from None
    schema = table.schema_arrow
    columns = schema.names
    if field not in columns:
        raise UserError(f"{path} has no column '{field}' (it has {', '.join(columns)}); choose one with {FIELD}")
    if columns.count(field) > 1:  # (pyarrow cannot tell them apart: a KeyError)
        raise UserError(f"{path} has {columns.count(field)} columns named '{field}'; write it with one, or choose "
                        f"another with {FIELD}")  # fmt: skip

    def is_text(kind) -> bool:  # (string_view: pyarrow 16+; a dictionary of strings: categories)
        if pa.types.is_dictionary(kind):
            return is_text(kind.value_type)
        tests = ("is_string", "is_large_string", "is_string_view")
        return any(getattr(pa.types, test, lambda _: False)(kind) for test in tests)

    kind = schema.field(field).type
    if not is_text(kind):
        texts = list(dict.fromkeys(column.name for column in schema if is_text(column.type)))
        hint = (f"its text columns: {', '.join(texts)}); choose one with {FIELD}" if texts
                else "it has no text column); write the text as a string column")  # (no field would do)
        raise UserError(f"{path}: column '{field}' holds {kind}, not text ({hint}")
    batches = table.iter_batches(columns=[field], batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except UserError:
            raise
        except Exception as e:  # a damaged row group: pyarrow's error types again
            detail = str(e).splitlines()[0]
            raise UserError(f"cannot read {path} as Parquet: {detail}; it is damaged, so copy it again") from None
        if batch is None:
            return
        for text in batch.column(0).to_pylist():
            if text:
                yield text, True, len(text.encode("utf-8", "surrogatepass"))
            else:
                skipped[path] += 1


def json_lines(
    f: IO[bytes], path: str, bad_utf8: collections.Counter, objects: str | None = None, fields: tuple[str, ...] = ()
) -> Iterator[tuple[int, object, int]]:
    """(line number, parsed value, bytes) of each non-blank line of a JSONL file open for reading bytes. `objects`:
    each line must be a JSON object, and one that is not is refused saying to write one `objects` ("example a
    line: {'text'}"). A lone surrogate escape is counted in bad_utf8 where it is in the text encoded: in what is
    under `fields` alone where they are given (the fields the reader tokenizes: an "id" or title beside them is
    never read)."""
    for lineno, line in enumerate(f, 1):
        if lineno == 1 and line.startswith(BOM):  # a byte order mark, which some editors write
            line = line[3:]
        if lineno == 1 and (line.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\0" in line):
            raise UserError(f"{path} is not UTF-8 text (UTF-16, as some Windows tools save, or binary: it holds NUL "
                            "bytes); save it as UTF-8 JSON lines")  # fmt: skip
        if not line.strip():
            continue
        try:
            value = json.loads(decode(line, path, bad_utf8))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: not a JSON line ({e.msg}); write one JSON object a line") from None
        read = [value.get(field) for field in fields] if fields and isinstance(value, dict) else value
        lone = SURROGATE_ESCAPE.search(line) and len(LONE_SURROGATE.findall(json.dumps(read, ensure_ascii=False)))
        if lone:  # (half of a UTF-16 pair, which encoding replaces by U+FFFD, as decode does invalid UTF-8)
            bad_utf8[path] += lone
        if objects is not None and not isinstance(value, dict):
            raise UserError(f"{path}:{lineno}: {json.dumps(value)[:40]} is not a JSON object; write one {objects}")
        yield lineno, value, len(line)


def _refuse_binary(path: str, head: bytes) -> None:
    """Refuse a file that is not text, judged by its first bytes: tokenizing it would train on noise.

    Text never holds NUL bytes; archives, token files, images and UTF-16 text do (or start with a known magic)."""
    kind = compression(head)
    if kind:  # compressed inside compressed, or a zip archive
        raise UserError(f"{path} holds {kind}-compressed data, not text; decompress it and give the text file")
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):  # (UTF-16's byte order mark: CJK text of it holds no NUL bytes)
        raise UserError(f"{path} is not UTF-8 text (UTF-16, as some Windows tools save); save it as UTF-8")
    if b"\0" not in head:
        return
    if (re.fullmatch(r"tokens-\d+\.bin|train\.bin|val\.bin", os.path.basename(path))
            and read_meta(os.path.dirname(path))):
        raise UserError(f"{path} is a prepared token file, not text; give its directory {os.path.dirname(path)}")
    raise UserError(f"{path} is binary (it holds NUL bytes), not UTF-8 text; give text or .jsonl files instead")


def _last_safe_cut(buf: bytes, start: int) -> int:
    """The last SAFE_CUT place in buf at or after start, else the last UNICODE_CUT place, or 0 if there is none
    (the caller then reads on). Text usually has one near its end, so the last 4 KiB are searched first."""
    for lo in (max(start, len(buf) - 4096), start):
        cuts = [m.start() for m in SAFE_CUT.finditer(buf, lo)]
        if cuts:
            return cuts[-1]
    for lo in (max(start, len(buf) - 4096), start):
        while lo < len(buf) and 0x80 <= buf[lo] < 0xC0:  # from a character's first byte
            lo += 1
        # one character a byte where the UTF-8 is invalid (never a letter, number or mark), so that the cut's
        # place in the text gives its place in the bytes
        text = buf[lo:].decode("utf-8", "surrogateescape")
        cut = max(unicode_cuts(text), default=0)  # (the last: they come in order)
        if cut:
            return lo + len(text[:cut].encode("utf-8", "surrogateescape"))
    return 0


def unicode_cuts(text: str) -> Iterator[int]:
    """The UNICODE_CUT places in text, in order."""
    for m in UNICODE_CUT.finditer(text):
        yield m.end() if m.group() == "\n" else m.start()


def decode(raw: bytes, path: str, bad_utf8: collections.Counter) -> str:
    """raw as UTF-8, invalid sequences replaced by U+FFFD and counted under path in bad_utf8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        bad_utf8[path] += text.count("\ufffd") - raw.count("\ufffd".encode())
        return text


def warn_bad_utf8(bad_utf8: collections.Counter) -> None:
    """The warning, if decode replaced any invalid UTF-8 (or json_lines counted a lone surrogate): how many
    sequences, in how many files, the first."""
    if bad_utf8:
        n = sum(bad_utf8.values())
        print(
            f"warning: replaced {plural(n, 'invalid UTF-8 sequence')} or unpaired \\ud800-\\udfff "
            f"{'escape' if n == 1 else 'escapes'} with U+FFFD in {plural(len(bad_utf8), 'file')}, first in "
            f"{next(iter(bad_utf8))}",
            file=sys.stderr,
        )


def sample(files: list[str], field: str, budget: int) -> Iterator[str]:
    """Texts from the start of every file, each file's share of the budget (bytes of text) proportional to the
    text it holds (text_bytes)."""
    ratios = {}
    sizes = [text_bytes(f, field, ratios) for f in files]
    share = min(1.0, budget / max(1, sum(sizes)))
    for path, size in zip(files, sizes):
        taken, want = 0, int(size * share) if share < 1 else math.inf  # (all of a corpus within the budget)
        # (read in pieces no larger than the share: a whole first piece of every file, 1 MB, took 2x the budget and
        # more from a corpus of many files; a JSONL record or Parquet row over what is left is cut to it)
        for text, _, n in pieces(path, field, collections.Counter(), max(1 << 12, min(CHUNK_BYTES, want))):
            if taken >= want:
                break
            text = without_surrogates(text)  # (the BPE trainer refuses them, and UTF-8 cannot cut them)
            if taken + n > want:
                text = text.encode()[: want - taken].decode("utf-8", "ignore")
            taken += n
            yield text


RATIO_SAMPLE = 4 << 20  # compressed bytes decompressed to estimate a compression's ratio


def text_bytes(path: str, field: str, ratios: dict[str, float]) -> int:
    """About how many bytes of text (or JSON lines) a file holds: its size, for a Parquet file its column's
    uncompressed size, for a compressed one its size times the ratio of its first RATIO_SAMPLE bytes decompressed, of
    the first file so compressed (kept in `ratios`: one read, not one for each file of a large corpus)."""
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq  # (pieces, which reads it next, says where pyarrow is missing)

        try:
            with storage.open_bytes(path) as f:
                meta = pq.ParquetFile(f).metadata
        except Exception:  # a damaged file: pieces says so in one line
            return storage.size(path)
        columns = [meta.schema.column(i).path for i in range(meta.num_columns)]
        if field not in columns:
            return 0
        column = columns.index(field)
        return sum(meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups))
    size = storage.size(path)
    suffix = next((s for s in DECOMPRESSORS if path.lower().endswith(s)), None)
    if suffix is None:
        return size
    if suffix not in ratios:
        with storage.open_bytes(path) as f:
            head = f.read(RATIO_SAMPLE)
        n = 0
        with _decompressing(io.BytesIO(head), suffix, path) as stream:
            with contextlib.suppress(UserError):  # (the head ends inside the data, as a file cut short does)
                while chunk := stream.read(1 << 14):  # (what the last read had decompressed is lost with its error)
                    n += len(chunk)
        if len(head) == size:  # all of it
            return n
        ratios[suffix] = n / max(1, len(head))
    return int(size * ratios[suffix])
