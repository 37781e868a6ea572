"""Training: resolve a run's configuration once, open or resume its directory, run the loop; the train.py CLI.

    python train.py [configs/X.yaml] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import functools
import io
import itertools
import math
import operator
import os
import shlex
import shutil
import sys
import textwrap
from collections.abc import Callable, Collection

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from lm import checkpoint as ckpt_lib
from lm import config as config_lib
from lm import data as data_lib
from lm import compile_cache, lora, loop, pretrained, sharding, storage
from lm import platform as platform_lib
from lm import plot as plot_lib
from lm import runs as runs_lib
from lm.data import examples as examples_lib
from lm.data import meta as meta_lib
from lm.data.loaders import Mixture, Origin
from lm.config import TRAINING_OPTIONS, Config, LoggingConfig, ModelConfig, SampleConfig, SourceConfig
from lm.errors import (
    DEBUG_NOTE,
    ArgumentParser,
    ConfigError,
    Interrupted,
    Stopped,
    UserError,
    cli,
    fits_in_memory,
    plural,
)
from lm.eval.scoring import Scorer
from lm.eval.tasks import digest as task_digest
from lm.eval.tasks import load_task, name_clash, task_requests
from lm.files import probe_writable, read_json, shown, write_json
from lm.metrics import MetricsWriter, StepTimer, peak_below_rate, peak_flops_per_device
from lm.model import count_params, init_params
from lm.optim import check_branch, make_optimizer, schedule
from lm.run_dir import RunDir, branch, holds_run, new_run, pushed_at_exit, read_status, setting, shown_dir, unwritable
from lm.scripts import command_line
from lm.steps import Trainer, model_params, rows_per_step, step_flops
from lm.tokenizer import HF_BPE, HF_GPT2, Tokenizer, named_tokenizer, spelled_once, tokenizer_item
from lm.validation import check_schedule, check_training, validate


EVAL_TASKS_FILE = "eval_tasks.json"  # (_note_eval_tasks)
TRAINED = "trained"  # in a checkpoint's dataset item: the tokens trained before its run's first step (_tokens_trained)
CUT = "cut"  # in a fine-tune checkpoint's dataset item: examples_lib.CUT_RULE, how examples longer than a row were cut
SOFTMAX = "softmax"  # in a checkpoint's dataset item: SOFTMAX_IDS, the loss's softmax over the tokenizer's ids alone
SOFTMAX_IDS = "ids"  # (checkpoints before 2026-12-06 took a padded vocabulary's rows into it, and record none)


def resolve_run_dir(cfg: Config) -> str:
    if cfg.run.dir:
        return RunDir(cfg.run.dir).path  # (a bucket's URL in one spelling)
    name = cfg.run.name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", name)


def _check_run_path(path: str) -> None:
    """One line for a local run.dir that no directory can be made at: a link in a loop of links or to nothing, a
    name longer than the file system takes (each was a traceback from listing its checkpoints, or a misleading
    'File exists')."""
    try:
        os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise UserError(
                f"run.dir {path} is a link to {os.readlink(path)}, which does not exist; make that directory (or "
                "remove the link), or set run.dir to another directory"
            ) from None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENAMETOOLONG):  # (a file on the way: the run's own checks say which)
            return
        what = "is in a loop of links" if e.errno == errno.ELOOP else f"cannot be used ({e.strerror or e})"
        raise UserError(f"run.dir {path} {what}; set run.dir to another directory") from None


def _claim(path: str) -> str:
    """The new directory runs/STAMP of a run given no name (`path`), made now, or runs/STAMP-2, -3, ... where runs
    started in the same second made those: each run of a sweep started at once gets its own, where all but one
    were refused as another run training the first's directory."""
    root, stamp = os.path.split(path)
    if os.path.exists(root) and not os.path.isdir(root):
        raise UserError(f"{root} is a file, where runs are kept; move it away, or set run.dir")
    for n in itertools.count(1):
        claimed = os.path.join(root, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.makedirs(claimed)
            return claimed
        except FileExistsError:
            continue
        except OSError as e:
            raise UserError(
                f"cannot create run directory {claimed}: {e.strerror or e}; set run.dir to a writable directory"
            ) from None


def resolve(
    cfg: Config,
    tokenizer: Tokenizer,
    chosen: Collection[str] | None = None,
    trained: ModelConfig | None = None,
    epoch_steps: int | None = None,
    pin: bool = True,
    trained_sample: SampleConfig | None = None,
) -> Config:
    """The run's final configuration, decided in one place (no JAX):

    - init_from (hf:DIR too) made absolute, so that a LoRA run's reference to its base holds from anywhere, and a
      run's directory pinned to the step it starts from (pinned; not with `pin` false: a full fine-tune's resume,
      which does not read it); the data's local paths (inputs, sources,
      validation, cache, evaluation tasks) made absolute too, so that config.yaml resumes the run from anywhere;
    - the model of init_from's weights (`trained`), with what the user `chosen` of it checked against them
      (pretrained.inherit); their sampling settings (`trained_sample`) but those the user chose;
    - train.steps from data.epochs (`epoch_steps`), where given;
    - the automatic model fields: the vocabulary from the tokenizer, the context from data.block_size;
    - run.dir filled in, so that the saved config.yaml alone restarts or resumes the run.
    """
    if cfg.init_from:
        cfg = dataclasses.replace(cfg, init_from=_resolved_init_from(cfg.init_from, pin))
    local = lambda path: storage.absolute(path) if path else path
    sources = [dataclasses.replace(s, path=local(s.path), val_path=local(s.val_path)) for s in cfg.data.sources]
    data = {"path": local(cfg.data.path), "val_path": local(cfg.data.val_path), "cache_dir": local(cfg.data.cache_dir)}
    tasks = tuple(map(local, cfg.train.eval_tasks))
    cfg = config_lib.replace(cfg, data={**data, "sources": sources}, train={"eval_tasks": tasks})
    if trained is not None:
        cfg = config_lib.replace(cfg, model=_inherited_model(cfg, trained, chosen))
        validate(cfg, inherited=True)  # (what depends on the weights' options, model.pos: as for a model set so)
    if trained_sample is not None:
        cfg = dataclasses.replace(cfg, sample=pretrained.inherit_sampling(cfg.sample, trained_sample, chosen))
    if trained is not None and cfg.data.format in ("examples", "chat", "preference"):
        # what the data is tokenized with, init_from's (see _check_data_tokenizer): config.yaml, which names every
        # key, resumes the run (it named lm's default, which that check refused as another tokenizer)
        cfg = config_lib.replace(cfg, data={"tokenizer": tokenizer.spec})
    if epoch_steps is not None:
        cfg = config_lib.replace(cfg, train={"steps": epoch_steps})
    model = config_lib.resolve_model(cfg.model, tokenizer.n_vocab, cfg.data.block_size)
    run = resolve_run_dir(cfg)
    if set("[]\\") & set(storage.absolute(run)):  # (the directory the run is in counts too)
        raise UserError(
            f"run directory {storage.absolute(run)} has '[', ']' or '\\' in its path, which orbax reads as a pattern "
            "when it writes a checkpoint (whose arrays could then never be read); train it in a directory without them"
        )
    return config_lib.replace(cfg, model=model, run={"dir": run})


def _inherited_model(cfg: Config, trained: ModelConfig, chosen: Collection[str] | None) -> ModelConfig:
    """The model a run from weights whose model is `trained` builds (pretrained.inherit), refused in one line where
    its context cannot hold data.block_size: train checks it before it prepares any data, resolve uses it."""
    m, block = pretrained.inherit(cfg.model, trained, chosen, frozen=bool(cfg.lora.rank)), cfg.data.block_size
    pretrained.check_context(cfg.init_from, m, trained, chosen)
    if block > m.max_seq_len:  # (resolve_model's refusal, with what a run from weights can do about it)
        grow = (" (its learned positions cannot grow)" if m.pos == "learned" else
                f", or extend the context: model.max_seq_len={block} (no parameter of model.pos={m.pos} depends on "
                "it)")  # fmt: skip
        raise ConfigError(f"data.block_size={block} is longer than init_from's context, model.max_seq_len="
                          f"{m.max_seq_len}; lower data.block_size{grow}")  # fmt: skip
    return m




def _resolved_init_from(init_from: str, pin: bool) -> str:
    """init_from (hf:DIR too) made absolute, a run's directory pinned to its newest step where `pin`."""
    hf = init_from.startswith(pretrained.HF_PREFIX)
    path = init_from.removeprefix(pretrained.HF_PREFIX)
    path = storage.absolute(path) if hf or not pin else pinned(storage.absolute(path))
    return (pretrained.HF_PREFIX if hf else "") + path


def pinned(path: str) -> str:
    """The checkpoint step directory (RUN/checkpoints/N) that an lm run's directory, its checkpoints/ directory
    or a step directory names now: its newest complete step. A LoRA run reads its base, and a DPO run its
    reference model, again at every resume and every load; pinned, they stay the weights the run started from
    when the base run trains on."""
    _, step = ckpt_lib.find(path)
    path = path.rstrip("/")
    if os.path.basename(path) == str(step):
        return path
    return f"{path if os.path.basename(path) == 'checkpoints' else path + '/checkpoints'}/{step}"


def _reads_base(cfg: Config) -> bool:
    """Whether the run reads its init_from again at every resume and load: LoRA's frozen base, DPO's reference."""
    return bool(cfg.lora.rank) or cfg.train.objective == "dpo"


def _names_base(started_from: str, given: str) -> bool:
    """Whether init_from as `given` names the base a run `started_from` (its config.yaml's init_from): the same,
    or the same run's directory (the command that started it, which named the run, now pinned to its step)."""
    run_of = lambda path: path.split("/checkpoints/")[0].rstrip("/")
    absolute = lambda path: storage.absolute(path) if path and not path.startswith(pretrained.HF_PREFIX) else path
    return bool(started_from) and (started_from == given or run_of(started_from) == run_of(absolute(given)))


def _same_base(stored: Config, cfg: Config, given: str) -> Config:
    """On resume: the run's own base, where its training reads init_from again (LoRA's frozen base, DPO's
    reference). The same command names the base run's newest step, which may be a later one: the run keeps
    the step it started from. Another model, or another step of the base run named as such (`given`: init_from
    as the user gave it, before pinned), is refused. A run that does not read its base again (a full fine-tune)
    keeps the init_from it started from too, as its config.yaml's record; another one is a warning (it went
    into config.yaml, unused)."""
    if stored.init_from == cfg.init_from:
        return cfg
    run_of = lambda path: path.split("/checkpoints/")[0].rstrip("/")
    if not _reads_base(cfg):
        if cfg.init_from and run_of(cfg.init_from) != run_of(stored.init_from or "") and jax.process_index() == 0:
            print(f"warning: init_from={given} is not read on resume: the run goes on from its checkpoint (it "
                  f"started from {stored.init_from or 'freshly initialised weights'})", file=sys.stderr)  # fmt: skip
        return dataclasses.replace(cfg, init_from=stored.init_from)
    what = "LoRA adapters" if cfg.lora.rank else "DPO reference"
    if not stored.init_from:  # (its init_from was '': "started from init_from=, ... resume with that init_from")
        raise UserError(
            "this run was started from freshly initialised weights, without init_from: it has no starting weights to "
            f"read again as {'a LoRA base' if cfg.lora.rank else 'a DPO reference model'}; start a new run: "
            f"{new_run(cfg.run)}"
        )
    names_a_step = os.path.basename(os.path.dirname(given.rstrip("/"))) == "checkpoints"
    if stored.init_from and run_of(stored.init_from) == run_of(cfg.init_from) and not names_a_step:
        return dataclasses.replace(cfg, init_from=stored.init_from)
    raise UserError(
        f"this run was started from init_from={stored.init_from}, which its {what} read again on resume; resume "
        f"with that init_from ({setting('init_from', stored.init_from)}), or start a new run: {new_run(cfg.run)}"
    )


def _check_data_tokenizer(
    cfg: Config,
    trained_tok: Tokenizer | None,
    chosen: Collection[str] | None,
    recorded: Callable[[], str] | None = None,
) -> None:
    """Fine-tuning data (examples, chat, preference) is tokenized with init_from's tokenizer: a data.tokenizer the
    user chose that names another would do nothing, so it is refused. (A token stream's is checked once it is
    prepared: lm.data.prepare_for_training.) `recorded`, on resume: the data.tokenizer of the run's own checkpoint,
    which a fine-tune's config.yaml repeats; an lm before 2026-12-02 wrote lm's default there (bytes), not
    init_from's, so that a run's config.yaml resumes it with the tokenizer it trained with."""
    if trained_tok is None or not chosen or "data.tokenizer" not in chosen:
        return
    named = spelled_once(cfg.data.tokenizer) != spelled_once(trained_tok.spec)  # (bpe:0300 is bpe:300)
    if named and recorded is not None and spelled_once(recorded()) == spelled_once(cfg.data.tokenizer):
        return  # (the run's own record: resolve names init_from's tokenizer from here on)
    if cfg.data.format in ("examples", "chat", "preference") and named:
        raise UserError(
            f"data.tokenizer={cfg.data.tokenizer} is not init_from's tokenizer ({trained_tok.spec}): "
            f"data.format={cfg.data.format} is tokenized with the starting model's own; set data.tokenizer="
            f"{trained_tok.spec} (which overrides a preset's), or leave data.tokenizer out"
        )


def _text_tokenizer(cfg: Config, trained_tok: Tokenizer | None, chosen: Collection[str] | None) -> Config:
    """Text to go on pretraining on from weights, data.tokenizer not chosen: tokenized with the weights' tokenizer
    (it took configs/default.yaml's bpe:1024, and a bytes model's run was refused as another tokenizer's). One
    imported with a Hugging Face model names no data.tokenizer: lm.data refuses that text in one line."""
    if (trained_tok is None or cfg.data.format != "text" or chosen is None or "data.tokenizer" in chosen
            or trained_tok.spec in (HF_BPE, HF_GPT2)):  # fmt: skip
        return cfg
    return config_lib.replace(cfg, data={"tokenizer": trained_tok.spec})


def _steps_set_by(cfg: Config) -> str:
    """The setting that makes train.steps what it is, as a fix names it to raise: data.epochs where it sets them."""
    return f"data.epochs={cfg.data.epochs}, which sets train.steps" if cfg.data.epochs else "train.steps"


def _prepare_data(cfg: Config, trained_tok: Tokenizer | None, is_main: bool) -> data_lib.Prepared:
    """The configured data, tokenized once (as init_from's weights were, when starting from them)."""
    progress = cfg.logging.bars and is_main
    if jax.process_count() == 1:
        return data_lib.prepare_for_training(cfg.data, cfg.seed, trained_tok, progress)
    # Process 0 tokenizes first; the others then find the data ready on a shared filesystem or in the bucket
    # of data.cache_dir, or prepare their own copy where each host has its own disk. That second reading says
    # nothing: what is wrong with the data (pairs cut to fit, examples skipped) was said by process 0's first.
    _together(lambda: is_main and data_lib.prepare_for_training(cfg.data, cfg.seed, trained_tok, progress),
              "prepare the data")  # fmt: skip
    with contextlib.redirect_stderr(io.StringIO()):
        prepare = lambda: data_lib.prepare_for_training(cfg.data, cfg.seed, trained_tok, False, publisher=is_main)
        data = _together(prepare, "prepare the data")
    _agree_on_data(data, bool(cfg.data.sources))
    return data


def _together(run: Callable, what: str):
    """run() in every process of a job, which go on only where none failed: a mistake found in one (a data file
    missing on its host) stops every process in one line, not that one alone while the others wait for it in
    the next collective until JAX's barrier times out (minutes, then an abort)."""
    if jax.process_count() == 1:
        return run()
    error = None
    try:
        result = run()
    except UserError as e:
        error, result = e, None
    failed = np.asarray(multihost_utils.process_allgather(np.array([error is not None]))).ravel()
    if error is not None:
        raise error
    if failed.any():
        processes = ", ".join(str(p) for p in np.flatnonzero(failed))
        raise UserError(f"process {processes} of the job could not {what} (its error line says why); fix that and "
                        "start the job again")  # fmt: skip
    return result


# Settings that may differ between the processes of a job: each process's own (not distributed.num_processes, which
# JAX takes from process 0 alone: a process given another count joined and trained silently), and the paths of each
# host's copy of the data and how it is prepared there, whose tokens _agree_on_data compares instead.
_PER_PROCESS = (
    "distributed.coordinator", "distributed.process_id", "distributed.initialization_timeout", "run.local_dir",
    "data.path", "data.val_path", "data.cache_dir", "data.workers", "data.shard_mb",
    "train.compile_cache", "logging.progress",
)  # fmt: skip


def _agree_on_config(cfg: Config, unnamed: bool = False) -> None:
    """Every process of a job must run the same configuration, or the job hangs in a collective that the others
    never enter, crashes in one whose shapes differ, or trains in a way its config.yaml (process 0's) does not say
    (another seed): each setting's value is hashed and compared across processes, and every process stops with
    the same line naming the settings that differ; `unnamed`: neither run.dir nor run.name was given."""
    if jax.process_count() == 1:
        return
    uneven = sharding.uneven_devices()  # (before differing's collective, which fails on them with a traceback)
    if uneven:
        raise UserError(uneven)
    keys = [k for k in config_lib.all_keys() if not k.startswith(_PER_PROCESS)]
    values = [operator.attrgetter(k)(cfg) for k in keys]
    if cfg.run.dir and not storage.is_url(cfg.run.dir):  # one directory in two spellings (runs/x, ./runs/x) is one
        values[keys.index("run.dir")] = os.path.normpath(cfg.run.dir)
    processes, apart = sharding.differing(values)
    if processes:
        differ, processes = [keys[i] for i in apart], list(map(str, processes))
        hint = ""
        if "run.dir" in differ and unnamed:  # each process named the run after its own start time
            hint = " (without run.name or run.dir each process names the run after the second it started: set one)"
        raise UserError(
            f"process{'es' if len(processes) > 1 else ''} {', '.join(processes)} of this job "
            f"{'were' if len(processes) > 1 else 'was'} started with other settings than process 0: "
            f"{', '.join(differ)}{hint}; start every process with the same config and overrides (only "
            "distributed.process_id differs)"
        )


def _agree_on_data(data: data_lib.Prepared, mixture: bool) -> None:
    """Every process must read the same tokens, also where each host prepared its own copy on its own disk:
    the checksums of each source's prepared files (checked against the files at start) are compared across
    processes, and every process stops with the same line, naming the sources that differ, if they do."""
    differ, apart = sharding.differing([meta_lib.digest(s.item()) for s in data.sources])
    if differ:
        inputs = (
            f"data.sources {', '.join(data.sources[i].name for i in apart)}"
            if mixture
            else "data.path or data.val_path"
        )
        raise UserError(
            f"process {', '.join(map(str, differ))} prepared other tokens than process 0 (their {inputs} inputs or "
            f"data.cache_dir copies differ; this process read {data.sources[apart[0]].directory}); give every host "
            "the same inputs"
        )


def _check_adapters(cfg: Config) -> None:
    """A LoRA run's targets and rank against its model's weights (lora.init_adapters' checks, on their shapes):
    refused before the run directory is touched and its base's step pinned (a refused run's pin kept that step
    from the base run's rotation for good)."""
    if cfg.lora.rank:
        shapes = jax.eval_shape(lambda key: nn.unbox(init_params(cfg.model, key)), jax.random.key(0))
        jax.eval_shape(lambda p: lora.init_adapters(p, cfg.lora.rank, cfg.lora.targets, jax.random.key(0)), shapes)


def _check_train_state_layout(stored: Config, cfg: Config, where: str) -> None:
    """Refuse settings under which the checkpoint's optimizer state or adapters no longer fit: a changed
    setting, not a damaged checkpoint, so it must not be skipped as unreadable."""

    def opt_state_structure(c: Config):
        return jax.tree.structure(jax.eval_shape(make_optimizer(c.optim, c.train.steps).init, {"kernel": jnp.zeros(1)}))

    changed = []
    if opt_state_structure(stored) != opt_state_structure(cfg):
        changed = [d for d in config_lib.differences(stored.optim, cfg.optim) if d.startswith(("name", "grad_clip"))]
        changed = [f"optim.{d}" for d in changed] or ["the optimizer's state"]
    # The adapters' shapes, or (alpha) the model they make with the same ones; targets as a set: their order, or one
    # named twice, makes the same adapters (a resume that reordered them was refused).
    adapters = lambda c: dataclasses.replace(c.lora, targets=tuple(sorted(set(c.lora.targets))))
    if adapters(stored) != adapters(cfg):
        changed += [f"lora.{d}" for d in config_lib.differences(adapters(stored), adapters(cfg))]
    if changed:  # (lora.alpha changes no array it stores: how its adapters scale, which it was said to)
        scales = [d for d in changed if d.startswith("lora.alpha")]
        what = ["what it stores"] * (len(scales) < len(changed)) + ["how its adapters scale"] * bool(scales)
        what = " and ".join(what)
        raise UserError(
            f"checkpoint {where} was trained with other settings that change {what} ({'; '.join(changed)}); "
            f"resume with the same settings, or start a new run from it: {branch(where, new_run(cfg.run))}"
        )


BRANCH_SHAPE = ("decay", "decay_fraction", "decay_shape", "warmup_steps")  # a wsd schedule's shape, with train.steps
SCHEDULE = ("lr", "min_lr", *BRANCH_SHAPE)  # the optim settings optim.schedule reads


def _branches(stored: Config, cfg: Config) -> bool:
    """Whether a resume changes a wsd schedule's shape: a decay branched from the stored run (optim.check_branch)."""
    shape = lambda c: (c.train.steps, *(getattr(c.optim, k) for k in BRANCH_SHAPE))
    return cfg.optim.decay == "wsd" and shape(stored) != shape(cfg)


# What a resume may change that makes the rest of the run other than the one the stored settings would continue:
# said in one line (the schedule's learning rate on its own), not refused.
TRAJECTORY = (
    "seed",
    "data.batch_size",
    "data.block_size",
    "train.grad_accum",
    "train.objective",
    "train.dpo_beta",
    "train.dpo_label_smoothing",
    "train.label_smoothing",
    "train.z_loss",
    "data.sources",  # their weights and order: the mixture of the rows to come
    "data.document_mask",
)


def _shown(key: str, value) -> str:
    """A TRAJECTORY setting's value as a warning names it: a mixture as its sources' names and weights."""
    if key == "data.sources":
        return "[" + ", ".join(f"{s.name or os.path.basename(s.path)}: {s.weight:g}" for s in value) + "]"
    return config_lib.shown_value(value)


def _mixture(sources: list) -> tuple:
    """A mixture as what its rows depend on: its sources' names, in order, and each one's rows of every MIX_PERIOD."""
    if len(sources) < 2:
        return ()
    return tuple(zip(data_lib.source_names(sources), Mixture([s.weight for s in sources], 0).quota.tolist()))


# What the validation batches are (lm.data's val_batches): another value evaluates other windows, or more of them
# (or, data.document_mask, the same windows with attention kept within each document).
VALIDATION_SET = ("train.eval_batches", "data.batch_size", "data.block_size", "data.document_mask")


def _resume_changes(stored: Config, cfg: Config, step: int, branched: bool = False) -> list[str]:
    """Warnings for a resume at `step` under settings that change the run's course: the learning rate its next
    update takes (a longer train.steps stretches a cosine or linear decay: the rate jumps back up), and
    TRAJECTORY's settings and the optimizer's that differ from the checkpoint's. A wsd decay `branched` from the
    checkpoint (optim.check_branch passed) changes the schedule as asked: neither its learning rate nor the
    schedule's settings (BRANCH_SHAPE) are said of it; the optimizer's other settings are."""
    if step >= cfg.train.steps:
        return []  # (no update follows the last step: a run resumed there only finishes, as the checkpoint's would)
    lines = []
    asked = {k: getattr(stored.optim, k) for k in BRANCH_SHAPE} if branched else {}  # (the branch's own settings)
    differences = config_lib.differences(stored.optim, dataclasses.replace(cfg.optim, **asked))
    # (those of the schedule are named in the learning rate's line; b1 or weight_decay read there as its cause)
    optim = [f"optim.{d}" for d in differences if d.split(" ")[0] in SCHEDULE]
    others = [f"optim.{d}" for d in differences if d.split(" ")[0] not in SCHEDULE]
    # (one jitted call: evaluated op by op, the two schedules compiled a dozen tiny programs, a second of a resume)
    rates = (schedule(stored.optim, stored.train.steps), schedule(cfg.optim, cfg.train.steps))
    before, after = (float(r) for r in jax.jit(lambda s: [rate(s) for rate in rates])(step))
    if not branched and not math.isclose(before, after, rel_tol=1e-6, abs_tol=0.0):
        lengthened = stored.train.steps != cfg.train.steps
        why = [f"train.steps {stored.train.steps} vs {cfg.train.steps}"] * lengthened
        if lengthened and cfg.data.epochs:  # (not the user's train.steps: the epochs' steps at the batch given now)
            why = [f"data.epochs={cfg.data.epochs} now gives train.steps {cfg.train.steps}, "
                   f"the run's {stored.train.steps}"]
        hint = "; a run scheduled with optim.decay=wsd changes its train.steps without a jump (before its decay)"
        lines.append(
            f"the learning rate of update {step + 1} is {before:.4g} under the run's schedule, {after:.4g} under this "
            f"one ({'; '.join(why + optim)})"
            f"{hint if lengthened and not optim and not cfg.data.epochs and stored.optim.decay != 'wsd' else ''}"
        )
    changed = others + ([] if lines else optim)  # (the schedule's changes are named in the learning rate's line)
    for key in TRAJECTORY:
        was, now = (operator.attrgetter(key)(c) for c in (stored, cfg))
        # a mixture: its names and shares (its files' contents are check_dataset's: a moved copy is the same data)
        same = _mixture(was) == _mixture(now) if key == "data.sources" else was == now
        if not same:
            changed.append(f"{key} {_shown(key, was)} vs {_shown(key, now)}")
    if changed:
        lines.append(f"resuming step {step} with other settings than the run's ({'; '.join(changed)}): the run goes on "
                     "from its checkpoint, but not as it would have")  # fmt: skip
    measured = [f"{key} {was} vs {now}" for key in VALIDATION_SET
                if (was := operator.attrgetter(key)(stored)) != (now := operator.attrgetter(key)(cfg))]  # fmt: skip
    if measured:  # (the best checkpoint is chosen by val_loss across resumes)
        lines.append(f"val_loss after step {step} is measured on other validation batches than before "
                     f"({'; '.join(measured)}): the best checkpoint (--best) compares it with the earlier steps' all "
                     "the same")  # fmt: skip
    was, now = stored.data.sources, cfg.data.sources
    if _mixture(was) != _mixture(now) and data_lib.source_names(was) == data_lib.source_names(now):
        # (val_loss is the sources' weighted mean: other shares weigh the same losses otherwise)
        lines.append(f"val_loss after step {step} weighs its sources' losses by other shares than before "
                     f"(data.sources {_shown('data.sources', was)} vs {_shown('data.sources', now)}): the best "
                     "checkpoint (--best) compares it with the earlier steps' all the same")  # fmt: skip
    return lines


@contextlib.contextmanager
def _writing(what: str):
    """A start-up write of the run's (its config.yaml, its metrics files), a failure of it one line: a full disk,
    which the run-directory check before it does not see (it writes an empty file), is the usual cause."""
    try:
        yield
    except OSError as e:
        raise UserError(
            f"cannot write {what}: {e.strerror or e}; free space (or fix the directory), then run the same command "
            "to resume"
        ) from None


def _take_lock(run: RunDir, held: contextlib.ExitStack) -> None:
    """Process 0 takes the run's lock (RunDir.lock, held until `held` closes); every process of the job stops, in one
    line, where it could not, rather than wait in a collective for a process that left."""
    refused = None
    if jax.process_index() == 0:
        try:
            held.enter_context(run.lock())
        except UserError as e:
            refused = e
    if not ckpt_lib.everywhere(refused is None):
        raise refused or UserError(
            f"another run is training {run.path} (process 0 could not take its lock); wait for it to end, or give "
            "this run another run.name or run.dir"
        )


def _check_resumed_tokenizer(ckpt_dir: str, given: dict, start_new: str, by_name: bool = False) -> None:
    """Refuse a resume whose data is tokenized otherwise than the newest checkpoint (`given`: tokenizer_item's), as
    _open_run does, where the config fails first (a config.yaml's resolved model.vocab_size smaller than another
    data.tokenizer's). `by_name`: before the data is prepared, `given` holds a spec alone, refused only where both it
    and the stored one are names (named_tokenizer) and differ."""
    steps = ckpt_lib.complete_steps(ckpt_dir)
    if steps:
        with contextlib.suppress(ckpt_lib.Damaged):  # (damaged: _open_run's to set aside; the config's error stands)
            stored = ckpt_lib.resume_items(ckpt_dir, steps[-1]).tokenizer
            named = named_tokenizer(stored["spec"]) and named_tokenizer(given["spec"])
            if by_name and (stored["spec"] == given["spec"] or not named):  # (a spec alone tells no ranks apart)
                return
            ckpt_lib.check_tokenizer(ckpt_dir, steps[-1], stored, given, start_new)


def _tokens_per_byte(data: data_lib.Prepared, batches: dict[str, list]) -> dict[str, float]:
    """Each source's validation tokens with loss per UTF-8 byte of their text, which converts its loss to bits per
    byte: of a token stream, its split's; of fine-tune examples, those in the batches evaluated (`batches`, this
    process's rows), as cut to data.block_size+1 (the split's counts, of whole examples, read 0.5% off)."""
    if data.pairs:
        return {}  # (DPO's validation has no bits per byte)
    if not data.examples:
        return {s.name: s.val_tokens_per_byte() for s in data.sources}
    ((name, rows),) = batches.items()
    byte_lengths, counted = data.tokenizer.byte_lengths, np.zeros(2, np.int64)
    for batch in rows:
        learned = batch["loss_mask"] > 0
        counted += (learned.sum(), byte_lengths[batch["targets"][learned]].sum())
    if jax.process_count() > 1:
        counted = np.asarray(multihost_utils.process_allgather(counted)).sum(axis=0)
    return {name: float(counted[0] / max(counted[1], 1))}


def _check_resume(cfg: Config, checkpoints: str) -> None:
    """Refuse what `resume` forbids, before the data is prepared (hours, for a large corpus) or init_from read; and
    a new run where every checkpoint was set aside as unreadable (which a fresh start would write over)."""
    has_checkpoints = bool(ckpt_lib.complete_steps(checkpoints))
    aside = [] if has_checkpoints else ckpt_lib.set_aside_steps(checkpoints)
    if aside:
        run, newest = shown(cfg.run.dir).rstrip("/"), aside[-1]
        raise UserError(
            f"every checkpoint of {run} was set aside as unreadable ({', '.join(aside)}); once what kept it from "
            f"restoring is mended, rename one back to resume ({run}/checkpoints/{newest} to {run}/checkpoints/"
            f"{newest.split('.')[0]}), or move the run directory away to start over"
        )
    if cfg.resume == "required" and not has_checkpoints:
        raise UserError(f"resume=required but {shown(cfg.run.dir)} has no checkpoint; use resume=auto to start fresh")
    if cfg.resume == "never" and has_checkpoints:
        raise UserError(
            f"{shown(cfg.run.dir)} already has checkpoints and resume=never; choose another run.name or run.dir, or "
            "give resume=auto to continue it"  # (the command's own: a run's config.yaml records resume=auto)
        )


def _open_run(
    cfg: Config,
    data: data_lib.Prepared,
    lock: Callable[[], None] | None,
    given: str = "",
    sized_by_block: bool = False,
) -> tuple[int, Config, dict | None]:
    """Create the run directory (checked writable) and take its lock with `lock` (None: train holds it already, the
    directory having existed); return the step to resume from (0 for a new run), after checking that the newest
    checkpoint fits this run, the run's config (its own base on resume; its own model.max_seq_len where the user
    left it to data.block_size: `sized_by_block`), and the items the step holds besides the train state (its config,
    the fingerprint of its base: ckpt_lib.resume_items; None for a new run)."""
    run_dir, ckpt_dir = RunDir.of(cfg.run).work, RunDir.of(cfg.run).checkpoints
    shown_ckpts = shown_dir(ckpt_dir)  # (a run in a bucket: named by its URL, not its working copy's)
    existing = ckpt_lib.complete_steps(ckpt_dir)
    resume_step, items = 0, None
    for step in reversed(existing):  # the newest checkpoint whose items can be read; damaged ones are set aside
        error = None
        try:
            items = ckpt_lib.resume_items(ckpt_dir, step)
        except ckpt_lib.Damaged as e:
            error = e
        if ckpt_lib.everywhere(error is None):
            resume_step = step
            break
        ckpt_lib.set_aside_everywhere(ckpt_dir, step, error)
    if existing and not resume_step:
        raise UserError(f"no checkpoint in {shown_ckpts} can be read; move the directory away to start over")
    origin = stream_origin(data, cfg, items, resume_step) if resume_step else Origin()
    if cfg.data.epochs and origin != Origin():  # the epochs' steps, the stream going on at another batch size
        cfg = config_lib.replace(cfg, train={"steps": data.steps_for_epochs(cfg.data, cfg.seed, origin)})
    if resume_step > cfg.train.steps:
        more = (
            f"raise data.epochs (which gives train.steps={cfg.train.steps})"
            if cfg.data.epochs
            else f"give train.steps above {resume_step} to train on"
        )
        raise UserError(
            f"{RunDir.of(cfg.run).path} is at step {resume_step}, past train.steps={cfg.train.steps}: nothing to "
            f"train; {more}, or start a new run: {new_run(cfg.run)}"
        )
    if resume_step:
        stored = items.config
        # (first: another tokenizer also makes another vocab_size, which the model's check would name instead)
        ckpt_lib.check_tokenizer(
            ckpt_dir, resume_step, items.tokenizer, tokenizer_item(data.tokenizer), new_run(cfg.run)
        )
        if sized_by_block and stored.model.max_seq_len != cfg.model.max_seq_len:
            # model.max_seq_len unset follows data.block_size: the run's model keeps its own, which a block fits in
            if cfg.data.block_size > stored.model.max_seq_len:
                raise UserError(
                    f"data.block_size={cfg.data.block_size} is longer than the model of checkpoint {shown_ckpts}/"
                    f"{resume_step} takes (model.max_seq_len={stored.model.max_seq_len}, its first block size); "
                    f"resume with data.block_size <= {stored.model.max_seq_len}, or start a new run: "
                    f"{new_run(cfg.run)}"
                )
            cfg = config_lib.replace(cfg, model={"max_seq_len": stored.model.max_seq_len})
        # Training options change how the same parameters are trained or run, not what they are.
        neutral = {name: getattr(cfg.model, name) for name in TRAINING_OPTIONS}
        diff = config_lib.differences(dataclasses.replace(stored.model, **neutral), cfg.model)
        if diff:
            raise UserError(
                f"checkpoint {shown_ckpts}/{resume_step} was trained with a different model ({'; '.join(diff)}); "
                f"use the same model settings, or start a new run: {new_run(cfg.run)}"
            )
        cfg = _same_base(stored, cfg, given)
        if _reads_base(cfg):  # (a run written before its base's step was recorded)
            whose = f"{'LoRA' if cfg.lora.rank else 'DPO'} checkpoint {shown_ckpts}/{resume_step}"
            pretrained.warn_unpinned(cfg.init_from, whose, f"{shown_ckpts}/{resume_step}")
        _check_train_state_layout(stored, cfg, f"{shown_ckpts}/{resume_step}")
        branched = _branches(stored, cfg)
        if branched:
            where = f"{shown_ckpts}/{resume_step}"
            sized_by = "train.steps"
            if cfg.data.epochs:
                sized_by = f"data.epochs (={cfg.data.epochs}, which sets train.steps)"
            before, after = (stored.optim, stored.train.steps), (cfg.optim, cfg.train.steps)
            check_branch(*before, *after, resume_step, where, sized_by, new_run(cfg.run))
        if stored.seed != cfg.seed and (data.examples or data.pairs) and data.sources[0].meta.get("seed") is not None:
            what = "examples" if data.examples else "pairs"  # (not "the data changed", as the files' checks say)
            raise UserError(
                f"seed={cfg.seed} holds out other {what} for validation than seed={stored.seed}, which checkpoint "
                f"{shown_ckpts}/{resume_step} was trained with (data.val_fraction draws them by the seed): the run "
                f"would train on its validation {what}; resume with seed={stored.seed} (a new run from this checkpoint "
                f"with seed={cfg.seed} would do the same: give it seed={stored.seed} or its own data.val_path)"
            )
        try:
            ckpt_lib.check_dataset(
                ckpt_dir, resume_step, items.dataset, data.dataset_item(), data.has_digest, new_run(cfg.run)
            )
        except UserError:
            start_new = f"or start a new run from it: {branch(f'{shown_ckpts}/{resume_step}', new_run(cfg.run))}"
            if bool(stored.data.val_path) != bool(cfg.data.val_path):  # (not "the training data changed" either)
                if cfg.data.val_path:
                    raise UserError(
                        f"data.val_path={cfg.data.val_path} makes the run train on all of its data, of which "
                        f"checkpoint {shown_ckpts}/{resume_step} held out data.val_fraction="
                        f"{stored.data.val_fraction} for validation; resume without data.val_path, {start_new}"
                    ) from None
                raise UserError(
                    f"checkpoint {shown_ckpts}/{resume_step} trained on all of its data, validating on "
                    f"data.val_path={stored.data.val_path}, and without it this resume holds out data.val_fraction="
                    f"{cfg.data.val_fraction} of the data; resume with "
                    f"{setting('data.val_path', stored.data.val_path)}, {start_new}"
                ) from None
            if stored.data.val_path != cfg.data.val_path:
                raise UserError(
                    f"data.val_path={cfg.data.val_path} is not the validation data checkpoint {shown_ckpts}/"
                    f"{resume_step} was trained beside ({stored.data.val_path}), whose losses it goes on from; "
                    f"resume with {setting('data.val_path', stored.data.val_path)}, {start_new}"
                ) from None
            if stored.data.val_fraction == cfg.data.val_fraction:
                raise
            raise UserError(  # (not "the training data changed: its files, or how this lm encodes them")
                f"data.val_fraction={cfg.data.val_fraction} holds out another part of the data for validation than "
                f"{stored.data.val_fraction}, which checkpoint {shown_ckpts}/{resume_step} was trained with; resume "
                f"with data.val_fraction={stored.data.val_fraction}, {start_new}"
            ) from None
        _check_cut_rule(data, cfg, items.dataset, f"{shown_ckpts}/{resume_step}")
        _check_softmax_rule(data, stored, items.dataset, f"{shown_ckpts}/{resume_step}")
        if jax.process_index() == 0:
            for line in _resume_changes(stored, cfg, resume_step, branched):
                print(f"warning: {line}", file=sys.stderr)
    elif not cfg.init_from and cfg.data.format in ("examples", "chat") and jax.process_index() == 0:
        # (configs/finetune_example.yaml run as it stands, its init_from left out: a model of random weights learned
        # the replies alone)
        print(f"warning: data.format={cfg.data.format} without init_from trains a model from random weights on this "
              "data alone; to fine-tune a trained model, add init_from=runs/NAME (or hf:DIR)", file=sys.stderr)
    t = cfg.train
    if t.ckpt_every and t.eval_every and t.ckpt_every % t.eval_every and jax.process_index() == 0:
        # (a checkpoint is ranked by the validation loss of its own step: one between evaluations has none)
        both = math.lcm(t.ckpt_every, t.eval_every)
        print(f"warning: train.ckpt_every={t.ckpt_every} is not a multiple of train.eval_every={t.eval_every}: only "
              f"checkpoints at multiples of {both} and the last have a validation loss to choose the best by (kept, "
              "--best); make train.ckpt_every a multiple of train.eval_every", file=sys.stderr)
    o = cfg.optim
    if o.warmup_steps >= t.steps and not resume_step and jax.process_index() == 0:
        # (configs/default.yaml's 100 warmup steps in `train.py train.steps=50`: half the peak at the end, no decay)
        decays = ", and it never decays" if o.decay != "constant" else ""
        print(f"warning: optim.warmup_steps={o.warmup_steps} is not below train.steps={t.steps}: the whole run "
              f"warms up, its last step at {t.steps / o.warmup_steps:.0%} of optim.lr={o.lr:g}{decays}; lower "
              f"optim.warmup_steps (a few percent of the run is usual) or raise {_steps_set_by(cfg)}", file=sys.stderr)
    alone = cfg.data.sources[0] if len(cfg.data.sources) == 1 else SourceConfig()
    unused = [name for name in ("name", "weight") if getattr(alone, name) != getattr(SourceConfig, name)]
    if unused and jax.process_index() == 0:  # (one source is the whole stream, logged as data.path's is: val_loss)
        print(f"warning: data.sources holds one source, so its {' and '.join(unused)} change nothing: a mixture needs "
              f"two or more sources (then each is logged by name); for one, data.path={alone.path} says the same",
              file=sys.stderr)
    m = cfg.model
    if m.rope_scaling != "none" and m.rope_factor == 1 and not resume_step and jax.process_index() == 0:
        # (a factor of 1 divides nothing, in llama3's rule too: the positions of a model without rope_scaling)
        print(f"warning: model.rope_scaling={m.rope_scaling} with model.rope_factor=1 stretches nothing; set "
              "model.rope_factor to the stretch, e.g. 4 for a context 4x the original", file=sys.stderr)  # fmt: skip
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UserError(f"{run_dir} is a file; set run.dir (or run.name) to a directory")
    try:
        os.makedirs(run_dir, exist_ok=True)
        if jax.process_index() == 0:  # writable? (config.yaml itself is saved once the run starts: _train)
            probe_writable(run_dir)
    except OSError as e:
        raise unwritable(run_dir, e) from None
    if not storage.is_url(ckpt_dir):
        _check_shared(run_dir)
    if lock is not None:  # a new run directory, made just now
        lock()
    return resume_step, cfg, items if resume_step else None, origin


def _check_shared(run_dir: str) -> None:
    """Every process of a job writes its part of each checkpoint into the run directory, which must be one directory
    that all of them see (a shared filesystem's). One on each host's own disk (or a relative run.dir from other
    working directories) failed the first checkpoint's write on every process but 0, and the job hung: process 0
    in the save's barrier, the others in JAX's shutdown waiting for it. Process 0 writes a file there that every
    other process must find, and every process stops with the same line where one does not."""
    if jax.process_count() == 1:
        return
    probe = os.path.join(run_dir, ".lm-shared-probe")
    if jax.process_index() == 0:
        with open(probe, "w") as f:
            f.write(os.urandom(8).hex())  # (a probe another run left on a host's own disk holds another)
    multihost_utils.sync_global_devices("lm: run directory probe written")
    try:
        with open(probe) as f:
            seen = f.read()
    except OSError:
        seen = None
    unseen, _ = sharding.differing([seen])  # the processes that read other than process 0's own file
    if jax.process_index() == 0:
        with contextlib.suppress(OSError):
            os.remove(probe)
    if unseen:
        processes = f"process{'es' if len(unseen) > 1 else ''} {', '.join(map(str, unseen))}"
        raise UserError(
            f"run directory {run_dir} is not one directory that the job's processes share: {processes} "
            "cannot see the file process 0 wrote there (each host's own disk, or a relative run.dir given in other "
            "working directories), and every process writes its part of each checkpoint into it; put run.dir on a "
            "filesystem every host mounts at the same path (NFS, Lustre), or in a gs:// bucket"
        )


def _check_cut_rule(data: data_lib.Prepared, cfg: Config, stored: dict | None, where: str) -> None:
    """A fine-tune's checkpoint written before its dataset item recorded the cut rule (CUT) may have cut its
    examples longer than a row otherwise than this lm: their prepared files are the same, so check_dataset passes,
    but its rows and loss masks are not. Before 2026-11-27 (an item without "stream") the rule was another, and
    the run is refused; from then to 2026-12-01 it kept an example's end, not its last learned token (a chat's
    closing turn or newline after its last reply), which is said."""
    if not data.examples or stored is None or CUT in stored:
        return
    source = data.sources[0]
    cut = examples_lib.count_truncated(source.directory, source.meta, "train", cfg.data.block_size)
    if not cut:
        return
    if "stream" not in stored:
        raise UserError(
            f"checkpoint {where} was written by an lm before 2026-11-27, which cut examples longer than "
            f"block_size+1 = {cfg.data.block_size + 1} tokens at their end ({cut} train examples here); this lm cuts "
            "them from the prompt's start, so the run would go on with other rows and loss masks; resume it with the "
            f"lm that wrote it, or start a new run from it: {branch(where, new_run(cfg.run))}"
        )
    cut = examples_lib.count_truncated(source.directory, source.meta, "train", cfg.data.block_size, unlearned_end=True)
    if cut and jax.process_index() == 0:
        print(
            f"warning: checkpoint {where} records no cut rule (an lm before 2026-12-05): if it was written before "
            f"2026-12-01, that lm cut {cut} train examples longer than block_size+1 = {cfg.data.block_size + 1} "
            "tokens, which end in tokens not learned, to keep their end, where this lm keeps their last learned "
            "token: the run goes on with other rows; to reproduce it exactly, resume it with the lm that wrote it",
            file=sys.stderr,
        )


def _check_softmax_rule(data: data_lib.Prepared, stored: Config, dataset: dict | None, where: str) -> None:
    """A checkpoint whose dataset item records no SOFTMAX rule may come from an lm before 2026-12-06, whose
    cross-entropy took the rows a padded vocabulary adds into its softmax (and trained them down): the resumed run
    goes on with other updates and reads a lower loss, which is said. (DPO left them out from 2026-12-05.)"""
    padded = stored.model.vocab_size - data.tokenizer.n_vocab
    if dataset is None or SOFTMAX in dataset or padded <= 0 or stored.train.objective == "dpo":
        return
    if jax.process_index() == 0:
        print(
            f"warning: checkpoint {where} records no softmax rule (an earlier lm): if it was written "
            f"before 2026-12-06, that lm's loss took the {padded} rows its padded vocabulary adds "
            f"(model.vocab_multiple) into the softmax, where this lm leaves them out: the run goes on with other "
            f"updates, and its loss reads lower than before (by up to "
            f"log({stored.model.vocab_size}/{data.tokenizer.n_vocab}) = "
            f"{math.log(stored.model.vocab_size / data.tokenizer.n_vocab):.2f}); to reproduce it exactly, resume it "
            "with the lm that wrote it",
            file=sys.stderr,
        )


def stream_origin(data: data_lib.Prepared, cfg: Config, items: ckpt_lib.ResumeItems, step: int) -> Origin:
    """Where the training stream's batches are counted from (lm.data.loaders.Origin), resuming at `step` from a
    checkpoint whose `items` were read: the origin it records (none, before lm kept one: (0, 0)), or where the
    batch size changes, the first row the run has not trained on (counting batch `step` from it). Counting the
    new batch size from (0, 0) skipped rows (a larger batch) or trained some again (a smaller one)."""
    origin = Origin(**((items.dataset or {}).get("stream") or {}))
    stored = items.config
    mixed = _mixture_going_on(stored, cfg, step)
    before = stored.data.batch_size
    if before == cfg.data.batch_size and not mixed:
        return origin
    row = data.rows_before(dataclasses.replace(cfg.data, batch_size=before), cfg.seed, origin, step)
    if not mixed:
        return dataclasses.replace(origin, index=step, row=row)
    # Each source goes on from the rows it had given by then: counted from row 0 under the new weights, a source
    # whose share grew trained its windows again, one whose share shrank skipped some (and its epochs went back).
    bases = Mixture(mixed, stored.seed).rows_of(row, origin)
    return Origin(step, row, row, tuple(int(b) for b in bases))


def _mixture_going_on(stored: Config, cfg: Config, step: int) -> list[float] | None:
    """The checkpoint's mixture weights where a resume at `step` changes them (None where it keeps them, or trains
    on one source). Its sources must be the checkpoint's, in its order: another list is one line."""
    was, now = (data_lib.source_names(c.data.sources) for c in (stored, cfg))
    if len(was) < 2 and len(now) < 2:
        return None
    if was != now:
        raise UserError(
            f"checkpoint {step} was trained on the data sources [{', '.join(was) or 'data.path'}], and this resume "
            f"names [{', '.join(now) or 'data.path'}]: a resume keeps the run's sources, in their order (their weights "
            f"may change); to train on others, start a new run from the checkpoint (init_from="
            f"{shown_dir(RunDir.of(cfg.run).checkpoints)}/{step} {new_run(cfg.run)})"
        )
    same = _mixture(stored.data.sources) == _mixture(cfg.data.sources)
    return None if same else [s.weight for s in stored.data.sources]


def train(cfg: Config, stop_after: int | None = None, chosen: Collection[str] | None = None) -> str:
    """Run (or resume) training as configured; return the run directory.

    `chosen` names the config keys the user set (config.set_keys), which decides what a run starting from
    trained weights may not contradict (None: the model options that differ from the defaults).
    `stop_after` ends the loop early after that step, as if the process had been killed there (used to test
    resumption). SIGTERM or Ctrl-C stops cleanly at any point: before training with lm.errors.Stopped,
    during training with a checkpoint.
    """
    cfg = config_lib.typed(cfg)  # (config.load's checks, for a config made or changed in Python: types, then values)
    validate(cfg)
    check_training(cfg)
    unnamed = not cfg.run.dir and not cfg.run.name  # runs/ the second it started
    cfg = config_lib.replace(cfg, run={"dir": resolve_run_dir(cfg)})
    run_dir = RunDir.of(cfg.run)
    if not run_dir.works_in_copy:
        _check_run_path(run_dir.path)
    work, uploads, locked, claimed = run_dir.work, None, False, False
    with loop.Signals() as signals, contextlib.ExitStack() as held:
        held.callback(ckpt_lib.release_reading, ckpt_lib.reading())  # the steps it read (init_from's: pinned since)
        try:
            with signals.start_up():
                sharding.split_cpu(cfg.mesh.cpu_devices)
                sharding.initialize(cfg.distributed)
                if unnamed and jax.process_count() == 1:  # (a job's processes would each make one of their own)
                    made = [] if os.path.isdir(os.path.dirname(cfg.run.dir)) else [os.path.dirname(cfg.run.dir)]
                    cfg = config_lib.replace(cfg, run={"dir": _claim(cfg.run.dir)})
                    run_dir, work, claimed = RunDir.of(cfg.run), cfg.run.dir, True
                    for directory in made:  # removed again where the run stops before writing to it
                        held.callback(_remove_if_empty, directory)
                    held.callback(_remove_if_untrained, cfg.run.dir)
                _agree_on_config(cfg, unnamed)
                # An existing run is locked before anything else (a bucket's before its pull empties the working
                # copy): a second command stops at once, and a signal here is the run's own to record.
                if run_dir.works_in_copy or (os.path.isdir(run_dir.path) and not claimed):
                    _take_lock(run_dir, held)
                    locked = True
                uploads = run_dir.for_training(lambda: ckpt_lib.complete_steps(run_dir.checkpoints))
                _check_resume(cfg, run_dir.checkpoints)
                compile_cache.use(cfg.train.compile_cache)
                # A full fine-tune that resumes goes on from its own checkpoints, whose model and tokenizer are the
                # weights' it started from: it never reads init_from again, which may be gone (rotated, deleted).
                has_steps = bool(ckpt_lib.complete_steps(run_dir.checkpoints))  # (listed once)
                resuming = bool(cfg.init_from) and has_steps
                own = resuming and not _reads_base(cfg)
                base = run_dir.checkpoints if own else cfg.init_from
                newest = functools.cache(lambda: ckpt_lib.load_config(*ckpt_lib.find(run_dir.checkpoints)))
                stored = newest() if resuming and not own else None
                if stored and _names_base(stored.init_from, cfg.init_from):  # (another one: _same_base's to refuse)
                    what = "the LoRA adapters of {} were" if cfg.lora.rank else "the DPO run {} was"
                    what = what.format(run_dir.path) + " trained on"
                    why = "a LoRA run holds only its adapters" if cfg.lora.rank else "DPO's reference model is its base"
                    pretrained.check_there(stored.init_from, what, f"{why}, and reads it again at every resume")
                trained_model, trained_tok, trained_sample = _together(
                    lambda: (*pretrained.config_and_tokenizer(base),  # (a resume's own sample settings, LoRA's too)
                             pretrained.sample_settings(run_dir.checkpoints if resuming else base)) if base else
                    (None, None, None), "read init_from"
                )  # fmt: skip
                if stored:  # another base is refused before the data is prepared (a DPO run's pairs: minutes)
                    _same_base(stored, dataclasses.replace(cfg, init_from=_resolved_init_from(cfg.init_from, True)),
                               cfg.init_from)  # fmt: skip
                if stored and stored.init_from == cfg.init_from:  # LoRA's or DPO's base read again: the run's?
                    pretrained.check_base(cfg.init_from, trained_model, stored.model, what)
                if resuming:  # (read so, its newest step was held from the run's rotation for as long as it trained)
                    ckpt_lib.release_reading_of(run_dir.checkpoints)
                cfg = _text_tokenizer(cfg, trained_tok, chosen)
                if has_steps and cfg.data.format == "text":
                    # Another tokenizer by name (once init_from's is taken): refused now, not once it is trained
                    # (bpe:N) and the corpus tokenized with it
                    given = {"spec": spelled_once(cfg.data.tokenizer), "ranks": None}
                    _check_resumed_tokenizer(run_dir.checkpoints, given, new_run(cfg.run), by_name=True)
                own_record = lambda: newest().data.tokenizer  # (read once: LoRA's and DPO's resume read it above)
                _check_data_tokenizer(cfg, trained_tok, chosen, own_record if resuming else None)
                if trained_model is not None:  # (before preparing data, which may take long, for a block that fits)
                    data_lib.check_stream_tokenizer(cfg.data, trained_tok)  # (first: the weights' fit is moot then)
                    _inherited_model(cfg, trained_model, chosen)
                data = _prepare_data(cfg, trained_tok, jax.process_index() == 0)
                held.enter_context(data.kept(cfg.logging.bars and jax.process_index() == 0))
                epoch_steps = data.steps_for_epochs(cfg.data, cfg.seed) if cfg.data.epochs else None
                given = cfg.init_from  # (resolve pins a run directory to its newest step)
                sized_by_block = not cfg.model.max_seq_len  # (resolve sets it to data.block_size)
                try:
                    cfg = resolve(
                        cfg, data.tokenizer, chosen, trained_model, epoch_steps, pin=not own,
                        trained_sample=trained_sample,
                    )  # fmt: skip
                except ConfigError:  # (a config.yaml's vocab_size too small: the tokenizer changed on resume?)
                    _check_resumed_tokenizer(run_dir.checkpoints, tokenizer_item(data.tokenizer), new_run(cfg.run))
                    raise
                if epoch_steps is not None:  # (validate saw the train.steps that data.epochs replaces)
                    if cfg.train.steps >= 2**31:
                        raise ConfigError(
                            f"data.epochs={cfg.data.epochs} gives train.steps={cfg.train.steps}, past the step "
                            "counter's 2**31 (it is 32-bit); lower data.epochs"
                        )
                    check_schedule(cfg.optim, cfg.train.steps, _steps_set_by(cfg))
                # Whatever the configuration can still be wrong about is found before the run directory is touched.
                mesh = sharding.make_mesh(cfg.mesh)
                sharding.check(cfg, mesh)
                _check_adapters(cfg)
                tasks = _eval_tasks(cfg, data.tokenizer)
                data.check(cfg.data, cfg.train.eval_batches)
                signals.check()  # the last moment before the run directory is touched
                lock = None if locked else lambda: _take_lock(RunDir.of(cfg.run), held)
                resume_step, cfg, resumed, origin = _open_run(cfg, data, lock, given, sized_by_block)
                locked = True
                if _reads_base(cfg) and cfg.init_from and jax.process_index() == 0:  # kept from its rotation
                    ckpt_lib.pin(cfg.init_from, cfg.run.dir)
                    if not resume_step:  # let go again where it stops before its first checkpoint
                        held.callback(_unpin_unless_saved, cfg.init_from, cfg.run.dir, RunDir.of(cfg.run).checkpoints)
        except Stopped:
            # (stopped while waiting for the job's other processes: nothing of the run was touched; JAX must not be)
            # (only a run's own command says so, not one stopped before it could lock the run: another trains there)
            if not sharding.joining() and locked and jax.process_index() == 0 and read_status(work):
                runs_lib.write_status(work, "stopped", idle=True)  # (its wall time stays: nothing trained)
            raise
        is_main = jax.process_index() == 0
        with pushed_at_exit(uploads):
            with runs_lib.track_status(work, enabled=is_main) as outcome, signals.start_up():
                with fits_in_memory(*_memory_advice(cfg)):
                    outcome.status = _train(
                        cfg, data, mesh, tasks, resume_step, resumed, origin, stop_after, signals, uploads
                    )
            if is_main and outcome.status == "finished" and plot_lib.available():
                try:
                    plot_lib.plot_runs([work], os.path.join(work, "curves.png"))
                except UserError as e:  # the run finished all the same (python -m lm.plot draws it later)
                    print(f"warning: {e}", file=sys.stderr)
            if signals.requested == loop.READER_GONE:  # stopped with a checkpoint: now exit as Unix tools do (141)
                raise BrokenPipeError(errno.EPIPE, "its output's reader went away")
            if signals.requested == "SIGINT" and outcome.status == "preempted":  # (main: exit 0, as after SIGTERM)
                raise Interrupted(cfg.run.dir)
    return cfg.run.dir


def _unpin_unless_saved(base: str, run: str, checkpoints: str) -> None:
    """A new run that ends without a checkpoint (stopped during start-up or its first steps, or failed there)
    releases the step of its base it pinned (ckpt_lib.pin): nothing of it reads that step again."""
    with contextlib.suppress(Exception):  # (a listing that fails keeps the pin: the safe side)
        if not ckpt_lib.complete_steps(checkpoints):
            ckpt_lib.unpin(base, run)


def _remove_if_empty(directory: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(directory)  # (only an empty one)


def _remove_if_untrained(run: str) -> None:
    """The directory this command made for a run given no name (runs/STAMP) goes again where the run stopped during
    its start-up (no checkpoint, no metrics; status.json, where written, `stopped`): "run the same command again"
    makes another, and each stop left one in lm.runs that held only its lock and status (its config and empty logs,
    after a stop while compiling). One that failed keeps its error, one that logged a step its metrics (train's
    stop_after, before a checkpoint)."""
    status = read_status(run).get("status")
    with contextlib.suppress(OSError):
        if os.path.getsize(os.path.join(run, "metrics.jsonl")):
            return
    if status in (None, "stopped") and not ckpt_lib.complete_steps(RunDir(run).checkpoints):
        shutil.rmtree(run, ignore_errors=True)


def _memory_advice(cfg: Config) -> tuple[str, str]:
    """What a run that runs out of device memory holds, and the settings that lower it (lm.errors.fits_in_memory)."""
    tc, rows, block = cfg.train, cfg.data.batch_size, cfg.data.block_size
    micro = f" in micro-batches of {rows // tc.grad_accum}" if tc.grad_accum > 1 else ""
    model = f"a {cfg.model.n_layer}-layer model of width {cfg.model.n_embd}"
    what = f"a training step of {rows} rows of {block} tokens{micro} ({model})"
    fixes = ["lower data.batch_size or data.block_size"]
    mesh = sharding.make_mesh(cfg.mesh)
    if rows // tc.grad_accum // sharding.batch_shards(mesh) > 1:  # more than one row on each device
        fixes.append("raise train.grad_accum (the micro-batches a step is summed over)")
    if cfg.model.remat != "full" and platform_lib.of(mesh.devices.flat[0].platform).remat_saves_memory:
        fixes.append("set model.remat=full (activations recomputed in the backward pass)")
    if mesh.shape["data"] > 1:  # (fsdp and tensor shard them already)
        fixes.append("shard the parameters and optimizer state over the devices (mesh.data=1 mesh.fsdp=-1)")
    fix = fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])}{',' if len(fixes) > 2 else ''} or {fixes[-1]}"
    return what, fix


