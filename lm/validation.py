"""Checks of a configuration's values that its types alone cannot make: choices, ranges, and values that must
agree with each other. Each problem is a ConfigError of one line that says how to fix it."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import operator
import os
from typing import TYPE_CHECKING, Any

from lm.errors import ConfigError
from lm.prepared_dir import META, PreparedDir
from lm.run_dir import RunDir
from lm.storage import user_path

if TYPE_CHECKING:
    from lm.config import Config

WANDB_MISSING = "logging.wandb=true needs the wandb package: pip install 'lm[wandb]' (or pip install wandb)"
MAX_CPU_DEVICES = 256  # mesh.cpu_devices' limit (see validate)
F32_MAX = 3.4028234663852886e38  # float32's largest number
F32_TINY = 1.1754943508222875e-38  # float32's smallest normal number
MAX_TEMPERATURE = F32_MAX  # above, a numpy overflow warning, then inf (uniform)
# The settings _check_unused_options's rules need that a run from weights takes from them (lm.pretrained.inherit
# refuses another value): advice to set them would fail. (model.norm too, but its rule's option, norm_bias, is one
# of the weights' own, refused first where it differs from theirs.)
WEIGHTS_FIX = ("model.pos",)

CHOICES = {
    "model.mlp": ("relu", "gelu", "swiglu"),
    "model.pos": ("learned", "sinusoidal", "rope", "none"),
    "model.rope_scaling": ("none", "linear", "llama3"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.norm_placement": ("pre", "post"),
    "model.attention": ("dot_product", "xla", "cudnn", "einsum"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.param_dtype": ("float32", "bfloat16", "float16"),
    "model.remat": ("none", "full", "dots"),
    "optim.name": ("adamw", "muon"),
    "optim.decay": ("cosine", "linear", "constant", "wsd"),
    "optim.decay_shape": ("linear", "cosine", "1-sqrt"),
    "resume": ("auto", "never", "required"),
    "data.format": ("text", "examples", "chat", "preference"),
    "data.pair_overflow": ("truncate", "refuse"),
    "train.objective": ("cross_entropy", "dpo"),
}


def _settings(node: Any, kind: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(key, value) of every setting of a config (or a section) whose value is a `kind` (int: not a bool),
    data.sources' items included."""
    found = []
    for field in dataclasses.fields(node):
        value, key = getattr(node, field.name), prefix + field.name
        if dataclasses.is_dataclass(value):
            found += _settings(value, kind, key + ".")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                found += _settings(item, kind, f"{key}[{i}].") if dataclasses.is_dataclass(item) else []
        elif isinstance(value, kind) and not isinstance(value, bool):
            found.append((key, value))
    return found


def _power(n: int) -> str:
    return f"{'-' if n < 0 else ''}2**{abs(n).bit_length() - 1}"


def int_range(key: str) -> tuple[int, int]:
    """The [low, high) an integer setting must lie in: past it numpy or JAX overflow (seed: 64-bit, the rest 32)."""
    return (-(2**63), 2**63) if key == "seed" else (-(2**31), 2**31)


KERNELS = {"cudnn": "cuDNN", "xla": "XLA"}  # model.attention's names of the kernels it insists on


