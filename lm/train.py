"""Training: the train state, the loss, the jitted train and eval steps, and the loop around them.

    python train.py [configs/X.yaml] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import signal
import sys
import time
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from tqdm import tqdm

from lm import checkpoint as ckpt_lib
from lm import config as config_lib
from lm import data as data_lib
from lm import lora, pretrained, sharding
from lm import plot as plot_lib
from lm import runs as runs_lib
from lm.config import Config, TrainConfig
from lm.errors import ArgumentParser, UserError, cli
from lm.metrics import MetricsWriter, peak_flops_per_device
from lm.model import Transformer, count_params, flops_per_token, init_params
from lm.optim import make_optimizer, schedule
from lm.tokenizer import get_tokenizer, tokenizer_item


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates done
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2]: the run's key; step keys are fold_in(rng, step)


def token_losses(logits_BTV, targets_BT, label_smoothing: float = 0.0, z_loss: float = 0.0):
    """(objective, cross-entropy) per token, in float32.

    The objective adds label smoothing (mass spread uniformly over the vocabulary) and the
    z-loss z * log(Z)^2; the plain cross-entropy is what gets reported.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    ce_BT = log_z_BT - jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    objective_BT = ce_BT
    if label_smoothing:
        uniform_BT = log_z_BT - logits_BTV.mean(axis=-1)
        objective_BT = (1 - label_smoothing) * ce_BT + label_smoothing * uniform_BT
    if z_loss:
        objective_BT = objective_BT + z_loss * log_z_BT**2
    return objective_BT, ce_BT


def _model_inputs(batch: dict) -> dict:
    """The model's packing inputs present in a batch (fine-tune examples carry them, pretraining does not)."""
    return {f"{k}_BT": batch[k] for k in ("positions", "segment_ids") if k in batch}


def _loss_mask(batch: dict) -> jax.Array:
    mask = batch.get("loss_mask")
    return jnp.ones(batch["targets"].shape, jnp.float32) if mask is None else mask.astype(jnp.float32)


def model_params(cfg: Config, trained: Any, frozen: Any) -> Any:
    """The model's parameters: the trained ones, or with LoRA the frozen base plus the trained adapters."""
    return lora.merge(frozen, trained, cfg.lora.alpha, cfg.lora.rank) if cfg.lora.rank else trained


def make_train_step(cfg: Config, tx: optax.GradientTransformation):
    """train_step(state, batch, frozen) -> (state, metrics), to be jitted with the state donated.

    `frozen` is the LoRA base model (None without LoRA): an argument, not a constant baked into the
    compiled step, and never differentiated.
    """
    model = Transformer(cfg.model, deterministic=False)
    lr_at = schedule(cfg.optim, cfg.train.steps)
    tc: TrainConfig = cfg.train
    accum = tc.grad_accum

    def micro_grads(params, frozen, batch, rng, count):
        def objective(params):
            full = model_params(cfg, params, frozen)
            logits = model.apply(full, batch["inputs"], **_model_inputs(batch), rngs={"dropout": rng})
            obj, ce = token_losses(logits, batch["targets"], tc.label_smoothing, tc.z_loss)
            mask = _loss_mask(batch)
            # Divided by the whole step's token count, so micro-batch gradients simply add up.
            return (obj * mask).sum() / count, (ce * mask).sum()

        return jax.value_and_grad(objective, has_aux=True)(params)

    def train_step(state: TrainState, batch: dict, frozen: Any = None):
        count = jnp.maximum(_loss_mask(batch).sum(), 1.0)
        rng = jax.random.fold_in(state.rng, state.step)
        if accum == 1:
            (_, ce_sum), grads = micro_grads(state.params, frozen, batch, rng, count)
        else:
            # Micro-batch a takes rows a, a+accum, ...: the reshape keeps each device's rows local.
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch
            )

            def body(grads, xs):
                mb, i = xs
                (_, ce_sum), g = micro_grads(state.params, frozen, mb, jax.random.fold_in(rng, i), count)
                return jax.tree.map(jnp.add, grads, g), ce_sum

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, ce_sums = jax.lax.scan(body, zeros, (micro, jnp.arange(accum)))
            ce_sum = ce_sums.sum()
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": ce_sum / count, "grad_norm": optax.tree_utils.tree_norm(grads), "lr": lr_at(state.step)}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(cfg: Config):
    """eval_step(params, batch, frozen) -> (summed cross-entropy, token count)."""
    model = Transformer(cfg.model, deterministic=True)

    def eval_step(params, batch, frozen=None):
        logits = model.apply(model_params(cfg, params, frozen), batch["inputs"], **_model_inputs(batch))
        _, ce = token_losses(logits, batch["targets"])
        mask = _loss_mask(batch)
        return (ce * mask).sum(), mask.sum()

    return eval_step


