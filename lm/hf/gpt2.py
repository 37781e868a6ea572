"""GPT-2 (model_type gpt2) in Hugging Face's format, in and out: weights and config.json.

Weights. GPT-2 stores its projections as Conv1D weights of shape [in, out] (y = x @ W + b), which is the
layout of our kernels, so only the attention needs reshaping: c_attn's output columns are q | k | v, each
N heads of H, and our fused kernel is [D, K, G+2, H] = [D, N, 3, H] for GPT-2 (K = N, G = 1); c_proj's input
rows are the N heads of H concatenated, our proj kernel is [N, H, D]. GPT-2's "gelu_new" is the tanh
approximation, which is what nn.gelu computes by default. Names may carry a "transformer." prefix (as
save_pretrained writes them) or not; the causal-mask buffers of older files (attn.bias, attn.masked_bias) are
ignored; lm_head.weight is read only when it differs from the token embedding (an untied head).

Vocabulary. An import keeps the file's vocab_size exactly (vocab_multiple=1). An export writes the
tokenizer's ids only: the rows a padded vocabulary adds are never drawn by the sampler, so they are dropped
and vocab_size is the tokenizer's n_vocab. Weights are read in the dtype they are stored in (model.param_dtype:
float32, bfloat16 or float16) and written as float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ModelConfig, SampleConfig
from lm.errors import UserError
from lm.files import write_json
from lm.hf.files import Weights, new_directory, read_config, write_weights
from lm.hf.generation import generation_fields, stop_tokens
from lm.hf.tokenizer import (
    MERGES_HEADER,
    directory_tokenizer,
    gpt2_tokenizer_config,
    merges_from_ranks,
    spell,
    tokenizer_ranks,
    write_tokenizer_files,
)
from lm.model import unscanned
from lm.tokenizer import Tokenizer

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}  # HF name -> model.mlp


def load_hf_gpt2(directory: str, scan_layers: bool = False) -> tuple[Any, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of a Hugging Face GPT-2 directory. The params are numpy arrays
    ({"params": ...}, as Transformer.init returns them unboxed) in the dtype the weights are stored in
    (model.param_dtype: float32, bfloat16 or float16; float64 ones become float32); place them with jax.device_put.
    Dropout is left at 0: GPT-2's resid/embd/attn_pdrop are training choices, for model.dropout to make."""
    cfg, get, wte, tensors = _read(directory, scan_layers)
    d, n, layers, vocab = cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.vocab_size
    h, hidden = d // n, cfg.mlp_hidden or 4 * d
    ln = lambda name: {"scale": get(f"{name}.weight", (d,)), "bias": get(f"{name}.bias", (d,))}

    def block(i: int) -> dict:
        at = lambda name, *shape: get(f"h.{i}.{name}", shape)
        qkv_kernel = at("attn.c_attn.weight", d, 3 * d).reshape(d, 3, n, h).transpose(0, 2, 1, 3)
        qkv_bias = at("attn.c_attn.bias", 3 * d).reshape(3, n, h).transpose(1, 0, 2)
        return {
            "ln1": ln(f"h.{i}.ln_1"),
            "attn": {
                "qkv": {"kernel": qkv_kernel, "bias": qkv_bias},
                "proj": {"kernel": at("attn.c_proj.weight", d, d).reshape(n, h, d), "bias": at("attn.c_proj.bias", d)},
            },
            "ln2": ln(f"h.{i}.ln_2"),
            "mlp": {
                "fc": {"kernel": at("mlp.c_fc.weight", d, hidden), "bias": at("mlp.c_fc.bias", hidden)},
                "proj": {"kernel": at("mlp.c_proj.weight", hidden, d), "bias": at("mlp.c_proj.bias", d)},
            },
        }

    blocks = [block(i) for i in range(layers)]
    params = {"wte": {"embedding": wte}, "wpe": {"embedding": get("wpe.weight", (cfg.max_seq_len, d))},
              "ln_f": ln("ln_f")}  # fmt: skip
    if scan_layers:
        params["h"] = jax.tree.map(lambda *xs: np.stack(xs), *blocks)
    else:
        params.update({f"h_{i}": block for i, block in enumerate(blocks)})
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": get("lm_head.weight", (vocab, d)).T.copy()}
    tensors.warn_unread()
    return {"params": params}, cfg, gpt2_tokenizer(directory, vocab)


