"""Models in Hugging Face's format, in and out: which architectures lm reads and writes, by config.json.

    params, model_cfg, tok = load("model_dir/")          # config.json, safetensors weights, tokenizer files
    export(params, model_cfg, tok, "out/")               # as gpt2, llama, qwen2 or qwen3, for transformers

    files.py      config.json and safetensors weights (one file or shards); never pickled .bin files
    tokenizer.py  tokenizer files <-> lm Tokenizers: GPT-2's vocab.json + merges.txt, tokenizer.json
    generation.py generation_config.json's sampling settings, the defaults lm samples such a model with
    gpt2.py       model_type gpt2, both ways
    llama.py      model_type llama, mistral, qwen2, qwen3, both ways

lm.pretrained loads such a directory as hf:DIR; `python -m lm.export` (lm/export.py) writes a checkpoint as one.
These modules know only models, configs and tokenizers, not checkpoints or runs, so both can import them.
No code from a model directory is ever run: architectures are lm's own, chosen by config.json's model_type.
"""

from __future__ import annotations

from typing import Any

from lm.config import ModelConfig, SampleConfig
from lm.errors import UserError
from lm.hf.files import read_config
from lm.hf.generation import sampling_defaults
from lm.hf.gpt2 import export_hf_gpt2, gpt2_incompatible, gpt2_model_config, load_hf_gpt2
from lm.hf.llama import MODEL_TYPES, context_limit, export_llama, llama_incompatible, llama_model_config, load_llama
from lm.hf.tokenizer import byte_to_char, directory_tokenizer, merges_from_ranks, spell, unspell
from lm.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED",
    "byte_to_char",
    "config_and_tokenizer",
    "context_limit",
    "export",
    "export_hf_gpt2",
    "gpt2_incompatible",
    "load",
    "load_hf_gpt2",
    "merges_from_ranks",
    "sampling_defaults",
    "spell",
    "unspell",
]
SUPPORTED = ("gpt2", *MODEL_TYPES)


def load(directory: str, scan_layers: bool = False, placer=None) -> tuple[Any, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of a Hugging Face model directory; params ({"params": ...}, as
    Transformer.init returns them unboxed) are numpy arrays in the stored dtype, or wherever `placer`
    (model config -> place(key, subtree)) puts each top-level subtree as soon as it is read."""
    model_type = _model_type(directory)
    if model_type == "gpt2":
        params, model_cfg, tokenizer = load_hf_gpt2(directory, scan_layers)
        if placer:
            place = placer(model_cfg)
            params = {"params": {key: place(key, tree) for key, tree in params["params"].items()}}
        return params, model_cfg, tokenizer
    model_cfg = llama_model_config(directory, scan_layers)
    tokenizer = _tokenizer(directory, model_cfg)  # its mistakes before the weights are read
    params, model_cfg = load_llama(directory, scan_layers, placer, model_cfg)
    return params, model_cfg, tokenizer


def config_and_tokenizer(directory: str) -> tuple[ModelConfig, Tokenizer]:
    """The model config and tokenizer of a Hugging Face model directory, reading no weights (but GPT-2's embeddings
    and head)."""
    if _model_type(directory) == "gpt2":
        return gpt2_model_config(directory)
    model_cfg = llama_model_config(directory)
    return model_cfg, _tokenizer(directory, model_cfg)


def _model_type(directory: str) -> str:
    model_type = read_config(directory).get("model_type")
    if model_type not in SUPPORTED:
        described = "has no model_type" if model_type is None else f"describes a {model_type!r} model"
        raise UserError(
            f"{directory}/config.json {described}; lm imports model_type "
            f"{', '.join(SUPPORTED)} (its own code for each: nothing from the directory is run)"
        )
    return model_type


def _tokenizer(directory: str, model_cfg: ModelConfig) -> Tokenizer:
    tokenizer = directory_tokenizer(directory, gpt2=False)
    if tokenizer.n_vocab > model_cfg.vocab_size:
        raise UserError(
            f"{directory}'s tokenizer has {tokenizer.n_vocab} ids but the model only {model_cfg.vocab_size}"
        )
    return tokenizer


def export(
    params: Any,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    out_dir: str,
    sample: SampleConfig | None = None,
    chat: bool = False,
) -> list[str]:
    """Write the model into out_dir as the first Hugging Face architecture that expresses it (gpt2, else
    llama, qwen2 or qwen3); return the names written, or refuse naming what neither can express. `sample`: the
    sampling settings generation_config.json recommends (none where None); `chat`: the weights were trained on
    chats, whose replies end where the chat template ends them (lm.hf.generation.stop_tokens)."""
    gpt2_problems, llama_problems = gpt2_incompatible(model_cfg), llama_incompatible(model_cfg)
    if not gpt2_problems:
        return export_hf_gpt2(params, model_cfg, tokenizer, out_dir, sample, chat)
    if not llama_problems:
        return export_llama(params, model_cfg, tokenizer, out_dir, sample, chat)
    raise UserError(
        f"no Hugging Face architecture lm writes can express this model: GPT-2 lacks {', '.join(gpt2_problems)}; "
        f"the Llama family lacks {', '.join(llama_problems)}"
    )