def validate(cfg: Config, inherited: bool = False) -> None:
    """Check values that types alone cannot; raise ConfigError naming the first problem. `inherited`: the model
    options are init_from's weights' already (train.resolve's second check), model.pos among them."""
    for key in ("lora.targets", "train.eval_tasks"):  # (omegaconf leaves a tuple's items unchecked: [[qkv]] passed)
        value = operator.attrgetter(key)(cfg)
        bad = [item for item in value if not isinstance(item, str)]
        if bad:
            raise ConfigError(f"{key} must be a list of strings, and one item is {bad[0]!r}; write e.g. {key}=[a,b]")
    if "" in cfg.train.eval_tasks:  # (an unset shell variable: "cannot read task file : Is a directory")
        raise ConfigError("train.eval_tasks holds an empty path ''; give task files (train.eval_tasks=[a.jsonl]), or "
                          "train.eval_tasks=[] for none")  # fmt: skip
    if not cfg.data.cache_dir:  # (an unset shell variable: the prepared data went into the working directory)
        raise ConfigError("data.cache_dir is empty ''; give the directory to keep prepared data in (its default: "
                          "data), or data.cache_dir=. for the working directory")  # fmt: skip
    for key, choices in CHOICES.items():
        value = operator.attrgetter(key)(cfg)
        if value not in choices:
            close = difflib.get_close_matches(str(value).lower(), choices, n=1)  # (DPO, RMSNorm: no hint before)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}{hint}")
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    later = _from_weights(cfg, inherited)
    # The list is built whole before the first failing check is reported: what divides by a count is guarded by
    # that count's own check (reported first), instead of dividing by zero.
    heads = m.n_head >= 1 and m.n_kv_head >= 0
    first_traced, traced = profile_window(t.profile_steps) or (1, 1)
    name_bytes = len(cfg.run.name.encode("utf-8", "surrogateescape"))
    bad_targets = _bad_lora_targets(cfg.lora)
    checks = [
        (
            cfg.run.dir or ("/" not in cfg.run.name and cfg.run.name not in (".", "..")),  # (run.dir: no name used)
            f"run.name={cfg.run.name} is not a name: a run is runs/NAME, one directory there (python -m lm.runs lists "
            "those); give a name without '/', or set run.dir to put the run elsewhere",
        ),
        (
            cfg.run.dir or name_bytes <= 255,  # (a directory name's limit)
            f"run.name is {name_bytes} bytes long, and a directory's name "
            "is at most 255; give a shorter run.name",
        ),
        (
            not cfg.run.local_dir or RunDir(cfg.run.dir).works_in_copy,
            "run.local_dir is where a run.dir in object storage (s3://, gs://) is worked on; a local run.dir needs "
            "none: drop run.local_dir",
        ),
        (
            d.format == "text" or not PreparedDir(d.cache_dir).shared,
            f"data.cache_dir={d.cache_dir} is in object storage, which holds token streams for pretraining; fine-tune "
            "examples are prepared on a local disk: set data.cache_dir to a local directory",
        ),
        (m.n_layer >= 1, f"model.n_layer must be >= 1, got {m.n_layer}"),
        (m.n_head >= 1, f"model.n_head must be >= 1, got {m.n_head}"),
        (m.n_embd >= 1, f"model.n_embd must be >= 1, got {m.n_embd}"),
        (m.n_kv_head >= 0, f"model.n_kv_head must be >= 0 (0 = n_head), got {m.n_kv_head}"),
        (m.vocab_size >= 0, f"model.vocab_size must be >= 0 (0 = from the tokenizer), got {m.vocab_size}"),
        (m.vocab_multiple >= 1, f"model.vocab_multiple must be >= 1, got {m.vocab_multiple}"),
        (m.mlp_hidden >= 0, f"model.mlp_hidden must be >= 0 (0 = automatic), got {m.mlp_hidden}"),
        (m.max_seq_len >= 0, f"model.max_seq_len must be >= 0 (0 = data.block_size), got {m.max_seq_len}"),
        (m.head_dim >= 0, f"model.head_dim must be >= 0 (0 = n_embd // n_head), got {m.head_dim}"),
        (
            not heads or m.head_dim or m.n_embd % m.n_head == 0,
            f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; pick n_embd as a multiple of "
            "n_head, or set model.head_dim",
        ),
        (
            not heads or m.n_head % m.kv_heads == 0,
            f"model.n_head={m.n_head} is not divisible by model.n_kv_head={m.n_kv_head}; use a divisor of n_head",
        ),
        (
            not heads or m.pos != "rope" or m.head_size % 2 == 0,
            f"model.pos=rope needs an even head dimension, got {m.head_size if heads else '?'}",
        ),
        (
            m.rope_scaling == "none" or m.pos == "rope" or later("pos"),
            f"model.rope_scaling={m.rope_scaling} scales RoPE, and init_from's weights have model.pos={m.pos}; drop "
            "model.rope_scaling and any other model.rope_* setting" if inherited else
            f"model.rope_scaling={m.rope_scaling} scales RoPE: set model.pos=rope or model.rope_scaling=none",
        ),
        (1 <= m.rope_factor < math.inf, f"model.rope_factor must be a finite number >= 1, got {m.rope_factor}"),
        (
            m.rope_scaling != "llama3" or 0 < m.rope_low_freq_factor < m.rope_high_freq_factor < math.inf,
            f"model.rope_scaling=llama3 needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, both "
            f"finite, got {m.rope_low_freq_factor} and {m.rope_high_freq_factor}",
        ),
        (
            m.rope_scaling != "llama3" or m.rope_original_max_len >= 1,
            f"model.rope_original_max_len must be >= 1, got {m.rope_original_max_len}",
        ),
        (0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}"),
        (0.0 <= m.attn_dropout < 1.0, f"model.attn_dropout must be in [0, 1), got {m.attn_dropout}"),
        (  # (xla: it trained with lm's einsum attention, unsaid)
            m.attention not in KERNELS or m.attn_dropout == 0,
            f"model.attn_dropout={m.attn_dropout} runs lm's einsum attention, never {KERNELS.get(m.attention)}'s, so "
            f"model.attention={m.attention} would not train with it; set model.attn_dropout=0, or "
            "model.attention=dot_product",
        ),
        (0 < m.norm_eps < math.inf, f"model.norm_eps must be a finite number > 0, got {m.norm_eps}"),
        (0 < m.rope_theta < math.inf, f"model.rope_theta must be a finite number > 0, got {m.rope_theta}"),
        (d.block_size >= 1, f"data.block_size must be >= 1, got {d.block_size}"),
        (
            not m.max_seq_len or d.block_size <= m.max_seq_len,
            f"data.block_size={d.block_size} is longer than model.max_seq_len={m.max_seq_len}; "
            "lower data.block_size, or raise model.max_seq_len (a resumed run keeps its own, and so do weights "
            "with learned positions; see README's context extension for init_from)",
        ),
        (d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}"),
        (0.0 <= d.val_fraction < 1.0, f"data.val_fraction must be in [0, 1), got {d.val_fraction}"),
        (
            # (a prepared data.path refuses a data.val_path: the data's own line says to drop data.val_fraction)
            d.val_fraction > 0 or d.val_path or d.sources or _prepared_locally(d.path),
            "data.val_fraction=0 holds out no validation data, which every run evaluates on (at least at its end); "
            "give data.val_path (validation text), or drop data.val_fraction",
        ),
        *(
            (d.val_fraction > 0 or bool(src.val_path), f"data.val_fraction=0 holds out nothing of data.sources[{i}], "
             "which has no val_path; give it one (each source's validation data), or drop data.val_fraction (a "
             "prepared directory holds out its own split)")
            for i, src in enumerate(d.sources)
        ),  # fmt: skip
        (
            not d.sources or d.val_fraction in (0, type(d)().val_fraction) or not all(s.val_path for s in d.sources),
            f"data.val_fraction={d.val_fraction} holds out a share of each source without a val_path, and every "
            "data.sources entry has one, so it would hold out nothing; drop data.val_fraction",
        ),
        (d.workers >= 0, f"data.workers must be >= 0 (0 = one per core), got {d.workers}"),
        (0 < d.shard_mb < math.inf, f"data.shard_mb must be a finite number > 0 (MB a shard), got {d.shard_mb}"),
        (
            not d.sources or not d.path,
            "set data.path (one source) or data.sources (a mixture), not both; move data.path into data.sources",
        ),
        (
            not d.sources or not d.val_path or d.path,  # (with data.path too: the line above)
            "data.val_path is data.path's validation data, and a mixture's sources each take their own; move it into "
            "its source's entry of data.sources: {path: FILE, val_path: VAL_FILE}",
        ),
        (not d.sources or d.format == "text", "data.sources mixes text for pretraining; use data.format=text"),
        (
            not d.document_mask or d.format == "text",
            "data.document_mask is for text (fine-tune examples are always kept apart)",
        ),
        (
            d.format != "examples" or d.prompt_field != d.completion_field,
            f"data.prompt_field and data.completion_field are both '{d.prompt_field}': each example would learn its "
            "prompt as its completion; name the two fields apart",
        ),
        *(
            check
            for i, src in enumerate(d.sources)
            for check in (
                (
                    bool(src.path),
                    f"data.sources[{i}] has no path; give each source one: {{path: FILE_OR_DIR, weight: W}}",
                ),
                (
                    src.weight > 0 and math.isfinite(src.weight),
                    f"data.sources[{i}].weight must be a finite number > 0, got {src.weight}",
                ),
            )
        ),
        (
            math.isfinite(sum(src.weight for src in d.sources)),
            "data.sources' weights add up to more than a number holds; give them as shares, e.g. 1 and 3",
        ),
        (0 < o.lr < math.inf, f"optim.lr must be a finite number > 0, got {o.lr}"),
        (
            o.decay == "constant" or 0 <= o.min_lr <= o.lr,
            f"optim.min_lr must be in [0, optim.lr={o.lr}], got {o.min_lr}",
        ),
        (
            0 <= o.warmup_steps < 2**31,
            f"optim.warmup_steps must be in [0, 2**31) (the step counter is 32-bit), got {o.warmup_steps}",
        ),
        (0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"optim.b1 and optim.b2 must be in [0, 1), got {o.b1}, {o.b2}"),
        (0 < o.eps < math.inf, f"optim.eps must be a finite number > 0, got {o.eps}"),
        (0 <= o.weight_decay < math.inf, f"optim.weight_decay must be a finite number >= 0, got {o.weight_decay}"),
        (0 <= o.grad_clip < math.inf, f"optim.grad_clip must be a finite number >= 0 (0 = off), got {o.grad_clip}"),
        (0 < o.decay_fraction <= 1, "optim.decay_fraction must be in (0, 1] (the share of train.steps the wsd decay "
         f"takes), got {o.decay_fraction}"),
        (0 < o.muon_lr < math.inf, f"optim.muon_lr must be a finite number > 0, got {o.muon_lr}"),
        (0 <= o.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {o.muon_momentum}"),
        (o.muon_ns_steps >= 1, f"optim.muon_ns_steps must be >= 1 (Newton-Schulz iterations), got {o.muon_ns_steps}"),
        (
            o.muon_ns_steps <= 100,  # (unrolled in the step: 100,000 compiled for minutes without end)
            f"optim.muon_ns_steps must be at most 100 (5 converge; each is unrolled in the train step), got "
            f"{o.muon_ns_steps}",
        ),
        (
            0 <= o.muon_update_rms < math.inf,
            f"optim.muon_update_rms must be a finite number >= 0 (0 = scaled by shape), got {o.muon_update_rms}",
        ),
        (
            0 <= o.muon_weight_decay < math.inf,
            f"optim.muon_weight_decay must be a finite number >= 0, got {o.muon_weight_decay}",
        ),
        (1 <= t.steps < 2**31, f"train.steps must be in [1, 2**31) (the step counter is 32-bit), got {t.steps}"),
        (t.grad_accum >= 1, f"train.grad_accum must be >= 1, got {t.grad_accum}"),
        (t.steps_per_call >= 0, "train.steps_per_call must be >= 1 (optimizer steps per jitted call), or 0 to let "
         f"the backend choose, got {t.steps_per_call}"),
        (
            t.grad_accum < 1 or d.batch_size % t.grad_accum == 0,
            f"data.batch_size={d.batch_size} is not divisible by train.grad_accum={t.grad_accum}; "
            "make data.batch_size a multiple of train.grad_accum",
        ),
        (t.log_every >= 1, f"train.log_every must be >= 1, got {t.log_every}"),
        (t.eval_every >= 0, f"train.eval_every must be >= 0, got {t.eval_every}"),
        (t.eval_batches >= 1, f"train.eval_batches must be >= 1, got {t.eval_batches}"),
        (t.eval_task_limit >= 0, f"train.eval_task_limit must be >= 0 (0 = every example), got {t.eval_task_limit}"),
        (t.ckpt_every >= 0, f"train.ckpt_every must be >= 0, got {t.ckpt_every}"),
        (t.keep >= 1, f"train.keep must be >= 1, got {t.keep}"),
        (t.keep_every >= 0, f"train.keep_every must be >= 0 (0 = off), got {t.keep_every}"),
        (
            not (t.keep_every and t.ckpt_every) or t.keep_every % t.ckpt_every == 0,
            f"train.keep_every={t.keep_every} keeps the checkpoints at its multiples, but they are written every "
            f"train.ckpt_every={t.ckpt_every} steps; give a multiple of {t.ckpt_every}",
        ),
        (
            not t.keep_every or t.ckpt_every,
            f"train.keep_every={t.keep_every} keeps the checkpoints at its multiples, but train.ckpt_every=0 writes "
            f"only the final one; set train.ckpt_every (a divisor of {t.keep_every}) or drop train.keep_every",
        ),
        (
            t.objective != "dpo" or d.format == "preference",
            f"train.objective=dpo trains on chosen/rejected pairs, and data.format is {d.format}; set "
            "data.format=preference",
        ),
        (
            d.format != "preference" or t.objective == "dpo",
            "data.format=preference holds chosen/rejected pairs, which only train.objective=dpo trains on; set "
            "train.objective=dpo",
        ),
        (0 < t.dpo_beta < math.inf, f"train.dpo_beta must be a finite number > 0, got {t.dpo_beta}"),
        (
            0.0 <= t.dpo_label_smoothing < 0.5,
            "train.dpo_label_smoothing must be in [0, 0.5) (the share of pairs taken to be mislabelled), got "
            f"{t.dpo_label_smoothing}",
        ),
        (
            t.objective != "dpo" or not (t.label_smoothing or t.z_loss),
            "train.label_smoothing and train.z_loss shape the cross-entropy objective, not dpo; drop them "
            "(train.dpo_label_smoothing is dpo's)",
        ),
        (0.0 <= t.label_smoothing < 1.0, f"train.label_smoothing must be in [0, 1), got {t.label_smoothing}"),
        (0 <= t.z_loss < math.inf, f"train.z_loss must be a finite number >= 0, got {t.z_loss}"),
        (
            first_traced <= t.steps,
            f"train.profile_steps={t.profile_steps} starts after the run's last step (train.steps={t.steps})",
        ),
        (  # (a window past the end traced the final evaluation and checkpoint too, and said nothing of it)
            first_traced + traced - 1 <= t.steps,
            f"train.profile_steps={t.profile_steps} ends after the run's last step (train.steps={t.steps}); "
            "trace fewer steps",
        ),
        (t.loss_chunk >= -1, "train.loss_chunk must be >= 0 (positions per chunk; 0 = unchunked), or -1 to let the "
         f"backend choose, got {t.loss_chunk}"),
        (0 <= t.peak_flops < math.inf,
         f"train.peak_flops must be a finite number >= 0 (0 = automatic), got {t.peak_flops}"),
        (0 <= d.epochs < 2**31, f"data.epochs must be in [0, 2**31) (0 = train.steps decides; each epoch is a step at "
                                f"least, and the step counter is 32-bit), got {d.epochs}"),
        (
            not d.epochs or d.format != "text",
            "data.epochs counts passes over fine-tune examples (data.format=examples, chat or preference); for text, "
            "set train.steps",
        ),
        (
            d.format == "preference" or d.pair_overflow == "truncate",
            f"data.pair_overflow={d.pair_overflow} applies to data.format=preference, and data.format is {d.format}; "
            "drop data.pair_overflow",
        ),
        (cfg.lora.rank >= 0, f"lora.rank must be >= 0 (0 = off), got {cfg.lora.rank}"),
        (0 < cfg.lora.alpha < math.inf, f"lora.alpha must be a finite number > 0, got {cfg.lora.alpha}"),
        (not cfg.lora.rank or cfg.init_from, "lora.rank > 0 adapts a trained model: set init_from too"),
        (not bad_targets, bad_targets),
        (
            0 <= cfg.sample.temperature <= MAX_TEMPERATURE,
            f"sample.temperature must be >= 0 and at most {MAX_TEMPERATURE:.3g}, got {cfg.sample.temperature}",
        ),
        (0 <= cfg.sample.top_p <= 1, f"sample.top_p must be in [0, 1], got {cfg.sample.top_p}"),
        (cfg.sample.top_k >= 0, f"sample.top_k must be >= 0, got {cfg.sample.top_k}"),
        (cfg.sample.max_new_tokens >= 1, f"sample.max_new_tokens must be >= 1, got {cfg.sample.max_new_tokens}"),
    ]
    dist = cfg.distributed
    host, _, port = dist.coordinator.rpartition(":")
    checks += [
        (
            not dist.coordinator or (dist.num_processes >= 1 and dist.process_id >= 0),
            "distributed.coordinator needs distributed.num_processes and distributed.process_id",
        ),
        (
            bool(dist.coordinator) or (dist.num_processes == 0 and dist.process_id == -1),
            "distributed.num_processes and distributed.process_id go with distributed.coordinator (process 0's "
            "HOST:PORT), without which each process trains alone; set it, or drop them where the cluster's "
            "environment gives them",
        ),
        (
            not dist.coordinator or (bool(host) and port.isdigit() and 1 <= int(port) <= 65535),
            f"distributed.coordinator={dist.coordinator} is not HOST:PORT (process 0's address and a free port, "
            "e.g. 10.0.0.1:1234)",
        ),
        (
            dist.initialization_timeout >= 1,
            f"distributed.initialization_timeout must be >= 1 second, got {dist.initialization_timeout}",
        ),
        (
            not dist.num_processes or dist.process_id < dist.num_processes,
            f"distributed.process_id={dist.process_id} is not below distributed.num_processes={dist.num_processes}: "
            "processes are numbered 0 to num_processes - 1",
        ),
    ]
    for axis in ("data", "fsdp", "tensor"):
        size = getattr(cfg.mesh, axis)
        checks.append((size == -1 or size >= 1, f"mesh.{axis} must be >= 1 or -1 (all remaining), got {size}"))
    checks.append((cfg.mesh.cpu_devices >= 0,
                   f"mesh.cpu_devices must be >= 0 (0 = as XLA_FLAGS says), got {cfg.mesh.cpu_devices}"))
    # XLA:CPU runs a collective on a thread per device: past ~256 of them its all-reduce waits a minute and aborts the
    # process (320 did, jax 0.10), so the limit is here; a host gains nothing from more devices than its cores.
    checks.append((
        cfg.mesh.cpu_devices <= MAX_CPU_DEVICES,
        f"mesh.cpu_devices must be at most {MAX_CPU_DEVICES} (XLA:CPU's collectives hang past that), "
        f"got {cfg.mesh.cpu_devices}; one device per core is the most that helps",
    ))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    for key, value in _settings(cfg, int):  # (after each one's own range: beyond these, numpy or JAX overflow, or hang)
        low, high = int_range(key)
        if not low <= value < high:
            raise ConfigError(f"{key}={value} is out of range: it must be in [{_power(low)}, {_power(high)})")
    for key, value in _settings(cfg, float):
        # What training computes with is float32, where a smaller number is 0 (or loses its digits) and a larger
        # one inf: optim.eps=1e-44 was a NaN loss blamed on optim.lr. (The host's own: data.*, and sample.*, whose
        # temperature 1e-50 is greedy; train.peak_flops divides the host's MFU, which 1e-300 made inf in JSON.)
        if key.startswith(("data.", "sample.")) or not math.isfinite(value) or value == 0:
            continue
        if not F32_TINY <= abs(value) <= F32_MAX:
            raise ConfigError(
                f"{key}={value:g} is {'below' if abs(value) < F32_TINY else 'beyond'} float32's range, which training "
                f"computes in (numbers of size {F32_TINY:.2g} to {F32_MAX:.2g}; 0 aside); give one in it"
            )
    _check_unused_options(cfg, later, inherited)
    if not cfg.data.epochs:  # (which set train.steps once the data is prepared: checked then, lm.train)
        check_schedule(o, t.steps)


def _prepared_locally(path: str) -> bool:
    """Whether data.path is a prepared directory on this machine's disk (one in a bucket is not asked here)."""
    return bool(path) and not PreparedDir(path).shared and os.path.isfile(os.path.join(user_path(path), META))


def _bad_lora_targets(lora) -> str:
    """What is wrong with lora.targets' names whatever the model ("" if nothing), found before any data is prepared
    (which of them a model has is lora.init_adapters' to check, with its weights)."""
    if not lora.rank:
        return ""
    from lm.lora import target_names_problem  # (with jax: imported for a LoRA run only)

    return target_names_problem(lora.targets)


def _from_weights(cfg, inherited: bool):
    """Whether a model option (by name) is still to come from init_from's weights: left at its default before the
    weights' model is taken (train.resolve inherits it, then validates again), so what depends on it cannot be
    judged yet."""
    defaults = type(cfg.model)()
    return lambda name: not inherited and bool(cfg.init_from) and getattr(cfg.model, name) == getattr(defaults, name)


def _check_unused_options(cfg, later=lambda name: False, inherited: bool = False) -> None:
    """Refuse an option set away from its default where what else is set ignores it (Muon's options with AdamW, a
    rope_factor without rope_scaling, a lora.alpha without lora.rank: trained as if it were not there). Each rule:
    (the option, the setting it needs, what that setting must be, whether it is). `inherited`: the model is
    init_from's weights', whose architecture (WEIGHTS_FIX) no setting changes, so only dropping the option helps."""
    o, m, t, d = cfg.optim, cfg.model, cfg.train, cfg.data
    llama3 = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
    rules = [
        *((f"optim.{f.name}", "optim.name", "=muon", o.name == "muon")
          for f in dataclasses.fields(o) if f.name.startswith("muon_")),
        *((f"optim.{name}", "optim.decay", "=wsd", o.decay == "wsd") for name in ("decay_fraction", "decay_shape")),
        *((f"model.{name}", "model.rope_scaling", "=llama3", m.rope_scaling == "llama3" or later("rope_scaling"))
          for name in llama3),
        ("model.rope_factor", "model.rope_scaling", "=linear (or llama3)",
         m.rope_scaling != "none" or later("rope_scaling")),
        ("model.rope_theta", "model.pos", "=rope", m.pos == "rope" or later("pos")),
        ("model.norm_bias", "model.norm", "=layernorm", m.norm == "layernorm" or later("norm")),  # (RMSNorm: none)
        # (model.bias gives every projection one; attn_bias, attention's output's too)
        *((f"model.{name}", "model.bias", "=false", not m.bias or later("bias")) for name in ("qkv_bias", "attn_bias")),
        ("model.qkv_bias", "model.attn_bias", "=false", not m.attn_bias or later("attn_bias")),
        *((f"lora.{name}", "lora.rank", " >= 1", cfg.lora.rank > 0) for name in ("alpha", "targets")),
        *((f"train.{name}", "train.objective", "=dpo", t.objective == "dpo")
          for name in ("dpo_beta", "dpo_label_smoothing")),
        # the record fields a format reads: another format's are never looked at
        ("data.prompt_field", "data.format", "=examples (or preference)", d.format in ("examples", "preference")),
        ("data.completion_field", "data.format", "=examples", d.format == "examples"),
        ("data.field", "data.format", "=text (or examples)", d.format in ("text", "examples")),
        # how text is prepared: fine-tune data is tokenized in one process into one file
        *((f"data.{name}", "data.format", "=text", d.format == "text") for name in ("workers", "shard_mb")),
        # a held-out share of the data, where data.val_path gives the validation data instead (0: none, as it says)
        ("data.val_fraction", "data.val_path", "='' (validation held out of data.path)",
         bool(d.sources) or not d.val_path or d.val_fraction == 0),
        ("optim.decay_embeddings", "lora.rank", "=0 (a LoRA run trains only its adapters)", cfg.lora.rank == 0),
        ("optim.decay_embeddings", "optim.weight_decay", " > 0 (the decay it applies)", o.weight_decay > 0),
        ("optim.muon_nesterov", "optim.muon_momentum", " > 0 (the momentum it looks ahead with)", o.muon_momentum > 0),
        ("train.eval_task_limit", "train.eval_tasks", "=[FILE.jsonl]", bool(t.eval_tasks)),
    ]  # fmt: skip
    defaults = type(cfg)()
    multiple = m.vocab_multiple
    if multiple != defaults.model.vocab_multiple and m.vocab_size % max(multiple, 1) and not later("vocab_size"):
        given = "init_from's weights give" if inherited else "the config gives"  # (a run's: a multiple, resolved)
        raise ConfigError(f"model.vocab_multiple={multiple} pads an automatic model.vocab_size (0), and {given} "
                          f"model.vocab_size={m.vocab_size}, not a multiple of it; drop model.vocab_multiple"
                          f"{'' if inherited else ', or give a model.vocab_size that is one'}")  # fmt: skip
    # AdamW's weight decay, under Muon, decays only the matrices AdamW trains: an untied head, embeddings if asked
    adamw_decays = not cfg.lora.rank and (not m.tie_embeddings or o.decay_embeddings or later("tie_embeddings"))
    if o.name == "muon" and o.weight_decay != defaults.optim.weight_decay and not adamw_decays:
        lora = "; a LoRA run trains only its adapters, which are Muon's" if cfg.lora.rank else ""
        raise ConfigError(
            f"optim.weight_decay={o.weight_decay} sets the decay of the matrices AdamW trains, which with "
            "optim.name=muon are an untied head (model.tie_embeddings=false) and, with optim.decay_embeddings=true, "
            f"the embeddings{lora}: here none; the Muon group's is optim.muon_weight_decay, so set that or drop "
            "optim.weight_decay"
        )

    def written(value):  # a value as it is written in an override
        if isinstance(value, (list, tuple)):
            return f"[{','.join(value)}]"
        return str(value).lower() if isinstance(value, bool) else value

    for key, need, wanted, applies in rules:
        value = operator.attrgetter(key)(cfg)
        if not applies and value != operator.attrgetter(key)(defaults):
            have = written(operator.attrgetter(need)(cfg))
            if inherited and need in WEIGHTS_FIX:
                raise ConfigError(
                    f"{key}={written(value)} applies only to {need}{wanted}, and init_from's weights have "
                    f"{need}={have}; drop {key}"
                )
            raise ConfigError(
                f"{key}={written(value)} applies only to {need}{wanted}, and {need} is {have}; set {need}{wanted} "
                f"or drop {key}"
            )


def wsd_decay_steps(o, steps: int) -> int:
    """The steps of a wsd schedule's decay: the last round(optim.decay_fraction * steps), at least two. The decay's
    first update takes the peak and the schedule reaches min_lr at train.steps, after the last update (as cosine's
    and linear's do), so a decay of one update would lower none."""
    return max(2, round(o.decay_fraction * steps))


def check_schedule(o, steps: int, sized_by: str = "train.steps") -> None:
    """A wsd decay must begin after the warmup has ended (a run shorter than its warmup never reaches either).
    `sized_by`: the setting that makes train.steps what it is (data.epochs where it sets them)."""
    if o.decay == "wsd" and steps < wsd_decay_steps(o, steps) and not o.warmup_steps:  # (one step)
        raise ConfigError(
            f"optim.decay=wsd decays over at least 2 steps, more than train.steps={steps}; raise {sized_by} to 2 or "
            "more, or use optim.decay=cosine"
        )
    if o.decay == "wsd" and steps - wsd_decay_steps(o, steps) < o.warmup_steps < steps:
        raise ConfigError(
            f"optim.warmup_steps={o.warmup_steps} runs into the wsd decay, the last {wsd_decay_steps(o, steps)} of "
            f"train.steps={steps} (optim.decay_fraction={o.decay_fraction}); lower optim.warmup_steps or "
            f"optim.decay_fraction, or raise {sized_by}"
        )


def profile_window(value: str) -> tuple[int, int] | None:
    """train.profile_steps as (first step, count), or None when off; ConfigError when it is not START:COUNT."""
    if not value:
        return None
    parts = value.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) < 1 or int(parts[1]) < 1:
        raise ConfigError(
            f"train.profile_steps={value!r} is not START:COUNT with START >= 1 and COUNT >= 1 "
            "(e.g. train.profile_steps=10:5 traces steps 10 to 14; \"\" = off)"
        )
    return int(parts[0]), int(parts[1])


