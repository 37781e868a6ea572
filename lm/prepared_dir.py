"""Where a prepared corpus lives and how lm checks, reads and writes it: PreparedDir, the one place that knows
whether a prepared directory (lm/data/meta.py says what it holds) is on a local disk or in object storage
(data.cache_dir=s3://... or gs://..., or one prepared and copied there by hand).

    current    a local directory's token files are checked against meta.json by size and sampled checksums (a
               file unchanged since its checksum matched on this machine is not read again: CHECKED); a
               bucket's by one listing, each object's size and version (ETag or generation) against those
               meta.json records when it was published (by checksums read as byte ranges where it records none,
               for a directory copied there by other means)
    reads      local shards are memory-mapped when first read; a bucket's are read a window at a time as byte
               ranges, one request each, all at once, several batches ahead (read_ahead)
    writes     a local directory is prepared in place the first time; prepared again (other inputs or settings), in
               .next inside it, whose files replace the old ones once it is whole (a mistake deep in an input
               cost the old tokens in place); a bucket's is tokenized in a local staging directory named by the
               URL; both where a killed prepare continues. Then published: meta.json deleted first (until it is
               back the directory is not prepared), the shards and rank file uploaded (moved, locally), the
               shards the older meta.json lists deleted (nothing else), and meta.json written last (a bucket's
               recording each object's size and version); one killed as it moved them, run again, moves the rest
    sharing    a bucket is seen by every process of a run: one prepares and publishes, the others read it; it
               holds token streams for pretraining only (fine-tune examples are read from a local disk)
    one writer two processes of this machine preparing the same directory (two runs of a sweep started at once)
               take turns (one_prepare_at_a_time): the second waits, then finds it prepared
    owner      a local directory that holds files lm did not write is never prepared into (strangers)
    readers    a run holds a local directory it trains on (being_read) until it ends: a prepare that would write it
               again (changed inputs) stops in one line (not_being_read) rather than change the tokens under the run

This module imports no other part of lm.data (lm/validation.py asks it about data.cache_dir while a config loads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable

import numpy as np

from lm import storage
from lm.errors import UserError
from lm.files import lock_file, read_json, write_json

META = "meta.json"
PROGRESS = "progress.json"
PREPARE_LOCK, READ_LOCK = ".prepare.lock", ".read.lock"  # (empty files in a local prepared directory)
SPLITS = ("train", "val")
NEXT = ".next"  # where a local directory prepared before is prepared again (PreparedDir.staging)
REPLACED = ".replaced.json"  # in the staging directory: the shards of the old prepare, the only old files deleted
OLD_TOKENS = re.compile(r"tokens-\d+\.bin|train\.bin|val\.bin")  # an older prepare's shards, format 1's too
READ_AHEAD = 8  # batches read from object storage at once, each a round of range requests


@dataclasses.dataclass(frozen=True)
class PreparedDir:
    """A prepared directory (or data.cache_dir, the root of prepared directories), local or a URL."""

    path: str

    @property
    def shared(self) -> bool:
        """Whether it is in object storage: read in place by every process, prepared by one."""
        return storage.is_url(self.path)

    @property
    def read_ahead(self) -> int:
        """How many batches to request at once: batches from object storage wait on the network, not the CPU."""
        return READ_AHEAD if self.shared else 1

    def shards(self, names: list[str], dtype: str) -> Shards:
        return Shards([os.path.join(self.path, name) for name in names], dtype, ranged=self.shared)

    def problem(self, meta: dict) -> str | None:
        """What is wrong with its token files, given the meta.json that describes them: sizes, then versions
        or contents; None when they are the ones it describes."""
        itemsize = np.dtype(meta["dtype"]).itemsize
        if self.shared:
            return self._objects_problem(self.path.rstrip("/"), meta, itemsize)
        if meta.get("kind") in ("examples", "preference"):  # preference pairs are two examples each
            problem = _examples_problem(self.path, meta, itemsize)
        else:
            problem = None
            for shard in meta["shards"]:
                problem = _wrong_size(os.path.join(self.path, shard["name"]), shard["tokens"] * itemsize)
                if problem:
                    break
        return problem or checksums_problem(self.path, meta.get("checksums", {}))

    @staticmethod
    def _objects_problem(url: str, meta: dict, itemsize: int) -> str | None:
        """One listing compares each object's size and version with those meta.json records; a directory
        uploaded by other means (no versions recorded) has its content checksums checked by byte ranges."""
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
                if not digest_matches(f"{url}/{name}", expected):
                    return f"{url}/{name} does not match the checksum meta.json records"
        return None

    def local_files(self, names: tuple[str, ...]) -> str:
        """A local directory holding those of `names` it has (a tokenizer's rank file, say): itself, or a copy
        downloaded once per process and removed at exit."""
        return _downloaded(self.path.rstrip("/"), names) if self.shared else self.path

    @contextlib.contextmanager
    def one_prepare_at_a_time(self, progress: bool):
        """Held while this machine prepares it: an exclusive lock on a file in it (a bucket's: beside its staging
        directory). Another process waits for it, saying so, and then finds the directory prepared (its caller asks
        again); without it the second deleted the first's temporary shards. A filesystem without locks (some
        network mounts) goes on without one."""
        where = self.staging + ".lock" if self.shared else os.path.join(self.path, PREPARE_LOCK)
        while True:
            try:
                os.makedirs(os.path.dirname(where), exist_ok=True)
            except OSError as e:  # (read-only, a name too long, a file in the way)
                raise UserError(
                    f"cannot write prepared data to {os.path.dirname(where)}: {e.strerror or e}; prepare into another "
                    "directory: data.cache_dir=DIR, or --out DIR"
                ) from None
            with _flock(where, shared=False, saying=self._waiting if progress else None):
                if os.path.isdir(os.path.dirname(where)):  # (else the prepare waited for failed and removed it)
                    yield
                    return

    @contextlib.contextmanager
    def being_read(self, progress: bool):
        """Held while a run trains on it: a shared lock on a file in it, which keeps a prepare from writing it again
        under the run (not_being_read). Taken after a prepare of it ends (one under way is waited for, saying so);
        its caller then checks that the directory is still the one it prepared or found. A bucket has none: its
        readers are on other machines. Nor does a directory this user cannot write to."""
        if self.shared:
            yield
            return
        with _flock(os.path.join(self.path, READ_LOCK), shared=True, saying=self._waiting if progress else None):
            yield

    @contextlib.contextmanager
    def not_being_read(self):
        """Held while a prepare writes it: refused, in one line, while a run trains on it (being_read), whose
        memory-mapped tokens the new ones would replace as it reads them."""
        if self.shared:
            yield
            return
        with _flock(os.path.join(self.path, READ_LOCK), shared=False, wait=False) as taken:
            if not taken:
                raise UserError(
                    f"{self.path} must be prepared again (its inputs or settings are not those it was prepared "
                    "from), but a run is training on it; wait for that run to end, or prepare into another "
                    "directory (data.cache_dir=DIR, or --out DIR)"
                )
            yield

    def remove_if_bare(self) -> None:
        """Remove a local directory that holds nothing but its locks (a first prepare that failed): called while
        holding both (one_prepare_at_a_time, not_being_read), which lets their files go (lm.files.lock_file)."""
        if self.shared or not os.path.isdir(self.path) or not set(os.listdir(self.path)) <= {PREPARE_LOCK, READ_LOCK}:
            return
        for name in (READ_LOCK, PREPARE_LOCK):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.path, name))
        with contextlib.suppress(OSError):  # (a file made there meanwhile keeps it)
            os.rmdir(self.path)

    @property
    def _waiting(self) -> str:
        return f"waiting for another process that is preparing {self.path}"

    @property
    def staging(self) -> str:
        """Where a prepare tokenizes when not in place, deleted once published: a bucket's in a local directory named
        by the URL, a local directory's (prepared before) in .next inside it."""
        return storage.work_place(self.path, "lm-prepare") if self.shared else os.path.join(self.path, NEXT)

    def stopped_prepare(self) -> str | None:
        """A line naming the prepare of other inputs or settings stopped in a local directory's .next, and the disk it
        holds until it is run again (it continues there) or deleted; None where there is none, or where a prepare
        holds the directory's lock (one under way writes it: not stopped, and not to be deleted)."""
        if self.shared or not os.path.isdir(self.staging):
            return None
        with _flock(os.path.join(self.path, PREPARE_LOCK), shared=True, wait=False) as free:
            if not free:
                return None
        size = sum(e.stat().st_size for e in os.scandir(self.staging) if e.is_file(follow_symlinks=False))
        return (f"note: {self.staging} holds {size / 1e6:,.1f} MB of a prepare of other inputs or settings that was "
                f"stopped; run that prepare again to finish it there, or delete {self.staging} to free the space")

    def build(
        self, tokenize: Callable[[str], dict], staged: Callable[..., dict | None], fingerprint: str, progress: bool
    ) -> dict:
        """Prepare it, `tokenize(directory)` returning the meta written: a local directory in place the first time;
        one prepared before (its tokens serve until the new ones are whole), and a bucket, in the staging
        directory (unless `staged(staging)` finds it tokenized there before, by a prepare whose publishing was cut
        short; or, locally, one of this `fingerprint` was cut short as it moved its files here: finish_moves), then
        published. The meta it holds. `staged(directory, meta)`: the meta if `directory` holds the prepare asked for
        as `meta` (its meta.json if None) describes it, else None."""
        if not self.shared and not os.path.isfile(os.path.join(self.path, META)) and not os.path.isdir(self.staging):
            return tokenize(self.path)  # (a prepare again continues in staging though the old meta.json was deleted)
        if self.shared:
            storage.check_writable(self.path, "data.cache_dir (or --out)")
        replaced = os.path.join(self.staging, REPLACED)  # (kept from the first try: a meta.json deleted since, by a
        if not os.path.isfile(replaced):  # publish cut short or by hand, still has its shards deleted)
            os.makedirs(self.staging, exist_ok=True)
            write_json(replaced, sorted(_recorded_shards(read_json(f"{self.path.rstrip('/')}/{META}"))))
        meta = staged(self.staging)
        if meta is None and not self.shared:
            finished = self._finish_moves(staged, fingerprint, progress)
            if finished is not None:
                return finished
        try:
            meta = meta or tokenize(self.staging)
        except UserError:  # (a mistake in an input, found deep inside it: fixing it changes the fingerprint, so
            shutil.rmtree(self.staging, ignore_errors=True)  # the tokens so far serve no later prepare; freed)
            raise
        return self._publish(self.staging, meta, progress) if self.shared else self._replace(self.staging, meta)

    def _finish_moves(self, staged: Callable[..., dict | None], fingerprint: str, progress: bool) -> dict | None:
        """A prepare of this `fingerprint` killed as _replace moved its files here from staging (its meta.json still
        there, this directory's deleted, some files here and the rest there): the rest moved here too, all checked
        as `staged` checks them (a file recorded as it was moved is not read again), then meta.json moved; its meta.
        None where there is no such prepare, or one of its files is not the one its meta.json describes (the
        caller tokenizes again). Until meta.json is here the directory is not prepared: nothing reads a mix."""
        if os.path.exists(os.path.join(self.path, META)):  # (not cut short as it moved: the old prepare is whole, and
            return None  # stays so until the new one is, which a damaged file in staging is not)
        meta = read_json(os.path.join(self.staging, META))
        if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint:
            return None  # (another prepare's: tokenized again in staging, which deletes them, as before)
        if progress:
            print(f"{self.path}: finishing a prepare that stopped as it moved its files into place", file=sys.stderr)
        self._move_files(self.staging, meta)
        if staged(self.path, meta) is None:
            return None
        os.replace(os.path.join(self.staging, META), os.path.join(self.path, META))
        shutil.rmtree(self.staging)
        return meta

    def _replace(self, staging: str, meta: dict) -> dict:
        """Move the prepare in `staging` here in place of the one here (meta.json removed first and moved last: one
        cut short between is not prepared, and _finish_moves completes it) and delete `staging`; its meta."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, META))
        self._move_files(staging, meta)
        os.replace(os.path.join(staging, META), os.path.join(self.path, META))
        shutil.rmtree(staging)
        return meta

    def _move_files(self, staging: str, meta: dict) -> None:
        """Move the files of the prepare in `staging` but its meta.json here (those a kill left there, after some
        were moved), and delete the old shards it replaces. Of the old files only the shards the old meta.json
        lists are deleted (a file of the user's named like one stays)."""
        old, checksums = _replaced(staging), meta.get("checksums", {})
        names = {n for n in os.listdir(staging) if n not in (META, PROGRESS) and not n.startswith(".")}
        recorded = read_json(_checked_path(staging))
        for name in sorted(names):
            # (recorded in staging: moved, it has another path and change time; a record carried over only where
            # staging's is of this very file, else one changed since the kill that stopped a prepare here was passed)
            trusted = name in checksums and isinstance(recorded, dict) and (
                recorded.get(name) == _seen(os.path.join(staging, name), checksums[name])[1])  # fmt: skip
            os.replace(os.path.join(staging, name), os.path.join(self.path, name))
            if trusted:
                record_written(os.path.join(self.path, name), checksums[name])
        new = names | {shard["name"] for shard in meta.get("shards", [])}  # (and those moved before a kill)
        for stale in sorted(old - new):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.path, stale))

    def _publish(self, local: str, meta: dict, progress: bool) -> dict:
        """Upload prepared directory `local` here (meta.json last) and delete `local`; the meta written here."""
        url = self.path.rstrip("/")
        old = _replaced(local)
        storage.remove(f"{url}/{META}")
        names = sorted(n for n in os.listdir(local) if n not in (META, PROGRESS) and not n.startswith("."))
        if progress:
            print(f"uploading {len(names)} files to {url}", file=sys.stderr)
        storage.upload([os.path.join(local, name) for name in names], [f"{url}/{name}" for name in names])
        listed = storage.objects(url)
        for stale in sorted((old & set(listed)) - set(names)):  # a shard of an older, longer prepare (only those)
            storage.remove(f"{url}/{stale}")
        meta = {**meta, "objects": {name: listed[name] for name in names}}
        write_json(f"{url}/{META}", meta)
        shutil.rmtree(local)
        return meta