def create_state(cfg: Config, tx: optax.GradientTransformation, mesh, frozen: Any = None) -> tuple[TrainState, Any]:
    """(state, shardings): the train state initialised directly in its sharded layout.

    With LoRA the trained parameters are adapters on the `frozen` base model; they are small, so
    every device holds them whole.
    """
    rng = jax.random.PRNGKey(cfg.seed)

    def init(rng, frozen):
        if cfg.lora.rank:
            params = lora.init_adapters(frozen, cfg.lora.rank, cfg.lora.targets, jax.random.fold_in(rng, 0))
        else:
            params = nn.unbox(init_params(cfg.model, jax.random.fold_in(rng, 0)))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng)

    abstract = jax.eval_shape(init, rng, frozen)
    if cfg.lora.rank:
        params_sh = jax.tree.map(lambda _: sharding.replicated(mesh), abstract.params)
    else:
        params_sh = sharding.param_shardings(jax.eval_shape(lambda r: init_params(cfg.model, r), rng), mesh)
    shardings = TrainState(
        step=sharding.replicated(mesh),
        params=params_sh,
        opt_state=sharding.opt_state_shardings(tx, abstract.opt_state, params_sh, mesh),
        rng=sharding.replicated(mesh),
    )
    state = jax.jit(init, out_shardings=shardings)(rng, frozen)
    return state, shardings


def _use_compile_cache(directory: str) -> None:
    """Keep compiled steps on disk, so that resuming or rerunning a run does not compile them again.

    The first directory set in a process stays in use (JAX reads the setting once)."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # only what is worth a file


def resolve_run_dir(cfg: Config) -> str:
    if cfg.run.dir:
        return cfg.run.dir
    name = cfg.run.name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", name)


class _Preemption:
    """SIGTERM or a first Ctrl-C asks the loop to checkpoint and stop; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.requested = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _prepare_data(cfg: Config, trained_tok, progress: bool):
    """(data directory, its meta, the tokenizer) for the configured data, tokenized once.

    Starting from trained weights, the data must be tokenized as those weights were.
    """
    if cfg.data.format == "examples":
        tok = trained_tok or get_tokenizer(cfg.data.tokenizer)
        data_dir, meta = data_lib.prepare_examples_for_config(cfg.data, tok, cfg.seed, progress=progress)
        return data_dir, meta, tok
    data_dir, meta = data_lib.prepare_for_config(cfg.data, progress=progress)
    tok = data_lib.get_tokenizer_for(data_dir, meta)
    if trained_tok is not None and tokenizer_item(trained_tok) != tokenizer_item(tok):
        raise UserError(
            f"init_from {cfg.init_from} uses tokenizer {trained_tok.spec} but the data is tokenized with {tok.spec}; "
            "set data.tokenizer to match (or fine-tune on data.format=examples, tokenized with the model's tokenizer)"
        )
    return data_dir, meta, tok


def _warn_unreadable(ckpt_dir: str, step: int, error: Exception) -> None:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"warning: checkpoint {ckpt_dir}/{step} cannot be restored ({reason[:200]}); trying an older one",
          file=sys.stderr)


def _restore_newest(ckpts, steps: list[int], abstract_state, make_iterator) -> tuple[Any, Any, int]:
    """(state, data iterator, step) from the newest of `steps` that restores; a damaged checkpoint
    (truncated or missing files) is skipped with a warning, never half-loaded."""
    for step in reversed(steps):
        iterator = make_iterator()  # a fresh one each try: a failed restore may have moved it
        try:
            state = ckpts.restore(step, abstract_state, iterator)
        except Exception as e:  # orbax and tensorstore raise many kinds; all mean "unusable"
            _warn_unreadable(ckpts.directory, step, e)
            if jax.process_index() == 0:  # kept for inspection, out of the way of the step's next save
                path = os.path.join(ckpts.directory, str(step))
                os.replace(path, f"{path}.unreadable")
            ckpts.manager.reload()
            continue
        return state, iterator, step
    raise UserError(f"no checkpoint in {ckpts.directory} can be restored; move the directory away to start over")


