"""The Llama family in Hugging Face's format, in and out: model_type llama, mistral, qwen2, qwen3; weights, config.

All four are the same pre-norm transformer with RMSNorm, RoPE (rotating each head's first half against its
second, as lm's rope does), grouped-query attention and a SwiGLU MLP; they differ in options lm's model has:
    llama    attention_bias (Q, K, V and O biases; with mlp_bias the MLP's too), rope_scaling linear or llama3
    mistral  a sliding window, accepted only where it covers the whole context
    qwen2    biases on Q, K and V only (model.qkv_bias)
    qwen3    an RMSNorm over each head's queries and keys (model.qk_norm), head_dim wider than hidden/heads

Weights. Hugging Face's Linear weights are [out, in] (y = x @ W.T); our kernels are [in, out] with the heads
as their own axes: q_proj [N*H, D] -> q [D, N, H], k_proj and v_proj [K*H, D] -> [D, K, H], o_proj [D, N*H]
-> proj [N, H, D]; gate/up/down_proj -> mlp gate, up, proj. Q/K/V stay three projections (fused_qkv=false).
An export writes the reverse (a fused [D, K, G+2, H] kernel split into q, k and v), as llama, or qwen2/qwen3
where their options are used, with the tokenizer's ids only (float32).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ModelConfig, SampleConfig
from lm.errors import UserError
from lm.files import write_json
from lm.hf.files import Weights, new_directory, read_config, release_freed_memory, write_weights
from lm.hf.generation import generation_fields, stop_tokens
from lm.hf.tokenizer import QWEN_SPLIT_PATTERN, write_tokenizer_files
from lm.model import unscanned
from lm.tokenizer import Tokenizer

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# dynamic (NTK) scaling changes the frequencies only beyond max_position_embeddings, which is lm's max_seq_len
# for an imported model: within it dynamic is default RoPE, exactly.
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
# What transformers (5.x) takes for a key a config.json leaves out, where it is not what lm would guess (a model of
# another shape): its config classes' defaults. (transformers writes every key; hand-made or older files may not.)
DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096, "num_key_value_heads": 8},
    # (the Qwens' window applies only where use_sliding_window is set, and then to the layers _slides names)
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096},
}
SHAPE_KEYS = ("num_key_value_heads", "head_dim")  # (of DEFAULTS' keys, those that set weight shapes)
ORIGINAL = "original_max_position_embeddings"


def model_config(config: dict, where: str, scan_layers: bool = False) -> ModelConfig:
    """lm's ModelConfig for a Llama-family config.json, or a UserError naming what lm's model lacks."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"{where} describes a {model_type!r} model, not one of {', '.join(MODEL_TYPES)}")
    given, config = config, {**DEFAULTS[model_type], **config}
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "max_position_embeddings")  # fmt: skip
    missing = [key for key in sizes if not isinstance(config.get(key), int) or config[key] < 1]
    if missing:
        raise UserError(f"{where} lacks positive integers for {', '.join(missing)}; is it a {model_type} config?")
    # Values of the wrong kind, or heads the model cannot group, were tracebacks where the model was built or run
    wrong = [f"{key}={config[key]!r}" for key in ("num_key_value_heads", "head_dim", "sliding_window")
             if config.get(key) is not None and not _count(config[key])]  # fmt: skip
    wrong += [f"{key}={config[key]!r}" for key in ("rope_theta", "rms_norm_eps") if key in config
              and not _positive(config[key])]  # fmt: skip
    wrong += [f"{key}={config[key]!r}" for key in ("attention_bias", "mlp_bias", "tie_word_embeddings",
              "use_sliding_window") if config.get(key) is not None and not isinstance(config[key], bool)]  # fmt: skip
    wrong += [f"{key}={config[key]!r}" for key in ("rope_scaling", "rope_parameters")
              if config.get(key) is not None and not isinstance(config[key], dict)]  # fmt: skip
    if model_type != "mistral" and config.get("use_sliding_window") and not isinstance(config.get("layer_types"), list):
        first = config.get("max_window_layers", 0)  # (the first layer that slides, as _slides reads it)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            wrong.append(f"max_window_layers={first!r}")
    if wrong:
        raise UserError(f"{where} has values lm cannot read: {', '.join(wrong)}; is it a {model_type} config?")
    d, n = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // n
    kv_heads = config.get("num_key_value_heads") or n
    if n % kv_heads or head_dim % 2:
        raise UserError(
            f"{where}: num_attention_heads={n} in groups of num_key_value_heads={kv_heads}, heads of {head_dim} "
            "features: attention needs a divisor of the heads and an even head width (RoPE)"
            + (_defaults_taken(given) or "; is it the config.json of these weights?")
        )
    problems = []
    if config.get("hidden_act", "silu") not in ("silu", "swish"):  # (transformers' names for one function)
        problems.append(f"hidden_act={config['hidden_act']}")
    # transformers reads attention_bias for llama and qwen3 only, and mlp_bias for llama only: mistral's and qwen2's
    # projections have fixed biases, so such a key in their files changes nothing (lm read it: weights refused)
    attention_bias = model_type in ("llama", "qwen3") and bool(config.get("attention_bias", False))
    mlp_bias = model_type == "llama" and bool(config.get("mlp_bias", False))
    if mlp_bias and not attention_bias:
        problems.append("mlp_bias=True with attention_bias=False")
    max_len = config["max_position_embeddings"]
    window = config.get("sliding_window")
    if window is not None and _slides(config, model_type) and window < max_len:
        problems.append(f"sliding_window={window} (shorter than max_position_embeddings={max_len})")
    # transformers' order: rope_scaling (older files, or a key added by hand) over rope_parameters
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope type {rope_type} (lm has {', '.join(ROPE_TYPES)})")
    if problems:
        raise UserError(f"{where} uses what lm's model does not have: {', '.join(problems)}")
    rope_options = {}

    def number(key: str, default: float | None = None, given: dict = rope) -> float:
        value = given.get(key, default)
        if not _positive(value):
            raise UserError(f"{where}: its {rope_type} rope scaling needs a positive number for {key}, not {value!r}")
        return float(value)

    if rope_type == "linear":
        rope_options = dict(rope_scaling="linear", rope_factor=number("factor"))
    elif rope_type == "llama3":
        factor, low, high = number("factor"), number("low_freq_factor"), number("high_freq_factor")
        if low >= high:  # (transformers then scales where lm blends: other logits; lm's own configs refuse it too)
            raise UserError(
                f"{where}: its llama3 rope scaling needs low_freq_factor < high_freq_factor, not {low:g} and {high:g}"
            )
        rope_options = dict(
            rope_scaling="llama3",
            rope_factor=factor,
            rope_low_freq_factor=low,
            rope_high_freq_factor=high,
            # transformers takes a top-level original_max_position_embeddings first (Phi-3's files have one), and
            # max_position_embeddings where both are left out
            rope_original_max_len=int(number(ORIGINAL, max_len, config if ORIGINAL in config else rope)),
        )
    return ModelConfig(
        vocab_size=config["vocab_size"],
        vocab_multiple=1,
        max_seq_len=max_len,
        n_layer=config["num_hidden_layers"],
        n_head=n,
        n_kv_head=config.get("num_key_value_heads") or n,
        n_embd=d,
        head_dim=0 if head_dim * n == d else head_dim,
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
        pos="rope",
        rope_theta=number("rope_theta", config.get("rope_theta", 10000.0)),
        norm="rmsnorm",
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        bias=attention_bias and mlp_bias,
        qkv_bias=model_type == "qwen2",
        attn_bias=attention_bias and not mlp_bias,
        qk_norm=model_type == "qwen3",
        fused_qkv=False,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        scan_layers=scan_layers,
        **rope_options,
    )