def gpt2_model_config(directory: str) -> tuple[ModelConfig, Tokenizer]:
    """The model config and tokenizer of a Hugging Face GPT-2 directory, reading of its weights the embeddings and
    head alone (whether they are tied, and their dtype), where load_hf_gpt2 reads them all."""
    cfg = _read(directory)[0]
    return cfg, gpt2_tokenizer(directory, cfg.vocab_size)


def gpt2_tokenizer(directory: str, vocab: int) -> Tokenizer:
    tokenizer = directory_tokenizer(directory, gpt2=True)
    if tokenizer.n_vocab > vocab:
        raise UserError(f"{directory}'s tokenizer has {tokenizer.n_vocab} ids but the model only {vocab} rows")
    return tokenizer


def _read(directory: str, scan_layers: bool = False) -> tuple[ModelConfig, Callable, np.ndarray, Weights]:
    """(the model config, a reader of checked tensors in the weights' dtype, the embeddings, the tensors)."""
    config = _checked(read_config(directory), os.path.join(directory, "config.json"))
    tensors = Weights(directory)
    d, n, layers = config["n_embd"], config["n_head"], config["n_layer"]
    stored = tensors.dtype("wte.weight") if "wte.weight" in tensors else "float32"  # (its absence: get's error)
    param_dtype = stored if stored in ("float32", "bfloat16", "float16") else "float32"
    dtype = jnp.dtype(param_dtype)

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise UserError(f"{directory}'s weights lack {name}; is it a complete GPT-2 checkpoint?")
        x = tensors[name]
        if x.shape != shape:
            raise UserError(f"{directory}'s {name} has shape {list(x.shape)}, config.json implies {list(shape)}")
        return x if x.dtype == dtype else x.astype(dtype)

    vocab, positions = config["vocab_size"], config["n_positions"]
    hidden = config.get("n_inner") or 4 * d
    wte = get("wte.weight", (vocab, d))
    head = tensors.get("lm_head.weight")
    if head is None and config.get("tie_word_embeddings", True) is False:  # (transformers draws a random head)
        raise UserError(f"{directory}'s config.json unties the head (tie_word_embeddings false) but its weights lack "
                        "lm_head.weight; is it a complete checkpoint?")  # fmt: skip
    tied = head is None or np.array_equal(head.astype(dtype), wte)
    cfg = ModelConfig(
        vocab_size=vocab,
        vocab_multiple=1,
        max_seq_len=positions,
        n_layer=layers,
        n_head=n,
        n_embd=d,
        mlp=ACTIVATIONS[config.get("activation_function", "gelu_new")],
        mlp_hidden=0 if hidden == 4 * d else hidden,
        pos="learned",
        norm="layernorm",
        norm_bias=True,
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        bias=True,
        fused_qkv=True,
        tie_embeddings=tied,
        scan_layers=scan_layers,
        param_dtype=param_dtype,
    )
    return cfg, get, wte, tensors


def _checked(config: dict, path: str) -> dict:
    """config, after refusing what lm's model cannot compute."""
    if config.get("model_type") != "gpt2":
        raise UserError(f"{path} describes a {config.get('model_type')!r} model; only GPT-2 (model_type gpt2) imports")
    sizes = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    missing = [key for key in sizes if not isinstance(config.get(key), int) or config[key] < 1]
    if missing:
        raise UserError(f"{path} lacks positive integers for {', '.join(missing)}; is it a GPT-2 config?")
    problems = []
    if config["n_embd"] % config["n_head"]:
        problems.append(f"n_embd={config['n_embd']} not divisible by n_head={config['n_head']}")
    activation = config.get("activation_function", "gelu_new")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        problems.append(f"activation_function={activation}")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        problems.append(f"layer_norm_epsilon={eps!r} (not a positive number)")
    if config.get("n_inner") is not None and (not isinstance(config["n_inner"], int) or config["n_inner"] < 1):
        problems.append(f"n_inner={config['n_inner']!r} (not a positive integer)")
    if not config.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false")
    if config.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=true")
    if config.get("add_cross_attention", False):
        problems.append("add_cross_attention=true")
    if problems:
        raise UserError(f"{path} uses what lm's model does not have: {', '.join(problems)}")
    return config