def _recorded_shards(meta) -> set[str]:
    """The token shards a meta.json lm wrote lists (format 1's train.bin and val.bin, which it does not name):
    the only old files a prepare again deletes; none for anything else."""
    if not isinstance(meta, dict) or meta.get("kind") in ("examples", "preference"):
        return set()
    shards = meta.get("shards")
    names = [s.get("name") for s in shards if isinstance(s, dict)] if isinstance(shards, list) else []
    if "shards" not in meta and "splits" in meta:
        names = [f"{split}.bin" for split in SPLITS]
    return {n for n in names if isinstance(n, str) and OLD_TOKENS.fullmatch(n)}


def _replaced(staging: str) -> set[str]:
    """The old shards a prepare in `staging` replaces, as build recorded them there before it began."""
    names = read_json(os.path.join(staging, REPLACED))
    return {n for n in names if isinstance(n, str) and OLD_TOKENS.fullmatch(n)} if isinstance(names, list) else set()


def strangers(path: str) -> list[str]:
    """The entries of local directory `path` when lm did not write it: none where it holds meta.json, progress.json,
    .next or a lock of lm's (a directory lm prepared, or began to prepare), else all. A prepare into one that holds
    any would replace or delete those named like its own files, and make it a prepared directory, whose tokens
    data.path on it reads instead of its files. In a bucket: none where it holds meta.json, else the names that are
    not lm's shards or rank file (a publish cut short deleted meta.json and left only those)."""
    if storage.is_url(path):
        from lm.tokenizer import RANK_FILE  # (imports tiktoken: only for a bucket, not while a config loads)

        names = storage.names(path)
        return [] if META in names else [n for n in names if not OLD_TOKENS.fullmatch(n) and n != RANK_FILE]
    if not os.path.isdir(path):
        return []
    names = sorted(os.listdir(path))
    return [] if {META, PROGRESS, NEXT, PREPARE_LOCK, READ_LOCK} & set(names) else names