def _check_train_state_layout(stored: Config, cfg: Config, where: str) -> None:
    """Refuse settings under which the checkpoint's optimizer state or adapters no longer fit: a changed
    setting, not a damaged checkpoint, so it must not be skipped as unreadable."""

    def opt_state_structure(c: Config):
        return jax.tree.structure(jax.eval_shape(make_optimizer(c.optim, 1).init, {"kernel": jnp.zeros(1)}))

    changed = []
    if opt_state_structure(stored) != opt_state_structure(cfg):
        changed = [d for d in config_lib.differences(stored.optim, cfg.optim) if d.startswith("grad_clip")]
        changed = [f"optim.{d}" for d in changed] or ["the optimizer's state"]
    if (stored.lora.rank, stored.lora.targets) != (cfg.lora.rank, cfg.lora.targets):
        changed += [f"lora.{d}" for d in config_lib.differences(stored.lora, cfg.lora)]
    if changed:
        raise UserError(
            f"checkpoint {where} was trained with other settings that change what it stores ({'; '.join(changed)}); "
            f"resume with the same settings, or start a new run from it: init_from={where} run.name=NEW"
        )


def _open_run(cfg: Config, tok, meta: dict) -> tuple[Config, int]:
    """(config with its run directory filled in, step to resume from or 0); checks what resuming needs."""
    run_dir = resolve_run_dir(cfg)
    # The saved config names its directory, so that file alone restarts or resumes this run.
    cfg = config_lib.replace(cfg, run={"dir": run_dir})
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    existing = ckpt_lib.complete_steps(ckpt_dir)
    if cfg.resume == "required" and not existing:
        raise UserError(f"resume=required but {run_dir} has no checkpoint; use resume=auto to start fresh")
    if cfg.resume == "never" and existing:
        raise UserError(f"{run_dir} already has checkpoints and resume=never; choose another run.name or run.dir")
    resume_step, stored = 0, None
    for step in reversed(existing):  # the newest checkpoint whose config can be read
        try:
            stored = ckpt_lib.load_config(ckpt_dir, step)
        except Exception as e:  # orbax and the filesystem raise many kinds; all mean "unusable"
            _warn_unreadable(ckpt_dir, step, e)
            continue
        resume_step = step
        break
    if existing and not resume_step:
        raise UserError(f"no checkpoint in {ckpt_dir} can be read; move the directory away to start over")
    if resume_step:
        # The attention implementation computes the same function of the same parameters: a run may move
        # between backends (model.attention=cudnn on a GPU, xla or dot_product on a CPU).
        diff = config_lib.differences(dataclasses.replace(stored.model, attention=cfg.model.attention), cfg.model)
        if diff:
            raise UserError(
                f"checkpoint {ckpt_dir}/{resume_step} was trained with a different model ({'; '.join(diff)}); "
                "use the same model settings, another run.dir, or move that step directory away"
            )
        _check_train_state_layout(stored, cfg, f"{ckpt_dir}/{resume_step}")
        ckpt_lib.check_tokenizer(ckpt_dir, resume_step, tokenizer_item(tok))
        ckpt_lib.check_dataset(ckpt_dir, resume_step, ckpt_lib.dataset_item(meta))
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UserError(f"{run_dir} is a file; set run.dir (or run.name) to a directory")
    try:
        os.makedirs(run_dir, exist_ok=True)
        if jax.process_index() == 0:
            config_lib.save(cfg, os.path.join(run_dir, "config.yaml"))
    except OSError as e:
        raise UserError(
            f"cannot write run directory {run_dir}: {e.strerror or e}; set run.dir to a writable directory"
        ) from None
    return cfg, resume_step


