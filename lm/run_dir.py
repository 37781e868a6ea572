"""Where a run lives and how lm works on it: RunDir, the one place that knows whether a run directory is a local
directory (trained, read and listed in place) or in object storage (run.dir=s3://... or gs://...), which lm works
on in a local copy that it keeps the bucket in step with.

A run directory is appended to (metrics.jsonl) and renamed in (damaged steps), which object storage cannot do. So
a run in a bucket writes its logs into an ordinary directory, its working copy (run.local_dir), and its checkpoints

    gs://  straight into the bucket: orbax writes gs:// itself (TensorStore's gcs driver), every process its part
           of each checkpoint, so a run of several processes (a TPU pod) needs no shared disk, and a checkpoint
           needs no room on the local disk. One process or several alike.
    s3://  into the local copy, then uploaded: orbax-checkpoint (0.12.8) builds TensorStore specs only for local
           paths and gs:// (s3:// paths are mangled; google/orbax#359), so one process only.

and (process 0 only)

    pull   at start: the bucket's files replace the local copy (its committed checkpoints too, for s3://); a step
           the bucket holds without its commit marker (an upload or a save that was killed) is deleted
    push   after each checkpoint is written, and at the end: new complete steps are uploaded (s3://), then every
           other file (config.yaml, metrics.jsonl, status.json, TensorBoard events, ...), then the new steps
           are marked committed (URL/committed/STEP), so the logs in the bucket reach every committed step;
           steps orbax no longer keeps are deleted (marker first)

so a run killed at any moment resumes from its newest committed step. A push runs in a background thread while
training goes on (Uploads); the next save waits for it. Readers (sample.py, lm.eval, lm.export, init_from, lm.runs,
lm.plot) read a temporary copy of what they need, and name it to the user by its URL.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable

import psutil

from lm import storage
from lm.errors import UserError, first_line
from lm.files import read_json, write_json
from lm.scripts import command_line

CHECKPOINTS, COMMITTED = "checkpoints", "committed"
LOCK = ".lock"  # held by a run training in the directory (RunDir.lock)
STATUS_FILE = "status.json"
MARKER = ".lm-local-copy-of"  # in a local copy: the URL it copies, so that only such a directory is ever emptied
SETTLED = ".lm-settled.json"  # in a local copy: the steps the bucket held when it was last pulled or pushed
PUSH_TRIES = 3  # checkpoints in a row whose push may fail (the bucket out of reach) before the run stops
NATIVE = ("gs",)  # the protocols orbax writes checkpoints to itself
SUMMARY_FILES = ("config.yaml", "metrics.jsonl", "status.json")  # what lm.runs and lm.plot read of a run


@dataclasses.dataclass(frozen=True)
class RunDir:
    """A run directory as the user named it (run.dir, or the RUN_DIR of sample.py, lm.eval, lm.runs, lm.plot);
    `local_dir` is run.local_dir, where a run in a bucket is worked on ("": a directory of the temp dir named by
    its URL)."""

    path: str
    local_dir: str = ""

    def __post_init__(self):
        if self.works_in_copy:
            object.__setattr__(self, "path", storage.normalized(self.path))  # one spelling of the URL
            # the copy's place, resolved once: it is recorded in the run's config
            chosen = os.path.abspath(self.local_dir) if self.local_dir else storage.work_place(self.path, "lm-runs")
            object.__setattr__(self, "local_dir", chosen)

    @classmethod
    def of(cls, run) -> RunDir:
        """The run directory of a RunConfig."""
        return cls(run.dir, run.local_dir)

    @property
    def works_in_copy(self) -> bool:
        """Whether the run is worked on in a local copy (it is in object storage), which run.local_dir names."""
        return storage.is_url(self.path)

    @property
    def work(self) -> str:
        """The directory the run writes its logs to: run.dir itself, or the local copy of a run in a bucket."""
        return self.local_dir if self.works_in_copy else self.path

    @property
    def checkpoints(self) -> str:
        """Where the run's checkpoints are written: in the bucket itself for gs://, else in work."""
        if self.works_in_copy and _native(self.path):
            return f"{self.path.rstrip('/')}/{CHECKPOINTS}"
        return os.path.join(self.work, CHECKPOINTS)

    def for_training(self, local_steps: Callable[[], list[int]]) -> Uploads | None:
        """Ready to train, with what pushes the run back to its bucket (process 0 of a run in a bucket), else
        None (a local directory is trained in place). A bucket is checked writable and its state pulled into
        the local copy by process 0 (the others only write their parts of the checkpoints); s3:// is refused
        for several processes. `local_steps` lists the complete checkpoints in the local copy."""
        if not self.works_in_copy:
            return None
        import jax
        from jax.experimental import multihost_utils

        protocol = self.path.partition("://")[0]
        if jax.process_count() > 1 and not _native(self.path):
            raise UserError(
                f"run.dir={self.path}: orbax cannot write checkpoints to {protocol}:// (google/orbax#359), and the "
                "processes of a multi-host run each write their part of every checkpoint; use a gs:// bucket or a "
                "shared filesystem"
            )
        if _native(self.path) and set("#?") & set(self.path):  # (gs://runs/q?x wrote its arrays under gs://runs/q/)
            raise UserError(
                f"run.dir={self.path} has '#' or '?' in its URL, where TensorStore, which writes a checkpoint's "
                f"arrays to {protocol}://, ends the path: they would go elsewhere, never to be read back; name the run "
                "without them"
            )
        storage.check_writable(self.path, "run.dir", f"-{jax.process_index()}")
        if jax.process_count() > 1:  # every process's probe is deleted before process 0 lists the bucket to pull it
            multihost_utils.sync_global_devices("lm: run directory probed")
        uploads = None
        if jax.process_index() == 0:
            copy = WorkingCopy(self.path, self.work)
            if _native(self.path):
                # (orbax's listing of a gs:// run before the pull deletes a partial step left it unable to write
                # that step again: its steps without markers are deleted, as an interrupted save's are)
                copy.pull(only_step=-1)
            elif not copy.push_if_ahead(local_steps()):
                copy.pull()
            uploads = Uploads(copy, local_steps)
        if jax.process_count() > 1:  # no process lists the checkpoints before process 0 has deleted uncommitted ones
            multihost_utils.sync_global_devices("lm: run directory pulled")
        return uploads

    def lock(self) -> contextlib.AbstractContextManager:
        """Held while a run trains here (by its process 0): a second run on the same directory is refused in one
        line, not left to write the same checkpoints (each failing the other's saves and restores). An exclusive
        flock on RUN_DIR/.lock, or for a run in a bucket on a file of this machine's temporary directory named by
        its URL (whatever run.local_dir its working copy has); the system releases it when the process ends,
        however it ends. Runs on other machines sharing a bucket are not seen."""
        path = storage.work_place(self.path, "lm-runs") + LOCK if self.works_in_copy else os.path.join(self.path, LOCK)
        return _locked(path, self.path)

    def read_copy(self, step: int | None = None, every_step: bool = False) -> str:
        """A local directory to read the run (or checkpoint step) from (sample.py, lm.eval, lm.export,
        init_from): a local one itself; one in a bucket copied into a temporary directory removed at exit, made
        once per process for each set of committed steps: the run's files and one committed checkpoint (the step
        the URL names, else `step`, else the newest), or all of them with `every_step` (to choose the best)."""
        if not self.works_in_copy:
            return os.path.abspath(self.path)
        url = self.path.rstrip("/")
        run_url, named = _split(url)
        fixed = named is not None or (step is not None and not every_step)  # one step: it never changes
        # (the newest or best of a run that trained on since, in a notebook's process: read again, not the old copy)
        marks = () if fixed else tuple(storage.names(f"{run_url}/{COMMITTED}"))
        return _read_copy(url, None if every_step else step, every_step, marks)

    def shown(self, step_dir: str) -> str:
        """How checkpoint step directory `step_dir` (of read_copy()) is named to the user: as it is, or for a
        run in a bucket by its URL, not by the temporary copy read."""
        if not self.works_in_copy:
            return step_dir
        return f"{_split(self.path)[0]}/{CHECKPOINTS}/{os.path.basename(step_dir)}"

    def summary_copy(self) -> str:
        """A local directory holding what a run's summary and plot read: itself, or for a run in a bucket a
        temporary copy of its SUMMARY_FILES with its committed steps as empty checkpoints/STEP directories
        (never its checkpoints' contents)."""
        return _summary_copy(self.path.rstrip("/")) if self.works_in_copy else self.path

    def runs(self) -> list[RunDir]:
        """The runs here: this directory if it is a run (it holds one of SUMMARY_FILES), else those directly
        under it, by name."""
        root = self.path.rstrip("/") if self.works_in_copy else self.path
        if _is_run(root):
            return [RunDir(root)]
        found = []
        for path in (os.path.join(root, name) for name in storage.names(root)):
            try:
                if _is_run(path):
                    found.append(RunDir(path))
            except UserError as e:  # (one that cannot be read: the others are still listed)
                print(f"warning: {e} (left out)", file=sys.stderr)
        return found


