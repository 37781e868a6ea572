"""The runs under a directory at a glance: model size, progress, best validation loss, status, wall time.

    python -m lm.runs [runs/] [--json | --quiet]

Status and wall time come from RUN_DIR/status.json, which the training loop keeps (`track_status`):
"running" with its pid, host and start time while a process works on the run, then "finished",
"stopped" (ended before train.steps without a signal), "preempted" (SIGTERM, Ctrl-C or SIGHUP, with a
checkpoint), "interrupted" (a second Ctrl-C: no checkpoint of its own; a resume starts from the last one) or
"failed" (with the error). A process killed outright leaves "running" behind; on
the host that ran it the table shows such a run as "killed". Everything else is read from what
the run wrote anyway: config.yaml, metrics.jsonl and checkpoints/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shlex
import socket
import sys
import time

import jax
import jax.numpy as jnp

from lm import config as config_lib
from lm import storage
from lm.checkpoint import complete_steps, trained_runs
from lm.config import ModelConfig
from lm.errors import ArgumentParser, Stopped, UserError, cli, first_line, peer_lost
from lm.files import write_json
from lm.metrics import read_metrics
from lm.model import count_params, init_params
from lm.run_dir import STATUS_FILE, RunDir, effective_status, finite, read_status
from lm.scripts import command_line

# What the training loop records; "killed" and "unknown" are only ever inferred by the reader.
STATUSES = ("running", "finished", "stopped", "preempted", "interrupted", "failed")


def write_status(run_dir: str, status: str, idle: bool = False, **info) -> dict:
    """Record the run's state in RUN_DIR/status.json, atomically: a reader never sees half a file.

    "running" starts a segment (this process's pid and host, the time) and folds the earlier
    segments into `previous_seconds`, so a resumed run's wall time counts every process that
    worked on it. Any other status ends the segment; `idle` (a command stopped during its start-up,
    which began no segment) leaves the wall time as it was: the last segment keeps its own end. `info`
    adds fields, e.g. error="...".
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    now = time.time()
    old = read_status(run_dir)
    if status == "running":
        record = {
            "status": status,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": now,
            "previous_seconds": wall_seconds(old, run_dir, now) or 0.0,
        }
    else:
        record = {k: v for k, v in old.items() if k != "error"} | {"status": status, "ended": now}
        if idle and "started" in old:  # (a killed segment ends at its last write to metrics.jsonl)
            record["ended"] = _segment_end(old, run_dir, now, gone=True)
    record.update(info)
    path = os.path.join(run_dir, STATUS_FILE)
    try:
        write_json(path, record, indent=1)
    except OSError as e:  # a full disk or a vanished run directory must not hide the run's own error
        if not _rewritten_in_place(path, record):
            print(f"warning: cannot write {path} ({e.strerror or e})", file=sys.stderr)
    return record


def _rewritten_in_place(path: str, record: dict) -> bool:
    """Whether `record` could overwrite status.json's own bytes, where its atomic write could not be made: a full disk
    has no room for the new file, but the old one's space takes the few hundred bytes that say how the run ended
    (which would otherwise stay "running", read as "killed"). A reader may find it half-written for that moment."""
    if storage.is_url(path):
        return False
    data = (json.dumps(record, indent=1, ensure_ascii=False) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.truncate(len(data))
    except OSError:
        return False
    return True


@dataclasses.dataclass
class Outcome:
    """How a tracked block ended; the block sets `status` to "stopped" or "preempted" when it is not "finished"."""

    status: str = "finished"


@contextlib.contextmanager
def track_status(run_dir: str, enabled: bool = True):
    """Mark the run "running" for the duration of the block, then record how the block ended.

    lm.errors.Stopped (a signal before training) records "stopped", a KeyboardInterrupt (a second Ctrl-C)
    "interrupted"; any other exception records "failed" with its one-line description. All propagate.
    `enabled=False` (every process but the first of a multi-host run) writes nothing.
    """
    outcome = Outcome()
    if enabled:
        started = write_status(run_dir, "running")["started"]
    try:
        yield outcome
    except Stopped:
        if enabled:  # (its segment ends where it began: a start-up stopped before any step leaves the wall time)
            write_status(run_dir, "stopped", ended=started)
        raise
    except KeyboardInterrupt:
        if enabled:
            write_status(run_dir, "interrupted")
        raise
    except BaseException as e:
        if enabled:
            write_status(run_dir, "failed", error=failure_line(e))
        raise
    if enabled:
        write_status(run_dir, outcome.status)


def failure_line(e: BaseException) -> str:
    """One line for status.json: a user error's own message (a lost process's, as the command says it: JAX's raw
    Gloo error was recorded where the loss came during a resume's restore), otherwise the exception's type and
    first line."""
    if lost := peer_lost(e):
        return lost
    text = first_line(e)
    if isinstance(e, UserError) or text == type(e).__name__:
        return text
    return f"{type(e).__name__}: {text}"


def wall_seconds(status: dict, run_dir: str, now: float | None = None) -> float | None:
    """Seconds that processes spent on the run, summed over resumes; None without a status.json."""
    if "started" not in status:
        return None
    end = _segment_end(status, run_dir, time.time() if now is None else now)
    return status.get("previous_seconds", 0.0) + max(end - status["started"], 0.0)


def _segment_end(status: dict, run_dir: str, now: float, gone: bool = False) -> float:
    """When the last segment of a status with a start ended: its recorded end, now while it runs, or, for a
    killed process, its last write to metrics.jsonl: one seen gone on this host, or on any host where the caller
    knows it is (`gone`: it holds the run's lock, which the process would hold)."""
    started = status["started"]
    if "ended" in status:
        return status["ended"]
    if (gone and status.get("status") == "running") or effective_status(status) == "killed":
        try:
            return max(started, os.path.getmtime(os.path.join(run_dir, "metrics.jsonl")))
        except OSError:
            return started
    return now


def given_or_latest(given: str | None) -> str:
    """A command's model argument, or where it is left out the newest run (latest_run); an empty one (an unset
    shell variable, `sample.py "$RUN"`) is refused, not read as left out: it chose the newest run, unsaid."""
    if given == "":
        raise UserError("the run given is empty ''; give RUN_DIR (runs/NAME), a checkpoint or hf:DIR, or leave it "
                        "out for the newest run")  # fmt: skip
    return given or latest_run()


def latest_run() -> str:
    """The run directory under runs/ whose latest checkpoint was written last."""
    root = "runs"
    found = trained_runs(root)
    if not found:
        raise UserError(
            f"no run with a checkpoint under {os.path.abspath(root)}; train one ({command_line('train')}) or pass "
            "RUN_DIR"
        )
    return found[-1]


@functools.cache
def param_count(model: ModelConfig) -> int | None:
    """Parameters of a model, from shapes alone: nothing is allocated and no device is touched. None where the
    config leaves the shapes to the data (vocab_size or max_seq_len 0: an empty or damaged config.yaml)."""
    if not model.vocab_size or not model.max_seq_len:
        return None
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    # (the attention kernel holds no parameters; a run's own, cudnn, is refused where no CUDA GPU is: a table)
    model = dataclasses.replace(model, attention="dot_product")
    return count_params(jax.eval_shape(lambda k: init_params(model, k), key))


@dataclasses.dataclass
class RunSummary:
    name: str
    path: str
    params: int | None  # None where config.yaml is missing or unreadable
    tokens: int | None  # tokens trained on, at the last logged step
    step: int | None  # last logged step
    steps: int | None  # train.steps
    best_val_loss: float | None
    best_val_bpb: float | None
    accuracy: dict[str, float]  # each train.eval_tasks task's accuracy at the latest evaluation that scored it
    last_checkpoint: int | None
    status: str  # one of STATUSES, or "killed" / "unknown" (see the module docstring)
    wall_seconds: float | None
    error: str | None  # a failed run's one-line error


def summarize(run_dir: str) -> RunSummary:
    cfg = None
    config_path = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(config_path) and os.path.getsize(config_path):  # (an empty one: the defaults, no run's)
        try:
            cfg = config_lib.load(config_path)
        except UserError:
            pass  # written by another lm version: the rest of the row still says something
    try:
        rows = read_metrics(run_dir)
    except UserError:
        rows = []  # a metrics.jsonl that cannot be read: the rest of the row still says something
    trained = [r for r in rows if finite(r.get("tokens"))]
    # the best of the finite ones: min() of a list with a NaN in it is NaN or not, by its place (and --json's NaN is
    # no JSON)
    val_loss = [r["val_loss"] for r in rows if finite(r.get("val_loss"))]
    val_bpb = [r["val_bpb"] for r in rows if finite(r.get("val_bpb"))]
    accuracy = {k.removeprefix("acc/"): v for r in rows for k, v in r.items() if k.startswith("acc/") and finite(v)}
    try:
        ckpts = complete_steps(os.path.join(run_dir, "checkpoints"))
    except UserError as e:  # (checkpoints that cannot be read: the rest of the row still says something)
        print(f"warning: {e} (the row shows no checkpoint)", file=sys.stderr)
        ckpts = []
    status = read_status(run_dir)
    state = effective_status(status)
    if state == "unknown" and cfg and ckpts and ckpts[-1] == cfg.train.steps:
        state = "finished"
    return RunSummary(
        name=os.path.basename(os.path.normpath(run_dir)),
        path=run_dir,
        params=param_count(cfg.model) if cfg else None,
        tokens=trained[-1]["tokens"] if trained else None,
        # (a run stopped between logged steps has its checkpoint at the step it reached)
        step=max([r["step"] for r in rows] + ckpts[-1:]) if rows or ckpts else None,
        steps=cfg.train.steps if cfg else None,
        best_val_loss=min(val_loss) if val_loss else None,
        best_val_bpb=min(val_bpb) if val_bpb else None,
        accuracy=accuracy,
        last_checkpoint=ckpts[-1] if ckpts else None,
        status=state,
        wall_seconds=wall_seconds(status, run_dir),
        error=status.get("error"),
    )


def list_runs(root: str = "runs") -> list[RunSummary]:
    """The runs directly under `root` (or `root` itself, when it is a run directory), by name; `root` may be a
    URL in object storage (each run read from a copy of its small files, and named by its URL)."""
    return [dataclasses.replace(summarize(run.summary_copy()), path=run.path) for run in RunDir(root).runs()]


def _human(n: float | None) -> str:
    if n is None:
        return "-"
    shown = float(f"{n:.3g}")  # (the unit is the one of what is shown: 999,680 is "1M", not "1e+03k")
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if shown >= size:
            return f"{shown / size:.3g}{unit}"
    return str(int(n))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _where_runs_are(root: str) -> str:
    """Where the runs are, for a `root` (local, or in a bucket) that has none directly under it: a run's own
    checkpoints directory (the run is its parent), or subdirectories holding runs one level down (tmp/ of
    tmp/runs/NAME, s3://bucket of s3://bucket/runs/NAME); "" otherwise."""
    if not storage.isdir(root):
        return ""
    root = root.rstrip("/") or root
    parent, name = os.path.split(root)  # (an s3://bucket/runs/x/checkpoints too: its parts are split at "/")
    parent = parent or "."
    if name == "checkpoints" and RunDir(parent).runs() == [RunDir(parent)]:
        return f"; it is a run's checkpoints: python -m lm.runs {shlex.quote(parent)}"
    below = [os.path.join(root, n) for n in storage.names(root) if not n.startswith(".")]
    below = [path for path in below if _holds_runs(path)]
    if not below:
        return ""
    more = f" (and {len(below) - 1} more directories)" if len(below) > 1 else ""
    return f"; {below[0]} holds runs{more}: python -m lm.runs {shlex.quote(below[0])}"


COLUMNS = ("name", "params", "tokens", "steps", "val_loss", "val_bpb", "acc", "ckpt", "status", "wall")


def _holds_runs(path: str) -> bool:
    try:
        return bool(RunDir(path).runs())
    except UserError:  # (one that cannot be read: not named as where the runs are)
        return False


def format_table(runs: list[RunSummary]) -> str:
    def cells(r: RunSummary) -> tuple[str, ...]:
        steps = "-" if r.step is None and r.steps is None else f"{r.step or 0}/{r.steps or '?'}"
        return (
            r.name,
            _human(r.params),
            _human(r.tokens),
            steps,
            "-" if r.best_val_loss is None else f"{r.best_val_loss:.4f}",
            "-" if r.best_val_bpb is None else f"{r.best_val_bpb:.4f}",
            " ".join(f"{task}={acc:.3f}" for task, acc in r.accuracy.items()) or "-",
            "-" if r.last_checkpoint is None else str(r.last_checkpoint),
            r.status,
            _duration(r.wall_seconds),
        )

    table = [COLUMNS] + [cells(r) for r in runs]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    # The name column reads best left-aligned, the numbers right-aligned.
    return "\n".join(
        "  ".join(c.ljust(w) if i in (0, 6, 8) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in table
    )


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m lm.runs", description="List training runs as a table.")
    parser.add_argument(
        "root", nargs="?", default="runs", help="directory of runs, or one run; may be s3:// or gs:// (default: runs)"
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print a JSON list, one object per run")
    output.add_argument("-q", "--quiet", action="store_true", help="print only the run directories, one per line")
    given = any(not a.startswith("-") for a in argv)
    args = parser.parse_args(argv)
    if not args.root:  # (an unset shell variable: it listed the working directory as "no runs in ")
        raise UserError(
            "the directory of runs is empty ''; give a directory of runs (runs) or one run's directory "
            "(runs/NAME), or leave it out for runs"
        )
    if storage.isfile(args.root):
        raise UserError(f"{args.root} is a file; give a directory of runs (runs) or one run's directory (runs/NAME)")
    if given and not storage.isdir(args.root):  # (no runs/ yet: "no runs"; in a bucket, nothing under it or no bucket)
        raise UserError(
            f"{args.root} does not exist; give a directory of runs (runs) or one run's directory (runs/NAME)"
        )
    runs = list_runs(args.root)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    elif args.quiet:
        for r in runs:
            print(r.path)
    elif not runs:
        print(f"no runs in {os.path.join(args.root, '')}{_where_runs_are(args.root)}")
    else:
        print(format_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