def train(cfg: Config, stop_after: int | None = None) -> str:
    """Run (or resume) training as configured; return the run directory.

    `stop_after` ends the loop early after that step, as if the process had been killed there
    (used to test resumption).
    """
    sharding.initialize(cfg.distributed)
    _use_compile_cache(cfg.train.compile_cache)
    is_main = jax.process_index() == 0
    trained_tok = None
    if cfg.init_from:
        trained_model, trained_tok = pretrained.describe(cfg.init_from)
        cfg = config_lib.replace(cfg, model=pretrained.inherit(cfg.model, trained_model))
        if not cfg.init_from.startswith(pretrained.HF_PREFIX):
            # Absolute, so that a LoRA checkpoint's reference to its base holds from any directory.
            cfg = dataclasses.replace(cfg, init_from=os.path.abspath(cfg.init_from))
    if jax.process_count() > 1:
        # Process 0 tokenizes first; the others then find the data ready on a shared filesystem,
        # or prepare their own copy where each host has its own disk.
        if is_main:
            _prepare_data(cfg, trained_tok, cfg.logging.progress)
        multihost_utils.sync_global_devices("lm: data prepared")
    data_dir, meta, tok = _prepare_data(cfg, trained_tok, cfg.logging.progress and is_main)
    d = cfg.data
    if d.format == "examples" and d.epochs:
        steps = data_lib.example_steps(data_dir, meta, d.block_size, d.batch_size, cfg.seed, d.epochs)
        cfg = config_lib.replace(cfg, train={"steps": steps})
    cfg = dataclasses.replace(cfg, model=config_lib.resolve_model(cfg.model, tok.n_vocab, cfg.data.block_size))
    cfg, resume_step = _open_run(cfg, tok, meta)

    with runs_lib.track_status(cfg.run.dir, enabled=is_main) as outcome:
        mesh = sharding.make_mesh(cfg.mesh)
        sharding.check(cfg, mesh)
        tx = make_optimizer(cfg.optim, cfg.train.steps)
        start = None  # the init_from parameters, laid out like the train state's
        if cfg.init_from and (cfg.lora.rank or not resume_step):
            start, _, _ = pretrained.load(cfg.init_from, mesh=mesh)
        frozen = start if cfg.lora.rank else None
        state, state_sh = create_state(cfg, tx, mesh, frozen)
        if start is not None and not cfg.lora.rank:
            state = state.replace(params=start)
        if start is not None and is_main and not resume_step and not cfg.logging.quiet:
            print(f"initialised parameters from {cfg.init_from}")

        rows = sharding.process_rows(mesh, cfg.data.batch_size)
        if d.format == "examples":

            def make_iterator():
                return data_lib.example_iterator(
                    data_dir, meta, d.block_size, d.batch_size, cfg.seed, rows=rows, verbose=is_main
                )

            val_data = data_lib.example_val_batches(
                data_dir, meta, d.block_size, d.batch_size, cfg.train.eval_batches, rows=rows, verbose=is_main
            )
        else:
            def make_iterator():
                return data_lib.train_iterator(data_dir, meta, d.block_size, d.batch_size, cfg.seed, rows=rows)

            val_data = data_lib.val_batches(data_dir, meta, d.block_size, d.batch_size, cfg.train.eval_batches, rows=rows)
        ckpts = ckpt_lib.Checkpoints(os.path.join(cfg.run.dir, "checkpoints"), keep=cfg.train.keep)
        try:
            train_iter = make_iterator()
            if resume_step:
                if is_main and not cfg.logging.quiet:
                    print(f"restoring {cfg.run.dir}/checkpoints/{resume_step} ...", flush=True)
                steps = [s for s in ckpts.steps() if s <= resume_step]
                abstract = ckpt_lib.abstract_like(state, state_sh)
                state, train_iter, resume_step = _restore_newest(ckpts, steps, abstract, make_iterator)
                if is_main and not cfg.logging.quiet:
                    print(f"resumed {cfg.run.dir} from step {resume_step}")
            loop = _Loop(cfg, tx, mesh, state_sh, frozen, meta, tokenizer_item(tok), ckpts, resume_step)
            with sharding.activate(mesh):
                end = min(cfg.train.steps, stop_after or cfg.train.steps)
                outcome.status = loop.run(state, train_iter, val_data, end)
        except BaseException:
            ckpts.close(quietly=True)  # what went wrong first is the error to report
            raise
        try:
            ckpts.wait()
        finally:
            ckpts.close()
    if is_main and outcome.status == "finished" and plot_lib.available():
        plot_lib.plot_runs([cfg.run.dir], os.path.join(cfg.run.dir, "curves.png"))
    return cfg.run.dir


