import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT, script
from helpers import TWO_PROGRAMS_RTOL, assert_same_losses, assert_same_params, assert_user_error, losses, params, run_cli
from helpers import run_main

from lm import config as config_lib
from lm import lora
from lm import plot as plot_lib
from lm.config import ModelConfig, OptimConfig
from lm.errors import UserError
from lm.model import Transformer, init_params
from lm.optim import decay_mask, make_optimizer, schedule
from lm.steps import TrainState, make_train_step, token_losses
from lm.train import main as train_main
from lm.train import train

TINY = os.path.join(config_lib.CONFIG_DIR, "tiny.yaml")


def tiny_cfg(tiny_args, *overrides):
    return config_lib.load(TINY, [*tiny_args, *overrides])


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_loss_falls_and_metrics_are_logged(tiny_args):
    cfg = tiny_cfg(tiny_args, "train.steps=30", "train.eval_every=15", "train.log_every=5")
    run_dir = train(cfg)
    records = read_metrics(run_dir)
    train_rows = [r for r in records if "loss" in r]
    eval_rows = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
    for r in train_rows[1:]:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "step_time"} <= set(r)
    assert "compile_time" in train_rows[0]
    assert [r["step"] for r in eval_rows] == [15, 30]
    for r in eval_rows:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-6)
        assert 0 < r["val_bpb"] < r["val_loss"] / math.log(2) * 1.01  # bytes tokenizer: ~1 token per byte
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5
    assert eval_rows[-1]["val_loss"] < math.log(257)
    saved = config_lib.load(os.path.join(run_dir, "config.yaml"))
    assert saved.run.dir == run_dir and saved.model.vocab_size == 320 and saved.model.max_seq_len == 32
    assert os.path.isdir(os.path.join(run_dir, "tensorboard"))


def test_open_model_options_train_from_scratch(tiny_args):
    """The options open models need (Qwen3's attention, Llama 3.1's RoPE scaling) are ordinary options."""
    options = [
        "model.pos=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.n_kv_head=1", "model.head_dim=24",
        "model.qk_norm=true", "model.bias=false", "model.qkv_bias=true", "model.rope_scaling=llama3",
        "model.rope_factor=8", "model.rope_original_max_len=16",
    ]
    run_dir = train(tiny_cfg(tiny_args, "train.steps=30", "train.eval_every=0", "train.log_every=10", *options))
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    saved = config_lib.load(os.path.join(run_dir, "config.yaml")).model
    assert (saved.head_dim, saved.qk_norm, saved.qkv_bias, saved.rope_scaling) == (24, True, True, "llama3")


def _batch(rng, batch, seq, vocab):
    tokens = jax.random.randint(rng, (batch, seq + 1), 0, vocab)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _state(cfg, tx):
    params = nn.unbox(init_params(cfg.model, jax.random.PRNGKey(0)))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(1))


def _one_step_and_four_micro_batches(n_layer, batch, tx=None):
    """((params, metrics) of one train step of the batch whole, then in 4 micro-batches; the config)."""
    base = config_lib.replace(
        config_lib.Config(),
        model={"n_layer": n_layer, "n_head": 2, "n_embd": 32, "vocab_size": 64, "max_seq_len": 16},
        data={"block_size": 16, "batch_size": 8},
    )
    results = []
    for accum in (1, 4):
        cfg = config_lib.replace(base, train={"grad_accum": accum})
        step_tx = tx or make_optimizer(cfg.optim, cfg.train.steps)
        state, metrics = jax.jit(make_train_step(cfg, step_tx))(_state(cfg, step_tx), batch)
        results.append((state.params, metrics))
    return results, base


def test_gradient_accumulation_matches_one_big_batch():
    (p1, m1), (p4, m4) = _one_step_and_four_micro_batches(2, _batch(jax.random.PRNGKey(2), 8, 16, 64))[0]
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_weighs_micro_batches_by_their_learned_tokens():
    # The loss is the mean over the step's learned tokens, not a mean of the micro-batches' means: micro-batches
    # with 16, 1, 0 and 8 learned tokens a row give the update and the loss of one batch of them all.
    batch = _batch(jax.random.PRNGKey(2), 8, 16, 64)
    mask = np.zeros((8, 16), np.float32)
    mask[0::4] = 1.0  # micro-batch 0 (rows a, a+accum, ...) learns every token
    mask[1::4, -1] = 1.0  # micro-batch 1: one token a row
    mask[3::4, 8:] = 1.0  # micro-batch 2 learns nothing, micro-batch 3 half its tokens
    batch["loss_mask"] = jnp.asarray(mask)
    tx = optax.sgd(1.0)
    ((p1, m1), (p4, m4)), base = _one_step_and_four_micro_batches(1, batch, tx)
    logits = Transformer(base.model, deterministic=True).apply(_state(base, tx).params, batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    expected = float((ce * mask).sum() / mask.sum())
    assert float(m1["loss"]) == pytest.approx(expected, rel=1e-5)
    assert float(m4["loss"]) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_of_bfloat16_weights_sums_in_float32():
    # With bfloat16 weights the micro-batches' gradients are summed in float32 and rounded once: a bfloat16 sum,
    # rounded at every micro-batch, was 4x further from the exact gradient at 32 micro-batches than one batch's.
    # grad_norm is a float32 norm (it was bfloat16's, 3 digits).
    cfg = config_lib.replace(
        config_lib.Config(),
        model={"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 64, "max_seq_len": 16, "param_dtype": "bfloat16"},
        data={"block_size": 16, "batch_size": 32},
    )
    seen = optax.GradientTransformation(  # the gradients it is given, as its state; no update
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda u, s, p=None: (jax.tree.map(jnp.zeros_like, u), u)
    )
    batch = _batch(jax.random.PRNGKey(2), 32, 16, 64)
    state = _state(cfg, seen)
    wide = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # the same weights, as float32
    cfg32 = config_lib.replace(cfg, model={"param_dtype": "float32"})
    as_float32 = state.replace(params=wide(state.params), opt_state=wide(state.opt_state))
    exact, _ = jax.jit(make_train_step(cfg32, seen))(as_float32, batch)
    errors = []
    for accum in (1, 32):
        step = jax.jit(make_train_step(config_lib.replace(cfg, train={"grad_accum": accum}), seen))
        new, metrics = step(state, batch)
        assert metrics["grad_norm"].dtype == jnp.float32
        errors.append(max(
            float(jnp.linalg.norm(g.astype(jnp.float32) - e) / jnp.linalg.norm(e))
            for g, e in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(exact.opt_state))
        ))  # fmt: skip
    assert errors[1] < 1.5 * errors[0], errors


def test_loss_mask_excludes_tokens_from_the_loss():
    cfg = config_lib.replace(
        config_lib.Config(),
        model={"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 32, "max_seq_len": 8},
        data={"block_size": 8, "batch_size": 2},
    )
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    step = jax.jit(make_train_step(cfg, tx))
    batch = _batch(jax.random.PRNGKey(3), 2, 8, 32)
    mask = jnp.zeros((2, 8)).at[:, 4:].set(1.0)
    other_targets = batch["targets"].at[:, :4].set((batch["targets"][:, :4] + 7) % 32)
    _, m_a = step(_state(cfg, tx), {**batch, "loss_mask": mask})
    _, m_b = step(_state(cfg, tx), {**batch, "targets": other_targets, "loss_mask": mask})
    _, m_full = step(_state(cfg, tx), batch)
    assert float(m_a["loss"]) == pytest.approx(float(m_b["loss"]), rel=1e-6)
    assert float(m_a["loss"]) != pytest.approx(float(m_full["loss"]), rel=1e-3)


def test_token_losses_label_smoothing_and_z_loss():
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 11)) * 3
    targets = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 11)
    obj, ce = token_losses(logits, targets)
    np.testing.assert_allclose(ce, optax.softmax_cross_entropy_with_integer_labels(logits, targets), rtol=1e-5)
    np.testing.assert_allclose(obj, ce)
    smoothed, ce2 = token_losses(logits, targets, label_smoothing=0.1)
    labels = optax.smooth_labels(jax.nn.one_hot(targets, 11), 0.1)
    np.testing.assert_allclose(smoothed, optax.softmax_cross_entropy(logits, labels), rtol=1e-5)
    np.testing.assert_allclose(ce2, ce)
    z, _ = token_losses(logits, targets, z_loss=1e-2)
    np.testing.assert_allclose(z, ce + 1e-2 * jax.nn.logsumexp(logits, -1) ** 2, rtol=1e-5)


