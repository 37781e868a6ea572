"""The Llama family in Hugging Face's format: model_type llama, mistral, qwen2 and qwen3, weights and config.json.

All four are the same pre-norm transformer with RMSNorm, RoPE (rotating each head's first half against its
second, as lm's rope does), grouped-query attention and a SwiGLU MLP; they differ in options lm's model has:
    llama    attention_bias (Q, K, V and O biases), rope_scaling linear or llama3 (Llama 3.1+)
    mistral  a sliding window, accepted only where it covers the whole context
    qwen2    biases on Q, K and V only (model.qkv_bias)
    qwen3    an RMSNorm over each head's queries and keys (model.qk_norm), head_dim wider than hidden/heads

Weights. Hugging Face's Linear weights are [out, in] (y = x @ W.T); our kernels are [in, out] with the heads
as their own axes: q_proj [N*H, D] -> q [D, N, H], k_proj and v_proj [K*H, D] -> [D, K, H], o_proj [D, N*H]
-> proj [N, H, D]; gate/up/down_proj -> mlp gate, up, proj. Q/K/V stay three projections (fused_qkv=false).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from lm.config import ModelConfig
from lm.errors import UserError
from lm.hf.files import read_config, read_tensors

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


def model_config(config: dict, where: str, scan_layers: bool = False) -> ModelConfig:
    """lm's ModelConfig for a Llama-family config.json, or a UserError naming what lm's model lacks."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"{where} describes a {model_type!r} model, not one of {', '.join(MODEL_TYPES)}")
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [key for key in sizes if not isinstance(config.get(key), int) or config[key] < 1]
    if missing:
        raise UserError(f"{where} lacks positive integers for {', '.join(missing)}; is it a {model_type} config?")
    d, n = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // n
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']}")
    attention_bias = bool(config.get("attention_bias", False))
    if config.get("mlp_bias", False) != attention_bias:
        problems.append(f"mlp_bias={config.get('mlp_bias')} with attention_bias={attention_bias}")
    max_len = config.get("max_position_embeddings") or 0
    window = config.get("sliding_window")
    if window is not None and (model_type == "mistral" or config.get("use_sliding_window")) and window < max_len:
        problems.append(f"sliding_window={window} (shorter than max_position_embeddings={max_len})")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope type {rope_type} (lm has {', '.join(ROPE_TYPES)})")
    if problems:
        raise UserError(f"{where} uses what lm's model does not have: {', '.join(problems)}")
    rope_options = {}
    if rope_type == "linear":
        rope_options = dict(rope_scaling="linear", rope_factor=float(rope["factor"]))
    elif rope_type == "llama3":
        rope_options = dict(
            rope_scaling="llama3",
            rope_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
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
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        norm="rmsnorm",
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        bias=attention_bias,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        fused_qkv=False,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        scan_layers=scan_layers,
        **rope_options,
    )


def load_llama(directory: str, scan_layers: bool = False) -> tuple[Any, ModelConfig]:
    """(params, model config) of a Llama-family directory; params are float32 numpy arrays ({"params": ...})."""
    cfg = model_config(read_config(directory), os.path.join(directory, "config.json"), scan_layers)
    tensors = read_tensors(directory)
    d, n, k, h, f = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.hidden

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise UserError(f"{directory}'s weights lack {name}; is it a complete checkpoint?")
        x = tensors.pop(name)  # each tensor is read once: the host holds one copy of the weights
        if x.shape != shape:
            raise UserError(f"{directory}'s {name} has shape {list(x.shape)}, config.json implies {list(shape)}")
        return x.astype(np.float32)

    def projection(name: str, heads: int, bias: bool) -> dict:
        """q_proj, k_proj or v_proj [heads*H, D] as our [D, heads, H] kernel, with its bias [heads, H]."""
        layer = {"kernel": get(f"{name}.weight", (heads * h, d)).T.reshape(d, heads, h).copy()}
        if bias:
            layer["bias"] = get(f"{name}.bias", (heads * h,)).reshape(heads, h)
        return layer

    def dense(name: str, n_in: int, n_out: int) -> dict:
        """An MLP Linear [n_out, n_in] as our [n_in, n_out] kernel, with its bias where the model has them."""
        layer = {"kernel": get(f"{name}.weight", (n_out, n_in)).T.copy()}
        if cfg.bias:
            layer["bias"] = get(f"{name}.bias", (n_out,))
        return layer

    def block(i: int) -> dict:
        at = f"model.layers.{i}."
        qkv_bias = cfg.bias or cfg.qkv_bias
        attn = {
            "q": projection(at + "self_attn.q_proj", n, qkv_bias),
            "k": projection(at + "self_attn.k_proj", k, qkv_bias),
            "v": projection(at + "self_attn.v_proj", k, qkv_bias),
            "proj": {"kernel": get(at + "self_attn.o_proj.weight", (d, n * h)).T.reshape(n, h, d).copy()},
        }
        if cfg.bias:
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

    wte = get("model.embed_tokens.weight", (cfg.vocab_size, d))
    params = {"wte": {"embedding": wte}}
    blocks = [block(i) for i in range(cfg.n_layer)]
    if scan_layers:
        params["h"] = jax.tree.map(lambda *xs: np.stack(xs), *blocks)
    else:
        params.update({f"h_{i}": b for i, b in enumerate(blocks)})
    params["ln_f"] = {"scale": get("model.norm.weight", (d,))}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight", (cfg.vocab_size, d)).T.copy()}
    return {"params": params}, cfg

