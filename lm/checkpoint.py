"""Checkpoints with orbax: parameters, optimizer state, data iterator, config and tokenizer.

A step directory RUN_DIR/checkpoints/<step>/ holds the items
  params     the model parameters (restorable alone, for sampling and fine-tuning)
  train      {step, rng, opt_state}
  data       the grain iterator state, one file per process (the same in each: any restores it)
  config     the resolved run config (plain dict)
  tokenizer  {spec, rank file contents where there is one}
  dataset    checksums of the prepared token files, so that a resume on changed data is refused
  base       of a run that reads its init_from again (LoRA's base, DPO's reference): its path and weights'
             fingerprint (lm.pretrained.fingerprint), so that a base changed in place is refused; {} otherwise
so a step directory alone is enough to sample, fine-tune or resume. The checkpoints directory may be gs://...
(lm.run_dir.RunDir.checkpoints): orbax writes there itself, and what is done here besides (listings, renames,
free space) goes through lm.storage and orbax's own path library, the same for a disk and a bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fnmatch
import hashlib
import json
import logging
import math
import numbers
import os
import re
import shlex
import sys
import time
import types
from collections.abc import Callable, Collection
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from lm import config as config_lib
from lm import storage
from lm.errors import PeerLostError, UserError, at_end, backend_failure, first_line, peer_lost
from lm.errors import said as _said
from lm.files import check_unicode_path, lock_file, probe_writable, read_json, write_json
from lm.run_dir import MARKER, STATUS_FILE, RunDir, branch, effective_status, read_status, runs_not_a_run
from lm.run_dir import shown_dir, uncommit
from lm.scripts import command_line
from lm.tokenizer import Tokenizer, encoding_extras, named_tokenizer, same_item, tokenizer_from_item


class _StreamHandler(grain.checkpoint.CheckpointHandler):
    """grain's handler of the data iterator's state, which restores under another number of processes than saved
    it. grain looks only for this process's file of a job of this size (process_I-of-N.json), so a job resumed
    with more or fewer processes found none and set the step aside as damaged. Every process saves the same
    state, the global batches taken (lm/data/loaders.py), so any process's file serves."""

    def restore(self, directory, item=None, args=None):
        item = item or args.item
        own = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        if own.exists():
            return super().restore(directory, item)
        saved = sorted(directory.glob("process_*-of-*.json"))
        if not saved:
            raise ValueError(f"File {own} does not exist.")
        item.set_state(json.loads(saved[0].read_text()))
        item.start_prefetch()  # (as grain's own restore does)
        return item


@ocp.args.register_with_handler(_StreamHandler, for_save=True)
@dataclasses.dataclass
class _StreamSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(_StreamHandler, for_restore=True)
@dataclasses.dataclass
class _StreamRestore(ocp.args.CheckpointArgs):
    item: Any


def _handlers() -> dict:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "train": ocp.StandardCheckpointHandler(),
        "data": _StreamHandler(),
        "config": ocp.JsonCheckpointHandler(),
        "tokenizer": ocp.JsonCheckpointHandler(),
        "dataset": ocp.JsonCheckpointHandler(),
        "base": ocp.JsonCheckpointHandler(),
    }


@dataclasses.dataclass(frozen=True)
class _IteratorSnapshot:
    """The data iterator's state taken when the save is requested, not when the background write runs."""

    state: Any

    def get_state(self) -> bytes:
        # grain's handler takes bytes from anything that is not one of its own iterators.
        return json.dumps(self.state, indent=1).encode()


def _val_loss(metrics: dict) -> float:
    """A step's rank for the best (lower is better): its validation loss, where a non-finite one (a diverged model's)
    ranks last; sorted as it was, a NaN could rank first, and --best and the rotation chose the diverged step."""
    loss = metrics["val_loss"]
    return loss if math.isfinite(loss) else math.inf


