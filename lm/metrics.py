"""Training metrics: the peak FLOP/s that MFU is measured against; metrics.jsonl, TensorBoard and W&B."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import secrets
import sys
import time

import jax
import jax.numpy as jnp
from omegaconf import OmegaConf
from tqdm import tqdm

from lm import storage
from lm.errors import UserError, first_line
from lm.files import read_json, write_json
from lm.run_dir import shown_dir
from lm.storage import atomic_open
from lm.validation import WANDB_MISSING

# Dense bfloat16 peak FLOP/s per device, from the vendors' data sheets, by the exact device_kind JAX reports
# (lowercased): variants of one chip differ (an H100 PCIe peaks at 756 TFLOP/s, an H100 SXM at 989).
KNOWN_PEAKS = {
    "nvidia a100-sxm4-40gb": 312e12,
    "nvidia a100-sxm4-80gb": 312e12,
    "nvidia a100-pcie-40gb": 312e12,
    "nvidia a100 80gb pcie": 312e12,
    "nvidia h100 80gb hbm3": 989e12,  # SXM5
    "nvidia h100 pcie": 756e12,
    "nvidia h100 nvl": 835e12,
    "nvidia h200": 989e12,
    "nvidia h200 nvl": 835e12,
    "nvidia gh200 480gb": 989e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e
    "tpu v5e": 197e12,
    "tpu v5": 459e12,  # v5p
    "tpu v5p": 459e12,
    "tpu v6 lite": 918e12,  # v6e (Trillium)
    "tpu v6e": 918e12,
}
_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "lm", "peak_flops.json")


def best_seconds(fn, *args, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls of a jitted fn, after one call that compiles it."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Best-of-`repeats` FLOP/s of an n x n matmul on the default device."""
    return 2 * n**3 / best_seconds(jax.jit(lambda x: x @ x), jnp.ones((n, n), dtype), repeats=repeats)


def peak_flops_per_device(override: float = 0.0, dtype: str = "float32") -> float:
    """The configured peak, the data-sheet peak of a known accelerator (KNOWN_PEAKS), or else a matmul in the
    model's compute `dtype` measured once on this device and cached (a GPU's float32 matmuls run as TF32, at half
    its bfloat16 rate: a bfloat16 run's MFU against them reached past 100%)."""
    if override:
        return override
    device = jax.devices()[0]
    kind = device.device_kind.strip().lower()
    if kind in KNOWN_PEAKS:
        return KNOWN_PEAKS[kind]
    key = _cache_key(device, dtype)
    cached = read_json(_CACHE)
    cached = cached if isinstance(cached, dict) else {}
    if key not in cached:
        cached[key] = measure_matmul_flops(dtype=jnp.dtype(dtype))
        try:
            os.makedirs(os.path.dirname(_CACHE), exist_ok=True)
            write_json(_CACHE, cached)
        except OSError:
            pass  # an unwritable home only costs a re-measurement next time
    return cached[key]


def _cache_key(device, dtype: str) -> str:
    """A measured peak's key: the device and machine, the JAX that measured it (another XLA has other matmul
    kernels: 0.10's and 0.11's were 315 and 263 GFLOP/s here, and one's peak made the other's MFU 20% off), and
    the matmul's dtype."""
    kind, machine = device.device_kind.strip().lower(), platform.processor() or platform.machine()
    name = jnp.dtype(dtype).name
    return f"{device.platform}:{kind}:{machine}:{os.cpu_count()}:jax{jax.__version__}:matmul2048:{name}"