def _eval_tasks(cfg: Config, tokenizer: Tokenizer) -> tuple:
    """train.eval_tasks read and tokenized once, with each one's requests; errors name the file and line."""
    fix = "restore it, or leave it out of train.eval_tasks (train.eval_tasks=[] for none)"
    # (each host reads its own copy: one missing stops every process, where the others waited for it in the next
    # collective until JAX's barrier timed out, and copies that differ are refused, where each process scored its
    # own rows of its own copy into one accuracy)
    read = lambda: [load_task(path, cfg.train.eval_task_limit, fix) for path in cfg.train.eval_tasks]
    tasks = _together(read, "read train.eval_tasks")
    clash = name_clash(cfg.train.eval_tasks)
    if clash:
        name, path, same = clash
        if same:  # (renaming the one file renames both)
            raise UserError(f"train.eval_tasks names {path} twice; give it once")
        raise UserError(f"two of train.eval_tasks are named {name} (the file name); rename one")
    if jax.process_count() > 1 and tasks:
        differ, apart = sharding.differing([task_digest(t) for t in tasks])
        if differ:
            raise UserError(
                f"process {', '.join(map(str, differ))} read other examples than process 0 in train.eval_tasks "
                f"{', '.join(tasks[i].name for i in apart)} (each host's copy of the file differs); give every host "
                "the same task files"
            )
    return tuple((t, task_requests(tokenizer, t, cfg.model.max_seq_len)) for t in tasks)