class _Loop:
    """The training loop: steps, metrics one step behind, evaluation, checkpoints, preemption."""

    def __init__(self, cfg: Config, tx, mesh, state_sh, frozen, meta: dict, tokenizer: dict, ckpts, resume_step: int):
        self.cfg, self.mesh, self.ckpts, self.tokenizer, self.frozen = cfg, mesh, ckpts, tokenizer, frozen
        self.is_main = jax.process_index() == 0
        self.resume_step = resume_step
        self.last_good = resume_step or None
        batch_sh = sharding.batch_sharding(mesh)
        frozen_sh = None if frozen is None else jax.tree.map(lambda x: x.sharding, frozen)
        self.train_step = jax.jit(
            make_train_step(cfg, tx),
            in_shardings=(state_sh, batch_sh, frozen_sh),
            out_shardings=(state_sh, sharding.replicated(mesh)),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(make_eval_step(cfg), in_shardings=(state_sh.params, batch_sh, frozen_sh))
        self.dataset = ckpt_lib.dataset_item(meta)
        self.tokens_per_step = cfg.data.batch_size * cfg.data.block_size
        self.flops_per_step = flops_per_token(cfg.model, cfg.data.block_size) * self.tokens_per_step
        self.peak = peak_flops_per_device(cfg.train.peak_flops) * jax.device_count()
        val = meta["splits"]["val"]
        # Bits per byte of the text the loss is taken on: all of it, or an example's completions.
        tokens, n_bytes = (val["loss_tokens"], val["loss_bytes"]) if "loss_tokens" in val else (val["tokens"], val["bytes"])
        self.val_tokens_per_byte = tokens / max(n_bytes, 1)
        self.writer = None
        if self.is_main:
            self.writer = MetricsWriter(
                cfg.run.dir,
                resume_step,
                cfg.logging.tensorboard,
                config_lib.to_yaml(cfg),
                wandb=cfg.logging.wandb,
                wandb_project=cfg.logging.wandb_project,
            )
        self.bar = tqdm(
            total=cfg.train.steps,
            initial=resume_step,
            disable=not (cfg.logging.progress and self.is_main),
            unit="step",
            dynamic_ncols=True,
        )
        self.compile_time = None
        self.interval_start, self.interval_steps = time.perf_counter(), 0

    def log(self, message: str) -> None:
        if not self.is_main or self.cfg.logging.quiet:
            return
        if self.bar.disable:
            print(message)
        else:
            self.bar.write(message)

    def run(self, state: TrainState, train_iter, val_data, end: int) -> str:
        """Train up to step `end`; return how it ended: finished, stopped (before train.steps) or preempted."""
        cfg, tc = self.cfg, self.cfg.train
        self.log(
            f"run {cfg.run.dir}: {count_params(state.params) / 1e6:.2f}M parameters, {jax.device_count()} "
            f"{jax.devices()[0].platform} device(s), mesh {dict(self.mesh.shape)}, "
            f"{self.tokens_per_step} tokens/step, steps {self.resume_step}..{tc.steps}"
        )
        step, pending = self.resume_step, None
        if step == 0 and cfg.init_from:
            self.evaluate(0, state.params, val_data)  # the starting model's score, to compare against
        try:
            with _Preemption() as preempt:
                while step < end:
                    batch = sharding.global_batch(next(train_iter), self.mesh, self.cfg.data.batch_size)
                    t0 = time.perf_counter()
                    state, metrics = self.train_step(state, batch, self.frozen)
                    if step == self.resume_step:
                        jax.block_until_ready(metrics)
                        self.compile_time = time.perf_counter() - t0
                        self.interval_start, self.interval_steps = time.perf_counter(), 0
                    else:
                        self.interval_steps += 1
                    step += 1
                    # Step k's scalars are fetched after step k+1 is dispatched: the device never waits.
                    if pending is not None:
                        self.finish(*pending)
                    pending = (step, metrics)
                    is_eval = step == tc.steps or (tc.eval_every and step % tc.eval_every == 0)
                    is_ckpt = step == tc.steps or (tc.ckpt_every and step % tc.ckpt_every == 0)
                    if not (is_eval or is_ckpt or preempt.requested or step == end):
                        continue
                    self.finish(*pending)
                    pending = None
                    evals = self.evaluate(step, state.params, val_data) if is_eval else {}
                    if is_ckpt or preempt.requested:
                        self.ckpts.save(
                            step, state, train_iter.get_state(), cfg, self.tokenizer, self.dataset, evals.get("val_loss")
                        )
                        self.last_good = step
                    # Evaluation and saving are not step time.
                    self.interval_start, self.interval_steps = time.perf_counter(), 0
                    if preempt.requested:
                        self.ckpts.wait()
                        self.bar.close()
                        self.log(
                            f"{preempt.requested}: stopped after step {step} with a checkpoint; "
                            f"resume with: python train.py {cfg.run.dir}/config.yaml"
                        )
                        return "preempted"
        finally:
            self.bar.close()
            if self.writer:
                self.writer.close()
        self.log(f"{'finished' if step == tc.steps else 'stopped'} {cfg.run.dir} at step {step}")
        self.log(f"sample with: python sample.py {cfg.run.dir}")
        return "finished" if step == tc.steps else "stopped"

    def evaluate(self, step: int, params, val_data) -> dict:
        sums = []  # on the device until the end: one transfer, not one per batch
        for batch in tqdm(val_data, desc="eval", leave=False, disable=self.bar.disable, dynamic_ncols=True):
            batch = sharding.global_batch(batch, self.mesh, self.cfg.data.batch_size)
            sums.append(self.eval_step(params, batch, self.frozen))
        total, count = np.asarray(jax.device_get(sums), np.float64).sum(axis=0)
        loss = float(total / max(count, 1.0))
        evals = {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 80.0)),
            "val_bpb": loss / math.log(2) * self.val_tokens_per_byte,
        }
        if self.writer:
            self.writer.write({"step": step, **evals})
        self.log(f"step {step}: val_loss {loss:.4f} ppl {evals['val_ppl']:.2f} bpb {evals['val_bpb']:.3f}")
        return evals

    def finish(self, step: int, metrics: dict) -> None:
        """Fetch a dispatched step's metrics; stop on a non-finite loss; log on log steps."""
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # A non-finite gradient leaves non-finite parameters although this step's loss was still finite.
        bad = next((k for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])), None)
        if bad:
            where = f"{self.ckpts.directory}/{self.last_good}" if self.last_good else "none yet"
            raise UserError(
                f"{bad.replace('_', ' ')} became {metrics[bad]} at step {step}; last good checkpoint: {where}. "
                "Lower optim.lr or raise optim.warmup_steps, then resume"
            )
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
        if step % self.cfg.train.log_every and step != self.cfg.train.steps:
            return
        record = {"step": step, **metrics, "tokens": step * self.tokens_per_step}
        if self.interval_steps:
            step_time = (time.perf_counter() - self.interval_start) / self.interval_steps
            record.update(
                tokens_per_sec=self.tokens_per_step / step_time,
                mfu=self.flops_per_step / step_time / self.peak,
                step_time=step_time,
            )
        if self.compile_time is not None:
            record["compile_time"], self.compile_time = self.compile_time, None
        self.interval_start, self.interval_steps = time.perf_counter(), 0
        if self.writer:
            self.writer.write(record)
        if self.bar.disable:
            self.log(
                f"step {step}: loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} grad_norm {metrics['grad_norm']:.3f}"
                + (f" {record['tokens_per_sec']:.0f} tok/s mfu {record['mfu']:.1%}" if "mfu" in record else "")
            )


