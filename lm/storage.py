"""Every path lm reads or writes, local or in object storage (s3://, gs://, any fsspec URL), through one layer:
fsspec's filesystem for the path (fsspec.core.url_to_fs), so a caller never asks which kind of path it holds.

What differs between a disk and a bucket is kept here where it is about storage itself: a bucket has no
directories to make and no free space to run out of, an object is written whole where a file is written beside
itself and renamed, a file's version is its modification time where an object's is its ETag or generation, and a
storage error (no bucket, no credentials, no network) becomes one line (`call`) where a local OSError stays
itself. What differs for a run or a prepared corpus in a bucket is policy, held by lm.run_dir.RunDir and
lm.prepared_dir.PreparedDir.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from typing import IO, Any

from lm.errors import UserError, at_exit

PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}  # what fsspec needs for a protocol
# Fail in about a minute, not botocore's default minutes of retries, when an endpoint cannot be reached, or two
# where it takes connections and never answers: 20 s without a byte is a timeout, botocore tries 3 times, and s3fs
# tries botocore's 3 twice (S3_TRIES; its own default of 5, over a read timeout of 60 s, was 15 minutes a request).
OPTIONS = {"s3": {"config_kwargs": {"connect_timeout": 10, "read_timeout": 20, "retries": {"total_max_attempts": 3}}}}
S3_TRIES = 2
# gcsfs: the same 10 s to connect and 20 s without a byte (aiohttp's default, 5 minutes a try, was 30 minutes).
GCS_TIMEOUTS = {"sock_connect": 10, "sock_read": 20}


def is_url(path: str) -> bool:
    """Whether path names object storage (a protocol other than file://)."""
    protocol, sep, _ = path.partition("://")
    return bool(sep) and protocol not in ("", "file")


def user_path(path: str) -> str:
    """A path as the user may write it, as lm reads it: file:///x is the local path /x (lm works on a local path
    with os, which read file:///x as ./file:/x: a traceback, or a directory named file: written), and a leading ~
    (or ~user) the home directory, as a shell would have made it (no shell expands `data.path=~/x`, nor YAML, nor
    an argument after --out=); a URL of object storage, or a spec such as bpe:N, stays as it is."""
    if path.startswith("file://"):
        path = path[len("file://") :] or "/"
    return os.path.expanduser(path)


def _local(path: str) -> bool:
    return not is_url(path)


def absolute(path: str) -> str:
    """path as it is named for good: a local path made absolute (runs may change directory), a URL as it is."""
    return os.path.abspath(path) if _local(path) else path


def _protocol(path: str) -> str:
    return path.partition("://")[0] if "://" in path else "file"


def basename(url: str) -> str:
    """The last part of a URL's path (x of s3://b/runs/x/)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def bucket(url: str) -> str:
    """The bucket an object storage URL names (b of s3://b/runs/x)."""
    return url.partition("://")[2].split("/", 1)[0]


def bucket_exists(url: str) -> bool:
    """Whether the bucket of `url` is there (a URL that lists nothing may name a bucket that is not)."""
    return isdir(f"{_protocol(url)}://{bucket(url)}")


def filesystem(path: str) -> Any:
    """The fsspec filesystem that serves path (a local one for a local path), or one line saying what to
    install."""
    protocol = _protocol(path)
    kind = ALIASES.get(protocol, protocol)  # (s3a:// is s3://: the same options)
    try:
        import fsspec

        options = OPTIONS.get(kind, {})
        if kind == "gs":
            import aiohttp  # (gcsfs's own client)

            options = {"requests_timeout": aiohttp.ClientTimeout(**GCS_TIMEOUTS)}
            # (gcsfs logs each request it gives up on with a traceback, and each guess it falls back from: `call`
            # says what failed in one line)
            logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
            _check_gcs_credentials()
        fs = fsspec.core.url_to_fs(path, **options)[0]
    except ImportError:
        package = PACKAGES.get(protocol, f"the fsspec package for {protocol}://")
        raise UserError(f"reading {path} needs {package}: pip install {package} (or 'lm[cloud]')") from None
    except ValueError:
        raise UserError(f"{path}: unknown storage protocol {protocol}://; use s3://, gs:// or a local path") from None
    if kind == "s3":
        fs.retries = S3_TRIES  # (s3fs's attribute, not an argument)
        # botocore asks an upload's endpoint for a "100 Continue" before it sends the body, and aiohttp waits for that
        # answer with no timeout (its read timeout starts once the body is sent): an endpoint that took connections
        # and never answered held every write (the run directory's check, a checkpoint's upload) for good, where a
        # read gives up in about 2 minutes. The header is optional in HTTP, and S3 takes the body without it.
        if fs not in _WITHOUT_100_CONTINUE:  # (fsspec keeps one filesystem per options: this runs once for each)
            client = call(path, "connect to", fs.connect)  # (s3fs's client, made once; no request is sent)
            client.meta.events.register("before-send.s3", _without_100_continue, unique_id="lm-without-100-continue")
            _WITHOUT_100_CONTINUE.add(fs)
    return fs


_WITHOUT_100_CONTINUE = weakref.WeakSet()


class _Once(logging.Filter):
    """Each message once: gcsfs asks google-auth for credentials in every filesystem it makes (one a thread), and
    google-auth warned on each that no metadata server answered (141 lines in a 6-step run in a bucket)."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage() in self.said
        self.said.add(record.getMessage())
        return not said


logging.getLogger("google.auth._default").addFilter(_Once())


@functools.lru_cache(maxsize=None)
def _check_gcs_credentials() -> None:
    """A GOOGLE_APPLICATION_CREDENTIALS file that is missing or no credentials, refused in one line: gcsfs reads the
    bucket anonymously then, while TensorStore (which writes a gs:// run's checkpoints) fails on it, so the run's
    checks passed and its first checkpoint failed, a ckpt_every of training later."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if not path:
        return
    import google.auth
    import google.auth.exceptions

    try:
        google.auth.load_credentials_from_file(path)
    except google.auth.exceptions.DefaultCredentialsError as e:
        why = ": ".join(str(a).rstrip(".") for a in e.args)  # (a malformed file's: what, then its cause)
        raise UserError(f"GOOGLE_APPLICATION_CREDENTIALS={path}: {why}; point it at a credentials file (a service "
                        "account's key, or gcloud auth application-default login's), or unset it") from None


def _without_100_continue(request, **kwargs) -> None:
    if "Expect" in request.headers:
        del request.headers["Expect"]


def call(url: str, what: str, function, *args):
    """function(*args) on url's filesystem; storage errors (no bucket, no credentials, no network) as one line.
    A local path's errors are left as they are (the caller's OSError handling sees them)."""
    try:
        return function(*args)
    except FileNotFoundError:
        raise
    except Exception as e:  # botocore's and google's own error types, or fsspec's wrapping of them
        if _local(url):
            raise
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, TimeoutError) and not str(e):  # (gcsfs's, fsspec's FSTimeoutError: no words of its own)
            detail = "the endpoint did not answer in time"
        raise UserError(
            f"cannot {what} {url}: {detail}; check the URL, the bucket and its credentials "
            "(AWS_* or GOOGLE_APPLICATION_CREDENTIALS)"
        ) from None


def _kind(path: str, what: str) -> str | None:
    """ "file" or "directory" for what is at path, None where there is nothing (or, on a disk, nothing that can
    be read). fsspec's own isdir and isfile answer False on any error, so a storage that cannot be reached would
    read as a missing input."""
    try:
        return call(path, what, filesystem(path).info, path)["type"]
    except OSError:
        return None


def isdir(path: str) -> bool:
    return _kind(path, "list") == "directory"


def isfile(path: str) -> bool:
    return _kind(path, "read") == "file"


def size(path: str) -> int:
    return call(path, "read", filesystem(path).size, path)


def _named(path: str, found: list[str]) -> list[str]:
    """fsspec lists bucket/key; lm names objects by their whole URL, with the protocol the user gave."""
    return sorted(found if _local(path) else (f"{_protocol(path)}://{p}" for p in found))


def _hidden_below(path: str, root: str) -> list[str]:
    """The names on `path`'s way below `root` (a prefix of it) that start with a dot: hidden ones."""
    return [name for name in path[len(root) :].split("/") if name.startswith(".")]


def walk_files(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """The files under directory `path` whose names end with one of suffixes (lower case; a name's in any case),
    sorted, hidden ones left out: those whose name, or a directory's under `path` on their way, starts with a dot
    (Jupyter's .ipynb_checkpoints copies, macOS's ._ files, .git). A local directory's links to directories are
    followed (fsspec's find skipped them), each directory once (a link back up is no loop)."""
    if not _local(path):
        listed = call(path, "list", filesystem(path).find, path)
        root = path.partition("://")[2].rstrip("/")  # (as fsspec lists it: bucket/key)
        shown = [p for p in listed if not _hidden_below(p, root)]
        return _named(path, [p for p in shown if p.lower().endswith(suffixes)])
    def unreadable(e: OSError):  # (os.walk skipped it without a word: its files were left out of the data)
        raise UserError(f"cannot read directory {e.filename} under {path}: {e.strerror or e}; make it readable or "
                        "move it out")  # fmt: skip

    found, visited = [], set()
    for directory, subdirectories, files in os.walk(path, onerror=unreadable, followlinks=True):
        real = os.path.realpath(directory)
        if real in visited:
            subdirectories.clear()
            continue
        visited.add(real)
        subdirectories[:] = [name for name in subdirectories if not name.startswith(".")]
        found += [os.path.join(directory, n) for n in files if n.lower().endswith(suffixes) and not n.startswith(".")]
    return sorted(found)


def glob(pattern: str) -> list[str]:
    """What pattern matches (** across directories), sorted, hidden names left out as the shell's glob leaves them:
    a wildcard's match that starts with a dot (macOS's ._ files, .git, .ipynb_checkpoints) only where the pattern's
    part says the dot (.*), as a directory's hidden files are read only where named (fsspec's glob matched them)."""
    found = call(pattern, "list", filesystem(pattern).glob, pattern)
    parts = pattern.split("/")
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    dotted = [part for part in parts[wild:] if part.startswith(".")]
    root = "/".join(parts[:wild])  # (the directory the wildcards start in, as fsspec lists it: absolute, bucket/key)
    root = (os.path.abspath(root or ".") if _local(pattern) else root.partition("://")[2]).rstrip("/") + "/"

    def shown(match: str) -> bool:
        hidden = _hidden_below(match, root) if match.startswith(root) else []
        return all(any(fnmatch.fnmatchcase(name, d) for d in dotted) for name in hidden)

    return _named(pattern, [match for match in found if shown(match)])


def names(path: str) -> list[str]:
    """The names directly under directory `path` ([] where there is none), listed afresh."""
    fs = filesystem(path)
    fs.invalidate_cache()  # fsspec caches listings; another process may have written since
    try:
        listed = call(path, "list", functools.partial(fs.ls, path, detail=False))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except PermissionError as e:  # (a local directory another user keeps private; a bucket's is call's line)
        raise UserError(f"cannot list {path}: {e.strerror}; make it readable, or move it away") from None
    itself = path.split("://", 1)[-1].rstrip("/")  # (the empty object a bucket console's "Create folder" makes)
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in listed if p.rstrip("/") != itself)


def version(path: str) -> dict:
    """What a fingerprint records of an input file: its size and its version (the local modification time, or
    the object's ETag / generation), so that a change prepares it again."""
    if _local(path):
        stat = os.stat(path)
        return {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    fs = filesystem(path)
    return {"path": path, "size": size(path), "version": str(call(path, "read", fs.ukey, path))}


def objects(url: str) -> dict[str, dict]:
    """{name: {"size", "version"}} of the objects directly under url ({} where there are none), from one
    listing: the version is the object's ETag (S3) or generation (GCS), which a new upload changes."""
    fs = filesystem(url)
    fs.invalidate_cache(url)  # fsspec caches listings; another process may have written since
    try:
        listed = call(url, "list", functools.partial(fs.ls, url, detail=True))
    except FileNotFoundError:
        return {}
    found = {}
    for info in listed:
        if info.get("type") == "file":
            version = info.get("ETag") or info.get("etag") or info.get("generation") or fs.ukey(info["name"])
            found[info["name"].rstrip("/").rsplit("/", 1)[-1]] = {"size": info["size"], "version": str(version)}
    return found


def modified(path: str) -> float | None:
    """When the file or object at path was last written (seconds since the epoch), None where its storage does not
    say."""

    def when(p: str) -> float | None:
        try:
            return filesystem(p).modified(p).timestamp()
        except NotImplementedError:
            return None

    return call(path, "read", when, path)


def read_ranges(paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
    """Bytes [start, end) of each path (of one filesystem): for object storage, one request per range, all at
    once."""
    if not paths:
        return []
    fs = filesystem(paths[0])
    starts, ends = [int(s) for s in starts], [int(e) for e in ends]
    return call(paths[0], "read", functools.partial(fs.cat_ranges, on_error="raise"), list(paths), starts, ends)


def open_bytes(path: str) -> IO[bytes]:
    """path open for reading bytes; from object storage it is read in ranges as it goes, seekable."""
    return call(path, "open", filesystem(path).open, path, "rb")


def read_bytes(path: str) -> bytes:
    """The whole of one (small) file or object."""
    return call(path, "read", filesystem(path).cat_file, path)


def tmp_path(path: str) -> str:
    """The temporary name a file is written under before it replaces `path`: beside it (so the rename stays on
    one filesystem), hidden, and unique to this process."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{cut_name(name)}.{os.getpid()}.tmp")


def cut_name(name: str) -> str:
    """`name` cut to 128 bytes (whole characters), to name a temporary file after: a name the filesystem takes
    (up to 255 bytes) then still does with a prefix and a suffix around it."""
    return name.encode()[:128].decode(errors="ignore")


def is_stream(path: str) -> bool:
    """Whether a local path is there and neither a file nor a directory: a device or a pipe, written into."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def is_stdout(path: str) -> bool:
    """Whether a local path is this process's standard output (`-o /dev/stdout`), whatever that is: a pipe, a
    terminal, or a file the shell redirected it to (which /dev/stdout then is: a name without a suffix)."""
    try:
        named, out = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # (no such path; a stdout without a descriptor, or none)
        return False
    return (named.st_dev, named.st_ino) == (out.st_dev, out.st_ino)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **kwargs) -> Iterator[IO]:
    """Open a temporary file that replaces `path` when the block ends without an error, and is removed when it
    ends with one: a reader sees the old file or the new one, never half of it. A `path` that is there and no
    regular file (a device or a pipe: `-o /dev/null`, `/dev/stdout`) is written into, not replaced (as root, the
    rename made /dev/null a regular file); a link to a file replaces the file it names, and stays a link."""
    if is_stream(path):
        with open(path, mode, **kwargs) as f:
            yield f
        return
    path = os.path.realpath(path) if os.path.islink(path) else path
    tmp = tmp_path(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_bytes(path: str, data: bytes) -> None:
    """One file or object written whole: a reader sees all of it or none (an object is, being written in one
    request; a file is written beside itself and renamed over the old one)."""
    if _local(path):
        with atomic_open(path, "wb") as f:
            f.write(data)
        return
    call(path, "write to", filesystem(path).pipe_file, path, data)


def makedirs(path: str) -> None:
    """Make directory path exist. A bucket has no directories to make (and s3fs would create a missing bucket)."""
    if _local(path):
        filesystem(path).makedirs(path, exist_ok=True)


def free_bytes(path: str) -> int | None:
    """The free space where path is, or None for object storage (a bucket has none to run out of)."""
    return shutil.disk_usage(path).free if _local(path) else None


def temp_dir(prefix: str) -> str:
    """A new temporary directory, removed as the process exits (also where a Ctrl-C or SIGTERM ends it: it stayed):
    where copies of objects are read from. Beside it, DIR.lock is locked while this process runs: what a process
    killed outright (SIGKILL, out of memory) left, unlocked, goes as the next one is made (it stayed for good)."""
    _remove_abandoned(prefix)
    local = tempfile.mkdtemp(prefix=prefix)
    lock = os.open(f"{local}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # (held until the process ends)

    def remove():
        shutil.rmtree(local, True)
        with contextlib.suppress(OSError):
            os.unlink(f"{local}.lock")

    at_exit(remove)
    return local


ABANDONED_AFTER_S = 60  # a lock file younger may be one whose process has not locked it yet


def _remove_abandoned(prefix: str) -> None:
    """The temporary directories named `prefix`... whose lock no process holds: a killed process's."""
    where = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(where):
            lock = os.path.join(where, name)
            if not re.fullmatch(re.escape(prefix) + r"[a-z0-9_]{8}\.lock", name):  # (tempfile's names: no other's)
                continue
            with contextlib.suppress(OSError):
                if time.time() - os.stat(lock).st_mtime < ABANDONED_AFTER_S:
                    continue
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (BlockingIOError: held, its process runs)
                    shutil.rmtree(lock[: -len(".lock")], True)
                    os.unlink(lock)
                finally:
                    os.close(fd)


ALIASES = {"s3a": "s3", "gcs": "gs"}  # other names fsspec gives a protocol


def normalized(url: str) -> str:
    """A bucket URL as one spelling: the protocol's own name (s3a:// is s3://, gcs:// gs://), no empty path segments,
    no trailing slash (gs://b//run/ is gs://b/run), so that every spelling of a run's URL names the same objects,
    working copy and lock."""
    scheme, _, rest = url.partition("://")
    scheme = ALIASES.get(scheme.lower(), scheme.lower())
    return f"{scheme}://{'/'.join(part for part in rest.split('/') if part)}"


def download_command(url: str) -> str:
    """The command that copies the objects under bucket URL `url` into a local directory DIR (a Hugging Face model
    lm.export wrote there, which hf:DIR reads from this machine)."""
    url = normalized(url)  # (s3a://, gcs://: as the clients spell them)
    return f"gcloud storage rsync -r {url} DIR" if url.startswith("gs://") else f"aws s3 sync {url} DIR"


def work_place(url: str, kind: str) -> str:
    """A local directory that stands for url across processes (where work on it continues after a kill):
    $TMPDIR/kind/NAME-<hash of url>."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), kind, f"{basename(url)}-{digest}")


def local_file(path: str) -> str:
    """A local file that holds what is at path: a local path itself (not checked), else a copy of the object
    (a run's config.yaml, say), removed at exit."""
    return path if _local(path) else _fetch(path)


@functools.lru_cache(maxsize=None)
def _fetch(url: str) -> str:
    """Downloaded once per process (train.py reads a config both to load it and to see which keys it sets)."""
    if not isfile(url):
        raise UserError(f"{url} not found; give the URL of an existing file")
    local = os.path.join(temp_dir("lm-"), url.rsplit("/", 1)[-1])
    download(url, local)
    return local


def download(url: str, local: str) -> None:
    call(url, "download", filesystem(url).get_file, url, local)


def upload(locals_: list[str], urls: list[str]) -> None:
    """Local files to their URLs (of one filesystem), several at once."""
    if urls:
        call(urls[0], "upload to", filesystem(urls[0]).put, list(locals_), list(urls))


def remove(path: str, recursive: bool = False) -> None:
    """Delete what is at path (with `recursive`, everything under it too), if there is anything."""
    try:
        call(path, "delete", functools.partial(filesystem(path).rm, recursive=recursive), path)
    except FileNotFoundError:
        pass


def check_writable(url: str, setting: str, suffix: str = "") -> None:
    """One line now, not after hours of work, where the bucket of url is missing or refuses writes; `setting`
    names what the user gave (run.dir, data.cache_dir); `suffix` tells the probes of several processes apart."""
    probe = f"{url.rstrip('/')}/.lm-write-test{suffix}"
    try:
        write_bytes(probe, b"")
    except FileNotFoundError:
        raise UserError(
            f"cannot write to {url}: bucket {bucket(url)} does not exist; create it, or fix {setting}"
        ) from None
    try:
        call(probe, "write to", filesystem(url).rm, probe)
    except FileNotFoundError:  # (another run probing the same place, a shared compile cache, removed it: written)
        pass