class _NoMetricsWarning(logging.Filter):
    """Leaves out orbax's warning at each save without a validation loss (train.eval_every=0, a checkpoint between
    evaluations): such a step ranks last for --best by design. The commands quiet absl's log; a run trained from
    Python printed a `WARNING:absl:Requested `tracked_metric`` line at every such checkpoint."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in str(record.msg)


_NO_METRICS_WARNING = _NoMetricsWarning()


PINS = "pinned"  # RUN/pinned/: a JSON file for each run that reads one of RUN's steps again (pin)


def pin(step_dir: str, by: str) -> None:
    """Keep RUN/checkpoints/N (`step_dir`) from RUN's checkpoint rotation for run `by` (a LoRA run on it, a DPO
    run's reference): a file in RUN/pinned/ that RUN's Checkpoints read at each rotation, until it is deleted (a run
    moved elsewhere still needs its base: RUN says at start which pins name a run no longer where it was). Local
    runs only (a run in a bucket is rotated in its local copy); a base that cannot be written to is a warning."""
    path = _pin_file(step_dir, by)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, {"step": int(step_dir.rpartition("/")[2]), "run": storage.absolute(by)})
    except OSError as e:
        print(f"warning: cannot keep {step_dir} from its run's checkpoint rotation ({e.strerror or e}): should "
              f"that run train on, this run's base may be deleted", file=sys.stderr)  # fmt: skip


def unpin(step_dir: str, by: str) -> None:
    """Let go of the pin run `by` wrote on `step_dir` (pin), and RUN/pinned/ with it where that leaves it empty: a
    new run that stops before its first checkpoint holds nothing of its base, and its pin would keep that step from
    the rotation for good (the run directory is still there, so the base never names it as gone)."""
    path = _pin_file(step_dir, by)
    if path is None:
        return
    with contextlib.suppress(OSError):
        os.remove(path)
        os.rmdir(os.path.dirname(path))  # (only an empty one)


def _pin_file(step_dir: str, by: str) -> str | None:
    """RUN/pinned/<id>.json, where run `by` pins RUN/checkpoints/N (`step_dir`); None for a step in a bucket, or a
    directory that is no step."""
    run, _, step = step_dir.rpartition("/checkpoints/")
    if storage.is_url(step_dir) or not step.isdigit():
        return None
    return os.path.join(run, PINS, hashlib.sha256(storage.absolute(by).encode()).hexdigest()[:16] + ".json")


@dataclasses.dataclass
class _Pinned(policies.PreservationPolicy):
    """Preserves the steps other runs pinned (pin), read again at every rotation."""

    run: str

    def pins(self) -> list[tuple[str, int, str]]:
        """(pin file, step, the run that pinned it) of each readable pin that is not stale."""
        return [pin for pin in self.all_pins() if not self.stale(pin[1], pin[2])]

    def all_pins(self) -> list[tuple[str, int, str]]:
        """(pin file, step, the run that pinned it) of each readable pin."""
        directory = os.path.join(self.run, PINS)
        found = []
        for name in storage.names(directory) if os.path.isdir(directory) else []:
            entry = read_json(os.path.join(directory, name))
            try:
                found.append((os.path.join(directory, name), int(entry["step"]), str(entry["run"])))
            except (ValueError, KeyError, TypeError):
                continue  # a damaged pin keeps nothing
        return found

    def stale(self, step: int, run: str) -> bool:
        """Whether the run now at `run` starts from another model than `step` (its config.yaml's init_from names
        another, or none): it was deleted and another trained in its place, which never let go of this pin. A run
        gone (moved: it still needs the step), one without a readable config.yaml, or whose init_from is gone from its
        path (this run moved) keeps it."""
        config = os.path.join(run, "config.yaml")
        if storage.is_url(run) or not os.path.isfile(config):
            return False
        try:
            init_from = config_lib.load(config).init_from
        except UserError:
            return False
        step_dir = os.path.join(self.run, "checkpoints", str(step))
        if not init_from or storage.is_url(init_from) or init_from.startswith("hf:"):
            return True
        return os.path.exists(init_from) and os.path.exists(step_dir) and not os.path.samefile(init_from, step_dir)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        steps = {step for _, step, _ in self.pins()}
        return [c.step in steps for c in checkpoints]


def _reading_lock(run: str, step: int) -> str:
    """The file whose shared flock a process reading `step` of `run` holds (hold_for_reading), and the rotation
    takes exclusively from choosing to delete the step until it is deleted (_Rotation)."""
    return os.path.join(run, PINS, f"read-{step}.lock")


def _lock_reading(path: str, shared: bool) -> int | None:
    """lock_file on a reading lock, making RUN/pinned/ first, and again where a reader letting go deleted it
    meanwhile (release_reading); raises the OSError of one that cannot be made or locked."""
    for attempt in range(3):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return lock_file(path, shared)
        except FileNotFoundError:
            if attempt == 2:
                raise


class _Rotation(policies.PreservationPolicy):
    """What a rotation keeps: what `kept` keeps, and the steps that processes are reading (hold_for_reading). Each
    other step is locked against readers from this choice (made as a save starts) until it is deleted (as the save
    ends, before the next save asks again), so that a reader never chooses a step about to go."""

    def __init__(self, kept: policies.PreservationPolicy, run: str):
        self.kept, self.run, self._deleting = kept, run, {}

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        self.release()
        keep = self.kept.should_preserve(checkpoints, context=context)
        return [k or not self._lock(c.step) for c, k in zip(checkpoints, keep)]

    def _lock(self, step: int) -> bool:
        """Whether this process now holds `step`'s reading lock exclusively (False: a reader holds it)."""
        path = _reading_lock(self.run, step)
        try:
            fd = _lock_reading(path, shared=False)
        except FileNotFoundError:
            return False  # (a directory made and deleted again each time: kept, to be chosen at the next save)
        except OSError:
            return True  # (no reader can lock it either)
        if fd is None:
            return False
        self._deleting[path] = fd
        return True

    def release(self) -> None:
        """Let go of the steps chosen last time, deleted by now (their lock files with them, and any other that no
        process holds: a killed run's rotation, or a killed reader, left its own for good)."""
        for path, fd in self._deleting.items():
            with contextlib.suppress(OSError):
                os.remove(path)
            os.close(fd)
        if self._deleting:  # and RUN/pinned/ where that leaves it empty, as a reader does (release_reading)
            directory = os.path.join(self.run, PINS)
            with contextlib.suppress(OSError):
                for name in fnmatch.filter(os.listdir(directory), "read-*.lock"):
                    _remove_unheld(os.path.join(directory, name))
                os.rmdir(directory)
        self._deleting = {}