def _note_eval_tasks(work: str, tasks: tuple, resume_step: int) -> None:
    """Keep in RUN/eval_tasks.json what each of train.eval_tasks held (lm.eval.tasks.digest); a resume that scores
    a task of the same name with other examples (the file edited, another train.eval_task_limit) says that its
    acc/NAME series changes there."""
    path = os.path.join(work, EVAL_TASKS_FILE)
    digests = {task.name: task_digest(task) for task, _ in tasks}
    before = read_json(path) if resume_step else None
    before = before if isinstance(before, dict) else {}
    for task, _ in tasks:
        if before.get(task.name, digests[task.name]) != digests[task.name]:
            print(f"warning: task {task.name} ({task.path}) holds other examples than when this run last scored it "
                  f"(train.eval_tasks): acc/{task.name} after step {resume_step} scores the new ones; give the task "
                  "another file name to keep the two apart", file=sys.stderr)  # fmt: skip
    if digests or before:
        with _writing(path):
            write_json(path, {**before, **digests})


def _tokens_trained(last: dict | None, step: int, resumed, origin: Origin) -> int:
    """The tokens the run trained on up to the checkpoint at `step` it resumes from: the count at the start of the
    run that wrote the checkpoint (its dataset item's "trained", TRAINED), and its steps since at the batch and
    block of the checkpoint's config. (A resume may change the batch: a count of steps times today's batch would be
    wrong for every step before it.) For a checkpoint written before it kept that count, the last count its
    metrics.jsonl kept (`last`: MetricsWriter.counted) and the steps since; without one (a step directory copied
    alone), the rows before the checkpoint's stream `origin` (where an earlier resume changed the batch) at the
    batch before it, then its own."""
    stored = resumed.config
    trained = (resumed.dataset or {}).get(TRAINED)
    if trained:  # (a metrics row before an earlier resume that changed the batch would count its steps at the new)
        return trained["tokens"] + (step - trained["step"]) * rows_per_step(stored) * stored.data.block_size
    per_row = rows_per_step(stored) // stored.data.batch_size * stored.data.block_size  # (a pair: two sequences)
    if last:
        counted, since = last["tokens"], last["step"]
    else:
        counted, since = origin.row * per_row, origin.index
    return counted + (step - since) * rows_per_step(stored) * stored.data.block_size