class Shards:
    """The token shards of a prepared directory, read a window at a time: memory-mapped (each when first read,
    by each process), or (`ranged`) as byte ranges, one request per window, all at once."""

    def __init__(self, paths: list[str], dtype: str, ranged: bool):
        self.paths, self.dtype, self.ranged = paths, dtype, ranged
        self._maps = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}  # each worker process maps the shards itself

    def windows(self, shards: np.ndarray, starts: np.ndarray, span: int) -> np.ndarray:
        """Tokens [start, start + span) of each (shard, start), as int32 rows."""
        if self.ranged:
            size = np.dtype(self.dtype).itemsize
            pieces = storage.read_ranges([self.paths[s] for s in shards], starts * size, (starts + span) * size)
            return np.stack([np.frombuffer(p, self.dtype) for p in pieces]).astype(np.int32)
        return np.stack([self._map(s)[a : a + span] for s, a in zip(shards, starts)]).astype(np.int32)

    def _map(self, shard: int) -> np.ndarray:
        if shard not in self._maps:
            self._maps[shard] = np.memmap(self.paths[shard], dtype=self.dtype, mode="r")
        return self._maps[shard]


def example_files(data_dir: str, split: str) -> tuple[str, str, str]:
    """(tokens, loss mask, offsets) files of a split of fine-tune examples."""
    stem = os.path.join(data_dir, f"examples_{split}")
    return f"{stem}.bin", f"{stem}_mask.bin", f"{stem}_idx.npy"