def test_label_smoothing_spreads_mass_over_the_tokenizers_ids_only():
    # 11 vocabulary rows, of which the tokenizer uses 7: the 4 padded rows are never targets and get no mass, and
    # are left out of the softmax (the model's distribution over tokens, as it samples and exports).
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 11)) * 3
    targets = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 7)
    smoothed, ce = token_losses(logits, targets, label_smoothing=0.1, n_vocab=7)
    labels = optax.smooth_labels(jax.nn.one_hot(targets, 7), 0.1)
    np.testing.assert_allclose(smoothed, optax.softmax_cross_entropy(logits[..., :7], labels), rtol=1e-5)
    np.testing.assert_allclose(ce, optax.softmax_cross_entropy_with_integer_labels(logits[..., :7], targets), rtol=1e-5)
    unpadded, _ = token_losses(logits, targets, label_smoothing=0.1)
    assert not np.allclose(smoothed, unpadded)


def test_resolve_decides_the_runs_config_without_jax(tmp_path, monkeypatch):
    from lm.tokenizer import get_tokenizer
    from lm.train import resolve

    monkeypatch.chdir(tmp_path)
    tok = get_tokenizer("bytes")
    trained = ModelConfig(vocab_size=320, vocab_multiple=1, max_seq_len=64, n_layer=12, n_head=2, n_embd=32)
    cfg = config_lib.load(None, ["init_from=hf:models/gpt2", "data.block_size=32", "run.name=x", "model.dropout=0.1"])
    # hf:DIR is made absolute, so a LoRA run's reference to its base holds from any directory.
    out = resolve(cfg, tok, chosen={"init_from", "data.block_size", "run.name", "model.dropout"}, trained=trained)
    assert out.init_from == f"hf:{tmp_path}/models/gpt2" and out.run.dir == os.path.join("runs", "x")
    assert (out.model.n_layer, out.model.vocab_size, out.model.dropout) == (12, 320, 0.1)
    # An explicit value equal to the default is still the user's choice, and contradicts 12-layer weights.
    explicit = config_lib.load(None, ["init_from=hf:models/gpt2", "model.n_layer=4", "data.block_size=32"])
    with pytest.raises(UserError, match=r"model.n_layer=4 \(the weights have 12\)"):
        resolve(explicit, tok, chosen={"init_from", "model.n_layer"}, trained=trained)
    # A value the user did not choose (the default preset's) comes from the weights.
    assert resolve(explicit, tok, chosen={"init_from"}, trained=trained).model.n_layer == 12
    examples = config_lib.load(None, ["data.format=examples", "data.path=ft.jsonl", "data.epochs=2"])
    epochs = resolve(examples, tok, chosen=set(), epoch_steps=37)
    assert epochs.train.steps == 37 and epochs.model.vocab_size == 320  # 257 ids padded to a multiple of 64


def test_weight_decay_only_on_matrices():
    for scan in (False, True):
        cfg = ModelConfig(vocab_size=64, max_seq_len=8, n_layer=2, n_head=2, n_embd=16, scan_layers=scan)
        params = nn.unbox(init_params(cfg, jax.random.PRNGKey(0)))
        flat = {
            "/".join(k.key for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(decay_mask(params, decay_embeddings=False))[0]
        }
        for name, decays in flat.items():
            assert decays == name.endswith("kernel"), name
        assert any(flat.values()) and not all(flat.values())
        with_emb = decay_mask(params, decay_embeddings=True)
        assert with_emb["params"]["wte"]["embedding"] and with_emb["params"]["wpe"]["embedding"]


def test_weight_decay_shrinks_only_decayed_params():
    cfg = config_lib.replace(
        config_lib.Config(),
        model={"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 32, "max_seq_len": 8},
        optim={"weight_decay": 0.5, "warmup_steps": 0, "grad_clip": 0.0},
    )
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    params = nn.unbox(init_params(cfg.model, jax.random.PRNGKey(0)))
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    # With zero gradients, the Adam part is zero: only decoupled decay moves parameters.
    kernel = params["params"]["h_0"]["mlp"]["fc"]["kernel"]
    np.testing.assert_allclose(updates["params"]["h_0"]["mlp"]["fc"]["kernel"], -cfg.optim.lr * 0.5 * kernel, rtol=1e-5)
    assert not np.any(updates["params"]["h_0"]["ln1"]["scale"])
    assert not np.any(updates["params"]["wte"]["embedding"])


def test_weight_decay_shrinks_lora_adapters_as_the_matrices_they_are():
    """A LoRA run trains only its adapters: AdamW's optim.weight_decay did nothing there (the mask knew kernels
    only), while Muon's decayed them."""
    cfg = config_lib.replace(config_lib.Config(), optim={"weight_decay": 0.5, "warmup_steps": 0, "grad_clip": 0.0})
    base = nn.unbox(init_params(ModelConfig(vocab_size=32, max_seq_len=8, n_layer=1, n_head=2, n_embd=16), jax.random.key(0)))
    adapters = lora.init_adapters(base, 4, ("qkv",), jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 1.0, adapters)  # B is zero at the start
    assert all(jax.tree.leaves(decay_mask(adapters, decay_embeddings=False)))
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, adapters), tx.init(adapters), adapters)
    for update, adapter in zip(jax.tree.leaves(updates), jax.tree.leaves(adapters)):
        np.testing.assert_allclose(update, -cfg.optim.lr * 0.5 * adapter, rtol=1e-5)


def test_schedule_values():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    s = schedule(cfg, 100)
    # The first update already moves the parameters: lr/warmup, not 0; the warmup's last update reaches lr.
    assert float(s(0)) == pytest.approx(1e-4)
    assert float(s(4)) == pytest.approx(5e-4)
    assert float(s(9)) == pytest.approx(1e-3)
    assert float(s(10)) == pytest.approx(1e-3)
    assert float(s(55)) == pytest.approx(5.5e-4, rel=1e-5)  # cosine half way
    assert float(s(100)) == pytest.approx(1e-4)
    lin = schedule(OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay="linear"), 100)
    assert float(lin(55)) == pytest.approx(5.5e-4, rel=1e-5) and float(lin(100)) == pytest.approx(1e-4)
    const = schedule(OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay="constant"), 100)
    assert float(const(100)) == pytest.approx(1e-3)


def test_a_run_no_longer_than_its_warmup_is_warned(tiny_args, tmp_path, capsys):
    """configs/default.yaml's 100 warmup steps in `train.py train.steps=50` trained at half the peak learning rate
    at most and never decayed, without a word."""
    train(tiny_cfg(tiny_args, "train.steps=4", "train.log_every=1"))  # (tiny's warmup: 5 steps)
    assert ("warning: optim.warmup_steps=5 is not below train.steps=4: the whole run warms up, its last step at 80% of "
            "optim.lr=0.003, and it never decays; lower optim.warmup_steps") in capsys.readouterr().err
    lrs = [r["lr"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "lr" in r]
    assert lrs[-1] == pytest.approx(0.8 * 3e-3)  # (what the warning says the last step takes)
    train(tiny_cfg(tiny_args, "train.steps=6"))  # (a resume: said when the run started)
    train(tiny_cfg(tiny_args, "train.steps=6", f"run.dir={tmp_path / 'longer'}"))
    assert "warmup_steps" not in capsys.readouterr().err


def test_nan_loss_stops_the_run(tiny_args):
    cfg = tiny_cfg(tiny_args, "optim.lr=1e30", "optim.warmup_steps=0", "optim.grad_clip=0", "train.steps=20")
    with pytest.raises(UserError, match=r"(loss|grad norm) became (nan|inf) at step \d+; last good checkpoint"):
        train(cfg)


def test_an_update_that_overflows_is_never_saved(tiny_args, tmp_path):
    """The loss and gradient norm of a step are those of the parameters before its update: an update that
    overflowed float32 (lr 3.4e38: lr x weight decay x w is past the largest float) was saved as checkpoint 1 and
    named the last good checkpoint when step 2's loss came out nan."""
    cfg = tiny_cfg(tiny_args, "optim.lr=3.4e38", "optim.warmup_steps=0", "train.ckpt_every=1", "train.steps=3")
    with pytest.raises(UserError, match=r"parameters became non-finite in an update by step 1 .* checkpoint: none yet"):
        train(cfg)
    assert not os.listdir(tmp_path / "run" / "checkpoints")


def test_train_cli_end_to_end(tmp_path, tiny_args):
    proc = run_cli("train.py", "configs/tiny.yaml", "train.steps=5", *tiny_args, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = os.path.join(tmp_path, "run")
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "5"))
    # (run.dir under the working directory: from it; the checkout's sample.py by its path, as it is not there)
    assert f"sample with: {script('sample')} run\n" in proc.stdout


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["model.nlayer=3"], ["unknown config key 'model.nlayer'", "model.n_layer"]),
        (["optim.lr=0"], ["optim.lr must be a finite number > 0"]),
        (["model.n_head=3"], ["not divisible by model.n_head=3"]),
        (["data.path=/no/such/corpus.txt"], ["/no/such/corpus.txt"]),
        (["model.n_layer=two"], ["model.n_layer"]),
        (["data.tokenizer=nonsense"], ["nonsense"]),
        (["model.n_kv_head=3", "model.n_head=4", "model.n_embd=32"], ["not divisible by model.n_kv_head=3"]),
        (["model.pos=rope", "model.n_head=4", "model.n_embd=20"], ["even head dimension", "5"]),
        (["model.max_seq_len=16"], ["data.block_size=32 is longer than model.max_seq_len=16",
                                    "(a resumed run keeps its own, and so do weights with learned positions"]),
        (["optim.lr=-1"], ["optim.lr must be a finite number > 0"]),
        (["model.mlp=swish"], ["model.mlp='swish' is not one of relu, gelu, swiglu"]),
        (["train.steps"], ["not key=value"]),
        (["data.batch_size=6", "train.grad_accum=4"], ["not divisible by train.grad_accum=4"]),
        (["mesh.data=3"], ["mesh data*fsdp*tensor = 3*1*1 = 3 but there is 1 device; set mesh.data=-1 to take the rest"]),
    ],
)
def test_train_cli_user_errors(tmp_path, tiny_args, args, fragments, monkeypatch, capsys):
    """(In this process: test_missing_and_unparsable_config_files and tests/test_mistakes.py's real processes check
    that such a line is all a user sees, with exit code 2.)"""
    monkeypatch.chdir(tmp_path)
    assert_user_error(run_main(train_main, "configs/tiny.yaml", *tiny_args, *args, capsys=capsys), *fragments)


