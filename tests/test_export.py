"""Behaviour of lm.hf and lm.export: a Hugging Face GPT-2 imports with the logits, greedy tokens and token ids
that transformers computed (tests/fixtures/tiny_gpt2, made by tests/fixtures/make_tiny_gpt2.py), exports
round-trip, incompatible models and malformed files are refused, and `python -m lm.export` works end to end.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import ROOT, assert_user_error, run_cli
from safetensors.numpy import load_file, save_file

from lm import config as config_lib
from lm import hf as hf_lib
from lm import model as M
from lm.config import ModelConfig, SampleConfig
from lm.errors import UserError
from lm.sampling import generate
from lm.tokenizer import HF_GPT2, get_tokenizer, train_bpe
from lm.train import train

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "tiny_gpt2")
# What a GPT-2 export writes, in order, where vocab.json and merges.txt can express its tokenizer
GPT2_FILES = ["config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt",
              "tokenizer_config.json"]  # fmt: skip
with open(os.path.join(FIXTURE, "reference.json")) as f:
    REFERENCE = json.load(f)


@pytest.fixture(scope="module", autouse=True)
def tokenizer_cache(tmp_path_factory):
    """Imported rank files go to a cache of this module's own (lm keeps them under XDG_CACHE_HOME)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        yield


def logits(params, cfg, ids):
    return np.asarray(M.Transformer(cfg).apply(params, np.array([ids], np.int32)))[0]


