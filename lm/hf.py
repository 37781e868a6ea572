"""GPT-2 in Hugging Face's format, in and out: weights, config and byte-level BPE tokenizer files.

    params, model_cfg, tok = load_hf_gpt2("gpt2/")      # config.json, model.safetensors, vocab.json, merges.txt
    export_hf_gpt2(params, model_cfg, tok, "out/")      # the same files, for transformers' GPT2LMHeadModel

lm.pretrained loads such a directory as hf:DIR; `python -m lm.export` (lm/export.py) writes a checkpoint as one.
This module knows only models, configs and tokenizers, not checkpoints or runs, so both can import it.

Weights. GPT-2 stores its projections as Conv1D weights of shape [in, out] (y = x @ W + b), which is the
layout of our kernels, so only the attention needs reshaping: c_attn's output columns are q | k | v, each
N heads of H, and our fused kernel is [D, K, G+2, H] = [D, N, 3, H] for GPT-2 (K = N, G = 1); c_proj's input
rows are the N heads of H concatenated, our proj kernel is [N, H, D]. GPT-2's "gelu_new" is the tanh
approximation, which is what nn.gelu computes by default. Names may carry a "transformer." prefix (as
save_pretrained writes them) or not; the causal-mask buffers of older files (attn.bias, attn.masked_bias) are
ignored; lm_head.weight is read only when it differs from the token embedding (an untied head).

Vocabulary. An import keeps the file's vocab_size exactly (vocab_multiple=1). An export writes the
tokenizer's ids only: the rows a padded vocabulary adds are never drawn by the sampler, so they are dropped
and vocab_size is the tokenizer's n_vocab. Weights are written as float32.

Tokenizer. vocab.json maps GPT-2's printable-character spelling of each token's bytes to its id, and
merges.txt lists the merges in priority order. tiktoken merges by the rank of the merged token instead, so an
imported vocabulary must give every merge a higher id than the merges before it (GPT-2's does); the ranks
become the rank file of an lm tokenizer "gpt2_hf", which splits text with GPT-2's pattern. An export derives
each token's merge from the ranks (the two tokens that BPE with the lower ranks leaves of it); only
tokenizers that split text as GPT-2 does (gpt2, r50k_base, gpt2_hf) or that have no merges (bytes) can be
written this way, the others are left out with a note.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import tempfile
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from lm.config import ModelConfig
from lm.errors import UserError
from lm.files import write_json
from lm.model import unscanned
from lm.tokenizer import HF_GPT2, RANK_FILE, Tokenizer, tokenizer_from_item, write_rank_file

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}  # HF name -> model.mlp
GPT2_SPLIT_SPECS = ("gpt2", "r50k_base", HF_GPT2)  # tokenizers that split text with GPT-2's pattern
MERGES_HEADER = "#version: 0.2"


# --- GPT-2's byte-level spelling of tokens ----------------------------------------------------------------


@functools.cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible spelling of bytes as printable characters: '!'..'~', '¡'..'¬' and '®'..'ÿ' stand
    for themselves, the other 68 bytes (controls, space, NBSP, soft hyphen) become chr(256), chr(257), ...
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@functools.cache
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def spell(token: bytes) -> str:
    return "".join(byte_to_char()[b] for b in token)


def unspell(text: str) -> bytes | None:
    """The bytes behind a GPT-2 spelling, or None if it is not one."""
    try:
        return bytes(_char_to_byte()[c] for c in text)
    except KeyError:
        return None


def ranks_from_hf(vocab: dict[str, int], merges: list[tuple[str, str]], eot: int, where: str) -> dict[bytes, int]:
    """tiktoken mergeable ranks from vocab.json and merges.txt, checked to encode text as the merges do."""
    ranks = {}
    for text, i in vocab.items():
        if i == eot:
            continue
        token = unspell(text)
        if token is None or token in ranks:
            raise UserError(f"{where}: vocab.json token {text!r} is not a byte-level BPE token of GPT-2's kind")
        ranks[token] = i
    if sorted(ranks.values()) != list(range(len(ranks))) or eot != len(ranks):
        raise UserError(
            f"{where}: vocab.json must number its tokens 0..{len(ranks) - 1} and give the end-of-text token "
            f"(eos_token_id {eot} in config.json) the last id, {len(ranks)}; lm has no other special tokens"
        )
    missing = sum(bytes([b]) not in ranks for b in range(256))
    if missing:
        raise UserError(f"{where}: vocab.json lacks {missing} of the 256 single-byte tokens")
    previous = -1
    for line, (left, right) in enumerate(merges, 2):
        pieces = unspell(left), unspell(right)
        merged = None if None in pieces else ranks.get(pieces[0] + pieces[1])
        if merged is None:
            raise UserError(f"{where}/merges.txt:{line}: merge '{left} {right}' makes no token of vocab.json")
        if merged <= previous:
            raise UserError(
                f"{where}/merges.txt:{line}: merge '{left} {right}' has a lower id than an earlier merge; "
                "lm needs ids that follow the merge order, as GPT-2's do"
            )
        previous = merged
    if len(merges) != len(ranks) - 256:
        raise UserError(f"{where}: merges.txt has {len(merges)} merges for {len(ranks) - 256} multi-byte tokens")
    return ranks


def _bpe(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """The pieces byte-pair merging leaves of `token` with the tokens ranked below `below`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pairs = [(ranks.get(a + b, below), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
        rank, i = min(pairs)
        if rank >= below:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]] | None:
    """The merge that makes each multi-byte token, in rank order; None if the ranks are no BPE.

    A token's merge joins the two pieces BPE with the lower ranks leaves of it. Where it leaves more than
    two (a token that BPE never produces from its bytes alone), any split into two lower-ranked tokens is
    a merge that makes it, and the one whose pieces rank lowest is taken.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _bpe(token, ranks, rank)
        if len(parts) != 2:
            splits = [(max(ranks.get(token[:k], rank), ranks.get(token[k:], rank)), k) for k in range(1, len(token))]
            highest, k = min(splits)
            if highest >= rank:
                return None
            parts = [token[:k], token[k:]]
        merges.append((parts[0], parts[1]))
    return merges


def _tokenizer_ranks(tokenizer: Tokenizer) -> dict[bytes, int] | None:
    """The tokenizer's mergeable ranks, if GPT-2's tokenizer files can express it (see the module doc)."""
    enc = tokenizer.encoding
    special = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    ranks = {}
    for i in range(tokenizer.n_vocab):
        if i in special:
            continue
        try:
            ranks[enc.decode_single_token_bytes(i)] = i
        except KeyError:  # an unused id: vocab.json cannot have gaps
            return None
    splits_like_gpt2 = tokenizer.spec in GPT2_SPLIT_SPECS or len(ranks) == 256
    if not splits_like_gpt2 or special != {tokenizer.eot} or tokenizer.eot != len(ranks):
        return None
    return ranks


def load_hf_tokenizer(directory: str, eot: int) -> Tokenizer:
    """The "gpt2_hf" Tokenizer of a directory's vocab.json and merges.txt; its rank file is kept in lm's
    tokenizer cache, by content hash, like the rank files of checkpoints."""
    vocab_path, merges_path = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    for path in (vocab_path, merges_path):
        if not os.path.isfile(path):
            raise UserError(f"{directory} has no {os.path.basename(path)}; lm needs GPT-2's tokenizer files")
    try:
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(merges_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {directory}'s tokenizer files: {e}") from None
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = []
    for line, text in enumerate(lines, 2):
        pair = text.split(" ")
        if len(pair) != 2:
            raise UserError(f"{merges_path}:{line}: expected two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise UserError(f"{vocab_path} is not a JSON object of token ids")
    ranks = ranks_from_hf(vocab, merges, eot, directory)
    with tempfile.TemporaryDirectory() as tmp:
        write_rank_file(ranks, os.path.join(tmp, RANK_FILE))
        with open(os.path.join(tmp, RANK_FILE)) as f:
            return tokenizer_from_item({"spec": HF_GPT2, "ranks": f.read()})


# --- import -------------------------------------------------------------------------------------------------


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{directory} has no config.json; give a Hugging Face GPT-2 model directory") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e.msg})") from None
    if config.get("model_type") != "gpt2":
        raise UserError(f"{path} describes a {config.get('model_type')!r} model; only GPT-2 (model_type gpt2) imports")
    sizes = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    missing = [key for key in sizes if not isinstance(config.get(key), int) or config[key] < 1]
    if missing:
        raise UserError(f"{path} lacks positive integers for {', '.join(missing)}; is it a GPT-2 config?")
    problems = []
    if config["n_embd"] % config["n_head"]:
        problems.append(f"n_embd={config['n_embd']} not divisible by n_head={config['n_head']}")
    if config.get("activation_function", "gelu_new") not in ACTIVATIONS:
        problems.append(f"activation_function={config['activation_function']}")
    if not config.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false")
    if config.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=true")
    if config.get("add_cross_attention", False):
        problems.append("add_cross_attention=true")
    if problems:
        raise UserError(f"{path} uses what lm's model does not have: {', '.join(problems)}")
    return config


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of model.safetensors (or of the shards an index names), without a "transformer." prefix."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise UserError(f"{directory} has no {name}; lm reads GPT-2 weights in safetensors format")
        try:
            tensors.update(load_file(path))
        except (SafetensorError, TypeError, ValueError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
    return {k.removeprefix("transformer."): v for k, v in tensors.items()}


def load_hf_gpt2(directory: str, scan_layers: bool = False) -> tuple[Any, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of a Hugging Face GPT-2 directory. The params are float32 numpy
    arrays ({"params": ...}, as Transformer.init returns them unboxed); place them with jax.device_put.
    Dropout is left at 0: GPT-2's resid/embd/attn_pdrop are training choices, for model.dropout to make."""
    config = _read_config(directory)
    tensors = _read_tensors(directory)
    d, n, layers = config["n_embd"], config["n_head"], config["n_layer"]
    h = d // n

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise UserError(f"{directory}'s weights lack {name}; is it a complete GPT-2 checkpoint?")
        x = tensors[name]
        if x.shape != shape:
            raise UserError(f"{directory}'s {name} has shape {list(x.shape)}, config.json implies {list(shape)}")
        return x.astype(np.float32)

    vocab, positions = config["vocab_size"], config["n_positions"]
    hidden = config.get("n_inner") or 4 * d
    wte = get("wte.weight", (vocab, d))
    head = tensors.get("lm_head.weight")
    tied = head is None or np.array_equal(head.astype(np.float32), wte)
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
    )
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
    params = {"wte": {"embedding": wte}, "wpe": {"embedding": get("wpe.weight", (positions, d))}, "ln_f": ln("ln_f")}
    if scan_layers:
        params["h"] = jax.tree.map(lambda *xs: np.stack(xs), *blocks)
    else:
        params.update({f"h_{i}": block for i, block in enumerate(blocks)})
    if not tied:
        params["lm_head"] = {"kernel": get("lm_head.weight", (vocab, d)).T.copy()}

    eot = config.get("eos_token_id")
    if not isinstance(eot, int):
        raise UserError(f"{directory}/config.json has no eos_token_id; lm needs the end-of-text token's id")
    tokenizer = load_hf_tokenizer(directory, eot)
    if tokenizer.n_vocab > vocab:
        raise UserError(f"{directory}'s tokenizer has {tokenizer.n_vocab} ids but the model only {vocab} rows")
    return {"params": params}, cfg, tokenizer


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