def test_missing_and_unparsable_config_files(tmp_path, capsys):
    proc = run_cli("train.py", "configs/nope.yaml", cwd=str(tmp_path))  # (a real process: one line, exit code 2)
    assert_user_error(proc, "config file 'configs/nope.yaml' not found", "configs/tiny.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    assert_user_error(run_main(train_main, str(bad), capsys=capsys), "cannot parse")
    newer = tmp_path / "newer.yaml"
    newer.write_text("format_version: 99\n")
    assert_user_error(run_main(train_main, str(newer), capsys=capsys), "format_version 99", "upgrade lm")


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_saved_config_alone_restarts_the_run(tmp_path, tiny_args):
    run_dir = train(tiny_cfg(tiny_args, "train.steps=10", "train.ckpt_every=5"))
    proc = run_cli("train.py", os.path.join(run_dir, "config.yaml"), "train.steps=15", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed run from step 10" in proc.stdout  # (named from the working directory, tmp_path)
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r][-1] == 15


def test_train_help_lists_presets_and_keys():
    """The help lists every key by section, as an unknown key's error line sends the user there (it listed none)."""
    proc = run_cli("train.py", "--help")
    assert proc.returncode == 0
    assert "configs/tiny.yaml" in proc.stdout and "section.key=value" in proc.stdout
    sections = {}
    for line in proc.stdout.split("keys (section.key=value):\n")[1].splitlines():
        if not line.startswith("    "):  # a section's line; its continuations are indented further
            section, _, line = line.strip().partition(": ")
        sections[section] = sections.get(section, "") + " " + line.strip()
    listed = {f"{section}.{name}".removeprefix("(top level).") for section, names in sections.items()
              for name in names.replace(",", " ").split()}  # fmt: skip
    assert listed == set(config_lib.all_keys()) - {"format_version"}
    from lm.config import load

    with pytest.raises(UserError, match=r"unknown config key 'zzzzqqq'; run `python train.py --help` for the keys"):
        load(None, ["zzzzqqq=1"])


def test_status_and_curves_after_training(tiny_args):
    from lm import runs

    run_dir = train(tiny_cfg(tiny_args, "train.steps=10"))
    assert runs.read_status(run_dir)["status"] == "finished"
    assert os.path.getsize(os.path.join(run_dir, "curves.png")) > 1000


def test_a_plot_that_cannot_be_written_does_not_fail_a_finished_run(tiny_args, capsys):
    """(A full disk at the end: the run printed "finished", then exited 2 on curves.png.)"""
    run_dir = tiny_args[0].split("=", 1)[1]
    os.makedirs(os.path.join(run_dir, "curves.png"))  # a path that takes no file, as a full disk takes none
    assert train(tiny_cfg(tiny_args, "train.steps=2", "train.eval_every=0")) == run_dir
    assert f"warning: cannot write {run_dir}/curves.png: Is a directory" in capsys.readouterr().err


def test_a_run_whose_last_checkpoint_fails_never_says_it_finished(tiny_args, capsys, monkeypatch):
    """The last checkpoint is written in the background: a write that failed (a bucket's bad credentials) came after
    "finished RUN at step N" and "sample with: ...", the lines of a run that had nothing to sample."""
    from lm.checkpoint import Checkpoints

    waited = Checkpoints.wait

    def wait(self):
        waited(self)
        raise UserError("writing a checkpoint to the bucket failed (403)")  # (as the write's own wait raises it)

    monkeypatch.setattr(Checkpoints, "wait", wait)
    with pytest.raises(UserError, match="403"):
        train(tiny_cfg(tiny_args, "train.steps=2", "train.eval_every=0"))
    out = capsys.readouterr().out
    assert "finished" not in out and "sample with" not in out, out


def test_a_signal_during_the_last_evaluation_still_finishes_the_run(tiny_args, monkeypatch):
    """(A Ctrl-C in the final evaluation: "stopped after step 500 with a checkpoint; resume with ...", a run
    recorded as preempted at 500/500, and no curves.png until the same command was run again.)"""
    import signal

    from lm import loop, runs

    evaluated = loop.evaluate

    def evaluate(trainer, params, validation, log, step):
        if step == 4:
            signal.raise_signal(signal.SIGINT)
        return evaluated(trainer, params, validation, log, step)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    run_dir = train(tiny_cfg(tiny_args, "train.steps=4", "train.eval_every=0"))
    assert runs.read_status(run_dir)["status"] == "finished"
    assert os.path.exists(os.path.join(run_dir, "curves.png"))


def test_a_ctrl_c_during_training_called_from_python_raises_once_the_run_stopped(tiny_args, monkeypatch):
    """train() called from Python (a notebook's loop of runs) returned after a Ctrl-C's clean stop, as when the run
    finished, and the loop started its next run: it raises KeyboardInterrupt (lm.errors.Interrupted) once the
    checkpoint is written. train.py's main ends with 0, as before."""
    import signal

    from lm import loop, runs
    from lm import train as train_lib
    from lm.errors import Interrupted

    evaluated = loop.evaluate

    def evaluate(trainer, params, validation, log, step):
        if step in (2, 4):
            signal.raise_signal(signal.SIGINT)
        return evaluated(trainer, params, validation, log, step)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    args = ["train.steps=6", "train.eval_every=2", "train.ckpt_every=100"]
    with pytest.raises(KeyboardInterrupt) as stopped:
        train(tiny_cfg(tiny_args, *args))
    run_dir = tiny_args[0].split("=", 1)[1]
    assert isinstance(stopped.value, Interrupted) and stopped.value.run_dir == run_dir
    assert runs.read_status(run_dir)["status"] == "preempted" and os.listdir(os.path.join(run_dir, "checkpoints"))
    assert train_lib.main([TINY, *tiny_args, *args, "train.steps=8"]) == 0  # (resumed: stopped again, at step 4)
    assert runs.read_status(run_dir)["status"] == "preempted"
    monkeypatch.setattr(loop, "evaluate", evaluated)
    assert train(tiny_cfg(tiny_args, *args, "train.steps=8")) == run_dir
    assert runs.read_status(run_dir)["status"] == "finished"


def test_a_second_ctrl_c_during_training_is_recorded_as_interrupted(tiny_args, monkeypatch):
    """(It was recorded as "failed: interrupted": the user's abort, read as the run's failure.)"""
    import signal

    from lm import loop, runs

    evaluated = loop.evaluate

    def evaluate(trainer, params, validation, log, step):
        signal.raise_signal(signal.SIGINT)  # the first asks for a checkpoint and a stop; the second aborts
        signal.raise_signal(signal.SIGINT)
        return evaluated(trainer, params, validation, log, step)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(tiny_args, "train.steps=4", "train.eval_every=2"))
    status = runs.read_status(tiny_args[0].split("=", 1)[1])
    assert status["status"] == "interrupted" and "error" not in status


def test_tokens_count_each_steps_own_batch_across_a_resume_that_changes_it(tiny_args):
    """(A resume with another data.batch_size logged step x the new batch as the tokens trained: every earlier step
    counted at the new size, and lm.plot's and lm.runs' token axis shifted.)"""
    from lm.metrics import read_metrics

    args = ["train.log_every=2", "train.ckpt_every=3", "train.eval_every=0", "train.steps=6"]
    # 8 x 32 tokens a step; killed after step 4, its checkpoint at 3 (a step not logged: the count at 2, plus one)
    run_dir = train(tiny_cfg(tiny_args, *args), stop_after=4)
    train(tiny_cfg(tiny_args, *args, "data.batch_size=16"))
    tokens = {r["step"]: r["tokens"] for r in read_metrics(run_dir) if "tokens" in r}
    assert tokens == {2: 512, 4: 768 + 512, 6: 768 + 3 * 512}
    # Its step 6 copied alone (no metrics.jsonl to count from) counts the steps before the batch changed at their
    # own batch too: from its stream's origin (step 8 read 2048, as if every step had been 8 rows).
    alone = os.path.join(os.path.dirname(run_dir), "alone")
    shutil.copytree(os.path.join(run_dir, "checkpoints", "6"), os.path.join(alone, "checkpoints", "6"))
    train(tiny_cfg([*tiny_args, f"run.dir={alone}"], *args[:-1], "train.steps=8", "data.batch_size=16"))
    assert [r["tokens"] for r in read_metrics(alone) if r["step"] == 8 and "tokens" in r] == [768 + 5 * 512]