# --- export -------------------------------------------------------------------------------------------------


def gpt2_incompatible(cfg: ModelConfig) -> list[str]:
    """The settings of a model that GPT-2's architecture cannot express, as key=value."""
    checks = [
        (cfg.pos == "learned", f"pos={cfg.pos}"),
        (cfg.mlp in ("gelu", "relu"), f"mlp={cfg.mlp}"),
        (cfg.norm == "layernorm", f"norm={cfg.norm}"),
        (cfg.norm != "layernorm" or cfg.norm_bias, "norm_bias=false"),
        (cfg.norm_placement == "pre", f"norm_placement={cfg.norm_placement}"),
        (cfg.bias, "bias=false"),
        (cfg.kv_heads == cfg.n_head, f"n_kv_head={cfg.n_kv_head}"),
        (cfg.head_size * cfg.n_head == cfg.n_embd, f"head_dim={cfg.head_dim}"),
        (not cfg.qk_norm, "qk_norm=true"),
    ]
    return [problem for ok, problem in checks if not ok]


def _layers(p: dict, cfg: ModelConfig) -> list[dict]:
    p = unscanned({"params": p}, cfg)[0]["params"]
    return [p[f"h_{i}"] for i in range(cfg.n_layer)]


def _c_attn(attn: dict, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """GPT-2's c_attn weight [D, 3D] and bias [3D] (columns q | k | v, heads within each)."""
    d = cfg.n_embd
    if cfg.fused_qkv:  # [D, N, 3, H] -> [D, 3, N, H] and [N, 3, H] -> [3, N, H]
        qkv = attn["qkv"]
        return qkv["kernel"].transpose(0, 2, 1, 3).reshape(d, 3 * d), qkv["bias"].transpose(1, 0, 2).reshape(3 * d)
    kernel = np.concatenate([attn[x]["kernel"].reshape(d, d) for x in "qkv"], axis=1)
    return kernel, np.concatenate([attn[x]["bias"].reshape(d) for x in "qkv"])


def hf_gpt2_tensors(params: Any, cfg: ModelConfig, n_vocab: int) -> dict[str, np.ndarray]:
    """The model's weights under GPT2LMHeadModel's names, float32, the first n_vocab vocabulary rows only."""
    p = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), nn.unbox(params))
    p = p.get("params", p)
    d = cfg.n_embd
    out = {"wte.weight": p["wte"]["embedding"][:n_vocab], "wpe.weight": p["wpe"]["embedding"]}
    ln = lambda module: (module["scale"], module["bias"])
    for i, block in enumerate(_layers(p, cfg)):
        at = f"h.{i}."
        out[at + "ln_1.weight"], out[at + "ln_1.bias"] = ln(block["ln1"])
        out[at + "attn.c_attn.weight"], out[at + "attn.c_attn.bias"] = _c_attn(block["attn"], cfg)
        out[at + "attn.c_proj.weight"] = block["attn"]["proj"]["kernel"].reshape(d, d)
        out[at + "attn.c_proj.bias"] = block["attn"]["proj"]["bias"]
        out[at + "ln_2.weight"], out[at + "ln_2.bias"] = ln(block["ln2"])
        for ours, theirs in (("fc", "c_fc"), ("proj", "c_proj")):
            out[f"{at}mlp.{theirs}.weight"] = block["mlp"][ours]["kernel"]
            out[f"{at}mlp.{theirs}.bias"] = block["mlp"][ours]["bias"]
    out["ln_f.weight"], out["ln_f.bias"] = ln(p["ln_f"])
    tensors = {"transformer." + k: np.ascontiguousarray(v) for k, v in out.items()}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(p["lm_head"]["kernel"][:, :n_vocab].T)
    return tensors


