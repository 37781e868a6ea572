"""The training loop: steps with their metrics fetched one step behind, evaluation, checkpoints, and signals."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from lm import sharding
from lm.checkpoint import Checkpoints
from lm.config import Config
from lm.data import Progress
from lm.data.preference import trained_on_chats
from lm.errors import Stopped, UserError, catch_stop_signals, terminal_gone
from lm.files import shown
from lm.eval.scoring import Request, Scorer
from lm.eval.tasks import Task, accuracy
from lm.metrics import MetricsWriter, StepTimer
from lm.run_dir import RunDir, Uploads, new_run
from lm.scripts import command_line
from lm.validation import profile_window
from lm.steps import Trainer, TrainState


READER_GONE = "its output's reader went away"  # why a run stopped whose stdout was a pipe that closed (| head)


class Signals:
    """SIGTERM, Ctrl-C and SIGHUP for the whole of a run.

    Before training starts (`training` False) a signal raises Stopped at once: nothing has been trained, and
    whatever start-up was writing (prepared data, the run's files) is written atomically, so nothing is left
    half-written. Once training runs, a signal asks the loop to checkpoint and stop after the current step;
    a second Ctrl-C then aborts at once. SIGHUP (the terminal closed: an ssh session that dropped) is a SIGTERM whose
    terminal is gone: what was written to that terminal goes nowhere from then on (writing there would fail), and
    a run whose output goes to a file goes on logging there. A SIGHUP ignored when the run started stays ignored:
    `nohup train.py` trains on after its terminal closes. (Ctrl-C and SIGTERM are taken even where ignored, as a
    script's background jobs start: `python train.py ... & wait` stopped with a checkpoint on Ctrl-C, and still does.)

    The processes of a multi-host job (jax.distributed) must all stop at the same step, or only some of them
    enter the checkpoint's collectives and the job hangs. There JAX's preemption service decides: it catches
    SIGTERM itself (from `jax.distributed.initialize` on), tells every process, and
    `multihost_utils.reached_preemption_sync_point` names the one step at which all of them stop, whichever
    of them got the signal. A Ctrl-C on one process is passed on to it as a SIGTERM.

    The service counts what it is asked about: it agrees on one more than the largest count a process last
    asked about, and answers yes only to that count exactly. orbax's save asks about its checkpoint's step, so
    the loop asks about steps too, and about every one of them (a call of several steps asks about each): asked
    about calls, a save at step 35 made the agreed count 36, which 20 calls never reached, and the job trained
    on to its end.
    """

    def __init__(self):
        self.requested: str | None = None
        self.training = False
        self.previous = {}
        self._asked = 0  # the last step stop_at asked the preemption service about
        self._reached = False  # and whether the service's answer for one of them was yes

    def __enter__(self) -> Signals:
        self.previous = catch_stop_signals(self._handle)
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGHUP":
            terminal_gone()
        if not self.training:
            self.requested = name
            raise self._stopped()
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = name
        if signum != signal.SIGTERM and jax.distributed.is_initialized():
            signal.raise_signal(signal.SIGTERM)  # the preemption service's notice, which every process hears

    def reader_gone(self) -> None:
        """stdout's reader went away (`train.py | head`, a pager quit): checkpoint and stop as on SIGTERM, whose
        notice every process of a multi-host job hears (it died of a BrokenPipeError, losing the steps since the last
        checkpoint)."""
        if self.requested is None:
            self.requested = READER_GONE
            if jax.distributed.is_initialized():
                signal.raise_signal(signal.SIGTERM)

    def check(self) -> None:
        """During start-up: stop now if a signal came whose Stopped was lost on its way (its handler ran inside a
        finalizer, a __del__, which cannot raise; lm.errors leaves such a Stopped unreported)."""
        if self.requested is not None and not self.training:
            raise self._stopped()

    def start_training(self, step: int = 0) -> None:
        """From here, step `step` on, a signal stops the run with a checkpoint (after a last start-up check)."""
        self.check()
        self.training = True
        self._asked = step

    def stop_at(self, step: int) -> bool:
        """Whether the run checkpoints and stops after the jitted call that ends with `step`: on this process's own
        signal, or in a multi-host job at the call every process agreed on (see the class: the service is asked
        about each step up to `step` not asked about yet, the steps every process shares)."""
        if not jax.distributed.is_initialized():
            return self.requested is not None
        while self._asked < step:
            self._asked += 1
            self._reached |= multihost_utils.reached_preemption_sync_point(self._asked)
        if self._reached:
            self.requested = self.requested or "SIGTERM"  # the service swallows the signal: Python never sees it
        return self._reached

    def _stopped(self) -> Stopped:
        return Stopped(
            self.requested,
            f"{self.requested} during start-up: stopped before training; no checkpoint was written. "
            "Run the same command again to start (or resume)",
        )

    @contextlib.contextmanager
    def start_up(self):
        """Whatever a start-up signal's Stopped turns into on its way out is that Stopped again: a signal can land
        inside library code (a C call, a thread pool) that reports the handler's exception as another error."""
        try:
            yield
        except Stopped:
            raise
        except BaseException:
            if self.requested is not None and not self.training:
                raise self._stopped() from None
            raise

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Profile:
    """train.profile_steps: a jax.profiler trace of steps START..START+COUNT-1 (as logged, 1-based) of the real run,
    written into RUN_DIR/profile for TensorBoard's profile tab or Perfetto (perfetto_trace.json.gz). The trace
    starts before the call holding step START is dispatched and stops once the call holding step START+COUNT-1
    has finished on the device (with train.steps_per_call > 1 a call holds several steps); a run
    that stops or fails inside the window closes the trace with what it has. A run resumed after START does not
    trace. Every process of a multi-host run writes its own host's trace."""

    def __init__(self, setting: str, directory: str, log: Log):
        window = profile_window(setting)
        self.first, self.last = (window[0], window[0] + window[1] - 1) if window else (0, -1)
        self.directory, self.log, self.tracing = directory, log, False
        self.started = self.first  # (the first step of the call the trace started in)

    def __enter__(self) -> Profile:
        return self

    def before(self, first: int, last: int) -> float:
        """Before the call of steps first..last is dispatched; the seconds starting the trace took (not step time)."""
        started = time.perf_counter()
        if first <= self.first <= last:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.tracing, self.started = True, first  # (a call of several steps is traced whole)
        return time.perf_counter() - started

    def stops(self, first: int, last: int) -> bool:
        """Whether the trace stops after the call of steps first..last (which the loop then waits for)."""
        return (self.tracing or first <= self.first <= last) and first <= self.last <= last

    def after(self, first: int, last: int) -> float:
        """After that call is dispatched (and, where it stops the trace, finished: stops()); the seconds writing the
        trace took (not step time)."""
        if self.tracing and first <= self.last <= last:
            started = time.perf_counter()
            self._stop()
            self.log.line(
                f"profile of steps {self.started}-{last}: {self.directory} (tensorboard --logdir, or Perfetto)"
            )
            return time.perf_counter() - started
        return 0.0

    def _stop(self) -> None:
        self.tracing = False
        jax.profiler.stop_trace()

    def __exit__(self, *exc):
        if self.tracing:
            self._stop()
        return False


def _gone(error: OSError) -> bool:
    """Whether a write failed because its reader went away: a pipe closed (EPIPE), a terminal hung up (EIO)."""
    return isinstance(error, BrokenPipeError) or error.errno == errno.EIO


def _to_devnull(stream) -> None:
    """What is written to `stream` from now on (and what is still buffered) goes nowhere: its reader went away."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


@dataclasses.dataclass
class Log:
    """Where a run reports: the progress bar, the terminal (process 0 only) and the metrics files."""

    cfg: Config
    writer: MetricsWriter | None
    bar: tqdm
    reader_gone: Callable[[], None] = lambda: None  # called once stdout's reader went away
    gone: bool = False

    def line(self, message: str) -> None:
        if self.writer is None or self.cfg.logging.quiet:
            return
        if self.gone:  # the lines until the run stops (where it stopped, how to resume) go to the terminal
            self._to_stderr(message)
            return
        try:
            if self.bar.disable:
                print(message)
            else:
                self.bar.write(message)
        except BrokenPipeError:
            _to_devnull(sys.stdout)
            self.gone = True
            self.reader_gone()
            self._to_stderr(message)
        except OSError as e:  # its terminal hung up (EIO) before SIGHUP's handler ran, or with SIGHUP ignored (disown)
            if e.errno != errno.EIO:
                raise
            _to_devnull(sys.stdout)

    def step(self, loss: float) -> None:
        """The bar one step on, showing the loss; a bar whose reader went away (`2>&1 | head`) goes nowhere, and the
        next line to stdout, the same pipe, stops the run."""
        try:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        except OSError as e:  # (and a terminal that hung up: EIO)
            if not _gone(e):
                raise
            _to_devnull(sys.stderr)

    @staticmethod
    def _to_stderr(message: str) -> None:
        try:
            print(message, file=sys.stderr)
        except OSError as e:  # stderr went to the same reader (`2>&1 | head`): status.json says where it stopped
            if not _gone(e):
                raise
            _to_devnull(sys.stderr)

    def record(self, record: dict) -> None:
        if self.writer:
            self.writer.write(record)

    def flush(self) -> None:
        if self.writer:
            self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.bar.close()
        if self.writer:
            self.writer.close(failed)


@dataclasses.dataclass(frozen=True)
class Validation:
    """The validation batches of each data source by name, what converts each one's loss to bits per byte,
    and the sources' weights (a mixture's validation loss is their weighted mean); the multiple-choice tasks
    of train.eval_tasks, each with its requests tokenized at start-up, and the scorer that runs them."""

    batches: dict[str, list]
    tokens_per_byte: dict[str, float]
    weights: dict[str, float]
    tasks: tuple[tuple[Task, list[Request]], ...] = ()
    scorer: Scorer | None = None


def evaluate(trainer: Trainer, params, validation: Validation, log: Log, step: int) -> dict:
    """Validation loss, perplexity and bits per byte of the text the loss is taken on (of each source of a
    mixture, and their weighted mean), or with train.objective=dpo the DPO loss and reward statistics of the
    validation pairs (val_loss, val_reward_margin, val_reward_accuracy, val_reward_chosen, val_reward_rejected);
    logged."""
    batch_size = trainer.cfg.data.batch_size
    means = {}
    for name, batches in validation.batches.items():
        sums = []  # on the device until the end: one transfer, not one per batch
        for batch in tqdm(batches, desc="eval", leave=False, disable=log.bar.disable, dynamic_ncols=True):
            sums.append(
                trainer.eval_step(params, sharding.global_batch(batch, trainer.mesh, batch_size), trainer.frozen)
            )
        fetched = jax.device_get(sums)
        count = max(sum(float(c) for _, c in fetched), 1.0)
        means[name] = {k: sum(float(s[k]) for s, _ in fetched) / count for k in fetched[0][0]}
    if trainer.cfg.train.objective == "dpo":
        (pairs,) = means.values()
        evals = {f"val_{k}": v for k, v in pairs.items()}
        summary = (
            f"step {step}: val_loss {pairs['loss']:.4f} reward accuracy {pairs['reward_accuracy']:.3f} "
            f"margin {pairs['reward_margin']:.3f} (chosen {pairs['reward_chosen']:.3f}, "
            f"rejected {pairs['reward_rejected']:.3f})"
        )
        return _score_tasks(evals, summary, params, validation, log, step)
    losses, evals = {name: m["loss"] for name, m in means.items()}, {}
    if len(losses) > 1:
        for name, loss in losses.items():
            evals[f"val_loss/{name}"] = loss
            evals[f"val_bpb/{name}"] = loss / math.log(2) * validation.tokens_per_byte[name]
    weight = sum(validation.weights.values())
    loss = sum(losses[name] * validation.weights[name] / weight for name in losses)
    bpb = sum(
        losses[name] / math.log(2) * validation.tokens_per_byte[name] * validation.weights[name] / weight
        for name in losses
    )
    evals = {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "val_bpb": bpb, **evals}
    each = "".join(f", {name} {value:.4f}" for name, value in losses.items()) if len(losses) > 1 else ""
    summary = f"step {step}: val_loss {loss:.4f} ppl {evals['val_ppl']:.2f} bpb {bpb:.3f}{each}"
    return _score_tasks(evals, summary, params, validation, log, step)


def _score_tasks(evals: dict, summary: str, params, validation: Validation, log: Log, step: int) -> dict:
    """Add the accuracies of train.eval_tasks to the validation's evals and its log line; log them."""
    accuracies = []
    for task, requests in validation.tasks:
        with tqdm(total=len(requests), desc=task.name, leave=False, disable=log.bar.disable, dynamic_ncols=True) as bar:
            scores = accuracy(task, [lp for lp, _ in validation.scorer.score(requests, bar.update, params=params)])
        evals[f"acc/{task.name}"], evals[f"acc_norm/{task.name}"] = scores["acc"], scores["acc_norm"]
        accuracies.append(f", {task.name} acc {scores['acc']:.3f}")
    log.record({"step": step, **evals})
    log.line(summary + "".join(accuracies))
    return evals


def _finish_call(
    first: int, metrics: dict, built: float | None, log: Log, timer: StepTimer, cfg: Config, last_good: str,
    progress: Progress,
) -> None:  # fmt: skip
    """Fetch a dispatched call's metrics (of steps first, first+1, ...: one value each) and finish each step.
    The call's steps are timed as they finish here (`built`, the seconds its batches took to build, is None for
    the first call, which compiled, and for one already timed when the loop waited for it): the time since the
    last call finished is this call's, as the next one was dispatched before this wait (StepTimer)."""
    fetched = {k: np.atleast_1d(v) for k, v in jax.device_get(metrics).items()}
    if built is not None:
        timer.step(len(fetched["loss"]), built)
    for i in range(len(fetched["loss"])):
        _finish_step(first + i, {k: float(v[i]) for k, v in fetched.items()}, log, timer, cfg, last_good, progress)


def _diverged_fix(cfg: Config, warmup: bool = True) -> str:
    """The advice of a diverged run: a lower learning rate (the one its parameters train at: under Muon the
    matrices' optim.muon_lr too, and in a LoRA run all of them; it named optim.lr alone) or, `warmup`, a longer
    warmup, then resume; in a LoRA run also a lower lora.alpha, whose alpha/rank scales every adapter update (a lower
    learning rate does not help a huge one), in a new run, as a resume keeps it."""
    muon = cfg.optim.name == "muon"
    rates = "optim.muon_lr" if muon and cfg.lora.rank else "optim.muon_lr and optim.lr" if muon else "optim.lr"
    fix = f"Lower {rates}" + (" or raise optim.warmup_steps" if warmup else "")
    if not cfg.lora.rank:
        return f"{fix}, then resume"
    scale = cfg.lora.alpha / cfg.lora.rank
    return (f"{fix}, then resume; or, as lora.alpha/lora.rank = {scale:g} scales every adapter update, start a new "
            f"run with a lower lora.alpha (a resume keeps it): {new_run(cfg.run)}")


def _finish_step(
    step: int, metrics: dict, log: Log, timer: StepTimer, cfg: Config, last_good: str, progress: Progress
) -> None:
    """Stop on a non-finite loss; report epochs begun, and log steps."""
    # A non-finite gradient leaves non-finite parameters although this step's loss was still finite.
    bad = next((k for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])), None)
    if bad:
        raise UserError(
            f"{bad.replace('_', ' ')} became {metrics[bad]} at step {step}; last good checkpoint: {last_good}. "
            + _diverged_fix(cfg)
        )
    log.step(metrics["loss"])
    for line in progress.new_epochs(step):
        log.line(line)
    if step % cfg.train.log_every and step != cfg.train.steps:
        return
    record = {"step": step, **metrics, "tokens": timer.tokens(step), **progress(step), **timer.report()}
    log.record(record)
    log.line(
        f"step {step}: loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} grad_norm {metrics['grad_norm']:.3f}"
        + (f" reward_accuracy {metrics['reward_accuracy']:.3f} margin {metrics['reward_margin']:.3f} (chosen "
           f"{metrics['reward_chosen']:.3f}, rejected {metrics['reward_rejected']:.3f})"
           if "reward_accuracy" in metrics else "")  # fmt: skip
        + (f" {record['tokens_per_sec']:.0f} tok/s mfu {record['mfu']:.1%}" if "mfu" in record else "")
    )