class Checkpoints:
    """The checkpoints of one run: keep the last `keep` plus the best by validation loss, every step that is a
    multiple of `keep_every` (if > 0), and the steps other runs pinned (pin)."""

    def __init__(
        self, directory: str, keep: int = 3, async_save: bool = True, read_only: bool = False, keep_every: int = 0
    ):
        self.directory = storage.absolute(directory)
        pinned = _Pinned(os.path.dirname(self.directory))
        preserve = policies.AnyPreservationPolicy(
            [
                policies.LatestN(n=keep),
                policies.BestN(get_metric_fn=_val_loss, reverse=True, n=1, keep_checkpoints_without_metrics=False),
                pinned,
                *([policies.EveryNSteps(interval_steps=keep_every)] if keep_every else []),
            ]
        )
        self._rotation = None
        copy = os.path.exists(os.path.join(pinned.run, MARKER))  # a bucket's run: read from copies of its own
        if jax.process_count() == 1 and not storage.is_url(self.directory) and not copy and not read_only:
            # (in a job of several processes each decides alike, without readers' locks, which some could miss)
            preserve = self._rotation = _Rotation(preserve, pinned.run)
        if not read_only:
            for path, step, run in pinned.all_pins():
                if pinned.stale(step, run):
                    with contextlib.suppress(OSError):
                        os.remove(path)
                    print(f"warning: step {step} is no longer kept for {run}: the run there now starts from another "
                          f"model (its config.yaml's init_from); deleted its pin {path}", file=sys.stderr)  # fmt: skip
                elif not (storage.is_url(run) or os.path.isdir(run)):
                    print(f"warning: step {step} is kept for {run}, which is no longer there (moved or deleted?); "
                          f"delete {path} to let the rotation remove it", file=sys.stderr)  # fmt: skip
            for name in incomplete(self.directory):
                print(
                    f"warning: ignoring incomplete checkpoint {name} in {self.directory} (its save was interrupted)",
                    file=sys.stderr,
                )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=preserve,
            # Without best_fn orbax neither writes a save's metrics nor reads them back, so BestN would see none
            # and best_step() would answer the latest step.
            best_fn=_val_loss,
            best_mode="min",
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        def manager() -> ocp.CheckpointManager:
            for attempt in range(READ_RETRIES):
                try:
                    return ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
                except (FileNotFoundError, NotADirectoryError):  # a step listed, then deleted by its run's rotation
                    if attempt == READ_RETRIES - 1 or not os.path.isdir(self.directory):
                        raise
                    time.sleep(0.05)

        try:
            try:
                self.manager = manager()
                try:  # ranked now, from the metrics orbax has read: JSON without a validation loss (`{}`) passed
                    self.manager.best_step()  # its reading and failed only when ranked (--best, a save's rotation)
                except (KeyError, TypeError):
                    self.manager.close()
                    raise
            except (ValueError, KeyError, TypeError):  # orbax reads every step's metrics file as it starts
                if not _set_aside_damaged_metrics(self.directory, read_only):
                    raise
                self.manager = manager()
            if not read_only:
                storage.makedirs(self.directory)  # orbax may create it only at the first save
        except (PermissionError, OSError) as e:
            raise UserError(f"cannot use checkpoint directory {self.directory}: {e.strerror or e}") from None
        # The directory held open, to notice it deleted or replaced mid-run: while it is held its inode number
        # cannot be given to a directory made in its place (ext4 reuses a freed one at once), so a new
        # directory at the same path never passes for it.
        self._held = None if read_only else _hold(self.directory)
        self._pending: int | None = None  # the step of the latest save started

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(
        self,
        step: int,
        state: Any,
        data_state: Any,
        cfg: config_lib.Config,
        tokenizer: dict,
        dataset: dict,
        base: dict,
        val_loss=None,
    ):
        """Start writing a checkpoint; training continues while it is written in the background.

        A vanished directory is reported as such, naming this step, whichever write notices it: the check
        before waiting on the previous save, that save's failure, or this one's."""
        self._stop_if(lambda: self._gone_problem(step))
        self._check(wait=True, step=step)  # orbax waits for the previous save anyway; its size and errors are needed
        self._stop_if(
            lambda: self._gone_problem(step) or self._unwritable_problem(step) or self._space_problem(step, state)
        )
        self._pending = step
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            train=ocp.args.StandardSave({"step": state.step, "rng": state.rng, "opt_state": state.opt_state}),
            data=_StreamSave(_IteratorSnapshot(data_state)),
            config=ocp.args.JsonSave(dataclasses.asdict(cfg)),
            tokenizer=ocp.args.JsonSave(tokenizer),
            dataset=ocp.args.JsonSave(dataset),
            base=ocp.args.JsonSave(base),
        )
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        absl_log = logging.getLogger("absl")  # (orbax's log)
        absl_log.addFilter(_NO_METRICS_WARNING)
        try:
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as e:  # this write or the previous one's background part failed: disk full, directory gone
            raise self._failed(e, step) from e
        finally:
            absl_log.removeFilter(_NO_METRICS_WARNING)

    def rotate(self) -> None:
        """Delete the steps the rotation keeps no longer, without a save: orbax rotates only as it saves, so a process
        killed between the final checkpoint's commit and its rotation left one more step than `train.keep` for good."""
        if self._rotation is None:  # (a run of several processes, or in a bucket, rotates only as it saves)
            return
        steps = self.steps()
        saved = lambda step: datetime.datetime.fromtimestamp(  # (local: this rotation is never a bucket's)
            os.path.getmtime(os.path.join(self.directory, str(step))), datetime.timezone.utc
        )
        infos = [types.SimpleNamespace(step=s, metrics=self.manager.metrics(s), time=saved(s)) for s in steps]
        kept = self._rotation.should_preserve(infos, context=policies.PreservationContext())  # as a save asks it
        for step, keep in zip(steps, kept):
            if not keep:
                self.manager.delete(step)
        self._rotation.release()

    def restore(self, step: int, abstract_state: Any, data_iterator: Any) -> Any:
        """The train state (sharded like `abstract_state`) at `step`; also rewinds `data_iterator`."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_state.params),
                train=ocp.args.StandardRestore(
                    {"step": abstract_state.step, "rng": abstract_state.rng, "opt_state": abstract_state.opt_state}
                ),
                data=_StreamRestore(data_iterator),
            ),
        )
        train = restored["train"]
        return abstract_state.replace(
            step=train["step"], rng=train["rng"], opt_state=train["opt_state"], params=restored["params"]
        )

    def restore_newest(
        self, steps: list[int], abstract_state: Any, make_iterator, stopped: Callable[[], None] = lambda: None
    ) -> tuple[Any, Any, int]:
        """(state, data iterator, step) from the newest of `steps` that restores; a damaged checkpoint (truncated
        or missing files) is set aside with a warning, never half-loaded. `stopped()` raises where a signal came
        during the restore (lm.loop.Signals.check): orbax's reads, cut short by its Stopped, fail as a damaged
        step's would, and the step is not set aside for that.

        Every process restores, and all agree on each outcome: a step that fails anywhere is set aside by
        process 0 while the others wait, and only then does any process look for the next one."""
        for step in reversed(steps):
            iterator = make_iterator()  # a fresh one each try: a failed restore may have moved it
            error = None
            try:
                state = self.restore(step, abstract_state, iterator)
            except Exception as e:  # orbax and tensorstore raise many kinds; all mean "unusable"
                stopped()  # (a signal's Stopped, turned into a read error on its way through orbax: not damage)
                error = e
            if everywhere(error is None):
                return state, iterator, step
            set_aside_everywhere(self.directory, step, error)
            self.manager.reload()
        raise UserError(f"no checkpoint in {self.directory} can be restored; move the directory away to start over")

    def wait(self) -> None:
        """Block until every save has been written; re-raise a background failure."""
        self._check(wait=True)

    def _check(self, wait: bool = False, step: int | None = None) -> None:
        """Re-raise a background write's failure, as the failure to write `step` where a save of it is asked
        for (else of the latest save started)."""
        try:
            if wait:
                self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # a background write failed: disk full, directory gone, ...
            raise self._failed(e, self._pending if step is None else step) from e

    def _stop_if(self, problem) -> None:
        """Raise the UserError `problem()` (process 0 asks it) names, if any; every process stops alike, so none
        waits in the save."""
        found = problem() if jax.process_index() == 0 else None
        if jax.process_count() > 1 and multihost_utils.broadcast_one_to_all(np.int32(found is not None)):
            found = found or f"process 0 cannot write a checkpoint to {self.directory} (see its error)"
        if found:
            raise UserError(found)

    def _gone(self) -> bool:
        """Whether the directory this run writes to was deleted, or replaced by another at its path."""
        if self._held is None:
            return False
        try:
            now = os.stat(self.directory)
        except OSError:
            return True
        held = os.fstat(self._held)
        return held.st_nlink == 0 or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def _gone_problem(self, step: int | None) -> str | None:
        if not self._gone():
            return None
        return (
            f"checkpoint directory {self.directory} is gone (deleted or unmounted during the run), so checkpoint "
            f"{step} cannot be written; restore it from a copy and resume, or start the run again"
        )

    def _unwritable_problem(self, step: int | None) -> str | None:
        """A directory that no longer takes files (remounted read-only, its permissions changed), found by making one:
        orbax's save would wait 300 s for its own directory to be made, then fail naming a timeout."""
        if storage.is_url(self.directory):
            return None
        try:
            probe_writable(self.directory)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return None  # (the space check says it better)
            kept = ", ".join(map(str, complete_steps(self.directory))) or "none"
            return (
                f"checkpoint directory {self.directory} cannot be written ({e.strerror or e}), so checkpoint {step} "
                f"cannot be written; complete checkpoints: {kept}. Make it writable (was it remounted read-only?), "
                "then resume with the same command"
            )
        return None

    def _space_problem(self, step: int, state: Any) -> str | None:
        """A save that cannot fit: the size of the newest checkpoint, or of the state before the first."""
        free = storage.free_bytes(self.directory)
        if free is None:
            return None  # a bucket has no free space to run out of
        steps = complete_steps(self.directory)
        if steps:
            needed = _disk_bytes(os.path.join(self.directory, str(steps[-1])))
        else:
            needed = int(sum(x.nbytes for x in jax.tree.leaves(state)) * 1.1) + (64 << 10)
        if free >= needed:
            return None
        kept = ", ".join(map(str, steps)) or "none"
        digits = next((d for d in (1, 2, 3) if f"{needed / 2**20:.{d}f}" != f"{free / 2**20:.{d}f}"), 3)
        return (
            f"not enough disk space for checkpoint {step} in {self.directory} (about {needed / 2**20:.{digits}f} MiB "
            f"needed, {free / 2**20:.{digits}f} MiB free); complete checkpoints: {kept}. Free space (the run deletes "
            "its oldest only once a new one is written: delete those you do not need yourself) and resume with the "
            "same command"
        )

    def _failed(self, e: Exception, step: int | None) -> UserError:
        lost = next(filter(None, map(peer_lost, (e, e.__cause__, e.__context__))), "")
        if lost:  # (not the disk: another process of the job died during the save's collectives)
            return PeerLostError(lost)
        found = self._gone_problem(step) or self._unwritable_problem(step)
        if found:
            return UserError(found)
        reason = first_line(e, last=True)
        kept = ", ".join(map(str, complete_steps(self.directory))) or "none"
        if storage.is_url(self.directory):  # (a bucket has no disk to fill; its bad credentials were said to be one)
            cause = " (the bucket's credentials, permissions or endpoint)"
        else:  # (a file missing from another process's view of the directory was said to be a full disk too)
            cause = " (a full disk: free space)" if re.search("No space left|Disk quota", reason) else ""
        return UserError(
            f"writing a checkpoint to {self.directory} failed ({reason}); complete checkpoints: {kept}. Fix the cause"
            f"{cause}, then resume with the same command"
        )

    def close(self, quietly: bool = False) -> None:
        """Finish pending writes and close; `quietly` (when another error is being reported) hides their failure."""
        try:
            self.manager.close()
        except Exception:
            if not quietly:
                raise
        finally:
            if self._held is not None:
                os.close(self._held)
                self._held = None
            if self._rotation is not None:
                self._rotation.release()