def same_tree(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and jax.tree.all(jax.tree.map(np.array_equal, a, b))


def copy_fixture(tmp_path, name="hf"):
    return shutil.copytree(FIXTURE, tmp_path / name)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_import_reproduces_transformers_logits(scan_layers):
    params, cfg, _ = hf_lib.load_hf_gpt2(FIXTURE, scan_layers=scan_layers)
    assert (cfg.vocab_size, cfg.vocab_multiple, cfg.max_seq_len, cfg.mlp_hidden) == (300, 1, 32, 64)
    assert (cfg.pos, cfg.mlp, cfg.norm, cfg.norm_bias, cfg.bias) == ("learned", "gelu", "layernorm", True, True)
    assert cfg.fused_qkv and cfg.tie_embeddings and cfg.scan_layers == scan_layers
    ids = REFERENCE["ids"][: len(REFERENCE["logits"])]
    np.testing.assert_allclose(logits(params, cfg, ids), np.array(REFERENCE["logits"]), atol=1e-4)


def test_import_reproduces_greedy_generation():
    params, cfg, tok = hf_lib.load_hf_gpt2(FIXTURE)
    settings = SampleConfig(max_new_tokens=len(REFERENCE["greedy"]), temperature=0)
    [sample] = generate(params, cfg, tok, [REFERENCE["prompt"]], settings)
    assert sample.prompt == REFERENCE["prompt_ids"]
    assert sample.tokens == REFERENCE["greedy"]


def test_tokenizer_from_vocab_and_merges_gives_transformers_ids():
    _, _, tok = hf_lib.load_hf_gpt2(FIXTURE)
    assert (tok.spec, tok.n_vocab, tok.eot) == (HF_GPT2, 300, 299)
    assert tok.encode(REFERENCE["text"]) == REFERENCE["ids"]
    assert tok.decode(REFERENCE["ids"]) == REFERENCE["text"]
    # The rank file travels like a checkpoint's: by content, from the directory it is stored in.
    again = get_tokenizer(HF_GPT2, os.path.dirname(tok.rank_file))
    assert again.encode(REFERENCE["text"]) == REFERENCE["ids"]


def test_names_without_prefix_and_mask_buffers_import_the_same(tmp_path):
    hf = copy_fixture(tmp_path)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(hf / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    tensors["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
    tensors["lm_head.weight"] = tensors["wte.weight"]  # tied: the same matrix
    save_file(tensors, hf / "model.safetensors", {"format": "pt"})
    params, cfg, _ = hf_lib.load_hf_gpt2(str(hf))
    expected, expected_cfg, _ = hf_lib.load_hf_gpt2(FIXTURE)
    assert cfg == expected_cfg and same_tree(params, expected)


def test_export_then_import_round_trips(tmp_path):
    params, cfg, tok = hf_lib.load_hf_gpt2(FIXTURE)
    written = hf_lib.export_hf_gpt2(params, cfg, tok, str(tmp_path / "out"))
    assert written == GPT2_FILES
    os.mkdir(tmp_path / "made")  # written aside and renamed into place, it is made as any directory is, not private
    assert os.stat(tmp_path / "out").st_mode == os.stat(tmp_path / "made").st_mode
    (tmp_path / "made.txt").write_text("")  # and its files as any file is: the weights too (safetensors writes 0600)
    assert {os.stat(tmp_path / "out" / name).st_mode for name in written} == {os.stat(tmp_path / "made.txt").st_mode}
    os.remove(tmp_path / "made.txt")
    assert sorted(os.listdir(tmp_path)) == ["made", "out"]
    again, again_cfg, again_tok = hf_lib.load_hf_gpt2(str(tmp_path / "out"))
    assert again_cfg == cfg and same_tree(again, params)
    assert again_tok.encode(REFERENCE["text"]) == REFERENCE["ids"]
    for name in ("vocab.json", "merges.txt"):
        with open(tmp_path / "out" / name) as exported, open(os.path.join(FIXTURE, name)) as original:
            if name == "vocab.json":
                assert json.load(exported) == json.load(original)
            else:
                assert exported.read().split("\n") == original.read().split("\n")
    with open(tmp_path / "out" / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["activation_function"] == "gelu_new"
    assert (config["vocab_size"], config["n_inner"], config["eos_token_id"]) == (300, 64, 299)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be,  or not?"},
        {"role": "assistant", "content": "That is\nthe question."}, {"role": "user", "content": "Whether 'tis"}]  # fmt: skip


@pytest.mark.parametrize("template", [None, "chatml"])
def test_a_gpt2_export_chats_as_lm_does(tmp_path, template):
    """A GPT-2 export's tokenizer_config.json holds the chat template lm chats with and trains chat data with: an
    imported model's own (the export dropped it), or lm's DEFAULT_TEMPLATE (transformers refused to chat with the
    export), so that transformers' apply_chat_template gives lm's ids and lm reads the same template back."""
    transformers = pytest.importorskip("transformers")
    from lm.chat import DEFAULT_TEMPLATE, encode_chat, template_of

    source = copy_fixture(tmp_path)
    if template:  # ChatML over GPT-2's one special token
        template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")  # fmt: skip
        with open(source / "tokenizer_config.json", "w") as f:
            json.dump({"chat_template": template}, f)
    params, cfg, tok = hf_lib.load_hf_gpt2(str(source))
    assert template_of(tok) == (template or DEFAULT_TEMPLATE)  # (an import of GPT-2's layout dropped its template)
    written = hf_lib.export_hf_gpt2(params, cfg, tok, str(tmp_path / "out"))
    assert written == GPT2_FILES
    _, _, again = hf_lib.load_hf_gpt2(str(tmp_path / "out"))
    assert template_of(again) == (template or DEFAULT_TEMPLATE)
    assert again.spec == ("hf_bpe" if template else "gpt2_hf")  # (GPT-2's layout and lm's template: as it was)
    ids = encode_chat(tok, CHAT, add_generation_prompt=True)[0]
    assert encode_chat(again, CHAT, add_generation_prompt=True)[0] == ids
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    out = theirs.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    assert list(out["input_ids"] if hasattr(out, "keys") else out) == ids
    assert theirs(REFERENCE["text"])["input_ids"] == REFERENCE["ids"]  # (GPT2Tokenizer's defaults otherwise)


def fixture_with(tmp_path, files: dict) -> str:
    """tests/fixtures/tiny_gpt2 with `files` (name: JSON) written over or beside its own."""
    source = copy_fixture(tmp_path)
    for name, value in files.items():
        with open(source / name, "w") as f:
            json.dump(value, f)
    return str(source)


def exported_again(tmp_path, tok):
    """`tok` exported as GPT-2 with a model of enough rows, then read back: (lm's tokenizer, transformers')."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(vocab_size=320, max_seq_len=16, n_layer=1, n_head=4, n_embd=32)
    hf_lib.export_hf_gpt2(random_params(cfg), cfg, tok, str(tmp_path / "out"))
    return hf_lib.load_hf_gpt2(str(tmp_path / "out"))[2], transformers.AutoTokenizer.from_pretrained(tmp_path / "out")


def test_a_gpt2_export_tokenizer_knows_the_models_context(tmp_path):
    """A GPT-2 export's tokenizer_config.json holds the context as model_max_length, as the llama export's does: without
    it transformers took 1e30, so truncation=True kept texts longer than n_positions, and the model failed on them
    ("index out of range in self")."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(vocab_size=320, max_seq_len=16, n_layer=1, n_head=4, n_embd=32)
    hf_lib.export_hf_gpt2(random_params(cfg), cfg, get_tokenizer("bytes"), str(tmp_path / "out"))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert theirs.model_max_length == 16
    assert len(theirs("To be, or not to be: that is the question.", truncation=True)["input_ids"]) == 16


def test_gpt2_files_stop_tokens_are_generation_configs_and_exported(tmp_path):
    """generation_config.json's eos_token_id list is where sampling stops (README: "every eos_token_id of
    generation_config.json"), for vocab.json files too; lm sampled past them, and the export wrote none."""
    source = fixture_with(tmp_path, {"generation_config.json": {"bos_token_id": 299, "eos_token_id": [299, 90]}})
    tok = hf_lib.load_hf_gpt2(source)[2]
    assert (tok.eot, tok.stop_ids) == (299, (299, 90))
    again, _ = exported_again(tmp_path, tok)
    assert again.stop_ids == (299, 90)
    with open(tmp_path / "out" / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == [299, 90]


@pytest.mark.parametrize("where", ["added_tokens_decoder", "added_tokens.json"])
def test_gpt2_files_added_tokens_that_are_not_special_are_ordinary_vocabulary(tmp_path, where):
    """An added token marked special false (added_tokens_decoder), or listed in added_tokens.json (read only
    without added_tokens_decoder, as transformers reads it) and not named special, is what transformers encodes
    text holding it to; lm made them special tokens that text never produces (other ids), and its export then
    named them special. A special one stays special (text never produces it)."""
    plain = lambda text: {"content": text, "special": False, "lstrip": False, "rstrip": False, "single_word": False}
    if where == "added_tokens_decoder":
        decoder = {"300": plain("<think>"), "301": plain("<tool>"), "302": {"content": "<|sys|>", "special": True}}
        files = {"tokenizer_config.json": {"added_tokens_decoder": decoder}, "added_tokens.json": {"<unread>": 303}}
    else:
        files = {"added_tokens.json": {"<think>": 300, "<tool>": 301, "<|sys|>": 302},
                 "special_tokens_map.json": {"additional_special_tokens": ["<|sys|>"]}}  # fmt: skip
    source = fixture_with(tmp_path, files)
    from lm.hf.tokenizer import load_hf_tokenizer

    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    tok = load_hf_tokenizer(source, {})
    texts = ["a<think>b", " <think>\nhi<tool>x", "<think><tool><think>", "plain text", "no <|sys|> here"]
    for text in texts:
        assert tok.encode(text) == theirs.encode(text) or "<|sys|>" in text, text
    assert 302 not in tok.encode("no <|sys|> here") and 302 in tok.special_tokens.values()
    assert tok.decode(tok.encode("a<think>b<tool>")) == "a<think>b<tool>"
    again, exported = exported_again(tmp_path, tok)
    for text in texts:
        assert again.encode(text) == tok.encode(text), text
        assert exported.encode(text) == tok.encode(text) or "<|sys|>" in text, text
    assert again.special_tokens == tok.special_tokens and again.hf["plain_added"] == {"<think>": 300, "<tool>": 301}
    assert "<unread>" not in tok.special_tokens and tok.n_vocab == 303


@pytest.mark.parametrize("pad", ["<|endoftext|>", "!"])
def test_gpt2_files_pad_token_is_kept_and_exported(tmp_path, pad):
    """The pad token GPT-2 files name (end-of-text, or an ordinary token such as "!") is kept, and exported so that
    transformers can pad a batch with the export; lm dropped it, and refused an ordinary one ("the vocabulary
    lacks 1 of the 256 single-byte tokens")."""
    source = fixture_with(tmp_path, {"tokenizer_config.json": {"pad_token": pad}})
    tok = hf_lib.load_hf_gpt2(source)[2]
    pad_id = 299 if pad == "<|endoftext|>" else 0
    assert tok.pad == pad_id and tok.encode("!") == [0]  # (an ordinary token stays one)
    assert tok.encode(REFERENCE["text"]) == REFERENCE["ids"]
    again, exported = exported_again(tmp_path, tok)
    assert again.pad == pad_id and exported.pad_token_id == pad_id
    batch = exported(["To be", "To be, or not"], padding=True)["input_ids"]
    assert batch[0][-1] == pad_id and len(batch[0]) == len(batch[1])


@functools.cache
def random_params(cfg: ModelConfig):
    """Weights at a scale that makes every part of the model matter."""
    rng = np.random.default_rng(0)
    shapes = nn.unbox(jax.eval_shape(functools.partial(M.init_params, cfg), jax.random.key(0)))
    draw = lambda path, x: np.float32(path[-1].key == "scale") + rng.normal(0, 0.3, x.shape).astype(np.float32)
    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.mark.parametrize(
    "options",
    [
        {"scan_layers": True, "mlp": "relu"},  # stacked layers
        {"fused_qkv": False, "tie_embeddings": False, "mlp_hidden": 48},  # separate q/k/v, an untied head
    ],
)
def test_other_gpt2_compatible_layouts_export(tmp_path, options):
    """A padded vocabulary exports its tokenizer's rows only; the logits of those ids are unchanged."""
    cfg = ModelConfig(vocab_size=320, max_seq_len=16, n_layer=2, n_head=4, n_embd=32, **options)
    params, tok = random_params(cfg), get_tokenizer("bytes")
    hf_lib.export_hf_gpt2(params, cfg, tok, str(tmp_path / "out"))
    again, again_cfg, again_tok = hf_lib.load_hf_gpt2(str(tmp_path / "out"))
    assert (again_cfg.vocab_size, again_cfg.tie_embeddings, again_cfg.mlp) == (257, cfg.tie_embeddings, cfg.mlp)
    ids = tok.encode("To be, or not")
    np.testing.assert_allclose(logits(again, again_cfg, ids), logits(params, cfg, ids)[:, :257], atol=1e-5)
    assert again_tok.encode("héllo\n  wörld") == tok.encode("héllo\n  wörld")


def test_export_refuses_what_gpt2_cannot_express(tmp_path):
    cfg = ModelConfig(vocab_size=320, max_seq_len=16, n_layer=1, n_head=4, n_kv_head=2, n_embd=32, pos="rope",
                      mlp="swiglu", norm="rmsnorm", bias=False)  # fmt: skip
    with pytest.raises(UserError) as e:
        hf_lib.export_hf_gpt2(random_params(cfg), cfg, get_tokenizer("bytes"), str(tmp_path / "out"))
    assert str(e.value).startswith(
        "GPT-2 cannot express this model (pos=rope, mlp=swiglu, norm=rmsnorm, bias=false, n_kv_head=2); "
    )
    assert not os.path.exists(tmp_path / "out")


def test_tokenizers_gpt2_files_cannot_express_are_written_as_tokenizer_json(tmp_path, capsys):
    """A bpe:N tokenizer (GPT-4's split, which vocab.json and merges.txt cannot say) was left out of a GPT-2 export,
    the default preset's among them: neither transformers nor sample.py hf:OUT could read the export's text."""
    with open(os.path.join(ROOT, "lm", "assets", "tinyshakespeare.txt")) as f:
        tok = train_bpe([f.read(20_000)], 300, str(tmp_path / "bpe.tiktoken"))
    cfg = ModelConfig(vocab_size=320, max_seq_len=16, n_layer=1, n_head=4, n_embd=32)
    params = random_params(cfg)
    written = hf_lib.export_hf_gpt2(params, cfg, tok, str(tmp_path / "out"))
    assert written == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json"]  # fmt: skip
    assert "note:" not in capsys.readouterr().err
    again, again_cfg, again_tok = hf_lib.load(str(tmp_path / "out"))
    texts = ["ROMEO: what light", "Hello\n\nWorld 12345", "  \u00e9t\u00e9 \u4e2d\u6587!!\n"]
    assert [again_tok.encode(t) for t in texts] == [tok.encode(t) for t in texts] and again_tok.eot == tok.eot
    ids = tok.encode(texts[0])
    np.testing.assert_allclose(logits(again, again_cfg, ids), logits(params, cfg, ids)[:, : tok.n_vocab], atol=1e-5)
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert [theirs(t, add_special_tokens=False)["input_ids"] for t in texts] == [tok.encode(t) for t in texts]


def test_merges_from_ranks():
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"ab": 256, b"bc": 257, b"abc": 258, b"abcd": 259})
    # BPE with the lower ranks leaves "ab" "c" of b"abc", and "abc" "d" of b"abcd".
    assert hf_lib.merges_from_ranks(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"abc", b"d")]
    # BPE leaves "a" "bc" "d" of b"abcd", which "ab" + "cd" make all the same.
    unreachable = {bytes([b]): b for b in range(256)} | {b"bc": 256, b"ab": 257, b"cd": 258, b"abcd": 259}
    assert hf_lib.merges_from_ranks(unreachable)[-1] == (b"ab", b"cd")
    # No two tokens ranked below b"xbcd" make it: these ranks are no BPE.
    assert hf_lib.merges_from_ranks({**ranks, b"xbcd": 260, b"xb": 261}) is None


def test_byte_spelling_is_gpt2s():
    spelled = hf_lib.byte_to_char()
    assert (spelled[ord("A")], spelled[ord(" ")], spelled[ord("\n")], spelled[0xAD]) == ("A", "Ġ", "Ċ", "Ń")
    assert len(set(spelled.values())) == 256
    assert hf_lib.unspell(hf_lib.spell(bytes(range(256)))) == bytes(range(256))


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def edit_config(hf, **changes):
    with open(hf / "config.json") as f:
        config = json.load(f)
    write_json(hf / "config.json", {**config, **changes})


def edit_vocab(hf, edit):
    with open(hf / "vocab.json") as f:
        vocab = json.load(f)
    edit(vocab)
    write_json(hf / "vocab.json", vocab)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda hf: edit_config(hf, model_type="bert"), "describes a 'bert' model; lm imports model_type gpt2, llama, mistral, qwen2, qwen3"),
        (lambda hf: edit_config(hf, model_type=None), "config.json has no model_type; lm imports model_type gpt2, llama, mistral, qwen2, qwen3"),
        (
            lambda hf: edit_config(hf, activation_function="gelu", scale_attn_by_inverse_layer_idx=True),
            "uses what lm's model does not have: activation_function=gelu, scale_attn_by_inverse_layer_idx=true",
        ),
        (lambda hf: edit_config(hf, n_inner=80), "c_fc.weight has shape [32, 64], config.json implies [32, 80]"),
        (lambda hf: os.remove(hf / "model.safetensors"), "has no model.safetensors"),
        (lambda hf: os.remove(hf / "merges.txt"), "has no merges.txt; lm needs the model's tokenizer files"),
        # (a bpe:N run exported before 2026-12-04: the weights and config alone, which the line said to complete
        # with GPT-2's files)
        (
            lambda hf: (os.remove(hf / "vocab.json"), os.remove(hf / "merges.txt")),
            "has no vocab.json; lm needs the model's tokenizer files: tokenizer.json, or GPT-2's vocab.json and "
            "merges.txt (lm.export left a bpe:N tokenizer's out before 2026-12-04: export its run again)",
        ),
        (
            lambda hf: (edit_config(hf, eos_token_id=0), edit_vocab(hf, lambda vocab: vocab.pop("<|endoftext|>"))),
            "the end-of-text token '<|endoftext|>' is not in vocab.json, and config.json's eos_token_id (0) is not "
            "the id after the last one (299)",
        ),
        (lambda hf: edit_config(hf, n_head=5), "uses what lm's model does not have: n_embd=32 not divisible by n_head=5"),
        (lambda hf: edit_config(hf, n_layer=None), "lacks positive integers for n_layer"),
        # (tracebacks: str + a tracer in the LayerNorm, an unhashable list looked up)
        (lambda hf: edit_config(hf, layer_norm_epsilon="1e-5"), "layer_norm_epsilon='1e-5' (not a positive number)"),
        (lambda hf: edit_config(hf, activation_function=["relu"]), "does not have: activation_function=['relu']"),
        (
            lambda hf: (hf / "merges.txt").write_text("#version: 0.2\nh e\nĠ t\n"),
            "merges.txt:3: merge 'Ġ t' has a lower id than an earlier merge",
        ),
        (lambda hf: (hf / "merges.txt").write_text("#version: 0.2\nĠ t\nz q\n"), "merges.txt:3: merge 'z q' makes no"),
    ],
)
def test_malformed_directories_are_refused(tmp_path, damage, message):
    hf = copy_fixture(tmp_path)
    damage(hf)
    with pytest.raises(UserError, match=re.escape(message)):
        hf_lib.load(str(hf))