@jax.jit
def _finite(state: TrainState) -> jax.Array:
    """Whether every float of the parameters and the optimizer's state is finite."""
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state)) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def path_argument(path: str) -> str:
    """`path` as a command line's argument to paste: quoted for the shell, and a relative one that starts with "-"
    led by "./", which an option parser would otherwise take for an option."""
    return shlex.quote(f"./{path}" if path.startswith("-") else path)


def _call_length(step: int, end: int, tc) -> int:
    """How many steps the next call runs: train.steps_per_call, up to the next multiple of it (so that a resumed
    run's calls are the uninterrupted run's), and never past an evaluation, a checkpoint or the end."""
    n = min(tc.steps_per_call - step % tc.steps_per_call, end - step)
    for every in (tc.eval_every, tc.ckpt_every):
        if every:
            n = min(n, every - step % every)
    return n


def run(
    trainer: Trainer,
    state: TrainState,
    train_iter: Any,
    validation: Validation,
    progress: Progress,
    ckpts: Checkpoints,
    save_items: dict,
    signals: Signals,
    log: Log,
    timer: StepTimer,
    start: int,
    end: int,
    uploads: Uploads | None = None,
) -> str:
    """Train from step `start` up to `end`; return how it ended: finished (train.steps reached), stopped (before
    them) or preempted (a signal: the state is checkpointed first). `save_items` are the checkpoint's other
    items (config, tokenizer, dataset, base); `uploads` uploads each checkpoint once written, in the background (a
    run.dir in object storage)."""
    cfg, tc = trainer.cfg, trainer.cfg.train
    step, pending, last_good = start, None, start or None
    where = lambda: f"{ckpts.directory}/{last_good}" if last_good else "none yet"
    if step == 0 and cfg.init_from:
        evaluate(trainer, state.params, validation, log, 0)  # the starting model's score
    signals.start_training(step)
    # LM_MALLOC=keep on a CPU: a step's temporaries are freed before the next step allocates its own, so that
    # the one block of the heap serves every step (overlapping steps would leave it fragmented, and growing).
    one_at_a_time = trainer.platform.one_call_at_a_time
    lengths = set()  # of the calls made: a new one compiles
    with Profile(tc.profile_steps, os.path.join(RunDir.of(cfg.run).work, "profile"), log) as profile:
        while step < end:
            n = _call_length(step, end, tc)
            # A call the loop waits for: the first of its length (it compiles, then runs for the first time: neither
            # is step time), the one that ends a profile (its trace is written) and, one_at_a_time, every call.
            new_length = n not in lengths
            waited = new_length or one_at_a_time or profile.stops(step + 1, step + n)
            if waited and pending is not None:  # the call before ends here, not with this one's wait
                _finish_call(*pending, log, timer, cfg, where(), progress)
                pending = None
            timer.not_steps(profile.before(step + 1, step + n))
            building = time.perf_counter()
            batches = tuple(
                sharding.global_batch(next(train_iter), trainer.mesh, cfg.data.batch_size) for _ in range(n)
            )
            dispatched = time.perf_counter()
            timer.built(dispatched - building)
            if n == 1:
                state, metrics = trainer.train_step(state, batches[0], trainer.frozen)
            else:
                state, metrics = trainer.train_steps(state, batches, trainer.frozen)
            if waited:
                jax.block_until_ready(metrics)
                if step == start:
                    timer.first_step(time.perf_counter() - dispatched)
                elif new_length:
                    timer.compiled(time.perf_counter() - dispatched)
                else:
                    timer.step(n, dispatched - building)  # finished now; otherwise timed as fetched (_finish_call)
            lengths.add(n)
            timer.not_steps(profile.after(step + 1, step + n))
            step += n
            # A call's scalars are fetched after the next call is dispatched: the device never waits.
            if pending is not None:
                _finish_call(*pending, log, timer, cfg, where(), progress)
            pending = (step - n + 1, metrics, None if waited else dispatched - building)
            is_eval = step == tc.steps or (tc.eval_every and step % tc.eval_every == 0)
            is_ckpt = step == tc.steps or (tc.ckpt_every and step % tc.ckpt_every == 0)
            if not (is_eval or is_ckpt or signals.stop_at(step) or step == end):
                continue
            _finish_call(*pending, log, timer, cfg, where(), progress)
            pending = None
            # A step's loss and gradient norm are of the parameters before its update: an update that overflowed
            # (a huge learning rate) shows only in the next step's loss, after this step would have been saved.
            if not bool(_finite(state)):
                raise UserError(
                    f"the parameters became non-finite in an update by step {step} (its loss and gradient norm were "
                    f"finite); last good checkpoint: {where()}. " + _diverged_fix(cfg, warmup=False)
                )
            evals = evaluate(trainer, state.params, validation, log, step) if is_eval else {}
            if not math.isfinite(evals.get("val_loss", 0.0)):  # finite weights whose logits overflow: no good step
                raise UserError(
                    f"validation loss became {evals['val_loss']} at step {step} (its parameters are finite); last good "
                    f"checkpoint: {where()}. " + _diverged_fix(cfg)
                )
            stop = signals.stop_at(step)  # again: a signal may have come during the evaluation
            if is_ckpt or stop:
                if uploads:
                    uploads.wait()  # the previous checkpoint's upload, before this save deletes what is not kept
                ckpts.save(step, state, train_iter.get_state(), val_loss=evals.get("val_loss"), **save_items)
                log.flush()  # TensorBoard's events up to this step, kept as the checkpoint is
                last_good = step
                if uploads:
                    uploads.start(ckpts.wait)
            timer.restart()  # evaluation and saving are not step time
            if stop and step < tc.steps:  # (a signal in the last step's evaluation: the run is finished all the same)
                ckpts.wait()
                log.bar.close()
                command = f"{command_line('train')} {path_argument(shown(cfg.run.dir) + '/config.yaml')}"
                log.line(
                    f"{signals.requested}: stopped after step {step} with a checkpoint; "
                    f"resume with: {sharding.relaunch(command, cfg.distributed)}"
                )
                return "preempted"
    if step == start:  # (resumed at its last step: no save rotates the steps a kill after that step's commit left)
        ckpts.rotate()
    ckpts.wait()  # the last checkpoint written before the run says it finished (a failed write came after "finished")
    log.bar.close()
    log.line(f"{'finished' if step == tc.steps else 'stopped'} {shown(cfg.run.dir)} at step {step}")
    # (a chat model, SFT or DPO on chat pairs: prompted through its template)
    chat = " --chat Hello" if trained_on_chats(cfg.data) else ""
    log.line(f"sample with: {command_line('sample')} {path_argument(shown(cfg.run.dir))}{chat}")  # a command to paste
    return "finished" if step == tc.steps else "stopped"