def _set_aside_damaged_metrics(directory: str, read_only: bool) -> bool:
    """Rename each step's metrics file (its validation loss, which orbax reads for every step as a manager starts)
    that holds no validation loss to metrics.unreadable, saying so: the step's arrays are unharmed, and it stays,
    without a loss to rank it by for the best. Whether any was; read-only, one line naming the first instead."""
    from etils import epath

    damaged = []
    for step_dir in sorted(epath.Path(directory).iterdir()) if epath.Path(directory).exists() else []:
        file = step_dir / "metrics" / "metrics"
        if step_dir.name.isdigit() and file.exists():
            try:
                loss = json.loads(file.read_text()).get("val_loss")
                ok = isinstance(loss, (int, float))
            except (ValueError, AttributeError, UnicodeDecodeError):
                ok = False
            if not ok:
                damaged.append(file)
    if damaged and read_only:
        raise UserError(f"{damaged[0]} (a checkpoint's validation loss) is damaged; move it away (the step's arrays "
                        "are unharmed), or resume the run, which sets it aside")  # fmt: skip
    if damaged and jax.process_index() == 0:
        for file in damaged:
            file.rename(file.parent / "metrics.unreadable")
            print(f"warning: {file} (a checkpoint's validation loss) is damaged; set aside as metrics.unreadable, "
                  "so that step is no longer a candidate for the best", file=sys.stderr)  # fmt: skip
    if damaged and jax.process_count() > 1:
        multihost_utils.sync_global_devices("lm: damaged checkpoint metrics set aside")
    return bool(damaged)