# slow: about 12 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_tokens_count_across_two_resumes_with_no_logged_step_after_the_batch_changed(tiny_args):
    """(Resumed twice, the second time from a checkpoint written after the batch changed but before a step was
    logged at it, the count went on from the last logged row at the new batch: steps 5 and 6 counted at 4 rows.)"""
    from lm.metrics import read_metrics

    args = ["train.log_every=4", "train.ckpt_every=1", "train.eval_every=0", "train.steps=8"]
    run_dir = train(tiny_cfg(tiny_args, *args), stop_after=5)  # 8 x 32 tokens a step; logged at 4
    train(tiny_cfg(tiny_args, *args, "data.batch_size=4"), stop_after=7)  # 4 x 32: nothing logged in 6..7
    train(tiny_cfg(tiny_args, *args, "data.batch_size=4"))
    tokens = {r["step"]: r["tokens"] for r in read_metrics(run_dir) if "tokens" in r}
    assert tokens == {4: 4 * 256, 8: 5 * 256 + 3 * 128}


def test_a_resume_at_another_batch_size_trains_on_the_rows_that_come_next(tiny_args):
    """(The data position was a batch count: resumed at step 3 with 16 rows a batch instead of 8, step 4 read rows
    48-63 of a stream of which 24 had been trained, skipping 24 rows; with 4 a batch, it trained rows again. The
    epoch metric jumped alike.) Each checkpoint records where its stream's batches are counted from."""
    from lm import checkpoint as ckpt_lib
    from lm.metrics import read_metrics

    args = ["train.log_every=1", "train.ckpt_every=3", "train.eval_every=0", "train.steps=3"]
    run_dir = train(tiny_cfg(tiny_args, *args))
    train(tiny_cfg(tiny_args, *args, "train.steps=6", "data.batch_size=16"))
    train(tiny_cfg(tiny_args, *args, "train.steps=9", "data.batch_size=4"))
    ckpts = os.path.join(run_dir, "checkpoints")
    streams = {step: ckpt_lib.resume_items(ckpts, step).dataset["stream"] for step in (3, 6, 9)}
    plain = {"mix_row": 0, "bases": []}  # (one source: no mixture's)
    assert streams == {3: {"index": 0, "row": 0, **plain}, 6: {"index": 3, "row": 24, **plain},
                       9: {"index": 6, "row": 72, **plain}}  # fmt: skip
    epochs = {r["step"]: r["epoch"] for r in read_metrics(run_dir) if "epoch" in r}
    rows = {1: 8, 2: 16, 3: 24, 4: 40, 5: 56, 6: 72, 7: 76, 8: 80, 9: 84}  # (each step's epoch: its rows after it)
    per_row = epochs[1] / 8
    assert all(math.isclose(epochs[s], n * per_row, rel_tol=1e-9) for s, n in rows.items()), epochs


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_data_epochs_after_a_batch_change_and_a_damaged_newest_step(tiny_args, tmp_path, capsys):
    """(A damaged newest step restored from the one before it, whose stream origin differs: the run kept the
    train.steps data.epochs gave from the newer one, stopping with rows of its epochs untrained.)"""
    import pathlib

    from lm.data import prepare_for_training
    from lm.data.loaders import Origin

    path = tmp_path / "task.jsonl"
    text = lambda i: {"prompt": f"Question {i}: ", "completion": f"the answer is {i * 7}."}
    path.write_text("".join(json.dumps(text(i)) + "\n" for i in range(120)))
    ex = ["data.format=examples", f"data.path={path}", "data.epochs=3", "train.log_every=1", "train.ckpt_every=4",
          "train.eval_every=0", "optim.warmup_steps=2"]  # fmt: skip
    run_dir = train(tiny_cfg(tiny_args, *ex), stop_after=4)
    train(tiny_cfg(tiny_args, *ex, "data.batch_size=16"), stop_after=8)
    for f in (pathlib.Path(run_dir) / "checkpoints" / "8" / "params").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:7])
    with pytest.raises(UserError, match="checkpoint 8 was set aside .* from step 4, at this batch size, data.epochs=3"):
        train(tiny_cfg(tiny_args, *ex, "data.batch_size=4"))
    assert "8.unreadable" in os.listdir(os.path.join(run_dir, "checkpoints"))
    capsys.readouterr()
    cfg = tiny_cfg(tiny_args, *ex, "data.batch_size=4")
    train(cfg)  # the same command again: from step 4's own origin (32 rows)
    want = prepare_for_training(cfg.data, cfg.seed, progress=False).steps_for_epochs(cfg.data, cfg.seed, Origin(4, 32))
    assert f"finished {run_dir} at step {want}\n" in capsys.readouterr().out


def test_step_times_next_to_a_checkpoint_hold_their_own_batches(tiny_args, monkeypatch):
    """The loop builds a call's batches before it waits for the call before it. (The call before an evaluation or
    checkpoint was timed without any building, the one after with two calls': tokens/s 3x too high, then too low;
    MFU above 100%.) Here building is a step's whole cost: the loop's and the timer's clock moves by 50 ms for each
    batch built and at no other time, so every step must time 50 ms exactly, whatever else the machine runs."""
    from lm import loop, metrics, sharding
    from lm.metrics import read_metrics

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], monotonic=time.monotonic, time=time.time)
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(metrics, "time", clock)
    build = sharding.global_batch

    def built_in_50_ms(*a, **k):
        now[0] += 0.05
        return build(*a, **k)

    monkeypatch.setattr(sharding, "global_batch", built_in_50_ms)
    every = ["train.log_every=1", "train.ckpt_every=3", "train.eval_every=0"]
    run_dir = train(tiny_cfg(tiny_args, "train.steps=9", *every))
    times = [r["step_time"] for r in read_metrics(run_dir) if "step_time" in r]
    # (It was 0 s before a checkpoint and 0.10 s after it. A wall clock failed on CI with its other tests: 1.5 s for the
    # step after the first checkpoint, the save's writing beside it.)
    assert times == pytest.approx([0.05] * 8), times