def check_training(cfg: Config) -> None:
    """What training refuses beyond validate (which every loaded config passes, checkpoints' and presets' too):
    float16, and DPO without weights to start from. Without loss scaling, which lm does not do, small gradients
    underflow in float16's range (bfloat16 has float32's); float16 weights hold no value above 65504 and none
    below 6e-8, and round away updates below 2**-11 of a weight (bfloat16's round away those below 2**-8: float32
    master weights keep both). DPO's reference model is the starting weights: a random initialisation is no
    model to align."""
    project = cfg.logging.wandb_project
    if cfg.logging.wandb and not (project and len(project) <= 128 and not set(project) & set("/\\#?%:")):
        # W&B's own rule for a project's name, which it checked only once the run directory was made
        raise ConfigError(
            f"logging.wandb_project={project!r} is no W&B project name: give 1 to 128 characters without / \\ # ? % :"
        )
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:  # before the run directory is made
        raise ConfigError(WANDB_MISSING)
    if cfg.train.objective == "dpo" and not cfg.init_from:
        raise ConfigError("train.objective=dpo aligns a trained model against its own starting weights: set init_from")
    if cfg.model.dtype == "float16":
        raise ConfigError(
            "model.dtype=float16 is refused for training: lm has no loss scaling, and in float16's range small "
            "gradients underflow to zero; use model.dtype=bfloat16 (float32's range, float16's speed on GPUs and TPUs)"
        )
    if cfg.model.param_dtype == "float16":
        raise ConfigError(
            "model.param_dtype=float16 is refused for training: float16 weights hold nothing above 65504, and "
            "without loss scaling (lm has none) their updates underflow; use model.param_dtype=float32 (bfloat16 "
            "weights train, with float32's range, but round away more small updates than float16's)"
        )