@contextlib.contextmanager
def _locked(path: str, run: str):
    import fcntl

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise unwritable(os.path.dirname(path), e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise UserError(
                f"another process (pid {holder}) is training {run}; wait for it to end, or give this run another "
                "run.name or run.dir"
            ) from None
        except OSError as e:  # a filesystem without locks (NFS without its lock daemon, say)
            raise UserError(
                f"cannot lock {path} ({e.strerror or e}), which keeps a second run out of {run}; put run.dir on a "
                "filesystem with locks (a local disk)"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError as e:  # a full disk: the file is new and empty, its pid needs a block
            raise UserError(
                f"cannot write {path}: {e.strerror or e}; free space (or set run.dir to another disk), then run the "
                "same command"
            ) from None
        yield
    finally:
        os.close(fd)  # the lock goes with it


def unwritable(directory: str, e: OSError) -> UserError:
    """The error for a run directory that cannot be written: a run already there (its checkpoints on a disk
    remounted read-only, say) is resumed from a copy, as another run.dir would start it over, from step 0."""
    if holds_run(directory):
        fix = ("make it writable (was it remounted read-only?), or copy the run to a writable directory and resume "
               f"the copy: {command_line('train')} COPY/config.yaml")  # fmt: skip
    else:
        fix = "set run.dir to a writable directory"
    return UserError(f"cannot write run directory {directory}: {e.strerror or e}; {fix}")


def uncommit(checkpoints: str, step: int) -> None:
    """Remove the commit marker of `step` where `checkpoints` is a run's checkpoints/ in a bucket (see the module's
    docstring), before the step itself is moved or deleted: a reader never finds a marker without its step."""
    if storage.is_url(checkpoints) and checkpoints.endswith(f"/{CHECKPOINTS}"):
        storage.remove(f"{checkpoints[: -len(CHECKPOINTS)]}{COMMITTED}/{step}")


def new_run(run) -> str:
    """The setting advice gives to start a new run, given this RunConfig: run.name=NEW, or run.dir=NEW for a run
    named by its directory (run.dir given, where run.name=NEW beside it was refused as the two both given)."""
    return "run.name=NEW" if run.name else "run.dir=NEW"


def setting(key: str, value) -> str:
    """KEY=VALUE as advice gives it, to paste as it is: the value quoted for the shell where it needs it (a space, a
    quote or a $ in a path)."""
    return f"{key}={shlex.quote(str(value))}"


def branch(step_dir: str, new: str) -> str:
    """The settings advice gives to start a new run (`new`: new_run's) from checkpoint `step_dir`."""
    return f"{setting('init_from', step_dir)} {new}"


def shown_dir(directory: str) -> str:
    """How a directory of a run's working copy (its checkpoints/, say) is named to the user: by its place in the
    bucket the copy is of (its MARKER says which), else as it is."""
    parts = os.path.normpath(directory).split(os.sep) if not storage.is_url(directory) else []
    for top in range(len(parts) - 1, 0, -1):
        try:
            with open(os.path.join(os.sep.join(parts[:top]) or os.sep, MARKER)) as f:
                url = f.read().strip()
        except OSError:
            continue
        return "/".join([url, *parts[top:]])
    return directory


def read_status(run_dir: str) -> dict:
    """RUN_DIR/status.json, or {} for a run without one (started by an older lm, or never started)."""
    status = read_json(os.path.join(run_dir, STATUS_FILE))
    if not isinstance(status, dict):
        return {}
    # a field of another type (a hand-edited or damaged file) is dropped: the rest of the row still says something
    kinds = {"status": str, "host": str, "pid": int, "started": float, "ended": float, "previous_seconds": float}
    return {
        k: v
        for k, v in status.items()
        if k not in kinds or (finite(v) if kinds[k] is float else isinstance(v, kinds[k])) and not isinstance(v, bool)
    }


def finite(x) -> bool:
    """Whether x is a finite number (a JSON file's field, which may hold anything)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def _alive(pid: int, started: float) -> bool:
    """Whether `pid` is still the process that wrote status.json at `started` (pids get reused)."""
    try:
        process = psutil.Process(pid)
        # The recorded process was created before it wrote `started`; a later one only shares the pid.
        return process.status() != psutil.STATUS_ZOMBIE and process.create_time() <= started + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def effective_status(status: dict) -> str:
    """The recorded status, with a "running" whose process is gone (on this host) read as "killed"."""
    state = status.get("status", "unknown")
    same_host = status.get("host") == socket.gethostname()
    known = "pid" in status and "started" in status  # (a damaged file without them: left as it says)
    if state == "running" and same_host and known and not _alive(status["pid"], status["started"]):
        return "killed"
    return state


def copy_of(directory: str) -> str | None:
    """The URL (one spelling) of the run that local directory `directory` is a local copy of, if it is one."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            return storage.normalized(f.read().strip())
    except OSError:
        return None


def _is_run(path: str) -> bool:
    return bool(set(SUMMARY_FILES) & set(storage.names(path)))


def holds_run(directory: str) -> bool:
    """Whether a local directory is a run's own: its config.yaml beside its checkpoints, metrics or status (the
    config.yaml that resumes that run; a corpus directory's walk leaves such a directory out)."""
    return os.path.isfile(os.path.join(directory, "config.yaml")) and any(
        os.path.exists(os.path.join(directory, name)) for name in ("checkpoints", "metrics.jsonl", "status.json")
    )


def _native(url: str) -> bool:
    """Whether orbax writes the checkpoints of a run at `url` into the bucket itself (no local copy of them)."""
    return url.partition("://")[0] in NATIVE


class Uploads:
    """The pushes of a run in a bucket: each in a background thread once its checkpoint is written, so training
    goes on while a checkpoint is uploaded; one at a time, the last ended before the next save begins (orbax's
    save may delete a step it no longer keeps). A push that fails (the bucket out of reach for a while) is a
    warning, and the next one brings the bucket up to the local copy; PUSH_TRIES in a row stop the run."""

    def __init__(self, copy: WorkingCopy, local_steps: Callable[[], list[int]]):
        self.copy, self.local_steps = copy, local_steps
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lm-upload")
        self._job = None
        self._failed = 0  # pushes in a row that failed

    def start(self, written: Callable[[], None]) -> None:
        """Push once `written()` returns (the checkpoint being saved is complete on disk), in the background."""
        self.wait()
        self._job = self._pool.submit(self._written_then_pushed, written)

    def _written_then_pushed(self, written: Callable[[], None]) -> Exception | None:
        written()  # (a checkpoint that could not be written: its failure, which wait raises)
        try:
            self.push()
        except Exception as e:  # the bucket out of reach, or refusing: tried again by the next push
            return e
        return None

    def wait(self) -> None:
        """Until the push in the background has ended; raise the failure of its checkpoint's write. A failed push
        is a warning, until PUSH_TRIES in a row have failed: then one line saying how to go on."""
        job, self._job = self._job, None
        if job is None:
            return
        failure = job.result()
        if failure is None:
            self._failed = 0
            return
        self._failed += 1
        said = first_line(failure)
        if self._failed >= PUSH_TRIES:
            raise UserError(
                f"cannot push to {self.copy.url} ({said}), at {self._failed} checkpoints in a row; the local copy "
                f"{self.copy.local} holds every checkpoint: run the same command again once the bucket can be reached "
                "(on this machine, it uploads what the bucket lacks first)"
            )
        print(f"warning: a checkpoint's push to {self.copy.url} failed ({said}); the next checkpoint's push tries "
              f"again, and {self.copy.local} holds it meanwhile", file=sys.stderr)  # fmt: skip

    def push(self) -> None:
        self.copy.push(self.local_steps())

    def finish(self, quietly: bool = False) -> None:
        """The last push, after the one in the background; then the thread ends. `quietly`: after another
        failure, which is the one to report."""
        try:
            for part in (self.wait, self.push):
                try:
                    part()
                except Exception:
                    if not quietly:
                        raise
        finally:
            self._pool.shutdown(wait=False)


@contextlib.contextmanager
def pushed_at_exit(uploads: Uploads | None):
    """Push once more (when there is a bucket) as the block ends: after a failure or a signal too, so the bucket
    gets status.json and the logs."""
    try:
        yield
    except BaseException:
        if uploads:
            uploads.finish(quietly=True)
        raise
    if uploads:
        uploads.finish()


class WorkingCopy:
    """A local directory kept in step with a run in a bucket (see the module's docstring)."""

    def __init__(self, url: str, local: str):
        self.url, self.local = url.rstrip("/"), local
        self.fs = storage.filesystem(url)
        # step -> the local step directory's identity when the bucket got it (pulled or pushed): a step written
        # again since (its damaged copy set aside, lm.checkpoint) is uploaded again, replacing the bucket's
        self._settled: dict[int, tuple[int, int] | None] = {}
        self._kept_aside: set[str] = set()  # the local copy's damaged steps set aside that the bucket has

    def _identity(self, step: int) -> tuple[int, int] | None:
        """(inode, mtime) of the local step directory: orbax writes a step as a new directory, renamed into place."""
        try:
            st = os.stat(os.path.join(self.local, CHECKPOINTS, str(step)))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _key(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def _call(self, what: str, function, *args):
        return storage.call(self.url, what, function, *args)

    def _names(self, *parts: str) -> list[str]:
        """The names directly under URL/parts ([] where there is nothing)."""
        return storage.names(self._key(*parts))

    def committed(self) -> list[int]:
        return sorted(int(n) for n in self._names(COMMITTED) if n.isdigit())

    def _files(self, *parts: str) -> list[str]:
        """Every object under URL/parts, as paths relative to it."""
        root = self._key(*parts)
        self.fs.invalidate_cache()
        try:
            found = self._call("list", self.fs.find, root)
        except FileNotFoundError:
            return []
        bare = root.split("://", 1)[1]
        return sorted(p[len(bare) + 1 :] for p in found if p.startswith(bare + "/"))

    def _download(self, relative: str) -> None:
        target = os.path.join(self.local, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            storage.download(self._key(relative), target)
        except FileNotFoundError:
            raise UserError(
                f"{self._key(relative)} was deleted while it was read (the run rotates its checkpoints as it "
                "trains); try again, or name an older step that the run keeps"
            ) from None

    def pull(self, only_step: int | None = None, reader: bool = False) -> None:
        """Make the local copy what the bucket holds (an empty directory for a new run): with `only_step`, of its
        committed checkpoints that one only (-1: none). Only a directory that is empty, or that a run of this URL
        made (its MARKER says so), is emptied first. A `reader` leaves a step uploaded without its marker alone:
        the run may be uploading it now."""
        if os.path.isdir(self.local) and os.listdir(self.local) and not self._ours():
            raise UserError(
                f"run.local_dir {self.local} holds other files (it is not a local copy of {self.url}); "
                "give an empty or new directory"
            )
        shutil.rmtree(self.local, ignore_errors=True)
        try:
            os.makedirs(self.local)
            with open(os.path.join(self.local, MARKER), "w") as f:
                f.write(self.url)
        except OSError as e:  # (a run.local_dir under a file, or where this user cannot write: another machine's)
            raise UserError(
                f"cannot make run.local_dir {self.local}, the local copy of {self.url}: {e.strerror or e}; set "
                "run.local_dir to a writable directory"
            ) from None
        committed = set(map(str, self.committed() if reader else self._clean()))
        wanted = committed if only_step is None else {str(only_step)}
        for relative in self._files():
            top = relative.split("/", 1)[0]
            if top == COMMITTED or (top == CHECKPOINTS and relative.split("/")[1] not in wanted):
                continue
            self._download(relative)
        self._settled = {int(name): self._identity(int(name)) for name in wanted if name.isdigit()}
        if not reader:
            self._record()

    def _ours(self) -> bool:
        """Whether the local directory is a copy of this URL (its MARKER says so, in any spelling of it)."""
        return copy_of(self.local) == storage.normalized(self.url)

    def _clean(self) -> list[int]:
        """Delete the bucket's steps that have no commit marker (an upload or a save that was killed) and the
        markers whose step is gone; return the committed steps."""
        committed = set(map(str, self.committed()))
        steps = self._names(CHECKPOINTS)
        for name in steps:
            if name not in committed and ".unreadable" not in name:  # (a damaged step set aside is kept)
                print(f"warning: deleting {self._key(CHECKPOINTS, name)}: it has no commit marker (its upload, or "
                      "its deletion under train.keep, was interrupted)", file=sys.stderr)  # fmt: skip
                self._delete(CHECKPOINTS, name)
        for name in committed - set(steps):  # a kill between orbax's deletion of a step and its marker's
            self._delete(COMMITTED, name)
            committed.discard(name)
        return sorted(map(int, committed))

    def _record(self) -> None:
        """Write down the steps the bucket holds now, as this copy has them, and the set-aside steps it has of this
        copy's (push_if_ahead reads it)."""
        steps = {str(step): ident for step, ident in self._settled.items()}
        write_json(os.path.join(self.local, SETTLED), {"steps": steps, "set_aside": sorted(self._kept_aside)})

    def push_if_ahead(self, local_steps: list[int]) -> bool:
        """Where this local copy (of an s3:// run) holds complete steps newer than the bucket's newest committed one
        (its run stopped after pushes that failed), and the bucket holds no committed step that the copy neither
        recorded nor has (no other run pushed meanwhile), bring the bucket up to the copy rather than the copy
        down to the bucket, which would delete those steps; whether it did."""
        record = read_json(os.path.join(self.local, SETTLED)) if self._ours() else None
        if not isinstance(record, dict) or not isinstance(record.get("steps"), dict):
            return False
        recorded, committed = record["steps"], self.committed()
        newer = [step for step in local_steps if step > max(committed, default=-1)]
        if not newer or any(str(step) not in recorded and step not in local_steps for step in committed):
            return False
        if recorded and not any(str(step) in recorded for step in committed):
            return False  # (the bucket lost every step it had: the run was deleted there, and starts anew)
        steps = ("step " if len(newer) == 1 else "steps ") + ", ".join(map(str, newer))
        print(f"{self.local} holds {steps}, which {self.url} lacks (pushes that "
              "failed): uploading them", file=sys.stderr)  # fmt: skip
        self._settled = {int(step): tuple(ident) if ident else None for step, ident in recorded.items()}
        self._kept_aside = set(record.get("set_aside") or [])
        self._clean()
        self.push(local_steps)
        return True

    def push(self, local_steps: list[int]) -> None:
        """Bring the bucket up to the local copy, whose complete checkpoints are `local_steps` (the caller has
        waited for every checkpoint write to end)."""
        committed = self.committed()
        if _native(self.url):  # orbax wrote them into the bucket: only their markers are new
            new = [step for step in local_steps if step not in committed]
        else:  # new, or written again here since the bucket got them (a damaged copy set aside)
            changed = lambda step: self._settled.get(step) != self._identity(step)
            new = [step for step in local_steps if step not in committed or changed(step)]
        if not _native(self.url):
            self._push_set_aside()
        for step in [] if _native(self.url) else new:
            if step in committed:  # its marker first: a kill during the upload leaves the step uncommitted
                self._delete(COMMITTED, str(step))
                self._delete(CHECKPOINTS, str(step))
            self._upload_tree(os.path.join(self.local, CHECKPOINTS, str(step)))
        # The logs before the markers: a run resumed from a committed step finds every row logged up to it.
        self._upload_tree(self.local, skip=(CHECKPOINTS, MARKER, SETTLED))
        for step in new:
            self._call("write", self.fs.pipe_file, self._key(COMMITTED, str(step)), b"")
            self._settled[step] = self._identity(step)
        for step in committed:
            if step not in local_steps:  # orbax's keep/best policy deleted it (in the bucket itself, for gs://)
                self._delete(COMMITTED, str(step))
                self._delete(CHECKPOINTS, str(step))
                self._settled.pop(step, None)
        self._record()

    def _push_set_aside(self) -> None:
        """Upload the damaged steps set aside in the local copy (lm.checkpoint.set_aside: STEP.unreadable), which
        the bucket keeps as a local run does, under a name the bucket's earlier ones leave free, before the
        step's damaged copy in the bucket is replaced or deleted."""
        local = os.path.join(self.local, CHECKPOINTS)
        names = [n for n in (os.listdir(local) if os.path.isdir(local) else []) if ".unreadable" in n]
        present = set(self._names(CHECKPOINTS)) if set(names) - self._kept_aside else set()
        for name in sorted(set(names) - self._kept_aside):
            step, target, n = name.split(".")[0], name, 1
            while target in present:
                n += 1
                target = f"{step}.unreadable-{n}"
            self._upload_tree(os.path.join(local, name), to=f"{CHECKPOINTS}/{target}")
            present.add(target)
            self._kept_aside.add(name)

    def _delete(self, *parts: str) -> None:
        """URL/parts and everything under it, if there is anything."""
        storage.remove(self._key(*parts), recursive=True)

    def _upload_tree(self, top: str, skip: tuple[str, ...] = (), to: str | None = None) -> None:
        """Every file under local directory `top` to its place in the bucket (or under URL/`to`), but for the names
        `skip` in `top`; several at once."""
        files = []
        for root, dirs, names in os.walk(top):
            if root == top:
                dirs[:] = [d for d in dirs if d not in skip]
            files += [os.path.join(root, name) for name in names if not (root == top and name in skip)]
        key = lambda f: self._key(to, os.path.relpath(f, top)) if to else self._key(os.path.relpath(f, self.local))
        storage.upload(files, [key(f) for f in files])


def _split(url: str) -> tuple[str, str | None]:
    """(run URL, step or None) of a run's URL, its checkpoints/ directory, or one of its step directories (as a
    local run's are read: its checkpoints/ was "no committed checkpoint")."""
    run_url = url.rstrip("/")
    parent, _, last = run_url.rpartition("/")
    if last.isdigit() and parent.endswith("/" + CHECKPOINTS):
        return parent.rsplit("/", 1)[0], last
    return (parent, None) if last == CHECKPOINTS and parent.partition("://")[2] else (run_url, None)


@functools.lru_cache(maxsize=None)
def _read_copy(url: str, step: int | None, every_step: bool, marks: tuple[str, ...] = ()) -> str:
    """(`marks`: the bucket's commit markers when the copy was asked for, so that a new step makes a new copy.)"""
    run_url, named = _split(url)
    local = storage.temp_dir("lm-read-")
    run = WorkingCopy(run_url, local)
    present = set(run._names(CHECKPOINTS))  # a marker whose step is gone (set aside, then killed): passed over
    committed = [step for step in run.committed() if str(step) in present]
    if not committed:
        if not storage.bucket_exists(run_url):  # (it said the run holds no committed checkpoint)
            raise UserError(f"{run_url}: bucket {storage.bucket(run_url)} does not exist; fix the URL (or the storage "
                            "endpoint)")  # fmt: skip
        if held := _committed_runs(run_url):  # (s3://bucket/runs: "holds no committed checkpoint")
            raise runs_not_a_run(run_url, held)
        if storage.isfile(f"{run_url}/config.json"):  # lm.export's output, given as a run (as a local one is said)
            raise UserError(f"{run_url} holds a model in Hugging Face format (config.json), not lm's checkpoints; "
                            f"download it ({storage.download_command(run_url)}) and give it as hf:DIR")  # fmt: skip
        raise UserError(f"{run_url} holds no committed checkpoint; give a run directory that has one")
    wanted = None if every_step else int(named or (step if step is not None else committed[-1]))
    if wanted is not None and wanted not in committed:
        raise UserError(
            f"{run_url} holds no committed checkpoint {wanted}; available: {', '.join(map(str, committed))}"
        )
    run.pull(only_step=wanted, reader=True)
    return os.path.join(local, CHECKPOINTS, named) if named else local


def _committed_runs(url: str) -> list[str]:
    """The runs directly under bucket URL `url` that hold a committed checkpoint, by when their newest was committed:
    the latest last."""
    found = []
    for name in storage.names(url):
        run = f"{url}/{name}"
        if steps := sorted(int(n) for n in storage.names(f"{run}/{COMMITTED}") if n.isdigit()):
            found.append((storage.modified(f"{run}/{COMMITTED}/{steps[-1]}") or 0, run))
    return [run for _, run in sorted(found)]


def runs_not_a_run(path: str, held: list[str]) -> UserError:
    """The error for a directory of runs `held` (the newest last) given where one run is asked for."""
    listed = f"`python -m lm.runs {shlex.quote(path)}` lists them"
    others = f" ({len(held)} runs there; {listed})" if len(held) > 1 else ""
    return UserError(f"{path} is a directory of runs, not a run; give one of them, e.g. {shlex.quote(held[-1])}"
                     f"{others}")  # fmt: skip


@functools.lru_cache(maxsize=None)
def _summary_copy(url: str) -> str:
    run = WorkingCopy(url, os.path.join(storage.temp_dir("lm-summary-"), url.rsplit("/", 1)[-1]))
    present = set(SUMMARY_FILES) & set(storage.objects(url))
    if not present:
        raise UserError(f"{url} holds no run (no {', '.join(SUMMARY_FILES)}); pass run directories' URLs (URL/NAME)")
    for name in sorted(present):
        run._download(name)
    written = storage.modified(run._key("metrics.jsonl")) if "metrics.jsonl" in present else None
    if written is not None:  # (a killed run's wall time ends at its last write to it, not at this download)
        os.utime(os.path.join(run.local, "metrics.jsonl"), (written, written))
    for step in run.committed():
        os.makedirs(os.path.join(run.local, CHECKPOINTS, str(step)))
    return run.local