def peak_below_rate(override: float = 0.0, dtype: str = "float32") -> str:
    """What a warning says of a peak that a run went faster than (MFU above 100%), and how it gets right. A peak
    measured here (a matmul timed once, perhaps while the machine was busy) is dropped from the cache, so that the
    next run measures it again."""
    if override:
        return "train.peak_flops is set below what this run reaches: raise it (FLOP/s of one device)"
    device = jax.devices()[0]
    if device.device_kind.strip().lower() in KNOWN_PEAKS:
        return f"the data sheet's peak of a {device.device_kind}; set train.peak_flops (FLOP/s of one device)"
    cached = read_json(_CACHE)
    if isinstance(cached, dict) and cached.pop(_cache_key(device, dtype), None) is not None:
        try:
            write_json(_CACHE, cached)
        except OSError:
            pass
    return (f"it was measured on this machine (while it was busy?) and is measured again when the next run starts "
            f"(cached in {_CACHE}); or set train.peak_flops")  # fmt: skip


class StepTimer:
    """Step timing in one place: the first step's time (compilation), then step time, tokens/s and MFU over
    the steps since the last report. Evaluation and checkpointing are not step time: call restart() after them.
    `tokens_before` were trained before step `first` (a resume's), at whatever batch the run had then. An MFU
    above 100% proves the peak wrong: `low_peak` (peak_below_rate, or None to say nothing) says so once.

    The loop builds a call's batches before it waits for the call before it, so the time between two waits holds
    the next call's building. Each call's building is moved to the call itself (built(), then step(n, built)):
    otherwise the call before an evaluation or checkpoint was timed without any building (too fast) and the call
    after it with two calls' (too slow). A call of several logged steps gives each of their rows its figures (the
    first row's report took them). The first call of each length compiles as it is dispatched and then runs for the
    first time, which costs more than later runs: the loop waits for it, and first_step() or compiled() makes that
    time compile_time, not step time (the call's rows carry no step figures)."""

    def __init__(
        self, tokens_per_step: int, flops_per_step: float, peak_flops: float, first: int = 0, tokens_before: int = 0,
        low_peak=None,
    ):  # fmt: skip
        self.tokens_per_step, self.flops_per_step, self.peak_flops = tokens_per_step, flops_per_step, peak_flops
        self.first, self.tokens_before, self.low_peak = first, tokens_before, low_peak
        self.compile_time, self.figures = None, {}
        self.restart()

    def restart(self) -> None:
        self.start, self.steps, self.moved = time.perf_counter(), 0, 0.0

    def first_step(self, seconds: float) -> None:
        """The first call (of one step or train.steps_per_call) has finished, `seconds` after it was dispatched: its
        time is mostly compilation."""
        self.compile_time, self.figures = seconds, {}
        self.restart()

    def not_steps(self, seconds: float) -> None:
        """`seconds` of this window were spent on something else (writing a profile's trace, say)."""
        self.moved -= seconds

    def compiled(self, seconds: float) -> None:
        """A call of a new length took `seconds` of this window to compile and run once: compile time, not step
        time; its rows have no step figures (the steps before it were reported when it was dispatched)."""
        self.not_steps(seconds)
        self.compile_time, self.figures = (self.compile_time or 0.0) + seconds, {}

    def tokens(self, step: int) -> int:
        """The tokens trained on by the end of `step`."""
        return self.tokens_before + (step - self.first) * self.tokens_per_step

    def built(self, seconds: float) -> None:
        """A call's batches took `seconds` of this window to build: its steps' time, counted with them."""
        self.moved -= seconds

    def step(self, steps: int = 1, built: float = 0.0) -> None:
        """`steps` steps (one call's, whose batches took `built` seconds to build) have finished."""
        self.steps += steps
        self.moved += built

    def report(self) -> dict:
        """compile_time (since the last report), and step_time, tokens_per_sec and mfu since the last report (or
        the last report's, no step having finished since: a row of the same call); then restart, where steps were
        timed (a row of the same call leaves the window to the call running now)."""
        if self.steps:  # (else a row of the call the last report timed, or of a call that compiled: none)
            step_time = max(time.perf_counter() - self.start + self.moved, 1e-9) / self.steps
            self.figures = dict(
                tokens_per_sec=self.tokens_per_step / step_time,
                mfu=self.flops_per_step / step_time / self.peak_flops,
                step_time=step_time,
            )
            mfu = self.figures["mfu"]
            if mfu > 1.0 and self.low_peak is not None:
                peak = f"{self.peak_flops / 1e9:.4g} GFLOP/s"
                # (tqdm.write: on a line of its own, not glued to the end of the progress bar's line)
                tqdm.write(f"warning: MFU {mfu:.0%} is above 100%: the peak it is measured against, {peak}, is too "
                           f"low; {self.low_peak()}", file=sys.stderr)  # fmt: skip
                self.low_peak = None  # (once)
            self.restart()
        record = dict(self.figures)
        if self.compile_time is not None:
            record["compile_time"], self.compile_time = self.compile_time, None
        return record