def _train(
    cfg: Config, data: data_lib.Prepared, mesh, tasks: tuple, resume_step: int, resumed, origin: Origin,
    stop_after: int | None, signals, uploads=None,
) -> str:  # fmt: skip
    """Build the train state (from init_from, or restored from the newest checkpoint), save the run's config.yaml
    and run the loop; `resumed` holds the resumed step's other items (_open_run: its config and the fingerprint of its
    base), None for a new run; `origin` is where the training stream's batches are counted from (stream_origin);
    `uploads` (a run.dir in object storage) uploads each checkpoint once it is written."""
    is_main = jax.process_index() == 0
    quiet = cfg.logging.quiet or not is_main
    start = None  # the init_from parameters, laid out like the train state's
    # DPO's reference model is the starting weights, resumed or not: with LoRA the base the adapters are on (the
    # same arrays), in a full fine-tune a frozen copy of them (one more copy of the parameters in memory).
    reference = cfg.train.objective == "dpo"
    frozen, base = None, {}
    if cfg.init_from and (_reads_base(cfg) or not resume_step):
        stored, stored_model, _ = pretrained.load(cfg.init_from, mesh=mesh)
        if _reads_base(cfg):  # read again at every resume and load: its weights must stay the ones it started from
            base = {"init_from": cfg.init_from, "weights": pretrained.fingerprint(stored)}
            if resume_step:
                steps_dir = RunDir.of(cfg.run).checkpoints
                which = "LoRA adapters were trained on" if cfg.lora.rank else "DPO reference model was"
                pretrained.check_weights(
                    base["weights"], resumed.base, cfg.init_from,
                    f"this run's {which}, as {steps_dir}/{resume_step} recorded them,",
                    f"put those weights back there to resume, or start a new run: {new_run(cfg.run)}",
                )  # fmt: skip
        stored = pretrained.in_layout(stored, stored_model, cfg.model, mesh)  # (model.scan_layers: the run's choice)
        dtype = jnp.dtype(cfg.model.param_dtype)  # the weights' own unless model.param_dtype was chosen
        start = jax.tree.map(lambda x: x if x.dtype == dtype else x.astype(dtype), stored)
        frozen = start if _reads_base(cfg) else None
        if reference and not cfg.lora.rank:
            # A full fine-tune's reference keeps the narrower of the stored dtype and param_dtype: 16-bit weights
            # trained with float32 masters keep a 16-bit reference, half the memory; the model casts weights to its
            # compute dtype, so the reference's log-probabilities are those of its float32 copy.
            narrower = lambda s, x: s if s.dtype.itemsize < x.dtype.itemsize else x
            frozen = jax.tree.map(narrower, stored, start)
    params = None  # (a resume restores the whole state, a LoRA run trains new adapters)
    if start is not None and not cfg.lora.rank and not resume_step:
        # The train state is donated to each step: it must not share its buffers with the reference.
        unshared = lambda x, f: jnp.copy(x) if x is f else x
        params = jax.tree.map(unshared, start, frozen) if reference else start
    trainer, state = Trainer.create(
        cfg, mesh, data.tokenizer.n_vocab, frozen=frozen, params=params, restoring=bool(resume_step)
    )
    if start is not None and not resume_step and not quiet:
        print(f"initialised parameters from {cfg.init_from}")

    rows = sharding.process_rows(mesh, cfg.data.batch_size)
    # (only the first says its warnings, of cut examples say: a resume makes more for the restore)
    make_iterator = lambda verbose=False: data.train_iterator(cfg.data, cfg.seed, rows, verbose, origin=origin)
    validation_batches = data.val_batches(cfg.data, cfg.train.eval_batches, rows, verbose=is_main)
    validation = loop.Validation(
        validation_batches,
        _tokens_per_byte(data, validation_batches),
        {s.name: s.weight for s in data.sources},
        tasks,
        Scorer(
            None,
            cfg.model,
            cfg.data.batch_size // cfg.train.grad_accum,  # the rows an eval step holds: they fit
            mesh=mesh,
            frozen=trainer.frozen,
            merge=functools.partial(model_params, cfg) if cfg.lora.rank else None,
            n_vocab=data.tokenizer.n_vocab,
        )
        if tasks
        else None,
    )
    progress = data.progress(cfg.data, cfg.seed)
    work = RunDir.of(cfg.run).work
    ckpts = ckpt_lib.Checkpoints(RunDir.of(cfg.run).checkpoints, keep=cfg.train.keep, keep_every=cfg.train.keep_every)
    log, failed = None, False
    try:
        train_iter = make_iterator(verbose=is_main)
        if resume_step:
            if not quiet:
                print(f"restoring {shown(cfg.run.dir)}/checkpoints/{resume_step} ...", flush=True)
            steps = [s for s in ckpts.steps() if s <= resume_step]
            # (the state Trainer.create gave is abstract, its shapes and layout: nothing is held beside the restore)
            state, train_iter, restored = ckpts.restore_newest(steps, state, make_iterator, signals.check)
            if restored != resume_step:  # an older step than the one read (its arrays were damaged): its origin
                origin = stream_origin(data, cfg, ckpt_lib.resume_items(ckpts.directory, restored), restored)
                if cfg.data.epochs and data.steps_for_epochs(cfg.data, cfg.seed, origin) != cfg.train.steps:
                    raise UserError(
                        f"checkpoint {resume_step} was set aside (damaged); from step {restored}, at this batch size, "
                        f"data.epochs={cfg.data.epochs} gives another train.steps than the schedule was built for: "
                        "run the same command again"
                    )
                position, train_iter = train_iter.get_state(), make_iterator()
                train_iter.set_state(position)
                resume_step = restored
            if not quiet:
                print(f"resumed {shown(cfg.run.dir)} from step {resume_step}")
        progress.origin = origin
        progress.new_epochs(resume_step)  # epochs that begin from here on are reported
        if is_main:  # only now: a run that could not start leaves the config.yaml that resumes it as it was
            # without the distributed.* launch settings, which are each process's own (process 0's would make every
            # process of a resume process 0, or a single-process resume wait for peers), nor this command's own
            # resume policy and terminal (resume=never refused the printed resume command, resume=required a new
            # run.name from the file; -q resumed silent): lm's defaults there. run.dir absolute, so that
            # the file copied alone resumes this run from any directory (runs/NAME resumed the working directory's)
            run = dataclasses.replace(cfg.run, dir=storage.absolute(cfg.run.dir))
            terminal = cfg.logging  # (logging.progress=false alone, a batch job's, is the run's to keep)
            if cfg.logging.quiet:  # (--quiet sets both)
                terminal = dataclasses.replace(cfg.logging, quiet=LoggingConfig.quiet, progress=LoggingConfig.progress)
            launched = dataclasses.replace(cfg, distributed=config_lib.DistributedConfig(), run=run,
                                           resume=Config.resume, logging=terminal)  # fmt: skip
            with _writing(os.path.join(work, "config.yaml")):
                config_lib.save(launched, os.path.join(work, "config.yaml"))
            _note_eval_tasks(work, tasks, resume_step)
        writer = None
        if is_main:
            with _writing(f"{work}'s metrics"):
                writer = MetricsWriter(
                    work,
                    resume_step,
                    cfg.logging.tensorboard,
                    config_lib.to_yaml(cfg),
                    wandb=cfg.logging.wandb,
                    wandb_project=cfg.logging.wandb_project,
                    quiet=cfg.logging.quiet,
                    # a run in a bucket is named by its URL, not by its local copy (NAME-<hash>)
                    name=storage.basename(cfg.run.dir) if storage.is_url(cfg.run.dir) else "",
                )
        bar = tqdm(
            total=cfg.train.steps,
            initial=resume_step,
            disable=not (cfg.logging.bars and is_main),
            unit="step",
            dynamic_ncols=True,
        )
        log = loop.Log(cfg, writer, bar, signals.reader_gone)
        tokens_per_step = rows_per_step(cfg) * cfg.data.block_size
        timer = StepTimer(
            tokens_per_step,
            step_flops(cfg),
            peak_flops_per_device(cfg.train.peak_flops, cfg.model.dtype) * jax.device_count(),
            resume_step,
            _tokens_trained(writer and writer.counted, resume_step, resumed, origin) if resume_step else 0,
            functools.partial(peak_below_rate, cfg.train.peak_flops, cfg.model.dtype) if is_main else None,
        )
        trained = count_params(state.params)  # (a LoRA run's state holds the adapters alone; its base is frozen)
        size = (f"{trained:,} trained parameters (LoRA adapters on {count_params(trainer.frozen) / 1e6:.2f}M)"
                if cfg.lora.rank else f"{trained / 1e6:.2f}M parameters")  # fmt: skip
        log.line(
            f"run {shown(cfg.run.dir)}: {size}, {plural(jax.device_count(), jax.devices()[0].platform + ' device')}, "
            f"mesh {dict(mesh.shape)}, "
            f"{tokens_per_step} tokens/step, steps {resume_step}..{cfg.train.steps}"
        )
        log.line(trainer.platform.describe())
        for line in data.summary(progress, cfg.train.steps):
            log.line(line)
        unused = data.unused_warning(cfg.data, progress)
        if unused:
            log.line(unused)
        # (stream_origin; the tokens trained before this run's first step, which its checkpoints count on from)
        dataset = {**data.dataset_item(), "stream": dataclasses.asdict(origin)}
        dataset[TRAINED] = {"step": resume_step, "tokens": timer.tokens_before}
        if data.examples:
            dataset[CUT] = examples_lib.CUT_RULE
        dataset[SOFTMAX] = SOFTMAX_IDS
        items = {"cfg": cfg, "tokenizer": tokenizer_item(data.tokenizer), "dataset": dataset, "base": base}
        end = min(cfg.train.steps, stop_after or cfg.train.steps)
        with sharding.activate(mesh):
            status = loop.run(
                trainer, state, train_iter, validation, progress, ckpts, items, signals, log, timer,
                resume_step, end, uploads,
            )
        # Before the log closes: a last checkpoint that fails to write fails the run, which W&B shows so too.
        ckpts.wait()
        if uploads:
            uploads.wait()  # before the manager it waits on is closed
    except BaseException:
        failed = True  # (W&B marks the run failed, not finished)
        ckpts.close(quietly=True)  # what went wrong first is the error to report
        raise
    finally:
        if log is not None:
            log.close(failed)
    ckpts.close()
    return status