def context_limit(config: dict, rope_chosen: bool = False) -> tuple[int, str] | None:
    """(the longest context, why) at which lm still computes what transformers does with a Llama-family config.json,
    where a context extension (model.max_seq_len beyond max_position_embeddings) would go past it; None where it
    never stops: a sliding window that model_config accepted as covering max_position_embeddings, and dynamic RoPE,
    which transformers rescales beyond max_position_embeddings (but where the run chose its own: `rope_chosen`)."""
    model_type = config.get("model_type")
    config = {**DEFAULTS.get(model_type, {}), **config}
    window = config.get("sliding_window")
    if window is not None and _slides(config, model_type):
        return window, f"sliding_window={window}: attention beyond it is what lm's model, which has no window, lacks"
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic" and not rope_chosen:
        return config["max_position_embeddings"], (
            "dynamic RoPE scaling, which transformers applies beyond it and lm does not (or choose the longer "
            "context's RoPE: model.rope_scaling=linear model.rope_factor=F)"
        )
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _slides(config: dict, model_type: str) -> bool:
    """Whether transformers gives any layer of this config a sliding window: every Mistral layer; a Qwen layer
    where use_sliding_window is set and layer_types (by default: from max_window_layers on) says so."""
    if model_type == "mistral":
        return True
    if not config.get("use_sliding_window"):
        return False
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        return "sliding_attention" in layer_types
    return config["num_hidden_layers"] > config.get("max_window_layers", 28)  # (Qwen2Config's default)