TB_FLUSH_SECONDS = 5  # TensorBoard's file is flushed this often (and at every checkpoint): how live it shows a run


def _section(key: str) -> str:
    """The TensorBoard / wandb section of a metric: val/ (validation loss), eval/ (task accuracy), train/."""
    if key.startswith("val_"):
        return "val/"
    return "eval/" if key.startswith(("acc/", "acc_norm/")) else "train/"


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl, and the same scalars to TensorBoard and W&B.

    W&B (`wandb=True`) is optional: the run keeps one W&B id in RUN_DIR/wandb_id, so a resumed
    run continues the same W&B run (a copy of a run, its original still where the id was written, is a new one).
    W&B drops points at steps it has already seen, so after a
    resume the steps a killed process logged past its last checkpoint keep their first values there.
    A fresh start (no checkpoint to resume from: a run killed before its first one, started again) begins anew
    everywhere: metrics.jsonl emptied, TensorBoard's earlier points dropped, a new W&B run (the old id's steps
    would have kept the dead process's values). A start with `tensorboard=False` in a run that has TensorBoard files
    drops their points as well (from its first step on), so that TensorBoard shows none this run replaced.

    `counted` is the last row kept from before a resume that counts tokens, or None. `name`: the run's name in W&B
    ("": the directory's; a run in a bucket gives its URL's, as its local copy is named NAME-<hash>).
    """

    def __init__(
        self,
        run_dir: str,
        resume_step: int = 0,
        tensorboard: bool = True,
        config_text: str = "",
        wandb: bool = False,
        wandb_project: str = "lm",
        quiet: bool = False,
        name: str = "",
    ):
        # Started first: a missing package or login fails before metrics.jsonl is touched.
        fresh = not resume_step
        name = name or os.path.basename(os.path.abspath(run_dir))
        self.wandb = _start_wandb(run_dir, wandb_project, config_text, fresh, quiet, name) if wandb else None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.counted = None
        if resume_step:
            kept = self._truncate_after(resume_step)
            self.counted = next((row for row in reversed(kept) if "tokens" in row), None)
        elif os.path.exists(self.path):
            os.remove(self.path)
        self.file = open(self.path, "a")
        self.tb = _TensorBoard(run_dir, resume_step, config_text) if tensorboard else None
        if not tensorboard and os.path.isdir(os.path.join(run_dir, "tensorboard")):  # an earlier start wrote points:
            _TensorBoard(run_dir, resume_step, "").close()  # those this run replaces are dropped, though it writes none

    def _truncate_after(self, step: int) -> list[dict]:
        """Forget what a run logged after the checkpoint it resumes from, so each step appears once; the rows kept."""
        if not os.path.exists(self.path):
            return []
        kept = [row for row in read_metrics(os.path.dirname(self.path)) if row.get("step", 0) <= step]
        with atomic_open(self.path) as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        return kept

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            raise UserError(
                f"cannot write {self.path} ({e.strerror or e}); free disk space, then run the same command again (it "
                "resumes from the run's last checkpoint, if it has one)"
            ) from None
        step = record["step"]
        scalars = {
            _section(key) + key: value
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float))
        }
        if self.tb is not None:  # an evaluation's row flushed at once: it followed its step's row within seconds,
            self.tb.scalars(scalars, step, now=any(not tag.startswith("train/") for tag in scalars))  # so waited
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def flush(self) -> None:
        """Every point so far on disk (at each checkpoint): a run killed outright later keeps TensorBoard's points up
        to the step it resumes from, as metrics.jsonl (written through) keeps them."""
        if self.tb is not None:
            self.tb.flush()

    def close(self, failed: bool = False) -> None:
        """Close every sink; a sink that cannot flush (full disk) loses its last records, not the run. `failed`: the
        run ends in an error (or a second Ctrl-C), which W&B shows as a failed run, not a finished one."""
        finish = self.wandb and functools.partial(self.wandb.finish, exit_code=1 if failed else 0)
        for close in (self.file.close, self.tb and self.tb.close, finish):
            try:
                if close:
                    close()
            except OSError as e:
                print(f"warning: closing the metrics of {os.path.dirname(self.path)} failed ({e.strerror or e})",
                      file=sys.stderr)


def _tensorboardx() -> tuple:
    """What _TensorBoard writes with, imported with torch hidden where nothing imported it yet: tensorboardX's writer
    module imports torch where it is installed (the `bench` extra), which took 3-4 s of every run's start-up on a
    2-core CPU, for a tensor type the event file never needs (an ImportError leaves tensorboardX on numpy)."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # `import torch` raises ImportError
    try:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import text
    finally:
        if hidden and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]  # (a later `import torch` imports it)
    return EventsWriter, Event, SessionLog, Summary, text


