"""Paths that may be object storage: s3://, gs:// (and any other fsspec URL) tested, listed, opened and
written the way local paths are, through fsspec (s3fs, gcsfs); a local path goes through os and open().

prepare streams text inputs from a bucket (byte ranges, never a whole download); prepared token shards in a
bucket are read a window at a time (read_ranges) and published there by lm.data.published; a run directory in a
bucket is lm.remote_run's. Storage errors become one line (`call`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import tempfile
from typing import IO, Any

from lm.errors import UserError

PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}  # what fsspec needs for a protocol
# Fail in about a minute, not botocore's default minutes of retries, when an endpoint cannot be reached.
OPTIONS = {"s3": {"config_kwargs": {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3}}}}


def is_url(path: str) -> bool:
    """Whether path names object storage (a protocol other than file://)."""
    protocol, sep, _ = path.partition("://")
    return bool(sep) and protocol not in ("", "file")


def filesystem(url: str) -> Any:
    """The fsspec filesystem that serves url, or one line saying what to install."""
    protocol = url.partition("://")[0]
    try:
        import fsspec  # lm[cloud], imported only for URLs

        return fsspec.filesystem(protocol, **OPTIONS.get(protocol, {}))
    except ImportError:
        package = PACKAGES.get(protocol, f"the fsspec package for {protocol}://")
        raise UserError(f"reading {url} needs {package}: pip install {package} (or 'lm[cloud]')") from None
    except ValueError:
        raise UserError(f"{url}: unknown storage protocol {protocol}://; use s3://, gs:// or a local path") from None


def call(url: str, what: str, function, *args):
    """function(*args) on url's filesystem; storage errors (no bucket, no credentials, no network) as one line."""
    try:
        return function(*args)
    except FileNotFoundError:
        raise
    except Exception as e:  # botocore's and google's own error types, or fsspec's wrapping of them
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"cannot {what} {url}: {detail}; check the URL, the bucket and its credentials "
            "(AWS_* or GOOGLE_APPLICATION_CREDENTIALS)"
        ) from None


def _kind(path: str, what: str) -> str | None:
    """"file" or "directory" for what is at URL path, None where there is nothing. fsspec's own isdir and isfile
    answer False on any error, so a storage that cannot be reached would read as a missing input."""
    try:
        return call(path, what, filesystem(path).info, path)["type"]
    except FileNotFoundError:
        return None


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    return _kind(path, "list") == "directory"


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    return _kind(path, "read") == "file"


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    return call(path, "read", filesystem(path).size, path)


def _url(protocol: str, path: str) -> str:
    """fsspec lists bucket/key; lm names objects by their whole URL."""
    return path if is_url(path) else f"{protocol}://{path}"


def walk_files(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """The files under directory `path` whose names end with one of suffixes, sorted."""
    if not is_url(path):
        return sorted(
            os.path.join(root, name) for root, _, names in os.walk(path) for name in names if name.endswith(suffixes)
        )
    fs, protocol = filesystem(path), path.partition("://")[0]
    return sorted(_url(protocol, p) for p in call(path, "list", fs.find, path) if p.endswith(suffixes))


def glob(pattern: str) -> list[str]:
    """What pattern matches (** across directories), sorted."""
    if not is_url(pattern):
        import glob as glob_lib

        return sorted(glob_lib.glob(pattern, recursive=True))
    fs, protocol = filesystem(pattern), pattern.partition("://")[0]
    return sorted(_url(protocol, p) for p in call(pattern, "list", fs.glob, pattern))


def version(path: str) -> dict:
    """What a fingerprint records of an input file: its size and its version (the local modification time, or
    the object's ETag / generation), so that a change prepares it again."""
    if not is_url(path):
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


def read_ranges(paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
    """Bytes [start, end) of each path: for object storage, one request per range, all at once."""
    if not paths:
        return []
    if not is_url(paths[0]):
        out, f = [], None
        try:
            for path, start, end in zip(paths, starts, ends):
                if f is None or f.name != path:  # one open for each run of ranges of the same file
                    if f is not None:
                        f.close()
                    f = open(path, "rb")
                f.seek(start)
                out.append(f.read(end - start))
        finally:
            if f is not None:
                f.close()
        return out
    fs = filesystem(paths[0])
    starts, ends = [int(s) for s in starts], [int(e) for e in ends]
    return call(paths[0], "read", functools.partial(fs.cat_ranges, on_error="raise"), list(paths), starts, ends)


def open_bytes(path: str) -> IO[bytes]:
    """path open for reading bytes; from object storage it is read in ranges as it goes, seekable."""
    if not is_url(path):
        return open(path, "rb")
    return call(path, "open", filesystem(path).open, path, "rb")


def temp_dir(prefix: str) -> str:
    """A new temporary directory, removed at exit: where copies of objects are read from."""
    local = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, local, True)
    return local


def work_place(url: str, kind: str) -> str:
    """A local directory that stands for url across processes (where work on it continues after a kill):
    $TMPDIR/kind/NAME-<hash of url>."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return os.path.join(tempfile.gettempdir(), kind, f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}")


@functools.lru_cache(maxsize=None)
def fetch(url: str) -> str:
    """A local copy of the one object at url (a run's config.yaml, say), removed at exit; downloaded once per
    process (train.py reads a config both to load it and to see which keys it sets)."""
    if not isfile(url):
        raise UserError(f"{url} not found; give the URL of an existing file")
    local = os.path.join(temp_dir("lm-"), url.rsplit("/", 1)[-1])
    download(url, local)
    return local


def read_bytes(url: str) -> bytes:
    """The whole of one (small) object."""
    return call(url, "read", filesystem(url).cat_file, url)


def download(url: str, local: str) -> None:
    call(url, "download", filesystem(url).get_file, url, local)


def upload(locals_: list[str], urls: list[str]) -> None:
    """Local files to their URLs (of one filesystem), several at once."""
    if urls:
        call(urls[0], "upload to", filesystem(urls[0]).put, list(locals_), list(urls))


def remove(url: str) -> None:
    """Delete the object at url, if there is one."""
    try:
        call(url, "delete", filesystem(url).rm, url)
    except FileNotFoundError:
        pass


def check_writable(url: str, setting: str, suffix: str = "") -> None:
    """One line now, not after hours of work, where the bucket of url is missing or refuses writes; `setting`
    names what the user gave (run.dir, data.cache_dir); `suffix` tells the probes of several processes apart."""
    probe = f"{url.rstrip('/')}/.lm-write-test{suffix}"
    try:
        write_bytes(probe, b"")
        call(probe, "write to", filesystem(url).rm, probe)
    except FileNotFoundError:
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        raise UserError(f"cannot write to {url}: bucket {bucket} does not exist; create it, or fix {setting}") from None


def write_bytes(url: str, data: bytes) -> None:
    """One object written whole (object storage has no appends or renames: a reader sees it all or not at all)."""
    call(url, "write to", filesystem(url).pipe_file, url, data)
