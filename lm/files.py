"""Small file helpers every module shares: text, JSON and copied files written atomically (storage.atomic_open),
and a user's text file."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from typing import Any

from lm import storage
from lm.storage import atomic_open
from lm.errors import UserError, undecodable


def write_text(path: str, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str, obj: Any, indent: int | None = 2) -> None:
    """obj as JSON (UTF-8, non-ASCII kept as it is, a final newline), written atomically; path may be a URL
    (one object written whole). A string that is not Unicode (a file name's undecodable bytes, which Python holds
    as lone surrogates) is written as JSON's \\u escapes, which read_json gives back as the same string."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    try:
        data = text.encode()
    except UnicodeEncodeError:
        data = json.dumps(obj, indent=indent).encode()
    storage.write_bytes(path, data + b"\n")


def read_json(path: str) -> Any:
    """The JSON in `path` (a file, or an object in object storage), or None where it is missing or not JSON."""
    try:
        return json.loads(storage.read_bytes(path))
    except (OSError, ValueError):
        return None


def check_unicode_path(path: str) -> None:
    """A path whose name holds bytes that are not UTF-8 (which Python holds as lone surrogates) is one line: lm
    writes its paths into configs and checkpoints as text, and the checkpoint library cannot open them."""
    if undecodable(path):
        raise UserError(f"the path {ascii(path)} has bytes that are not UTF-8 in its name; rename it")


def shown(path: str) -> str:
    """A local path as a message shows it: relative to the working directory where it is under it (a run resumed
    from its config.yaml, which stores run.dir absolute, is named as a new run of it was: runs/NAME), else as it is."""
    if not path or storage.is_url(path) or not os.path.isabs(path):
        return path
    try:
        here = os.getcwd()
    except OSError:  # (the working directory deleted under the run)
        return path
    return os.path.relpath(path, here) if here != os.sep and path.startswith(here + os.sep) else path


def probe_writable(directory: str) -> None:
    """Make `directory` (and its parents) if need be, and a file in it, deleted at once: raises the OSError a write
    there would (read-only, no permission, not a directory), before the work whose result would be lost."""
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
        pass


def why_not_made(path: str, e: OSError) -> str:
    """Why `path` (or a directory above it) could not be made: a file where one of its directories should be (what
    makedirs reports as "File exists"), or the OSError's own reason."""
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if os.path.exists(above) and not os.path.isdir(above):
        return f"{above} is a file, not a directory"
    return e.strerror or str(e)


def lock_file(path: str, shared: bool, wait: bool = False) -> int | None:
    """A descriptor of file `path` (made if need be) holding flock's shared or exclusive lock (waiting for it, if
    `wait`), or None where another process holds a conflicting one. A shared lock's file is opened for reading only
    (all it needs, NFS included: another user's file too). Raises the OSError of a file that cannot be opened or
    locked (a directory this user cannot write to, a filesystem without locks): each caller goes on without one.

    A lock file may be deleted by the process that holds it exclusively (checkpoint rotation, a reader letting go):
    one deleted (or replaced) between this open and this lock is a file no other process will open again, so the
    path is opened and locked anew until the lock held is the file's at `path`."""
    while True:
        fd = os.open(path, (os.O_RDONLY if shared else os.O_RDWR) | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    return fd
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        os.close(fd)


def copy_file(src: str, dst: str) -> None:
    """Copy src over dst atomically."""
    with open(src, "rb") as f, atomic_open(dst, "wb") as out:
        shutil.copyfileobj(f, out)


# The first bytes of compressed files, which are text only once decompressed.
COMPRESSED = {b"\x1f\x8b": "gzip", b"PK\x03\x04": "zip", b"\xfd7zXZ\x00": "xz", b"(\xb5/\xfd": "zstd"}
COMPRESSED.update({bytes([0x50 + i]) + b"*M\x18": "zstd" for i in range(16)})  # a skippable frame first (pzstd's)
# bzip2: "BZh", the block size, then a block's magic or the end of an empty stream (so text that starts "BZh" is text)
COMPRESSED.update({b"BZh%d%s" % (n, m): "bzip2" for n in range(1, 10) for m in (b"1AY&SY", b"\x17rE8P\x90")})


def compression(head: bytes) -> str | None:
    """The compression ("gzip", "zstd", ...) whose magic a file's first (16) bytes start with, else None."""
    return next((name for magic, name in COMPRESSED.items() if head.startswith(magic)), None)


def check_given(path: str, what: str) -> None:
    """Refuse an empty path a user gave for a `what` ("task file"): an unset shell variable, which the error of
    reading it named as nothing ("cannot read task file : Is a directory")."""
    if not path:
        raise UserError(f"the {what} given is empty ''; give the path of a {what} (an unset shell variable?)")


def read_user_text(path: str, what: str, if_empty: str) -> str:
    """A UTF-8 text file a user named (a prompt, a text to score): its text, or a UserError that says what is wrong;
    `what` names it ("prompt file"), `if_empty` is the advice when it is empty. Its line ends are kept as they are
    (CRLF too), and a byte order mark that starts it is no text, as training reads a corpus; a file holding NUL
    bytes is binary, not text."""
    check_given(path, what)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        with open(path, "rb") as f:  # (a .gz given as text: "not UTF-8 (byte 1)" said nothing of why)
            kind = compression(f.read(16))
        if kind:
            raise UserError(f"{what} {path} is {kind}-compressed, not text; decompress it") from None
        raise UserError(f"{what} {path} is not UTF-8 (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}; give the path of a {what}") from None
    marked, text = text.startswith("\ufeff"), text.removeprefix("\ufeff")  # (some editors write one; lm.eval scored it)
    if not text:
        raise UserError(f"{what} {path} is empty{' (a byte order mark alone)' if marked else ''}; {if_empty}")
    if "\0" in text:
        raise UserError(f"{what} {path} is binary (it holds NUL bytes), not UTF-8 text; give a text file")
    return text