class _TensorBoard:
    """TensorBoard's event file of one process, written by tensorboardX's synchronous EventsWriter: flushed every
    TB_FLUSH_SECONDS and by flush(). (tensorboardX's SummaryWriter writes from a thread that flushed every 2
    minutes, so a run killed outright lost the points of the minutes before its checkpoint for good, as the resume
    purges only what comes after it; its flush() leaves what the thread has not written yet.) A resumed run's
    file starts with a session start at the step after its checkpoint, which makes TensorBoard drop the points
    the killed process logged from there on. A write error (a full disk) ends TensorBoard's file with a warning,
    not the run: metrics.jsonl's own write says what is wrong."""

    def __init__(self, run_dir: str, resume_step: int, config_text: str):
        EventsWriter, Event, SessionLog, Summary, text = _tensorboardx()
        self._event, self._summary = Event, Summary
        directory = os.path.join(run_dir, "tensorboard")
        os.makedirs(directory, exist_ok=True)
        self._file = EventsWriter(os.path.join(directory, "events"), f".{os.getpid()}")
        self._flushed = time.monotonic()
        # TensorBoard drops the points from this step on that earlier files hold: those a killed process logged
        # past the checkpoint this run resumes from, or every one of a process killed before its first checkpoint
        start = resume_step + 1 if resume_step else 0
        self._write(Event(wall_time=time.time(), step=start, session_log=SessionLog(status=SessionLog.START)))
        if config_text:  # at each start, as a resume may change it; TensorBoard's text plugin renders markdown,
            block = text("config", "```\n" + config_text + "\n```")  # a fenced block keeps the YAML's indentation
            self._write(Event(wall_time=time.time(), step=start, summary=block))

    def scalars(self, scalars: dict[str, float], step: int, now: bool = False) -> None:
        """Written, and flushed where TB_FLUSH_SECONDS have passed since the last flush, or `now`."""
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
        if now or time.monotonic() - self._flushed > TB_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        self._call("flush")
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._call("close")

    def _write(self, event) -> None:
        self._call("write_event", event)

    def _call(self, method: str, *args) -> None:
        if self._file is None:
            return
        try:
            getattr(self._file, method)(*args)
        except OSError as e:
            tqdm.write(f"warning: TensorBoard's event file stopped ({e.strerror or e}); metrics.jsonl has every point",
                       file=sys.stderr)  # fmt: skip (over the progress bar, as the MFU warning)
            self._file = None