# --- the command line -----------------------------------------------------------------------------------------


def run_export(*args, cwd):
    env = dict(os.environ)
    command = [sys.executable, "-m", "lm.export", *args]
    return subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run of configs/tiny.yaml (learned positions, gelu, LayerNorm, tied: GPT-2's shape) trained 3 steps."""
    root = tmp_path_factory.mktemp("trained")
    overrides = ["train.steps=3", "run.dir=runs/tiny", "data.cache_dir=data"]
    overrides += ["logging.progress=false", "logging.tensorboard=false"]
    done = run_cli("train.py", os.path.join(ROOT, "configs", "tiny.yaml"), *overrides, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    return root


def test_cli_exports_a_trained_run(trained_run):
    from lm.sampling import load

    done = run_export("runs/tiny", "hf", "--step", "3", cwd=trained_run)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "wrote hf: " + ", ".join(GPT2_FILES)
    # the step exported is named, as sample.py and lm.serve name theirs (--best's or the newest: it said none)
    assert f"exporting {trained_run / 'runs' / 'tiny' / 'checkpoints' / '3'}\n" in done.stderr, done.stderr
    params, cfg, tok = load(str(trained_run / "runs" / "tiny"))
    again, again_cfg, again_tok = hf_lib.load_hf_gpt2(str(trained_run / "hf"))
    assert (cfg.vocab_size, again_cfg.vocab_size) == (320, tok.n_vocab)
    ids = tok.encode("ROMEO: what")
    assert again_tok.encode("ROMEO: what") == ids
    np.testing.assert_allclose(logits(again, again_cfg, ids), logits(params, cfg, ids)[:, : tok.n_vocab], atol=1e-5)


def test_cli_errors_are_one_line(trained_run):
    assert_user_error(run_export("runs/missing", "hf", cwd=trained_run), "does not exist")
    assert_user_error(run_export("runs/tiny", "hf", "--step", "7", cwd=trained_run), "no checkpoint for step 7")
    assert_user_error(run_export("runs/tiny", cwd=trained_run), "the following arguments are required: out_dir")


def test_an_export_directory_may_have_the_longest_name_a_filesystem_takes(tmp_path):
    from lm.hf.files import new_directory

    out = tmp_path / ("é" * 127)  # 254 bytes: its staging directory's name (".NAME.partial-XXXX") is cut to fit
    with new_directory(str(out)) as staging:
        with open(os.path.join(staging, "config.json"), "w") as f:
            f.write("{}")
    assert sorted(os.listdir(tmp_path)) == [out.name] and os.listdir(out) == ["config.json"]


def test_a_link_to_no_directory_is_refused_as_such(tmp_path):
    """An out_dir that is a link to a directory not made yet (a volume not mounted, a typo in its target) was
    refused as "cannot write LINK: Not a directory; free space (or give another directory)", which blamed the disk."""
    from lm.hf.files import new_directory

    os.symlink(tmp_path / "missing", tmp_path / "link")
    with pytest.raises(UserError, match=r"link is a link to .*missing, which does not exist; make that directory"):
        with new_directory(str(tmp_path / "link")):
            pass
    assert os.path.islink(tmp_path / "link") and sorted(os.listdir(tmp_path)) == ["link"]


def test_an_export_that_cannot_be_renamed_into_place_blames_the_disk_only_when_it_is_full(tmp_path, monkeypatch):
    """Every failed write said "free space (or give another directory)": of a permission denied too."""
    import errno

    from lm.hf.files import new_directory

    for error, fix in ((PermissionError(errno.EACCES, "Permission denied"), "; give another directory, then"),
                       (OSError(errno.ENOSPC, "No space left on device"), "; free space (or give another directory)")):
        monkeypatch.setattr(os, "replace", lambda *a, error=error: (_ for _ in ()).throw(error))
        with pytest.raises(UserError, match=rf"^cannot write .*out: {error.strerror}{re.escape(fix)}"):
            with new_directory(str(tmp_path / "out")):
                pass
        assert not os.path.exists(tmp_path / "out")


def test_an_empty_directory_that_is_there_already_is_written_into(tmp_path, monkeypatch):
    """The export was renamed over an empty out_dir: that failed for "." and for a volume mounted into a container
    ("Device or resource busy; free space (or give another directory)") and for a link to an empty directory ("Not
    a directory"), and replaced the directory's own mode and group. An out_dir of '' blamed the disk."""
    params, cfg, tok = hf_lib.load_hf_gpt2(FIXTURE)
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    hf_lib.export(params, cfg, tok, str(tmp_path / "link"))
    assert os.path.islink(tmp_path / "link") and sorted(os.listdir(tmp_path / "target")) == sorted(GPT2_FILES)
    here = tmp_path / "here"
    here.mkdir()
    os.chmod(here, 0o2770)
    (here / ".lm-export.partial-x1y2").mkdir()  # (an export killed there: no content)
    monkeypatch.chdir(here)
    assert hf_lib.export(params, cfg, tok, ".") == GPT2_FILES
    assert sorted(os.listdir(here)) == sorted(GPT2_FILES) and os.stat(here).st_mode & 0o7777 == 0o2770
    assert hf_lib.load_hf_gpt2(str(here))[1] == cfg
    with pytest.raises(UserError, match="already exists and is not empty"):
        hf_lib.export(params, cfg, tok, ".")
    with pytest.raises(UserError, match=r"^the directory to export into is empty ''; give the path of a new directory$"):
        hf_lib.export(params, cfg, tok, "")


@pytest.mark.parametrize("choice", [["--step", "3"], ["--best"]])
def test_cli_refuses_a_step_of_a_hugging_face_directory(tmp_path, choice):
    """--step and --best choose among a run's checkpoints: with hf:DIR, lm.export ignored them and exported the model
    (sample.py, lm.eval and lm.serve refuse them in one line)."""
    done = run_export(f"hf:{FIXTURE}", "out", *choice, cwd=tmp_path)
    assert_user_error(done, f"a step or the best checkpoint is chosen among a run's checkpoints, not in hf:{FIXTURE}")
    assert not os.path.exists(tmp_path / "out")


def test_what_a_killed_export_left_beside_its_directory_goes_with_the_next_export(tmp_path):
    """An export killed by SIGTERM or SIGKILL (no `finally` runs) left its staging directory, `.NAME.partial-XXXX`
    holding a model.safetensors as large as the model, hidden beside the directory to export into: the same
    command run again wrote the export but kept that for good. An empty out_dir's own leftovers went already."""
    from lm.hf.files import new_directory

    left = tmp_path / ".out.partial-x1y2"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\\0" * 64)
    (tmp_path / ".other.partial-x1y2").mkdir()  # (another name's: not this export's)
    with new_directory(str(tmp_path / "out")) as staging:
        with open(os.path.join(staging, "config.json"), "w") as f:
            f.write("{}")
    assert sorted(os.listdir(tmp_path)) == [".other.partial-x1y2", "out"]
    assert os.listdir(tmp_path / "out") == ["config.json"]


def test_an_export_running_beside_keeps_its_staging_directory(tmp_path):
    """A second export to the same path (or to a name cut_name cuts to the same) removed the first's staging
    directory while it wrote, as a killed export's: the first failed, or published a model missing what it had
    written before. The running one's stays; the later of the two is refused as before (the directory is there)."""
    from lm.hf.files import new_directory

    with pytest.raises(UserError, match="cannot write"):
        with new_directory(str(tmp_path / "out")) as first:
            with open(os.path.join(first, "model.safetensors"), "w") as f:
                f.write("weights")
            with new_directory(str(tmp_path / "out")) as second:
                assert os.path.isfile(os.path.join(first, "model.safetensors"))
                with open(os.path.join(second, "config.json"), "w") as f:
                    f.write("{}")
    assert os.listdir(tmp_path) == ["out"]


def test_export_into_the_hf_directory_it_reads_spelled_with_a_tilde(tmp_path, monkeypatch):
    """hf:~/models/x is read from the home directory (no shell expands a ~ after hf:); the check that refuses an
    export into the directory it exports compared the unexpanded path, and told to remove that directory first."""
    from lm.export import _check_outside

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(FIXTURE, tmp_path / "model")
    for out in (tmp_path / "model", tmp_path):
        with pytest.raises(UserError, match="holds the checkpoint being exported"):
            _check_outside("hf:~/model", str(out))
    _check_outside("hf:~/model", str(tmp_path / "exported"))


def test_an_export_of_a_chat_fine_tune_stops_generate_at_the_chat_templates_turn_end(tmp_path, data_cache):
    """A base model whose template ends a reply with a token that is none of its stops (Qwen2.5's <|im_end|>, whose
    stop is <|endoftext|>): a chat fine-tune of it exports that token among eos_token_id too, where sample.py --chat
    stops (it named the stops alone, so transformers' generate ran past every reply). The base's own export keeps its
    stops, so that importing it again gives the same tokenizer."""
    from lm.export import main as export_main

    source = shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "open_models", "llama"), tmp_path / "base")
    with open(source / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    tok = hf_lib.load(str(source))[2]
    assert tok.stop_ids == (1,) and tok.decode([3]) == "<|im_end|>"
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    chats.write_text((json.dumps(chat) + "\n") * 8)
    run = tmp_path / "run"
    args = [f"init_from=hf:{source}", f"data.path={chats}", "data.format=chat", f"data.cache_dir={data_cache}",
            f"run.dir={run}", "logging.progress=false", "data.block_size=32", "data.batch_size=2", "train.steps=1",
            "train.eval_every=0"]  # fmt: skip
    train(config_lib.load(None, args))
    for given, out, stops in ((str(run), "chat", [1, 3]), (f"hf:{source}", "plain", [1])):
        assert export_main([given, str(tmp_path / out)]) == 0
        with open(tmp_path / out / "generation_config.json") as f:
            assert json.load(f)["eos_token_id"] == stops
        assert hf_lib.load(str(tmp_path / out))[2].stop_ids == tuple(stops)


@pytest.mark.parametrize("command", ["export", "sample", "eval"])
def test_a_ctrl_c_during_the_checkpoints_read_is_interrupted_not_a_damaged_checkpoint(tmp_path, monkeypatch, capsys,
                                                                                        command):
    """A Ctrl-C while orbax reads the weights, which its reads report as a read error: `interrupted` and 130, as at
    any other moment (lm.export, sample.py and lm.eval said the checkpoint was damaged and to move it away)."""
    import signal

    from lm.errors import UserError as Damaged  # (what lm.checkpoint makes of the read error)
    from lm.eval import __main__ as eval_cli
    from lm.export import main as export_main
    from lm.sampling import cli as sample_cli

    def interrupted_read(*args, **kwargs):
        try:
            signal.raise_signal(signal.SIGINT)
        except BaseException as e:  # as orbax's reads do: the KeyboardInterrupt comes out as another error
            raise Damaged(f"checkpoint is damaged (its params cannot be read: {e!r}); move this one away") from None

    source = f"hf:{copy_fixture(tmp_path)}"
    main, args = {
        "export": (export_main, [source, str(tmp_path / "out")]),
        "sample": (sample_cli.main, [source, "--prompt", "hi", "--max-new-tokens", "2"]),
        "eval": (eval_cli.main, [source, "--text", os.path.join(FIXTURE, "config.json")]),
    }[command]
    monkeypatch.setattr({"export": "lm.export.load", "sample": "lm.sampling.cli.load", "eval": "lm.eval.__main__.load"}[
        command], interrupted_read)
    assert main(args) == 130
    said = "interrupted; no results were written\n" if command == "eval" else "interrupted\n"
    assert capsys.readouterr().err.endswith(said)
    assert not os.path.exists(tmp_path / "out")