PARSER_EPILOG = """\
Override any key as section.key=value, e.g.
  {train} configs/shakespeare_char.yaml model.n_layer=6 optim.lr=3e-4 train.steps=500
A run directory's config.yaml restarts (or resumes) that run: {train} runs/NAME/config.yaml
""" + DEBUG_NOTE + "\n"


def _run_holding(preset: str | None) -> str | None:
    """The run directory a config file belongs to (it is the config.yaml of a run: checkpoints, metrics or status
    beside it), or None. That run is the one `python train.py RUN_DIR/config.yaml` resumes, from any directory: the
    run.dir inside is as the run was started (relative to where that was), and a copied run keeps its original's."""
    if not preset or os.path.basename(preset) != "config.yaml":
        return None
    directory = os.path.dirname(preset) or "."
    return directory if holds_run(directory) else None


def _keys_help() -> str:
    """--help's list of every key, by section (--keys says what each does, README's "Configuration" more)."""
    sections: dict[str, list[str]] = {}
    for key in config_lib.all_keys():
        if key == "format_version":  # (the file's format, not a setting)
            continue
        section, _, rest = key.rpartition(".")
        sections.setdefault(section or "(top level)", []).append(rest)
    lines = [textwrap.fill(", ".join(names), 100, initial_indent=f"  {section}: ", subsequent_indent="    ")
             for section, names in sections.items()]  # fmt: skip
    more = f"\n{command_line('train')} --keys [SECTION_OR_KEY] prints each key's value and meaning."
    return "\n\nkeys (section.key=value):\n" + "\n".join(lines) + more