# slow: about 16 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_closed_stdout_or_stderr_is_no_failure(tmp_path, tiny_args):
    """(`python train.py ... >&-` trained, then failed on flushing a stdout Python had set to None: exit 1.)"""
    import shlex

    command = shlex.join([sys.executable, os.path.join(ROOT, "train.py"), "tiny", *tiny_args, "train.steps=2"])
    for closed in (">&-", "2>&-"):
        done = subprocess.run(["bash", "-c", f"{command} {closed}"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, (closed, done.stdout[-2000:], done.stderr[-2000:])
    assert os.listdir(os.path.join(tiny_args[0].split("=", 1)[1], "checkpoints")) == ["2"]


# slow: about 24 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_quiet_prints_only_the_run_directory(tmp_path, tiny_args):
    """Absolute, however it was named (a new run printed runs/NAME as given, its resume the stored absolute path), so
    that a script can use it from any directory."""
    proc = run_cli("train.py", "configs/tiny.yaml", "--quiet", "train.steps=5", *tiny_args, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == tiny_args[0].split("=", 1)[1] + "\n"
    named = [a for a in tiny_args if not a.startswith("run.dir=")] + ["run.name=q"]
    for args in (["configs/tiny.yaml", *named, "train.steps=1"], ["runs/q/config.yaml", "train.steps=2"]):
        proc = run_cli("train.py", *args, "--quiet", cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout == f"{tmp_path / 'runs' / 'q'}\n", proc.stdout


def test_runs_without_a_name_started_in_the_same_second_each_have_their_own(tmp_path, tiny_args, monkeypatch):
    """A sweep started at once without run.name (`for lr in ...; do python train.py optim.lr=$lr & done`): runs started
    in the same second were given one directory, and all but one were refused as "another process is training"."""
    import datetime

    from lm import train as train_lib

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 27, 12, 0, 0)

    monkeypatch.setattr(train_lib.datetime, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    unnamed = [a for a in tiny_args if not a.startswith("run.dir=")]
    with pytest.raises(UserError, match="input '.*absent.txt' not found"):  # a run that stops before writing
        train(tiny_cfg(unnamed, "data.path=absent.txt"))
    assert not (tmp_path / "runs").exists()  # leaves nothing behind
    first = train(tiny_cfg(unnamed, "train.steps=2", "train.eval_every=0"))
    second = train(tiny_cfg(unnamed, "train.steps=2", "train.eval_every=0"))
    assert (first, second) == ("runs/20261127-120000", "runs/20261127-120000-2")
    assert train_lib._claim("runs/20261127-120000") == "runs/20261127-120000-3"
    (tmp_path / "runs").rename(tmp_path / "kept")
    (tmp_path / "runs").write_text("")
    with pytest.raises(UserError, match="^runs is a file, where runs are kept; move it away, or set run.dir$"):
        train(tiny_cfg(unnamed, "train.steps=2"))


def test_a_run_without_a_name_stopped_during_start_up_leaves_no_directory(tmp_path, tiny_args, monkeypatch):
    """A run given no name stopped while it compiled (its status, config and empty logs written, no step) left
    runs/STAMP behind, listed by lm.runs as a stopped run of no steps; running the same command again, as the stop
    advises, made another. One that fails there keeps its directory and its error."""
    import signal

    from lm import loop
    from lm.errors import Stopped
    from lm.runs import read_status

    monkeypatch.chdir(tmp_path)
    unnamed = [a for a in tiny_args if not a.startswith("run.dir=")]
    monkeypatch.setattr(loop, "run", lambda *args, **kwargs: signal.raise_signal(signal.SIGTERM))
    with pytest.raises(Stopped):
        train(tiny_cfg(unnamed, "train.steps=2"))
    assert not (tmp_path / "runs").exists()

    def fails(*args, **kwargs):
        raise RuntimeError("compiling failed")

    monkeypatch.setattr(loop, "run", fails)
    with pytest.raises(RuntimeError):
        train(tiny_cfg(unnamed, "train.steps=2"))
    [kept] = (tmp_path / "runs").iterdir()
    assert read_status(str(kept))["status"] == "failed"


def test_a_run_without_a_name_that_logged_steps_keeps_its_directory(tmp_path, tiny_args, monkeypatch):
    """train(cfg, stop_after=N) of a run given no name, stopped before its first checkpoint, removed runs/STAMP with
    the metrics of its N steps, and returned (and said "sample with:") that directory, gone."""
    monkeypatch.chdir(tmp_path)
    unnamed = [a for a in tiny_args if not a.startswith("run.dir=")]
    run = train(tiny_cfg(unnamed, "train.steps=4", "train.log_every=1", "train.ckpt_every=0"), stop_after=2)
    assert [json.loads(line)["step"] for line in open(os.path.join(run, "metrics.jsonl"))][-1] == 2


def test_debug_shows_the_traceback(tmp_path):
    quiet = run_cli("train.py", "tiny", "model.nlayer=2", cwd=str(tmp_path))
    assert_user_error(quiet, "unknown config key 'model.nlayer'")
    loud = run_cli("train.py", "tiny", "model.nlayer=2", "--debug", cwd=str(tmp_path))
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "ConfigError" in loud.stderr


# slow: a long multi-device or multi-process run; .ci/run runs it after the default suite
@pytest.mark.slow
def test_compile_cache_keeps_the_compiled_step_and_can_be_turned_off(tmp_path, tiny_args):
    # Every program kept, however fast it compiled (a GPU compiles this one in under lm's half-second floor).
    run = [*tiny_args[1:], "train.steps=2", "--quiet"]
    cache = tmp_path / "cache"
    every = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    kept = run_cli("train.py", "tiny", f"run.dir={tmp_path / 'a'}", f"train.compile_cache={cache}", *run, env=every)
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert any(name.startswith("jit_train_step") for name in os.listdir(cache))
    # Off: nothing under the default location either (HOME points into the test's directory).
    off = run_cli("train.py", "tiny", f"run.dir={tmp_path / 'b'}", "train.compile_cache=", *run, env={"HOME": str(tmp_path)})
    assert off.returncode == 0, off.stderr[-2000:]
    assert not (tmp_path / ".cache" / "lm" / "jax").exists()


# slow: about 30 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_damaged_compile_cache_entry_is_one_line_and_kept_anew(tmp_path, tiny_args):
    """An entry of train.compile_cache cut short (a full disk, a killed copy): JAX warned with its source line and
    compiled the program again, but never wrote over the entry, so every later run compiled it again and warned."""
    cache = tmp_path / "cache"
    every = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    run = [*tiny_args[1:], "train.steps=1", "optim.warmup_steps=0", "train.eval_every=0",
           f"train.compile_cache={cache}", "--quiet"]  # (warmup: no warning that the step is all warmup)
    for name in "abc":
        if name == "b":
            for entry in cache.iterdir():
                entry.write_bytes(b"cut short")
        done = run_cli("train.py", "tiny", f"run.dir={tmp_path / name}", *run, env=every)
        assert done.returncode == 0, done.stderr[-2000:]
        warned = [line for line in done.stderr.splitlines() if "arning" in line]
        if name == "b":
            said = f"warning: the compilation cache {cache} held a damaged entry for "
            assert warned and all(
                line.startswith(said) and line.endswith(": removed, compiled again") for line in warned
            ), warned
        else:
            assert warned == [], warned
    assert any(name.startswith("jit_train_step") for name in os.listdir(cache))
    assert all(entry.stat().st_size > len(b"cut short") for entry in cache.iterdir())


# slow: about 21 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_compile_cache_bounded_after_it_was_kept_unbounded_keeps_new_programs(tmp_path, tiny_args):
    """JAX_COMPILATION_CACHE_MAX_SIZE set on a cache lm kept unbounded (its default): JAX's eviction read an access
    time that no entry kept so had, so every write failed, one warning each ("cannot keep jit_train_step ...: free
    space there"), and the program was compiled again at every run."""
    cache = tmp_path / "cache"
    every = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    for name, width, bound in (("a", 32, None), ("b", 48, "1000000000")):
        run = [*tiny_args[1:], f"run.dir={tmp_path / name}", "train.steps=1", "optim.warmup_steps=0",
               "train.eval_every=0", f"model.n_embd={width}", f"train.compile_cache={cache}", "--quiet"]  # fmt: skip
        env = every if bound is None else {**every, "JAX_COMPILATION_CACHE_MAX_SIZE": bound}
        done = run_cli("train.py", "tiny", *run, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [line for line in done.stderr.splitlines() if "arning" in line] == [], done.stderr[-2000:]
    assert len([n for n in os.listdir(cache) if n.startswith("jit_train_step") and n.endswith("-cache")]) == 2


def test_a_compile_cache_entry_removed_while_access_times_are_given_leaves_the_others_theirs(tmp_path, monkeypatch):
    """An entry removed by another run between the listing and its stat (JAX's eviction, a damaged entry removed)
    left an empty access time of its own and stopped the pass: the entries after it kept none, and JAX 0.10's
    eviction failed every write again."""
    from lm import compile_cache

    cache, listed = tmp_path / "cache", os.scandir
    cache.mkdir()
    for name in ("b", "c", "d"):
        (cache / f"{name}-cache").write_bytes(b"program")
    (cache / "a-cache").symlink_to(tmp_path / "removed")  # (listed, then gone: its stat fails)
    monkeypatch.setattr(os, "scandir", lambda path: sorted(listed(path), key=lambda entry: entry.name))
    compile_cache._access_times_given(str(cache))
    assert sorted(p.name for p in cache.iterdir() if p.name.endswith("-atime")) == ["b-atime", "c-atime", "d-atime"]
    written = (cache / "b-cache").stat().st_mtime_ns
    assert int.from_bytes((cache / "b-atime").read_bytes(), "little") == written


# slow: about 10 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_home_that_cannot_be_written_is_one_warning(tmp_path, tiny_args):
    """A read-only home (a container's): JAX warned at every compile that it could not read its cache (a UserWarning
    with its source line), and matplotlib logged two WARNING lines for its config directory; the run went on."""
    (tmp_path / "file").write_text("")
    home = tmp_path / "file" / "home"  # (root writes read-only directories: a path under a file cannot be made)
    done = run_cli("train.py", "tiny", *tiny_args, "train.steps=2", "optim.warmup_steps=1",
                   env={"HOME": str(home), "XDG_CACHE_HOME": ""})  # (warmup: its warning alone)
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "arning" in line]
    assert warnings == [
        f"warning: train.compile_cache=~/.cache/lm/jax cannot be written ({tmp_path / 'file'} is a file, not a "
        "directory): compiling without it; set train.compile_cache to a writable directory, or '' for none"
    ], done.stderr[-2000:]
    assert os.path.isfile(tmp_path / "run" / "curves.png") or not plot_lib.available()


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_each_run_of_a_process_uses_its_own_compile_cache(tmp_path, tiny_args, monkeypatch):
    """JAX opens its compilation cache once: a second run of the same Python process (a notebook) that set another
    train.compile_cache, or "" (off), wrote into the first one's directory."""
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # (lm then keeps JAX's floor as it is)
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    first, second = tmp_path / "first", tmp_path / "second"

    def run(name: str, width: int, cache) -> None:  # (a model of its own width: a program not compiled before)
        overrides = [*tiny_args[1:], f"run.dir={tmp_path / name}", "train.steps=1", "train.eval_every=0",
                     f"model.n_embd={width}", f"train.compile_cache={cache}"]  # fmt: skip
        train(config_lib.load("tiny", overrides))

    def kept(directory) -> set[str]:
        return {n for n in os.listdir(directory) if n.startswith("jit_train_step")} if directory.exists() else set()

    try:
        run("a", 32, first)
        assert len(kept(first)) == 1
        run("b", 48, "")
        assert len(kept(first)) == 1 and jax.config.jax_compilation_cache_dir != str(first)  # (the process's own)
        run("c", 64, second)
        assert len(kept(first)) == 1 and len(kept(second)) == 1
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()


def test_a_run_without_a_compile_cache_gives_back_the_process_floor(tmp_path, monkeypatch):
    """A notebook's run with train.compile_cache and then one with "" gave back JAX's cache directory but kept lm's
    0.5 s floor on what it keeps, for the process's own compiles too, where JAX's is 1 s."""
    from lm import compile_cache

    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.setattr(compile_cache, "_STATE", {})
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        compile_cache.use(str(tmp_path / "cache"))
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5
        compile_cache.use("")
        assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == before
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()


def test_a_compile_cache_in_a_bucket_makes_no_local_directory(tmp_path, monkeypatch, capsys):
    """train.compile_cache=s3://bucket/jax made the local directories s3:/bucket/jax in the working directory and then
    handed the URL to JAX, which warned with its source line at every compile that it could not read the bucket."""
    from lm import compile_cache, storage

    def refused(url, setting, suffix=""):
        raise UserError(f"cannot write to {url}/.lm-write-test: Unable to locate credentials")

    monkeypatch.setattr(storage, "check_writable", refused)
    monkeypatch.setattr(compile_cache, "_STATE", {})
    monkeypatch.chdir(tmp_path)
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        compile_cache.use("s3://bucket/jax")
        assert os.listdir(tmp_path) == []
        assert jax.config.jax_compilation_cache_dir == before[0]
        assert capsys.readouterr().err.startswith(
            "warning: train.compile_cache=s3://bucket/jax cannot be written (cannot write to s3://bucket/jax/"
        )
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_train_checks_a_config_made_in_python(tmp_path, tiny_args):
    """config.load's checks, for a config changed with config.replace: it trained, and its resume was refused."""
    cfg = config_lib.load("tiny", tiny_args)
    with pytest.raises(UserError, match="optim.name='sgdx' is not one of adamw, muon"):
        train(config_lib.replace(cfg, optim={"name": "sgdx"}))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, warned", [("pad", False), ("keep", False), ("system", False), ("", False), ("lots", True)])
def test_malloc_setting(tmp_path, setting, warned):
    proc = subprocess.run(
        [sys.executable, "-m", "lm.runs", str(tmp_path)],
        env={**os.environ, "LM_MALLOC": setting},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert ("LM_MALLOC='lots' is not one of pad, keep, system" in proc.stderr) == warned
    assert ("LM_MALLOC" in proc.stderr) == warned  # an empty setting is the default's, as if unset


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_malloc_keep_holds_on_to_freed_blocks():
    # 256 MiB allocated and freed inside a command: glibc maps a block that large on its own and unmaps it when
    # freed, unless LM_MALLOC=keep, which serves it from the heap and keeps it (XLA:CPU's per-step temporaries).
    script = """
import numpy as np
from lm import errors, platform

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

@errors.cli
def main(argv):
    before = rss()
    block = np.ones((256 << 20) // 8)
    del block
    print(platform.malloc_mode, (rss() - before) >> 20)

main([])
"""
    grown = {}
    for setting in ("pad", "keep", "system"):
        proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "LM_MALLOC": setting}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        mode, mib = proc.stdout.split()
        assert mode == setting
        grown[setting] = int(mib)
    assert grown["keep"] >= 250 and grown["pad"] < 50 and grown["system"] < 50, grown


@pytest.mark.slow
def test_malloc_keep_trains_the_same_run(tmp_path, tiny_args):
    # LM_MALLOC=keep runs CPU steps one at a time (lm.loop); the run is the same, bit for bit.
    runs = {}
    for setting in ("pad", "keep"):
        run_dir = tmp_path / setting
        proc = run_cli("train.py", "tiny", *tiny_args, f"run.dir={run_dir}", "train.steps=6", "train.log_every=1", env={"LM_MALLOC": setting})
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[setting] = losses(run_dir)
    assert runs["keep"] == runs["pad"] and len(runs["pad"]) >= 6


def test_importing_lm_changes_no_process_wide_state():
    # A library import must leave the host program's hooks, loggers and allocator alone; the CLIs set them.
    script = """
import logging, sys, threading
before = (sys.excepthook, sys.unraisablehook, threading.excepthook,
          logging.getLogger("absl").level, logging.getLogger("asyncio").level)
import lm, lm.train, lm.sampling, lm.data, lm.export, lm.runs, lm.plot
after = (sys.excepthook, sys.unraisablehook, threading.excepthook,
         logging.getLogger("absl").level, logging.getLogger("asyncio").level)
assert before == after, (before, after)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "LM_MALLOC": "lots"}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LM_MALLOC" not in proc.stderr  # the setting is not even read on import


@pytest.mark.parametrize("option", ["model.dtype=float16", "model.param_dtype=float16"])
def test_float16_training_is_refused_in_one_line(tmp_path, tiny_args, option):
    """lm has no loss scaling: float16 training is refused before anything is prepared or written."""
    proc = run_cli("train.py", "tiny", *tiny_args, option)
    assert_user_error(proc, option, "bfloat16")
    assert not os.path.exists(os.path.join(tmp_path, "run"))


def test_16_bit_weights_train_in_float32_and_a_lora_base_stays_as_stored():
    from lm.pretrained import inherit

    trained = ModelConfig(n_layer=2, n_head=2, n_embd=32, param_dtype="float16")
    assert inherit(ModelConfig(), trained, chosen=[]).param_dtype == "float32"
    assert inherit(ModelConfig(), trained, chosen=["model.param_dtype"]).param_dtype == "float32"  # the default, chosen
    assert inherit(ModelConfig(), trained, chosen=[], frozen=True).param_dtype == "float32"  # never float16 in training
    bf16 = ModelConfig(n_layer=2, n_head=2, n_embd=32, param_dtype="bfloat16")
    assert inherit(ModelConfig(), bf16, chosen=[]).param_dtype == "float32"  # master weights
    assert inherit(ModelConfig(), bf16, chosen=[], frozen=True).param_dtype == "bfloat16"  # LoRA's base as stored
    chosen = ModelConfig(param_dtype="bfloat16")
    assert inherit(chosen, bf16, chosen=["model.param_dtype"]).param_dtype == "bfloat16"


def test_a_shorter_context_than_learned_positions_names_the_block_size_not_growth():
    from lm.pretrained import inherit

    learned = ModelConfig(n_layer=1, n_head=2, n_embd=32, pos="learned", max_seq_len=128)
    with pytest.raises(UserError) as shorter:  # (it said their context "cannot grow", of a context made shorter)
        inherit(ModelConfig(n_layer=1, n_head=2, n_embd=32, max_seq_len=64), learned, chosen=["model.max_seq_len"])
    assert "whose number stays: a shorter data.block_size alone trains a shorter context)" in str(shorter.value)
    assert "grow" not in str(shorter.value)
    with pytest.raises(UserError, match="so their context cannot grow"):
        inherit(ModelConfig(n_layer=1, n_head=2, n_embd=32, max_seq_len=256), learned, chosen=["model.max_seq_len"])


def test_a_llama3_context_extension_scales_against_the_weights_own_context():
    """model.rope_scaling=llama3 on weights trained without scaling: rope_original_max_len ("the context the model
    was first trained at") is theirs, not the default 8192, against which a 1024-token model's frequencies were
    hardly scaled; one chosen is kept, and weights already scaled keep their own."""
    from lm.pretrained import inherit

    trained = ModelConfig(n_layer=2, n_head=2, n_embd=32, pos="rope", max_seq_len=1024)
    longer = ModelConfig(pos="rope", max_seq_len=4096, rope_scaling="llama3", rope_factor=4.0)
    keys = ["model.max_seq_len", "model.rope_scaling", "model.rope_factor"]
    assert inherit(longer, trained, chosen=keys).rope_original_max_len == 1024
    chosen = dataclasses.replace(longer, rope_original_max_len=2048)
    assert inherit(chosen, trained, chosen=[*keys, "model.rope_original_max_len"]).rope_original_max_len == 2048
    scaled = dataclasses.replace(trained, rope_scaling="llama3", rope_original_max_len=512)
    assert inherit(longer, scaled, chosen=keys).rope_original_max_len == 512
    assert inherit(dataclasses.replace(longer, rope_scaling="linear"), trained, chosen=keys).rope_original_max_len == 8192


@pytest.fixture
def call_lengths(monkeypatch):
    """The lengths of the calls of several steps that the loop makes (train.steps_per_call), in order."""
    from lm.steps import Trainer

    made, create = [], Trainer.create.__func__

    def spying(cls, *args, **kwargs):
        trainer, state = create(cls, *args, **kwargs)
        jitted = trainer.train_steps
        trainer.train_steps = lambda state, batches, frozen: (made.append(len(batches)), jitted(state, batches, frozen))[1]
        return trainer, state

    monkeypatch.setattr(Trainer, "create", classmethod(spying))
    return made


# slow: three runs compiled with other step counts a call (about 40 s); .ci/run runs it after the default suite, which keeps the default run within 15 minutes
@pytest.mark.slow
def test_several_steps_per_call_train_the_same_run(tmp_path, tiny_args, call_lengths):
    """train.steps_per_call=4 runs the same updates as one step per call (dropout and micro-batches too), its
    calls ending at every evaluation and checkpoint; a resumed run makes the uninterrupted run's calls."""
    run = ["train.steps=14", "train.log_every=1", "train.eval_every=5", "train.ckpt_every=7", "model.dropout=0.1", "train.grad_accum=2"]
    others = [a for a in tiny_args if not a.startswith("run.dir=")]
    in_dir = lambda name, *more: tiny_cfg(others, f"run.dir={tmp_path / name}", *run, *more)
    one = train(in_dir("one"))
    assert call_lengths == []
    several = in_dir("four", "train.steps_per_call=4")
    four = train(several)
    # Steps 1-4, 5 (eval), 6-7 (checkpoint), 8, 9-10 (eval), 11-12, 13-14: calls of one step take train_step.
    assert call_lengths == [4, 2, 2, 2, 2]
    assert_same_losses(losses(one), losses(four), rtol=TWO_PROGRAMS_RTOL)
    assert_same_params(params(one, 14), params(four, 14), exact=False)
    resumed = in_dir("resumed", "train.steps_per_call=4")
    train(resumed, stop_after=9)  # killed after step 9: steps 8-9 are lost, the checkpoint is step 7's
    del call_lengths[:]
    train(resumed)
    assert call_lengths == [2, 2, 2]  # 8, 9-10, 11-12, 13-14: where the uninterrupted run's calls were
    assert_same_losses(losses(four), losses(tmp_path / "resumed"))
    assert_same_params(params(four, 14), params(tmp_path / "resumed", 14))


@pytest.mark.parametrize("per_call", [1, 5])
@pytest.mark.parametrize("waits", [False, True], ids=["fetched-one-behind", "one-at-a-time"])
def test_logged_step_time_is_the_steps_own(tiny_args, monkeypatch, per_call, waits):
    """Every logged interval's step_time is what its steps took, up to the run's last step, whether a call holds
    one step or several, and whether the loop fetches a call's metrics after dispatching the next one or waits
    for each call (LM_MALLOC=keep). The loop's clock is a simulated device's: each step takes 40 ms once
    the one before has finished, and a call's metrics are ready when its last step is; the host takes no time.
    Steps used to be counted when their call was dispatched: with 5 steps a call, the last interval before an
    evaluation read twice its step time, and the one after it half."""
    from lm import loop, metrics, platform
    from lm.steps import Trainer

    if waits:
        backend = platform.current()
        monkeypatch.setattr(platform, "current", lambda: dataclasses.replace(backend, one_call_at_a_time=True))
    now, device_free, ready = [1000.0], [0.0], {}  # ready: id(a call's metrics) -> (metrics, when ready)

    def wait(x):
        if id(x) in ready:
            now[0] = max(now[0], ready[id(x)][1])
        return x

    class Device:  # lm.loop's jax, whose waits for metrics advance the clock to when they are ready
        def __getattr__(self, name):
            return getattr(jax, name)

        def block_until_ready(self, x):
            return jax.block_until_ready(wait(x))

        def device_get(self, x):
            return jax.device_get(wait(x))

    clock = types.SimpleNamespace(perf_counter=lambda: now[0], time=time.time, monotonic=time.monotonic)  # (TensorBoard's)
    monkeypatch.setattr(loop, "jax", Device())
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(metrics, "time", clock)
    create = Trainer.create.__func__

    def simulated(cls, *args, **kwargs):
        trainer, state = create(cls, *args, **kwargs)
        for name in ("train_step", "train_steps"):

            def call(state, batches, frozen, jitted=getattr(trainer, name)):
                state, out = jitted(state, batches, frozen)
                device_free[0] = max(now[0], device_free[0]) + 0.04 * (len(batches) if isinstance(batches, tuple) else 1)
                ready[id(out)] = (out, device_free[0])
                return state, out

            setattr(trainer, name, call)
        return trainer, state

    monkeypatch.setattr(Trainer, "create", classmethod(simulated))
    run = ["train.steps=40", "train.log_every=10", "train.eval_every=20", "train.ckpt_every=0", f"train.steps_per_call={per_call}"]
    rows = [r for r in read_metrics(train(tiny_cfg(tiny_args, *run))) if "loss" in r]
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    assert [r["step_time"] for r in rows] == pytest.approx([0.04] * 4)


@pytest.mark.parametrize("per_call, traced", [(1, 2), (2, 1)])
def test_profile_steps_trace_those_steps_of_the_real_run(tiny_args, capsys, per_call, traced):
    import glob
    import gzip

    cfg = tiny_cfg(tiny_args, "train.steps=6", "train.eval_every=0", "train.profile_steps=3:2", f"train.steps_per_call={per_call}")
    run_dir = train(cfg)
    profile = os.path.join(run_dir, "profile")
    assert glob.glob(os.path.join(profile, "plugins", "profile", "*", "*.xplane.pb"))  # TensorBoard's profile tab
    [perfetto] = glob.glob(os.path.join(profile, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(perfetto) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    calls = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and "train_step" in e.get("name", ""))
    outermost = [c for i, c in enumerate(calls) if not any(o[0] <= c[0] and c[1] <= o[1] for o in calls[:i])]
    # Steps 3 and 4 were dispatched inside the trace, no others (a call nests its own event): in two calls, or in
    # one of two steps (train_steps).
    assert len(outermost) == traced
    assert "profile of steps 3-4" in capsys.readouterr().out


def test_the_profile_line_names_the_steps_traced(monkeypatch):
    """With train.steps_per_call=3 and train.profile_steps=3:2 the calls of steps 1-3 and 4-6 are traced whole, and
    the line said "profile of steps 3-4"."""
    from lm import loop

    said, calls = [], []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: calls.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))
    with loop.Profile("3:2", "PROFILE", types.SimpleNamespace(line=said.append)) as profile:
        for first, last in [(1, 3), (4, 6), (7, 9)]:
            profile.before(first, last)
            profile.after(first, last)
    assert calls == ["start", "stop"]
    assert said == ["profile of steps 1-6: PROFILE (tensorboard --logdir, or Perfetto)"]


@pytest.mark.parametrize("value", ["3", "a:b", "0:2", "2:0", "1:2:3"])
def test_profile_steps_must_be_start_colon_count(tiny_args, value):
    with pytest.raises(config_lib.ConfigError, match="train.profile_steps"):
        tiny_cfg(tiny_args, f"train.profile_steps={value}")


def test_an_unquoted_profile_window_in_yaml_is_the_window_written(tiny_args, tmp_path):
    """YAML 1.1 read `profile_steps: 2:3` as the base-60 number 123 (refused, with a hint to quote it): a config's
    values are now the text written, which the setting reads."""
    preset = tmp_path / "p.yaml"
    with open(TINY) as f:
        preset.write_text(f.read().replace("train:\n", "train:\n  profile_steps: 2:3\n", 1))
    assert config_lib.load(str(preset), tiny_args).train.profile_steps == "2:3"


@pytest.mark.parametrize("value", ["3", "60", "120"])
def test_a_number_no_yaml_window_reads_as_gets_no_yaml_hint(tiny_args, value):
    """A START alone on the command line (or a number no START:COUNT >= 1:1 reads as in YAML) is not taken for an
    unquoted YAML window: the hint would name a window the user never wrote."""
    with pytest.raises(config_lib.ConfigError) as caught:
        tiny_cfg(tiny_args, f"train.profile_steps={value}")
    assert "base-60" not in str(caught.value)


def test_profile_steps_after_the_last_step_are_refused(tiny_args):
    with pytest.raises(config_lib.ConfigError, match="starts after the run's last step"):
        tiny_cfg(tiny_args, "train.steps=5", "train.profile_steps=6:1")
    # One that ends after it traced the final evaluation and checkpoint, and logged no "profile of steps" line.
    assert tiny_cfg(tiny_args, "train.steps=5", "train.profile_steps=4:2").train.profile_steps == "4:2"
    with pytest.raises(config_lib.ConfigError, match=r"train.profile_steps=4:3 ends after the run's last step \("):
        tiny_cfg(tiny_args, "train.steps=5", "train.profile_steps=4:3")


def test_config_yaml_resumes_from_any_directory_with_relative_data_paths(tmp_path, monkeypatch, tiny_args, capsys):
    """The data's local paths and run.dir are stored absolute: a run started with data.path=corpus.txt and
    run.name=rel in one directory resumes from its config.yaml in another (it was "'corpus.txt' not found" there),
    also from the file copied alone (that started a new run in the working directory's runs/rel)."""
    from lm.train import train

    work = tmp_path / "work"
    work.mkdir()
    with open(config_lib.BUNDLED_CORPUS, encoding="utf-8") as f:
        (work / "corpus.txt").write_text(f.read()[:100_000])
    (work / "val.txt").write_text("Speak, speak.\n" * 500)
    monkeypatch.chdir(work)
    tiny = os.path.join(config_lib.CONFIG_DIR, "tiny.yaml")
    args = [a for a in tiny_args if not a.startswith(("run.dir=", "data.cache_dir="))] + ["run.name=rel"]
    args += ["data.path=corpus.txt", "data.val_path=val.txt", "data.cache_dir=cache", "train.steps=2"]
    args += ["train.eval_every=0"]
    run_dir = str(work / train(config_lib.load(tiny, args)))
    saved = config_lib.load(os.path.join(run_dir, "config.yaml"))
    assert (saved.data.path, saved.data.val_path) == (str(work / "corpus.txt"), str(work / "val.txt"))
    assert saved.run.dir == str(work / "runs" / "rel") == run_dir
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    train(config_lib.load(os.path.join(run_dir, "config.yaml"), ["train.steps=3"]))
    # (named as from the working directory, as a new run's runs/NAME is: it was absolute on a resume alone)
    out = capsys.readouterr().out
    assert "resumed work/runs/rel from step 2" in out and f"sample with: {script('sample')} work/runs/rel\n" in out
    assert re.search(r"^data: .* \(work/cache/corpus-[^/ ]+\)$", out, re.M), out  # (its data too)
    shutil.copy(os.path.join(run_dir, "config.yaml"), tmp_path / "alone.yaml")
    monkeypatch.chdir("/")  # (not under the working directory: as stored)
    train(config_lib.load(str(tmp_path / "alone.yaml"), ["train.steps=4"]))
    assert f"resumed {run_dir} from step 3" in capsys.readouterr().out and not (tmp_path / "runs").exists()


def test_a_run_in_a_directory_whose_path_holds_brackets_is_refused(tmp_path, tiny_args, monkeypatch):
    """orbax globs a checkpoint's own path to gather its arrays: under p[1]/ it wrote checkpoints whose arrays could
    never be read (run.name=x in such a working directory, or a relative run.dir)."""
    (tmp_path / "p[1]").mkdir()
    monkeypatch.chdir(tmp_path / "p[1]")
    args = [a for a in tiny_args if not a.startswith("run.dir=")]
    with pytest.raises(UserError, match=r"run directory .*/p\[1\]/runs/x has '\[', '\]' or '\\' in its path"):
        train(config_lib.load("tiny", [*args, "run.name=x", "train.steps=1"]))
    assert not os.path.exists(tmp_path / "p[1]" / "runs" / "x" / "checkpoints")


# slow: about 8 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_log_lines_print_beside_the_progress_bar_and_quiet_silences_both(tiny_args, capsys):
    """(With the bar on, as on a terminal by default, the loss lines the README promises every log_every steps were
    never printed; logging.quiet=true without logging.progress=false still drew the bars and said the data was up
    to date.)"""
    train(tiny_cfg(tiny_args, "train.steps=10", "logging.progress=true"))
    out, err = capsys.readouterr()
    assert "step 5: loss " in out and "step 10: loss " in out and "step 10: val_loss " in out and "%|" in err
    train(tiny_cfg(tiny_args, "train.steps=10", "logging.progress=true", "logging.quiet=true", "resume=never",
                   f"run.dir={tiny_args[0].split('=', 1)[1]}-quiet"))
    assert capsys.readouterr() == ("", "")


# slow: about 11 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_config_yaml_keeps_the_run_not_the_commands_resume_policy_and_terminal(tiny_args, capsys):
    """A run's config.yaml recorded the command's resume=never (the resume command the run printed on SIGTERM,
    `train.py RUN_DIR/config.yaml`, was refused), resume=required (a new run.name=NEW from it was refused: "has no
    checkpoint") and -q (logging.quiet, logging.progress: the resume printed nothing but its directory)."""
    run_dir = train(tiny_cfg(tiny_args, "train.steps=2", "train.eval_every=0", "resume=never", "logging.quiet=true"))
    saved = config_lib.load(os.path.join(run_dir, "config.yaml"))
    assert (saved.resume, saved.logging.quiet, saved.logging.progress) == ("auto", False, True)
    capsys.readouterr()
    train(config_lib.load(os.path.join(run_dir, "config.yaml"), ["train.steps=3", "resume=required"]))
    assert "resumed " in capsys.readouterr().out  # (not refused, and not silent)
    assert config_lib.load(os.path.join(run_dir, "config.yaml")).resume == "auto"
    train(config_lib.load(os.path.join(run_dir, "config.yaml"), ["train.steps=4", "logging.progress=false"]))
    assert config_lib.load(os.path.join(run_dir, "config.yaml")).logging.progress is False  # (a batch job's: kept)


def test_resume_never_says_how_to_continue_the_run(tmp_path):
    """A command with resume=never refuses a directory that has checkpoints: the line named only another run.name or
    run.dir, not resume=auto, which continues it."""
    from lm.train import _check_resume

    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    cfg = config_lib.load("tiny", [f"run.dir={tmp_path}", "resume=never"])
    with pytest.raises(UserError, match="resume=never; .*resume=auto to continue it"):
        _check_resume(cfg, str(tmp_path / "checkpoints"))


def test_every_64_bit_seed_initialises_its_own_model():
    """`seed` is a 64-bit integer: seeds that differ only above the low 32 bits (0 and 2**32, -1 and 2**32 - 1)
    initialised the same model (jax.random.PRNGKey kept the low 32 bits), while a seed below 2**32 keeps its key."""
    from lm import sharding
    from lm.steps import create_state

    def init(seed):
        cfg = config_lib.load("tiny", ["model.vocab_size=257", "model.max_seq_len=32", f"seed={seed}"])
        state, _ = create_state(cfg, make_optimizer(cfg.optim, 10), sharding.make_mesh(cfg.mesh))
        return [np.asarray(state.rng)] + [np.asarray(x) for x in jax.tree.leaves(state.params)]

    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b))
    assert np.array_equal(init(7)[0], np.asarray(jax.random.PRNGKey(7)))  # (runs of seeds below 2**32 are unchanged)
    assert not same(init(0), init(2**32))
    assert not same(init(-1), init(2**32 - 1))
    assert not same(init(-(2**63)), init(0))


def test_weights_mismatch_names_booleans_as_written():
    """(The message said model.fused_qkv=False ... override them as model.fused_qkv=True: Python's spelling, not
    the config's; found by a fuzz of every key.)"""
    from lm.pretrained import inherit

    trained = ModelConfig(vocab_size=320, max_seq_len=32, n_layer=1, n_embd=32, fused_qkv=True)
    with pytest.raises(UserError) as info:
        inherit(ModelConfig(fused_qkv=False), trained, chosen=["model.fused_qkv"])
    message = str(info.value)
    assert "model.fused_qkv=false (the weights have true)" in message, message
    assert "override them as model.fused_qkv=true" in message, message


# slow: about 9 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_checkpoint_of_before_the_softmax_over_ids_alone_is_said_at_resume(tiny_args, capsys):
    """Before 2026-12-06 the loss took a padded vocabulary's rows (bytes: 257 ids in 320) into its softmax: a
    checkpoint of then resumed with other updates and a lower loss without a word. One whose dataset item records
    no softmax rule is said; this lm's checkpoints record it."""
    from lm import train as train_lib

    args = ["train.ckpt_every=2", "train.eval_every=0"]
    run_dir = train(tiny_cfg(tiny_args, *args, "train.steps=2"))
    path = os.path.join(run_dir, "checkpoints", "2", "dataset", "metadata")
    with open(path) as f:
        item = json.load(f)
    assert item[train_lib.SOFTMAX] == train_lib.SOFTMAX_IDS
    with open(path, "w") as f:  # as an older lm wrote it
        json.dump({k: v for k, v in item.items() if k != train_lib.SOFTMAX}, f)
    capsys.readouterr()
    train(tiny_cfg(tiny_args, *args, "train.steps=3"))
    err = capsys.readouterr().err
    assert "records no softmax rule" in err and "63 rows its padded vocabulary adds" in err, err
    train(tiny_cfg(tiny_args, *args, "train.steps=4"))  # (step 3 records it)
    assert "records no softmax rule" not in capsys.readouterr().err