def hf_gpt2_config(cfg: ModelConfig, eot: int, n_vocab: int) -> dict:
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
        "bos_token_id": eot,
        "eos_token_id": eot,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": True,
        "dtype": "float32",
    }


def export_hf_gpt2(params: Any, model_cfg: ModelConfig, tokenizer: Tokenizer, out_dir: str) -> list[str]:
    """Write config.json, model.safetensors and, where the tokenizer allows, vocab.json and merges.txt into
    out_dir, for transformers' GPT2LMHeadModel; return the names written. Refuses a model GPT-2 cannot express."""
    problems = gpt2_incompatible(model_cfg)
    if problems:
        raise UserError(
            f"GPT-2 cannot express this model ({', '.join(problems)}); only models with pos=learned, mlp=gelu or "
            "relu, norm=layernorm with norm_bias, norm_placement=pre, bias, n_kv_head=n_head, the default head_dim "
            "and no qk_norm export"
        )
    # Never over another export or the user's files: a half-overwritten model directory is worse than none.
    if os.path.isfile(out_dir):
        raise UserError(f"{out_dir} is a file; give the path of a new directory to export into")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"{out_dir} already exists and is not empty; give a new directory, or remove that one first")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out_dir}: {e.strerror or e}") from None
    n_vocab = tokenizer.n_vocab
    save_file(hf_gpt2_tensors(params, model_cfg, n_vocab), os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
    write_json(os.path.join(out_dir, "config.json"), hf_gpt2_config(model_cfg, tokenizer.eot, n_vocab))
    written = ["config.json", "model.safetensors"]
    ranks = _tokenizer_ranks(tokenizer)
    merges = merges_from_ranks(ranks) if ranks is not None else None
    if merges is None:
        print(
            f"note: tokenizer {tokenizer.spec} does not split text as GPT-2's does, so vocab.json and merges.txt "
            f"cannot express it; {out_dir} holds the weights and config only",
            file=sys.stderr,
        )
        return written
    vocab = {spell(token): i for token, i in sorted(ranks.items(), key=lambda item: item[1])}
    vocab["<|endoftext|>"] = tokenizer.eot
    write_json(os.path.join(out_dir, "vocab.json"), vocab)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join([MERGES_HEADER, *(f"{spell(a)} {spell(b)}" for a, b in merges)]) + "\n")
    return written + ["vocab.json", "merges.txt"]