def _typed_with(argv: list[str], first: str | None, keys_last: bool = False) -> str:
    """The arguments as typed, quoted for a shell, with `first` (the config) moved to the front; with `keys_last`,
    `--keys` moved to the end, its value left where it was typed. (The advice that rebuilt the line from the parsed
    arguments put an override given after `--keys VALUE` before VALUE, which then won, and split a value with a space.)
    """
    words = [w.removeprefix("--keys=") for w in argv if w != "--keys"] if keys_last else list(argv)
    if first is not None:
        words.remove(first)
        words.insert(0, first)
    return " ".join([*map(shlex.quote, words), *(["--keys"] if keys_last else [])])


@cli
def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="train.py",
        hint="settings are section.key=value overrides, e.g. train.steps=500",
        description="Train a decoder-only language model.",
        epilog=PARSER_EPILOG.format(train=command_line("train")) + "\npresets:\n"
        + "\n".join(f"  {p}" for p in config_lib.list_presets()) + _keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "config", nargs="?", help="a YAML preset or a run's config.yaml (default: configs/default.yaml)"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar or log lines; print only the run directory at the end",
    )
    parser.add_argument(
        "--keys", nargs="?", const="", metavar="SECTION_OR_KEY",
        help="print the configuration (the preset with the overrides) as YAML, each key with its meaning, and exit "
        "without training; only the keys under SECTION_OR_KEY (e.g. optim, or model.n_layer) where given",
    )  # fmt: skip
    # Intermixed: --quiet may come between the preset and the overrides.
    args = parser.parse_intermixed_args(argv)
    preset, overrides = args.config, list(args.overrides)
    if args.quiet:
        overrides += ["logging.progress=false", "logging.quiet=true"]
    # (a run named lr=0.01 has runs/lr=0.01/config.yaml: a path, whose missing file is said as such; keys have no /)
    if preset and "=" in preset and not os.path.isfile(preset) and "/" not in preset.split("=", 1)[0]:
        preset, overrides = None, [preset] + overrides
        # (a preset after the overrides was "a second config file; one is read (default.yaml)": one was given)
        late = next((o for o in overrides if "=" not in o and config_lib.names_a_config(o)), None)
        if late is not None:
            raise ConfigError(f"the config file '{late}' comes first, before the key=value overrides: "
                              f"{command_line('train')} {_typed_with(argv, late)}")
    if args.keys and config_lib.names_a_config(args.keys):
        # (python train.py --keys tiny: --keys took the preset as its SECTION_OR_KEY, "unknown key 'tiny'")
        as_typed = _typed_with(argv, args.keys, keys_last=True)
        raise ConfigError(f"--keys takes a section or key (optim, model.n_layer), not the config '{args.keys}'; "
                          f"give the config first: {command_line('train')} {as_typed}")
    if args.keys and "=" in args.keys:  # (tiny --keys optim.lr=1e-3: "unknown config key ...; did you mean
        # 'optim.lr'?", which followed showed optim.lr without the override)
        as_typed = _typed_with(argv, preset, keys_last=True)
        raise ConfigError(f"--keys takes a section or key (optim, model.n_layer), not the override '{args.keys}'; "
                          f"give the overrides before it: {command_line('train')} {as_typed}")
    cfg = config_lib.load(preset or config_lib.default_preset(), overrides)
    own = _run_holding(preset)
    given = config_lib.set_keys(None, overrides)  # (run={name: x, dir: y} sets both too)
    if {"data.epochs", "train.steps"} <= given and cfg.data.epochs:  # (train.steps was ignored without a word)
        raise ConfigError(
            f"data.epochs={cfg.data.epochs} and train.steps={cfg.train.steps} are both given, and data.epochs sets "
            "the steps (its passes over the examples); give one"
        )
    if {"run.dir", "run.name"} <= given:
        raise ConfigError(  # (run.name was unused, without a word)
            "run.dir and run.name are both given: a run is run.dir, or runs/RUN.NAME; give one"
        )
    if "run.dir" not in given:
        if "run.name" in given:  # a new run, named, from the file's settings
            cfg = config_lib.replace(cfg, run={"dir": ""})  # (a run.dir in the file, a run's, would win over it)
            if "run.local_dir" not in given:  # (the file's: a bucket run's local copy, which runs/NAME needs not)
                cfg = config_lib.replace(cfg, run={"local_dir": ""})
        elif own and os.path.realpath(resolve_run_dir(cfg)) != os.path.realpath(own):
            cfg = config_lib.replace(cfg, run={"dir": own})
    if args.keys is not None:  # (after the run's own checks and directory: what the run would be, run.dir included)
        if cfg.init_from:  # (a comment: the output still loads back as it was)
            print("# init_from: the model and sample settings and data.tokenizer that this config does not set come "
                  "from its weights when the run starts (RUN_DIR/config.yaml records them), not the values below")
        print(config_lib.annotated_yaml(cfg, args.keys), end="")
        return 0
    # What the user chose: the preset they named and their overrides, not the default preset's values.
    try:
        run_dir = train(cfg, chosen=config_lib.set_keys(preset, overrides))
    except Interrupted as e:  # stopped with a checkpoint, which the run said: ended as by SIGTERM
        run_dir = e.run_dir
    if cfg.logging.quiet:
        print(storage.absolute(run_dir))  # the one line a script needs: RUN=$(python train.py --quiet ...)
    return 0


if __name__ == "__main__":
    sys.exit(main())