def set_aside(directory: str, step: int) -> str:
    """Rename a damaged step directory out of the way of the step's next save, keeping it for inspection (under a
    new name if an earlier one of that step was set aside already); return the new path. In a bucket its commit
    marker (lm.run_dir) goes first, so that readers never find a marker without its step."""
    path = os.path.join(directory, str(step))
    from etils import epath  # orbax's path library: in a bucket, the listings it caches then see the move

    uncommit(directory, step)

    target, n = f"{path}.unreadable", 1
    while epath.Path(target).exists():
        n += 1
        target = f"{path}.unreadable-{n}"
    epath.Path(path).rename(target)
    return target


def set_aside_steps(directory: str) -> list[str]:
    """The names of the steps set aside in checkpoints directory `directory` (set_aside), oldest step first."""
    aside = [name for name in storage.names(directory) if re.fullmatch(r"\d+\.unreadable(-\d+)?", name)]
    return sorted(aside, key=lambda name: (int(name.split(".")[0]), name))


def set_aside_everywhere(directory: str, step: int, error: BaseException | None) -> None:
    """A step that failed to read on some process (`error` here, or None where it read): set aside by process 0,
    which says so, while the others wait."""
    if jax.process_index() == 0:
        moved_to = set_aside(directory, step)
        warn_unreadable(directory, step, error or RuntimeError("it failed on another process"), moved_to)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"lm: checkpoint {step} set aside")


class Damaged(UserError):
    """A checkpoint item that cannot be read: its files damaged (truncated, missing), or not what they should be."""

    def __init__(self, directory: str, step: int, item: str, error: BaseException):
        self.detail = f"its {item} cannot be read: {_said(error)}"
        super().__init__(
            f"checkpoint {shown_dir(directory)}/{step} is damaged ({self.detail}); give another of the run's steps, or "
            "move this one away"
        )


def _read_item(directory: str, step: int, item: str, read: Callable[[str], Any]) -> Any:
    """read(the item's directory), its failure a Damaged naming the step and the item."""
    try:
        return read(os.path.join(directory, str(step), item))
    except UserError:
        raise
    except Exception as e:  # orbax, TensorStore, JSON and the filesystem raise many kinds; all mean "unusable"
        failure = backend_failure()  # orbax starting a JAX that cannot start: not the step's fault (never set aside)
        if failure:
            raise UserError(failure) from None
        raise Damaged(directory, step, item, e) from e


def everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process."""
    if jax.process_count() == 1:
        return ok
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def warn_unreadable(directory: str, step: int, error: BaseException, moved_to: str) -> None:
    detail = error.detail if isinstance(error, Damaged) else _said(error)
    print(
        f"warning: checkpoint {shown_dir(directory)}/{step} cannot be restored ({detail}); set aside as "
        f"{os.path.basename(moved_to)}, trying an older one",
        file=sys.stderr,
    )


def find(path: str, step: int | None = None, best: bool = False) -> tuple[str, int]:
    """(checkpoints directory, step) for a run directory, its checkpoints/ directory, or a step directory; one in
    object storage is read from a local copy of the step needed (lm.run_dir). The step is kept from its run's
    rotation while this process lives (hold_for_reading): one the rotation is about to delete is passed over for
    the newer one being saved (waiting for it), or, where the user named it, refused."""
    check_unicode_path(path)
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise UserError(f"a checkpoint step is an integer, got {step!r}")
    deadline, said = time.monotonic() + READ_WAIT_SECONDS, False
    while True:
        directory, chosen = _choose(path, step, best)
        if hold_for_reading(directory, chosen):
            return directory, chosen
        if step is not None or _names_a_step(path) or time.monotonic() > deadline:
            raise UserError(
                f"checkpoint {shown_dir(directory)}/{chosen} is being deleted by its run's checkpoint rotation "
                "(the run trains on, keeping its newest train.keep steps and the best); give a newer step, or the run "
                "directory"
            )
        if not said:  # its run is saving a newer one, which the rotation keeps
            print(f"waiting for the checkpoint that {os.path.dirname(shown_dir(directory))} is saving: its rotation is "
                  f"deleting step {chosen}", file=sys.stderr)  # fmt: skip
            said = True
        time.sleep(0.2)


READ_RETRIES = 20  # the times a manager reads a training run's steps again where its rotation deleted one meanwhile
READ_WAIT_SECONDS = 600  # the longest find waits for a training run's next checkpoint
_READING: dict[str, int] = {}  # reading locks this process holds (hold_for_reading): path -> descriptor
UNHELD_REMOVAL_S = 0.1  # how long a reader tries a held reading lock again (_remove_unheld holds one a moment)


def hold_for_reading(directory: str, step: int) -> bool:
    """Keep `step` of checkpoints `directory` from its run's rotation (should the run train, or train again) until
    this process ends or calls release_reading: a shared lock on its reading lock, which the rotation passes over
    (_Rotation). False where the rotation has chosen to delete the step already (it holds that lock), or deleted it
    since it was chosen. A run whose directory takes no new file (another user's), or in a bucket (read from a
    copy), is read without one."""
    path = _reading_lock(os.path.dirname(directory), step)
    if path in _READING or storage.is_url(directory):
        return True
    try:
        fd = _lock_reading(path, shared=True)
        # (held: by the rotation, which chose the step and holds it until its next save, or for a moment by a process
        # deleting the lock files no process holds, _remove_unheld: a step kept, which a retry then locks)
        deadline = time.monotonic() + UNHELD_REMOVAL_S
        while fd is None and time.monotonic() < deadline:
            time.sleep(0.005)
            fd = _lock_reading(path, shared=True)
    except OSError:
        return True
    if fd is None:
        return False
    if _incomplete(os.path.join(directory, str(step))):  # deleted between its choice and the lock
        os.close(fd)
        return False
    at_end(release_reading)
    _READING[path] = fd
    return True


def release_reading(keeping: Collection[str] = ()) -> None:
    """Let go of the steps this process holds (hold_for_reading), but for the lock files `keeping` names: a server
    once it has loaded them, a training run as it ends (init_from's step), any reader at exit. The lock file of a
    step no other process holds is deleted, with any other that no process holds (a killed reader's), and
    RUN/pinned/ with them where that leaves it empty: a reader leaves the run as it found it."""
    for path, fd in list(_READING.items()):
        if path in keeping:
            continue
        os.close(fd)
        del _READING[path]
        directory = os.path.dirname(path)
        with contextlib.suppress(OSError):
            for name in fnmatch.filter(os.listdir(directory), "read-*.lock"):  # (this one's too, now)
                _remove_unheld(os.path.join(directory, name))
            os.rmdir(directory)  # (only an empty one)


def _remove_unheld(path: str) -> None:
    """Delete a reading lock file that no process holds: one let go of, or a killed reader's."""
    if path in _READING:
        return
    with contextlib.suppress(OSError):
        fd = lock_file(path, shared=False)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.remove(path)
            os.close(fd)


def release_reading_of(checkpoints: str) -> None:
    """Let go of the steps of checkpoints directory `checkpoints` that this process holds: a run's own, read as it
    starts (its config, tokenizer, sampling settings), which its rotation would otherwise keep while it trains."""
    pins = os.path.realpath(os.path.join(os.path.dirname(checkpoints.rstrip("/")), PINS))
    release_reading(keeping={path for path in _READING if os.path.realpath(os.path.dirname(path)) != pins})


def reading() -> set[str]:
    """The lock files of the steps this process holds (hold_for_reading)."""
    return set(_READING)


def _names_a_step(path: str) -> bool:
    return os.path.basename(path.rstrip("/")).isdigit()


def _no_checkpoint_yet(run: str) -> str:
    """Why a run (its config.yaml or status.json there) has no checkpoint to read, and what to do: it trains still
    toward its first one, or it stopped before it (a signal during its start-up), which its config.yaml resumes, or
    the command that started it where it stopped before writing one ("train first (python train.py)" started
    another run instead)."""
    if effective_status(read_status(run)) == "running":
        return f"{run} has no checkpoint yet: its run is still training toward its first one; wait for it"
    if not os.path.isfile(os.path.join(run, "config.yaml")):  # (stopped before writing it: while compiling, say)
        return (f"{run} has no checkpoint: its run ended during its start-up, before writing its config.yaml; "
                f"run the {command_line('train')} command that started it again, or give another run")
    resume = f"{command_line('train')} {shlex.quote(os.path.join(run, 'config.yaml'))}"
    return f"{run} has no checkpoint: its run ended before its first one; train it with {resume}, or give another run"


def _choose(path: str, step: int | None, best: bool) -> tuple[str, int]:
    if step is not None and best:  # (from Python: the command lines refuse --step with --best)
        raise UserError(f"step={step} and best=True both choose a checkpoint; give one of them")
    path = RunDir(path).read_copy(step, best)
    if not os.path.exists(path):
        raise UserError(f"{path} does not exist; give a run directory (runs/NAME) or a checkpoint step directory")
    path = path.rstrip("/")
    if os.path.isfile(path):  # (a run's config.yaml, say: "no checkpoint found; train first" misled)
        parent = os.path.dirname(path) or "."
        if any(os.path.exists(os.path.join(parent, item)) for item in ("config.yaml", "checkpoints", *READ)):
            raise UserError(f"{path} is a file; give the run directory that holds it ({parent}) or a checkpoint "
                            "step directory")  # fmt: skip
        raise UserError(f"{path} is a file; give a run directory (runs/NAME) or a checkpoint step directory")
    if ".unreadable" in os.path.basename(path):
        raise UserError(f"{path} is a checkpoint set aside as unreadable (damaged); give another step of its run")
    base = os.path.basename(path)
    in_checkpoints = os.path.basename(os.path.dirname(path)) == "checkpoints"
    if base.isdigit() and (in_checkpoints or any(os.path.isdir(os.path.join(path, item)) for item in READ)):
        if (step is not None and step != int(base)) or best:  # a step directory is that step: say so, not ignore it
            chosen = "--best" if best else f"--step {step}"
            raise UserError(f"{path} is the checkpoint of step {base}, and {chosen} asks for another; give its run "
                            f"directory with {chosen}, or drop {chosen}")  # fmt: skip
        if incomplete := _incomplete(path):
            raise UserError(f"{incomplete}; give another step")
        return os.path.dirname(path), int(base)
    directory = path if base == "checkpoints" else os.path.join(path, "checkpoints")
    steps = complete_steps(directory)
    if not steps:
        if os.path.isfile(os.path.join(path, "config.json")):  # a model in Hugging Face format, given as a run
            raise UserError(f"{path} holds a model in Hugging Face format (config.json), not lm's checkpoints; "
                            f"give it as hf:{path}")  # fmt: skip
        aside = set_aside_steps(directory) if os.path.isdir(directory) else []
        if aside:  # ("no checkpoint found; train first" of a run whose every step a resume set aside as damaged)
            raise UserError(
                f"every checkpoint of {path} was set aside as unreadable ({', '.join(aside)}); once mended, rename "
                f"one back ({directory}/{aside[-1]} to {directory}/{aside[-1].split('.')[0]}), or give another run"
            )
        if any(os.path.isdir(os.path.join(path, item)) for item in READ):  # a step directory renamed (best/, step4/)
            raise UserError(f"{path} holds one checkpoint step, but a step directory is read by its name, the step "
                            f"number, and {base!r} is none; rename it to its step (as in RUN/checkpoints/N), or give "
                            f"its run directory")  # fmt: skip
        parent = os.path.dirname(path) or "."
        if os.path.basename(parent).isdigit() and any(os.path.isdir(os.path.join(parent, i)) for i in READ):
            # (RUN/checkpoints/N/params: "no checkpoint found; train first")
            raise UserError(f"{path} is a part of checkpoint step {parent}; give that step directory")
        held = trained_runs(path)
        if held:  # (a directory of runs, `sample.py runs`: "no checkpoint found; train first")
            raise runs_not_a_run(path, held)
        if any(os.path.isfile(os.path.join(path, f)) for f in ("config.yaml", STATUS_FILE)):  # (a run before its
            # first checkpoint: stopped, or still starting or training)
            raise UserError(_no_checkpoint_yet(path))
        raise UserError(
            f"no checkpoint found in {path}; train first ({command_line('train')}) or pass another run directory"
        )
    if best:
        ckpts = Checkpoints(directory, read_only=True)
        step = ckpts.best_step()
        ckpts.close()
        if step is None:
            raise UserError(f"no checkpoint in {path} has a validation loss; drop --best or pass --step")
    elif step is not None and step not in steps:
        raise UserError(f"no checkpoint for step {step} in {path}; available: {', '.join(map(str, steps))}")
    if step is not None:
        if incomplete := _incomplete(os.path.join(directory, str(step))):
            others = [s for s in steps if not _incomplete(os.path.join(directory, str(s)))]  # (not this one)
            raise UserError(f"{incomplete}; choose another with --step (available: {', '.join(map(str, others))})")
        return directory, step
    for newest in reversed(steps):  # the newest whole one: a step whose files were lost or never copied is passed over
        if not (incomplete := _incomplete(os.path.join(directory, str(newest)))):
            return directory, newest
        if incomplete not in _WARNED_INCOMPLETE:  # (a command finds its checkpoint several times: one warning)
            _WARNED_INCOMPLETE.add(incomplete)
            print(f"warning: {incomplete}; using an older one", file=sys.stderr)
    raise UserError(f"no checkpoint in {directory} is complete; train again or give a checkpoint that is")


_WARNED_INCOMPLETE: set[str] = set()  # the incomplete steps this process has warned of, passing them over
READ = ("config", "tokenizer", "params")  # the items of a checkpoint that its readers (sampling, export, ...) load


def _incomplete(step_dir: str) -> str:
    """Empty for a (local) step directory that holds every item of READ, else a sentence naming those it lacks."""
    missing = [item for item in READ if not os.path.isdir(os.path.join(step_dir, item))]
    return f"checkpoint {step_dir} is incomplete (it has no {' or '.join(missing)})" if missing else ""


def _hold(directory: str) -> int | None:
    """An open descriptor of the directory (None where one cannot be had, as for a bucket: the directory is then
    never "gone")."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None


def _disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)


def trained_runs(root: str) -> list[str]:
    """The run directories directly under local directory `root` that hold a complete checkpoint, by when their
    newest one was written: the latest last."""
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            ckpts = os.path.join(root, name, "checkpoints")
            try:
                steps = complete_steps(ckpts)
            except UserError as e:  # (one that cannot be read: not the newest run, as the others may be)
                print(f"warning: {e} (that run is left out)", file=sys.stderr)
                continue
            if steps:
                found.append((os.path.getmtime(os.path.join(ckpts, str(steps[-1]))), os.path.join(root, name)))
    return [run for _, run in sorted(found)]


def complete_steps(directory: str) -> list[int]:
    # Orbax writes into a temporary directory and renames it when complete; only plain step names are finished
    # checkpoints. In a gs:// bucket it writes in place and marks a step complete with a file. Its listing knows both.
    if not storage.is_url(directory) and os.path.exists(directory) and not os.path.isdir(directory):
        raise UserError(f"{directory} is a file, where a run keeps its checkpoints; move it away, or name another run")
    try:
        return sorted(ocp.utils.checkpoint_steps(directory))
    except PermissionError as e:  # (a run another user keeps private)
        raise UserError(f"cannot list {directory}: {e.strerror}; make it readable, or move it away") from None


def incomplete(directory: str) -> list[str]:
    """Step directories that orbax was still writing when the process died (in a bucket, where it writes in place,
    lm.run_dir deletes those at start)."""
    return [name for name in storage.names(directory) if ".orbax-checkpoint-tmp" in name]


def _load_json_item(directory: str, step: int, item: str) -> dict:
    def read(path: str) -> dict:
        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
            return ckptr.restore(path)

    return _read_item(directory, step, item, read)


def load_base_item(directory: str, step: int) -> dict | None:
    """The weights' fingerprint of the base a step's run read (lm.pretrained.fingerprint), or None where the step
    has none (written before checkpoints recorded it, or a run without a base)."""
    if not storage.isdir(os.path.join(directory, str(step), "base")):
        return None
    return _load_json_item(directory, step, "base").get("weights")


def load_config(directory: str, step: int) -> config_lib.Config:
    """The run config stored with a checkpoint."""
    raw = _load_json_item(directory, step, "config")
    return _read_item(directory, step, "config", lambda _: config_lib.from_dict(raw))


def load_tokenizer_item(directory: str, step: int) -> dict:
    """A step's tokenizer item (lm.tokenizer.tokenizer_item), a Damaged where it is not one."""
    item = _load_json_item(directory, step, "tokenizer")

    def shaped(_) -> dict:
        optional = lambda key, kind: isinstance(item.get(key), (kind, type(None)))
        if not (isinstance(item, dict) and isinstance(item.get("spec"), str) and optional("ranks", str)
                and optional("hf", dict)):  # fmt: skip
            raise ValueError("it is no tokenizer record (spec, ranks, hf)")
        return item

    return _read_item(directory, step, "tokenizer", shaped)


def load_tokenizer(directory: str, step: int) -> Tokenizer:
    """A step's tokenizer, a Damaged where its stored ranks make no tokenizer of its kind."""
    item = load_tokenizer_item(directory, step)
    return _read_item(directory, step, "tokenizer", lambda _: tokenizer_from_item(item))


def load_params(directory: str, step: int, abstract_params: Any) -> Any:
    """Only the parameters of a checkpoint, placed like `abstract_params` (shapes, dtypes, shardings)."""

    def read(path: str) -> Any:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            return ckptr.restore(path, args=ocp.args.StandardRestore(abstract_params))

    return _read_item(directory, step, "params", read)


@dataclasses.dataclass(frozen=True)
class ResumeItems:
    """What a resume compares the run with, read from its step: each a Damaged where it cannot be read."""

    config: config_lib.Config
    tokenizer: dict
    dataset: dict | None  # None: written before checkpoints recorded their data
    base: dict | None  # the base's fingerprint (load_base_item)


def resume_items(directory: str, step: int) -> ResumeItems:
    has = lambda item: storage.isdir(os.path.join(directory, str(step), item))
    return ResumeItems(
        load_config(directory, step),
        load_tokenizer_item(directory, step),
        _load_json_item(directory, step, "dataset") if has("dataset") else None,
        load_base_item(directory, step),
    )


def check_dataset(
    directory: str,
    step: int,
    stored: dict | None,
    dataset: dict,
    has_digest: Callable[[str, str], bool],
    new_run: str = "run.name=NEW",
) -> None:
    """Refuse to resume on data other than the checkpoint was trained on: the run would not be reproduced.
    `has_digest(name, digest)`: whether the prepared file `name` has that digest in another form lm has written
    (lm.data.Prepared.has_digest), where the data was prepared again since by this lm; `new_run`: the setting that
    starts a new run (lm.run_dir.new_run)."""
    if stored is None:
        return  # written before checkpoints recorded their data: nothing to compare with
    shown = shown_dir(directory)  # (a run in a bucket: its URL, not its working copy's)
    changed = sorted(
        name
        for name, digest in stored.get("checksums", {}).items()
        if dataset["checksums"].get(name) != digest and not has_digest(name, digest)
    )
    if stored.get("tokens") != dataset["tokens"]:
        changed = changed or ["token counts"]
    first_format = lambda names: bool(names) and all(n.rpartition("/")[2] in ("train.bin", "val.bin") for n in names)
    if changed and first_format(stored.get("checksums", {})) and not first_format(dataset["checksums"]):
        raise UserError(
            f"checkpoint {shown}/{step} was trained on data in lm's first prepared format (train.bin and "
            "val.bin, before 2026-11-23), which this lm prepares again as shards: the two cannot be compared, so "
            "resuming it exactly cannot be checked; resume it with the lm that wrote it, or start a new run from "
            f"it: {branch(f'{shown}/{step}', new_run)}"
        )
    if changed:
        raise UserError(
            f"the training data changed since checkpoint {shown}/{step} was written ({', '.join(changed)} differ: its "
            "files, or how this lm encodes them, a chat template's rendering say); restore the original data (or "
            f"resume with the lm that wrote the checkpoint), or start a new run from it: "
            f"{branch(f'{shown}/{step}', new_run)}"
        )


def check_tokenizer(directory: str, step: int, stored: dict, tokenizer: dict, new_run: str = "run.name=NEW") -> None:
    """Refuse a checkpoint whose tokenizer (`stored`) differs from the one the data was tokenized with; `new_run`:
    the setting that starts a new run (lm.run_dir.new_run)."""
    if same_item(stored, tokenizer):
        return
    shown = shown_dir(directory)  # (a run in a bucket: its URL, not its working copy's)
    if stored["spec"] == tokenizer["spec"] and stored.get("ranks") == tokenizer.get("ranks"):
        # (an imported tokenizer whose files changed since: its added tokens, template, normalisation, ...)
        mine, theirs = encoding_extras(stored.get("hf")) or {}, encoding_extras(tokenizer.get("hf")) or {}
        changed = sorted(key for key in {*mine, *theirs} if mine.get(key) != theirs.get(key))
        raise UserError(
            f"checkpoint {shown}/{step} was trained with another {stored['spec']} tokenizer than the model's "
            f"files give now (its {', '.join(changed)} differ): the Hugging Face model's tokenizer files changed; "
            "restore them, or train a new run (another run.dir)"
        )
    if stored["spec"] == tokenizer["spec"] and stored.get("ranks"):  # (ranks damaged in the checkpoint: not another)
        load_tokenizer(directory, step)
    if stored["spec"].endswith(".tiktoken") and tokenizer["spec"].endswith(".tiktoken"):  # (a file edited since)
        raise UserError(
            f"checkpoint {shown}/{step} was trained with other ranks than {tokenizer['spec']} holds now (the file "
            f"changed, or another one was given); restore the file it was trained with, or start a new run (another "
            "run.dir)"
        )  # (it said "trained on other data" and to set data.tokenizer to match: it matched, by name)
    if stored["spec"] == tokenizer["spec"] and stored["spec"].startswith("bpe:"):  # (trained again on changed inputs)
        raise UserError(
            f"checkpoint {shown}/{step} was trained with a {stored['spec']} tokenizer learned from other text than "
            f"the data holds now (data.path's files changed, or another data.path was given), and {stored['spec']} "
            "learned from this text has other ranks; restore the text it was trained on, or start a new run from "
            f"it, which keeps its tokenizer: {branch(f'{shown}/{step}', new_run)}"
        )  # (it said to set data.tokenizer and data.path to match the checkpoint: both matched, by name)
    detail = (
        f"both {stored['spec']} but with different ranks (trained on other data)"
        if stored["spec"] == tokenizer["spec"]
        else f"{stored['spec']} vs {tokenizer['spec']}"
    )
    named = f"={stored['spec']}" if named_tokenizer(stored["spec"]) else ""
    raise UserError(
        f"checkpoint {shown}/{step} and the data use different tokenizers ({detail}); "
        f"set data.tokenizer{named} (and data.path) to match the checkpoint, or start a new run ({new_run})"
    )