def hf_gpt2_config(cfg: ModelConfig, eot: int, bos: int, n_vocab: int) -> dict:
    """config.json for transformers' GPT2LMHeadModel."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": n_vocab,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.mlp_hidden or None,
        "activation_function": "gelu_new" if cfg.mlp == "gelu" else "relu",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout,
        "bos_token_id": bos,
        "eos_token_id": eot,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": True,
        "dtype": "float32",
    }


def export_hf_gpt2(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    out_dir: str,
    sample: SampleConfig | None = None,
    chat: bool = False,
) -> list[str]:
    """Write config.json, generation_config.json (with `sample`'s settings, where given), model.safetensors and
    vocab.json, merges.txt and tokenizer_config.json where GPT-2's tokenizer files express the tokenizer, else
    tokenizer.json and tokenizer_config.json (lm.hf.tokenizer.write_tokenizer_files: bpe:N, say), into out_dir, for
    transformers' GPT2LMHeadModel; return the names written. Refuses a model GPT-2 cannot express."""
    problems = gpt2_incompatible(model_cfg)
    if problems:
        raise UserError(
            f"GPT-2 cannot express this model ({', '.join(problems)}); only models with pos=learned, mlp=gelu or "
            "relu, norm=layernorm with norm_bias, norm_placement=pre, bias, n_kv_head=n_head, the default head_dim "
            "and no qk_norm export"
        )
    with new_directory(out_dir) as directory:
        return _write_gpt2(params, model_cfg, tokenizer, directory, sample, chat)


def _write_gpt2(
    params: Any, model_cfg: ModelConfig, tokenizer: Tokenizer, directory: str, sample: SampleConfig | None, chat: bool
) -> list[str]:
    """export_hf_gpt2's files, written into `directory` (which becomes out_dir)."""
    n_vocab = tokenizer.n_vocab
    weights = write_weights(hf_gpt2_tensors(params, model_cfg, n_vocab), directory)
    bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eot
    config = hf_gpt2_config(model_cfg, tokenizer.eot, bos, n_vocab)
    write_json(os.path.join(directory, "config.json"), {**config, "pad_token_id": tokenizer.pad})
    generation = {"bos_token_id": bos, "eos_token_id": stop_tokens(tokenizer, chat)}  # (every stop token: generate's)
    generation.update(generation_fields(sample, model_cfg.max_seq_len) if sample else {})
    write_json(os.path.join(directory, "generation_config.json"), {**generation, "pad_token_id": tokenizer.pad})
    written = ["config.json", "generation_config.json", *weights]
    ranks = tokenizer_ranks(tokenizer)
    merges = merges_from_ranks(ranks) if ranks is not None else None
    if merges is None:  # (bpe:N: GPT-4's split) tokenizer.json says its split pattern, as the llama export writes it
        return [*written, *write_tokenizer_files(tokenizer, directory, model_cfg.max_seq_len)]
    vocab = {spell(token): i for token, i in sorted(ranks.items(), key=lambda item: item[1])}
    vocab.update(tokenizer.special_tokens)  # at their own ids: <|endoftext|> last in GPT-2's files, anywhere in others
    write_json(os.path.join(directory, "vocab.json"), dict(sorted(vocab.items(), key=lambda item: item[1])))
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join([MERGES_HEADER, *(f"{spell(a)} {spell(b)}" for a, b in merges)]) + "\n")
    written += ["vocab.json", "merges.txt"]
    settings = gpt2_tokenizer_config(tokenizer, model_cfg.max_seq_len)
    write_json(os.path.join(directory, "tokenizer_config.json"), settings)
    return [*written, "tokenizer_config.json"]