def load_llama(
    directory: str, scan_layers: bool = False, placer=None, cfg: ModelConfig | None = None
) -> tuple[Any, ModelConfig]:
    """(params, model config) of a Llama-family directory ({"params": ...}), in the dtype the weights are stored
    in (model.param_dtype: float32, bfloat16 or float16). Tensors are read one at a time onto JAX's CPU device
    (whose transposes run several times faster than numpy's); with a `placer` (model config ->
    place(key, subtree)), each top-level subtree (wte, h_0, ...) is placed as soon as it is built, so the host
    holds about one layer beyond what placing keeps (all of the stack with scan_layers). `cfg` is
    llama_model_config's, where the caller has it already."""
    cfg = cfg or llama_model_config(directory, scan_layers)
    tensors = Weights(directory)
    placed = placer(cfg) if placer else (lambda key, tree: tree)
    d, n, k, h, f = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.hidden
    dtype = jnp.dtype(cfg.param_dtype)

    def place(key: str, tree: dict) -> dict:
        tree = jax.block_until_ready(placed(key, tree))
        release_freed_memory()  # the transient copies of this subtree's tensors
        return tree

    def get(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name not in tensors:
            raise UserError(f"{directory}'s weights lack {name}; is it a complete checkpoint?")
        x = tensors.array(name)
        if x.shape != shape:
            raise UserError(
                f"{directory}'s {name} has shape {list(x.shape)}, config.json implies {list(shape)}"
                + _defaults_taken(directory)
            )
        return x if x.dtype == dtype else x.astype(dtype)

    def projection(name: str, heads: int, bias: bool) -> dict:
        """q_proj, k_proj or v_proj [heads*H, D] as our [D, heads, H] kernel, with its bias [heads, H]."""
        layer = {"kernel": _transposed(get(f"{name}.weight", (heads * h, d))).reshape(d, heads, h)}
        if bias:
            layer["bias"] = get(f"{name}.bias", (heads * h,)).reshape(heads, h)
        return layer

    def dense(name: str, n_in: int, n_out: int) -> dict:
        """An MLP Linear [n_out, n_in] as our [n_in, n_out] kernel, with its bias where the model has them."""
        layer = {"kernel": _transposed(get(f"{name}.weight", (n_out, n_in)))}
        if cfg.bias:
            layer["bias"] = get(f"{name}.bias", (n_out,))
        return layer

    def block(i: int) -> dict:
        at = f"model.layers.{i}."
        qkv_bias = cfg.bias or cfg.qkv_bias or cfg.attn_bias
        attn = {
            "q": projection(at + "self_attn.q_proj", n, qkv_bias),
            "k": projection(at + "self_attn.k_proj", k, qkv_bias),
            "v": projection(at + "self_attn.v_proj", k, qkv_bias),
            "proj": {"kernel": _transposed(get(at + "self_attn.o_proj.weight", (d, n * h))).reshape(n, h, d)},
        }
        if cfg.bias or cfg.attn_bias:
            attn["proj"]["bias"] = get(at + "self_attn.o_proj.bias", (d,))
        if cfg.qk_norm:
            attn["q_norm"] = {"scale": get(at + "self_attn.q_norm.weight", (h,))}
            attn["k_norm"] = {"scale": get(at + "self_attn.k_norm.weight", (h,))}
        mlp = {
            "gate": dense(at + "mlp.gate_proj", d, f),
            "up": dense(at + "mlp.up_proj", d, f),
            "proj": dense(at + "mlp.down_proj", f, d),
        }
        return {
            "ln1": {"scale": get(at + "input_layernorm.weight", (d,))},
            "attn": attn,
            "ln2": {"scale": get(at + "post_attention_layernorm.weight", (d,))},
            "mlp": mlp,
        }

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        params = {"wte": place("wte", {"embedding": get("model.embed_tokens.weight", (cfg.vocab_size, d))})}
        if scan_layers:
            params["h"] = place("h", jax.tree.map(lambda *xs: jnp.stack(xs), *[block(i) for i in range(cfg.n_layer)]))
        else:
            params.update({f"h_{i}": place(f"h_{i}", block(i)) for i in range(cfg.n_layer)})
        params["ln_f"] = place("ln_f", {"scale": get("model.norm.weight", (d,))})
        if not cfg.tie_embeddings:
            params["lm_head"] = place("lm_head", {"kernel": _transposed(get("lm_head.weight", (cfg.vocab_size, d)))})
    tensors.read.add("lm_head.weight")  # (tied: the embeddings, as llama_model_config found it)
    tensors.warn_unread()
    return {"params": params}, cfg


def _defaults_taken(directory: str | dict) -> str:
    """What a shape error adds where config.json (a directory's, or as read) leaves out a key that sets weight shapes,
    and lm took transformers' default for it (which fits that model type's usual size, not necessarily this model)."""
    config = read_config(directory) if isinstance(directory, str) else directory
    taken = {key: value for key, value in DEFAULTS.get(config.get("model_type"), {}).items() if key in SHAPE_KEYS}
    left_out = [f"{key} (taken as transformers' default, {taken[key]})" for key in taken if key not in config]
    return f"; config.json leaves out {', '.join(left_out)}: add the model's value to it" if left_out else ""


@jax.jit
def _transposed(x: jax.Array) -> jax.Array:
    return x.T


def llama_model_config(directory: str, scan_layers: bool = False) -> ModelConfig:
    """The model config of a Llama-family directory, its param_dtype the weights' (read without the weights, but
    for a head that config.json ties to the embeddings and the weights store: untied where it is another, as
    transformers 5 and GPT-2's files (lm.hf.gpt2) read it; tied, that head was left out for the embeddings)."""
    cfg = model_config(read_config(directory), os.path.join(directory, "config.json"), scan_layers)
    tensors = Weights(directory)
    if "model.embed_tokens.weight" not in tensors:
        raise UserError(f"{directory}'s weights lack model.embed_tokens.weight; is it a complete checkpoint?")
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        head, embedding = tensors.array("lm_head.weight"), tensors.array("model.embed_tokens.weight")
        if head.shape != embedding.shape or not bool(jnp.array_equal(head, embedding)):
            cfg = dataclasses.replace(cfg, tie_embeddings=False)  # (a shape of its own: load_llama's one line)
    stored = tensors.dtype("model.embed_tokens.weight")
    return dataclasses.replace(cfg, param_dtype=stored if stored in ("float32", "bfloat16", "float16") else "float32")


# --- export -------------------------------------------------------------------------------------------------


def llama_incompatible(cfg: ModelConfig) -> list[str]:
    """The settings of a model that none of llama, qwen2 and qwen3 can express, as key=value."""
    checks = [
        (cfg.pos == "rope", f"pos={cfg.pos}"),
        (cfg.norm == "rmsnorm", f"norm={cfg.norm}"),
        (cfg.mlp == "swiglu", f"mlp={cfg.mlp}"),
        (cfg.norm_placement == "pre", f"norm_placement={cfg.norm_placement}"),
        # QK-norm is qwen3's, which has no MLP biases and none on Q/K/V alone (attention_bias: on Q, K, V and O)
        (not (cfg.qk_norm and (cfg.bias or (cfg.qkv_bias and not cfg.attn_bias))), "qk_norm with bias or qkv_bias"),
    ]
    return [problem for ok, problem in checks if not ok]


def llama_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face architecture a model is exported as: qwen3 for QK-norm, qwen2 for Q/K/V-only biases."""
    if cfg.qk_norm:
        return "qwen3"
    return "qwen2" if cfg.qkv_bias and not (cfg.bias or cfg.attn_bias) else "llama"


def llama_tensors(params: Any, cfg: ModelConfig, n_vocab: int) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face's Llama-family names, float32, the first n_vocab rows only."""
    p = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), nn.unbox(params))
    p = unscanned({"params": p.get("params", p)}, cfg)[0]["params"]
    d, n, k, h = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size
    out = {"model.embed_tokens.weight": p["wte"]["embedding"][:n_vocab], "model.norm.weight": p["ln_f"]["scale"]}
    for i in range(cfg.n_layer):
        block, at = p[f"h_{i}"], f"model.layers.{i}."
        attn = block["attn"]
        if cfg.fused_qkv:  # [D, K, G+2, H]: query head j*G + g is the g-th of kv head j, as in GQA's layout
            qkv, g = attn["qkv"], n // k
            attn = dict(attn)
            for x, (index, heads) in {"q": (slice(0, g), n), "k": (g, k), "v": (g + 1, k)}.items():
                attn[x] = {"kernel": qkv["kernel"][:, :, index].reshape(d, heads, h)}
                if "bias" in qkv:
                    attn[x]["bias"] = qkv["bias"][:, index].reshape(heads, h)
        for x in "qkv":
            out[f"{at}self_attn.{x}_proj.weight"] = attn[x]["kernel"].reshape(d, -1).T
            if "bias" in attn[x]:
                out[f"{at}self_attn.{x}_proj.bias"] = attn[x]["bias"].reshape(-1)
        out[at + "self_attn.o_proj.weight"] = attn["proj"]["kernel"].reshape(n * h, d).T
        if "bias" in attn["proj"]:
            out[at + "self_attn.o_proj.bias"] = attn["proj"]["bias"]
        if cfg.qk_norm:
            out[at + "self_attn.q_norm.weight"] = attn["q_norm"]["scale"]
            out[at + "self_attn.k_norm.weight"] = attn["k_norm"]["scale"]
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj")):
            out[f"{at}mlp.{theirs}.weight"] = block["mlp"][ours]["kernel"].T
            if "bias" in block["mlp"][ours]:
                out[f"{at}mlp.{theirs}.bias"] = block["mlp"][ours]["bias"]
        out[at + "input_layernorm.weight"] = block["ln1"]["scale"]
        out[at + "post_attention_layernorm.weight"] = block["ln2"]["scale"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"]["kernel"][:, :n_vocab].T
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def llama_config(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    """config.json for transformers' LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM."""
    kind = llama_model_type(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=cfg.rope_factor)
    elif cfg.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=cfg.rope_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_len,
        )
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    config = {
        "architectures": [architecture],
        "model_type": kind,
        "vocab_size": tokenizer.n_vocab,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4 reads these two keys, 5 reads rope_parameters
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": tokenizer.prefix[0] if tokenizer.prefix else None,
        "eos_token_id": tokenizer.eot,
        "pad_token_id": tokenizer.pad,
        "attention_dropout": cfg.attn_dropout,
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    if kind == "llama":
        config.update(attention_bias=cfg.bias or cfg.attn_bias, mlp_bias=cfg.bias)
    elif kind == "qwen3":
        config.update(attention_bias=cfg.attn_bias, use_sliding_window=False, sliding_window=None)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def export_llama(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    out_dir: str,
    sample: SampleConfig | None = None,
    chat: bool = False,
) -> list[str]:
    """Write config.json, generation_config.json (with `sample`'s settings, where given), model.safetensors and
    the tokenizer files into out_dir, for transformers' Llama, Qwen2 or Qwen3 classes; return the names written."""
    problems = llama_incompatible(model_cfg)
    if problems:
        raise UserError(f"no Llama-family architecture can express this model ({', '.join(problems)})")
    kind = llama_model_type(model_cfg)
    qwen_split = tokenizer.hf is not None and tokenizer.hf["pattern"] == QWEN_SPLIT_PATTERN
    if kind != "llama" and not qwen_split and tokenizer.spec != "bytes":
        print(
            f"note: transformers reads {kind} tokenizers with Qwen's split pattern and NFC, whatever tokenizer.json "
            f"says; tokenizer {tokenizer.spec} splits text otherwise, so its ids there may differ from lm's",
            file=sys.stderr,
        )
    generation = {
        "bos_token_id": tokenizer.prefix[0] if tokenizer.prefix else None,
        "eos_token_id": stop_tokens(tokenizer, chat),
        **({"pad_token_id": tokenizer.pad} if tokenizer.pad is not None else {}),
        **(generation_fields(sample, model_cfg.max_seq_len) if sample else {}),
    }
    with new_directory(out_dir) as directory:
        weights = write_weights(llama_tensors(params, model_cfg, tokenizer.n_vocab), directory)
        write_json(os.path.join(directory, "config.json"), llama_config(model_cfg, tokenizer))
        write_json(os.path.join(directory, "generation_config.json"), generation)
        tokenizer_files = write_tokenizer_files(tokenizer, directory, model_cfg.max_seq_len)
        return ["config.json", "generation_config.json", *weights, *tokenizer_files]