PARSER_EPILOG = """\
Override any key as section.key=value, e.g.
  python train.py configs/shakespeare_char.yaml model.n_layer=6 optim.lr=3e-4 train.steps=500
A run directory's config.yaml restarts (or resumes) that run: python train.py runs/NAME/config.yaml
"""


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="train.py",
        hint="settings are section.key=value overrides, e.g. train.steps=500",
        description="Train a decoder-only language model.",
        epilog=PARSER_EPILOG + "\npresets:\n" + "\n".join(f"  {p}" for p in config_lib.list_presets()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", help="a YAML preset or a run's config.yaml (default: configs/default.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar or log lines; print only the run directory at the end"
    )
    # Intermixed: --quiet may come between the preset and the overrides.
    args = parser.parse_intermixed_args(argv)
    preset, overrides = args.config, list(args.overrides)
    if args.quiet:
        overrides += ["logging.progress=false", "logging.quiet=true"]
    if preset and "=" in preset:
        preset, overrides = None, [preset] + overrides
    if preset is None:
        default = os.path.join(config_lib.CONFIG_DIR, "default.yaml")
        preset = default if os.path.exists(default) else None
    cfg = config_lib.load(preset, overrides)
    run_dir = train(cfg)
    if cfg.logging.quiet:
        print(run_dir)  # the one line a script needs: RUN=$(python train.py --quiet ...)
    return 0


if __name__ == "__main__":
    sys.exit(main())