def _start_wandb(run_dir: str, project: str, config_text: str, fresh: bool, quiet: bool, name: str):
    """A W&B run for this run directory, created on a `fresh` start and resumed after that; `quiet`
    (logging.quiet): without W&B's own lines on the terminal either."""
    try:
        import wandb
    except ImportError:
        raise UserError(WANDB_MISSING) from None
    id_path, here = os.path.join(run_dir, "wandb_id"), _run_place(run_dir)
    run_id, written_in = "", ""
    if not fresh and os.path.exists(id_path):
        run_id, written_in = _wandb_id(run_dir)
        written_in = written_in and _run_place(written_in)  # (one a local copy of a bucket's run: its URL)
        if written_in and written_in != here and not _same_directory(written_in, run_dir) and (
            _wandb_id(written_in)[0] == run_id
        ):
            # (a copy of a run that is still there: under its id, W&B dropped every step of the copy's up to the
            # original's last, so the copy's resumed curve was lost there)
            shown = here if storage.is_url(here) else run_dir  # (a bucket's run: its URL, not its local copy)
            print(f"warning: {shown} is a copy of {written_in}, whose W&B run it would share; it is logged as a "
                  "new W&B run", file=sys.stderr)  # fmt: skip
            run_id = ""
    if not run_id or written_in != here:  # (an empty file: a write cut short before 2026-12-05; a run moved here)
        run_id = run_id or secrets.token_hex(6)
        with atomic_open(id_path) as f:
            f.write(f"{run_id}\n{here}\n")  # (where it was written: a copy elsewhere is a new run)
    try:
        return wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=run_dir,
            config=OmegaConf.to_container(OmegaConf.create(config_text)) if config_text else None,
            settings=wandb.Settings(silent=True) if quiet else None,
        )
    except Exception as e:  # noqa: BLE001 - wandb's errors (no login, no network) vary and run to many lines
        with contextlib.suppress(Exception):
            wandb.teardown()  # (now: at exit it printed a stray "wandb: " after the error line)
        raise UserError(
            f"W&B did not start ({first_line(e)}); run `wandb login`, set WANDB_MODE=offline, or set "
            "logging.wandb=false"
        ) from None


def _run_place(run_dir: str) -> str:
    """Which run a run directory is, for its W&B id: the URL of a run in a bucket (of its local copy, whichever
    run.local_dir or machine that is in: each is the same run), else the directory's real path."""
    if storage.is_url(run_dir):
        return run_dir
    # (shown_dir names what lies inside a copy, by the marker of a directory above it: the id file's place, less its
    # name, is the run's)
    return os.path.dirname(shown_dir(os.path.join(os.path.realpath(run_dir), "wandb_id")))


def _same_directory(a: str, b: str) -> bool:
    """Whether two local paths are one directory, whose real paths differ where a file system is mounted at both
    (a bind mount: a cluster's /scratch and /gpfs/scratch, a container's volume)."""
    with contextlib.suppress(OSError, ValueError):
        return not storage.is_url(a) and not storage.is_url(b) and os.path.samefile(a, b)
    return False


def _wandb_id(run_dir: str) -> tuple[str, str]:
    """(the W&B id in RUN_DIR/wandb_id, the run it was written in: "" before 2026-12-06, or where none)."""
    try:
        lines = storage.read_bytes(storage.absolute(os.path.join(run_dir, "wandb_id"))).decode().split("\n")
    except (OSError, UserError, UnicodeDecodeError):
        return "", ""
    return lines[0].strip(), (lines[1].strip() if len(lines) > 1 else "")


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl; [] before the first logged step.

    A line cut short (the writer killed mid-line), or one that is not a JSON object with a step (bytes a disk fault
    left), is skipped; a metrics.jsonl that cannot be read at all (a directory, no permission) is one line saying so.
    """
    rows = []
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise UserError(
            f"cannot read {path}: {e.strerror or e}; it should be the run's log of metrics, a file"
        ) from None
    return rows