SAMPLES, SAMPLE_BYTES = 64, 1 << 16  # content_digest's pieces: a file of up to 4 MiB is read whole


def content_digest(path: str, first_piece_only: bool = False) -> str:
    """A SHA-256 of a file's size and SAMPLES evenly spaced pieces of it (all of a small file): cheap enough to
    check at every start, and changed by any edit that moves or rewrites tokens. path may be a URL (the pieces
    are read as byte ranges). `first_piece_only`: of a small file, only its first piece, as lm wrote checksums
    from 2026-11-23 to 2026-12-02 (an edit past its first 64 KiB went unseen): digest_matches still reads them."""
    size = storage.size(path)
    sha = hashlib.sha256(str(size).encode())
    if size <= SAMPLES * SAMPLE_BYTES:
        starts, ends = [0], [min(SAMPLE_BYTES, size) if first_piece_only else size]
    else:
        starts = [(size - SAMPLE_BYTES) * i // (SAMPLES - 1) for i in range(SAMPLES)]
        ends = [s + SAMPLE_BYTES for s in starts]
    for piece in storage.read_ranges([path] * len(starts), starts, ends):
        sha.update(piece)
    return sha.hexdigest()


def digest_matches(path: str, expected: str) -> bool:
    """Whether a file still has the content_digest a meta.json recorded, in either way lm has written one."""
    if content_digest(path) == expected:
        return True
    return SAMPLE_BYTES < storage.size(path) <= SAMPLES * SAMPLE_BYTES and content_digest(path, True) == expected


CHECKED = os.path.join(os.path.expanduser("~"), ".cache", "lm", "checksums")  # (checksums_problem's record)
CHECKED_KEEP = 256  # records kept in CHECKED (the newest)
SETTLED_NS = 2 * 10**9  # a file changed this recently may change again within its timestamp's tick: not recorded


def checksums_problem(directory: str, checksums: dict[str, str]) -> str | None:
    """Which file of local `directory` does not have the checksum meta.json records, if any. A file whose stat
    (size, modification and change times, inode, device) is the one recorded in CHECKED when its checksum last
    matched here, in this boot, is not read again: an edit in place changes its times (its change time even where
    the modification time is set back), a file renamed over it its inode, a copy elsewhere its path. The record,
    one JSON per machine and directory, written whole, is left alone where it cannot be read or written."""
    where = _checked_path(directory)
    checked = read_json(where)
    checked = checked if isinstance(checked, dict) else {}
    now, matched = time.time_ns(), {}
    for name, expected in checksums.items():
        path = os.path.join(directory, name)
        stat, seen = _seen(path, expected)  # (before its bytes are read: a change as they are read is seen next time)
        if (seen is None or checked.get(name) != seen) and not digest_matches(path, expected):
            return f"{path} does not match the checksum meta.json records"
        settled = seen is not None and now - max(stat.st_mtime_ns, stat.st_ctime_ns) > SETTLED_NS
        if settled or seen is not None and checked.get(name) == seen:  # (one record_written made stays)
            matched[name] = seen
    if matched != checked:
        _write_checked(where, matched)
    return None


def record_written(path: str, digest: str) -> None:
    """Record in CHECKED that file `path`, just written and renamed into place by this prepare (which holds its
    directory's prepare lock: nothing else writes it), has checksum `digest`: a prepare continued after a kill, and
    the first start on it, read none of it while its stat is the same (a shard cut or changed since is read)."""
    directory, name = os.path.split(path)
    where = _checked_path(directory)
    checked = read_json(where)
    _, seen = _seen(path, digest)
    if seen is not None:
        _write_checked(where, {**(checked if isinstance(checked, dict) else {}), name: seen})


def _seen(path: str, expected: str) -> tuple[os.stat_result | None, list | None]:
    """A file's stat, and what CHECKED records of it with its checksum (size, times, inode, device, this boot);
    None where it cannot be stat'ed."""
    try:
        stat = os.stat(path)
    except OSError:
        return None, None
    return stat, [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev, expected, _boot_id()]


@functools.cache
def _boot_id() -> str:
    """This boot of the machine (Linux's boot_id; "" elsewhere): a record is of one boot, as bytes written and never
    synced may not have reached the disk before a crash (a file of the recorded size and times, holding zeros)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _write_checked(where: str, matched: dict) -> None:
    with contextlib.suppress(OSError):
        os.makedirs(CHECKED, exist_ok=True)
        write_json(where, matched, indent=None)
        _prune_checked(where)


def _prune_checked(kept: str) -> None:
    """Delete the records in CHECKED beyond the CHECKED_KEEP written last, never `kept`: there is one per machine
    and directory, and each container's new hostname added one that was never removed. A record deleted costs only
    reading that directory's checksums once more."""
    with contextlib.suppress(OSError):
        records = sorted((e.stat().st_mtime_ns, e.path) for e in os.scandir(CHECKED) if e.name.endswith(".json"))
        for _, path in records[:-CHECKED_KEEP]:
            if path != kept:
                with contextlib.suppress(FileNotFoundError):  # (another process's prune)
                    os.remove(path)


def _checked_path(directory: str) -> str:
    """The file in CHECKED that records the checksums of `directory` found matching on this machine."""
    key = f"{socket.gethostname()}\0{os.path.realpath(directory)}".encode(errors="surrogateescape")
    return os.path.join(CHECKED, f"{hashlib.sha256(key).hexdigest()[:32]}.json")


def _examples_problem(data_dir: str, meta: dict, itemsize: int) -> str | None:
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
    actual = storage.size(path) if storage.isfile(path) else None
    if actual == expected:
        return None
    return f"{path} has {actual if actual is not None else 'no'} bytes where meta.json records {expected}"


@contextlib.contextmanager
def _flock(path: str, shared: bool, wait: bool = True, saying: str | None = None):
    """Hold flock's shared or exclusive lock on file `path` (lm.files.lock_file), yielding True; where another
    process holds a conflicting one, wait for it (saying so, if `saying`) or, not to `wait`, yield False at once. A
    file that cannot be opened or locked (a directory this user cannot write; a filesystem without locks) yields
    True without a lock."""
    try:
        fd = lock_file(path, shared)
        if fd is None and wait:
            if saying:
                print(saying, file=sys.stderr)
            fd = lock_file(path, shared, wait=True)
    except OSError:
        yield True
        return
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=None)
def _downloaded(url: str, names: tuple[str, ...]) -> str:
    local = storage.temp_dir("lm-tokenizer-")
    for name in names:
        if storage.isfile(f"{url}/{name}"):
            storage.download(f"{url}/{name}", os.path.join(local, name))
    return local
