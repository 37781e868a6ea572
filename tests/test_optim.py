"""lm.optim: the wsd schedule and decays branched from its stable phase; Muon's groups, how each kernel is read as
matrices (fused qkv, attention's output, scanned layers, LoRA adapters), its shape scaling, and Muon in training
(resume, LoRA). Muon on sharded meshes: tests/test_sharding.py."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers
from helpers import assert_same_losses, assert_same_params, losses, params

from lm import config as config_lib
from lm import lora, platform
from lm.config import ModelConfig, OptimConfig
from lm.errors import ConfigError, UserError
from lm.model import init_params, unscanned
from lm.optim import check_branch, make_optimizer, muon_dimensions, schedule
from lm.train import train


def test_wsd_schedule_values_are_exact():
    """Warmup, the peak until the decay, then the decay's shape over its last round(fraction * steps) updates."""
    base = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay="wsd", decay_fraction=0.2)
    k = np.arange(101)
    warmup = 1e-3 * (k + 1) / 10
    t = np.clip((k - 80) / 20, 0, 1)  # the decay: updates 80..99, reaching min_lr at 100
    shapes = {
        "linear": 1e-3 - 9e-4 * t,
        "cosine": 1e-4 + 9e-4 * 0.5 * (1 + np.cos(np.pi * t)),
        "1-sqrt": 1e-4 + 9e-4 * (1 - np.sqrt(t)),
    }
    for shape, decay in shapes.items():
        got = np.asarray(schedule(OptimConfig(**base, decay_shape=shape), 100)(k))
        np.testing.assert_allclose(got, np.where(k < 10, warmup, decay), rtol=1e-6, err_msg=shape)
        assert np.all(got[9:81] == np.float32(1e-3)), shape  # the peak itself, exactly, up to the decay's first update
    # 1-sqrt falls fastest at the end: half way through the decay, 29% of the way down.
    assert float(schedule(OptimConfig(**base), 100)(90)) == pytest.approx(1e-4 + 9e-4 * (1 - math.sqrt(0.5)))
    # Muon's group: the same shape, from muon_lr down to min_lr scaled alike.
    muon = np.asarray(schedule(OptimConfig(**base), 100, peak=0.02)(k))
    np.testing.assert_allclose(muon, 20 * np.asarray(schedule(OptimConfig(**base), 100)(k)), rtol=1e-6)
    # A fraction of 1 without warmup decays from the first update: the branch that init_from starts.
    whole = schedule(OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, decay="wsd", decay_fraction=1.0, decay_shape="linear"), 50)
    assert float(whole(0)) == pytest.approx(1e-3) and float(whole(25)) == pytest.approx(5e-4)
    # A decay of round(fraction * steps) < 2 updates takes two, so that one is lowered: the decay's first update
    # takes the peak (a decay of one update, as before, left the whole run at the peak).
    short = schedule(OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0, decay="wsd", decay_fraction=0.01), 20)
    assert float(short(18)) == pytest.approx(1e-3) and float(short(19)) == pytest.approx(1e-4 + 9e-4 * (1 - math.sqrt(0.5)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.decay_fraction=0"], "optim.decay_fraction must be in (0, 1]"),
        (["optim.decay_fraction=1.5"], "optim.decay_fraction must be in (0, 1]"),
        (["optim.decay=wsd", "optim.decay_fraction=0.9"], "optim.warmup_steps=5 runs into the wsd decay, the last 18"),
        # (no warmup to lower, and any fraction decays over 2 steps: it said to lower either)
        (["optim.decay=wsd", "optim.warmup_steps=0", "train.steps=1"],
         "optim.decay=wsd decays over at least 2 steps, more than train.steps=1; raise train.steps to 2 or more"),
        (["optim.decay_shape=sqrt"], "optim.decay_shape='sqrt' is not one of linear, cosine, 1-sqrt"),
        (["optim.decay_shape=cosine"], "optim.decay_shape=cosine applies only to optim.decay=wsd"),
        (["optim.name=lion"], "optim.name='lion' is not one of adamw, muon"),
        (["optim.muon_lr=0.05"], "optim.muon_lr=0.05 applies only to optim.name=muon"),
        (["optim.name=muon", "optim.muon_ns_steps=0"], "optim.muon_ns_steps must be >= 1"),
        (["optim.name=muon", "optim.muon_ns_steps=100000"], "optim.muon_ns_steps must be at most 100"),  # (compiled on)
        (["optim.name=muon", "optim.muon_momentum=1"], "optim.muon_momentum must be in [0, 1)"),
        (["optim.name=muon", "optim.muon_lr=0"], "optim.muon_lr must be a finite number > 0"),
        (["optim.name=muon", "optim.muon_lr=inf"], "optim.muon_lr must be a finite number > 0, got inf"),
        (["optim.name=muon", "optim.muon_update_rms=inf"], "optim.muon_update_rms must be a finite number >= 0"),
        (["optim.lr=.inf"], "optim.lr must be a finite number > 0, got inf"),
        # (optax's schedules take them as int32: a traceback from inside the jitted step)
        (["optim.warmup_steps=3000000000"], "optim.warmup_steps must be in [0, 2**31) (the step counter is 32-bit)"),
    ],
)
def test_bad_schedule_and_muon_settings(overrides, message):
    with pytest.raises(ConfigError) as e:
        config_lib.load("tiny", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_wsd_schedule_under_data_epochs_is_judged_by_the_steps_the_epochs_give():
    """(It was refused against the preset's train.steps, which data.epochs replaces; lm.train checks it once the
    epochs' steps are known: tests/test_finetune.py.)"""
    wsd = ["optim.decay=wsd", "optim.decay_fraction=0.95"]  # with tiny's 20 steps and 5 of warmup: 1 stable step
    with pytest.raises(ConfigError, match="runs into the wsd decay"):
        config_lib.load("tiny", wsd)
    assert config_lib.load("tiny", [*wsd, "data.format=examples", "data.epochs=1"]).data.epochs == 1


# --- Muon ------------------------------------------------------------------------------------------------------

MODEL = ModelConfig(vocab_size=64, max_seq_len=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=True)


def _is_dims(x) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


@functools.cache
def _params(model: ModelConfig):
    return nn.unbox(init_params(model, jax.random.PRNGKey(0)))


def _random_like(tree, seed=1):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@functools.cache
def _optimizer(cfg: OptimConfig):
    """The optimizer of these settings, and its update jitted once (it is traced again for each tree it meets)."""
    tx = make_optimizer(cfg, 100)
    return tx, jax.jit(tx.update)


def _first_update(cfg: OptimConfig, params, grads):
    tx, update = _optimizer(cfg)
    return update(grads, tx.init(params), params)[0]


def _muon_cfg(**kw):
    return OptimConfig(name="muon", warmup_steps=0, decay="constant", grad_clip=0.0, **kw)


def _orthogonalised(g_2d, cfg):
    """The update Muon makes of a plain 2-D kernel (an MLP's) with this gradient, at its first step."""
    p = {"params": {"h_0": {"mlp": {"fc": {"kernel": jnp.zeros(g_2d.shape)}}}}}
    g = {"params": {"h_0": {"mlp": {"fc": {"kernel": g_2d}}}}}
    return _first_update(cfg, p, g)["params"]["h_0"]["mlp"]["fc"]["kernel"]


def test_muon_trains_the_blocks_matrices_and_adamw_the_rest():
    for model in (MODEL, ModelConfig(**{**MODEL.__dict__, "fused_qkv": False, "tie_embeddings": False})):
        flat = {
            "/".join(k.key for k in path): d
            for path, d in jax.tree_util.tree_flatten_with_path(muon_dimensions(_params(model)), is_leaf=_is_dims)[0]
        }
        for name, d in flat.items():
            matrix = "/h_" in f"/{name}" and name.endswith("kernel")
            assert (d is not None) == matrix, name  # not embeddings, the head, norms or biases
        assert "params/lm_head/kernel" in flat or model.tie_embeddings


def test_muon_update_is_the_orthogonalised_gradient_scaled_by_shape():
    cfg = _muon_cfg(muon_lr=1.0)
    g = jax.random.normal(jax.random.PRNGKey(0), (32, 128))
    u = -np.asarray(_orthogonalised(g, cfg))
    # Newton-Schulz's quintic leaves singular values near 1 (about 0.7 to 1.2), not exactly 1, in the
    # directions of the gradient's: U V^T of its SVD. A [32, 128] matrix: times sqrt(128 / 32) = 2.
    s = np.linalg.svd(u / 2, compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.3
    left, _, right = np.linalg.svd(np.asarray(g), full_matrices=False)
    polar = left @ right
    cosine = np.sum(u * polar) / np.linalg.norm(u) / np.linalg.norm(polar)
    assert cosine > 0.97
    # A tall [128, 32] matrix is not scaled up; with muon_update_rms the update has about that RMS in either shape:
    # ~0.85x it, as README says (the singular values Newton-Schulz leaves are below 1 on average).
    tall = -np.asarray(_orthogonalised(g.T, cfg))
    np.testing.assert_allclose(tall, u.T / 2, rtol=1e-4, atol=1e-6)
    for shape_g in (g, g.T):
        rms = -np.asarray(_orthogonalised(shape_g, _muon_cfg(muon_lr=1.0, muon_update_rms=0.2)))
        plain = -np.asarray(_orthogonalised(shape_g, cfg))
        scaled = plain * 0.2 * math.sqrt(128) / math.sqrt(max(1, shape_g.shape[1] / shape_g.shape[0]))
        # (two programs, whose matmuls may sum in another order: 5 Newton-Schulz iterations amplify it to ~1e-5)
        np.testing.assert_allclose(rms, scaled, rtol=1e-5, atol=2e-5)
        assert 0.8 < np.sqrt(np.mean(rms**2)) / 0.2 < 0.9


def test_each_kernel_is_orthogonalised_as_its_matrices():
    """Fused qkv [D, K, G+2, H]: each slot's [D, K*H] alone; attention's output [N, H, D]: one [N*H, D];
    separate q/k/v [D, N, H]: [D, N*H]."""
    cfg = _muon_cfg(muon_lr=1.0)
    params = _params(MODEL)
    grads = _random_like(params)
    got = _first_update(cfg, params, grads)["params"]["h_1"]["attn"]
    g = grads["params"]["h_1"]["attn"]
    d, k, slots, h = g["qkv"]["kernel"].shape
    assert (k, slots) == (2, 4)  # GQA: two query heads per K/V head
    for slot in range(slots):
        alone = _orthogonalised(g["qkv"]["kernel"][:, :, slot].reshape(d, k * h), cfg)
        np.testing.assert_allclose(got["qkv"]["kernel"][:, :, slot].reshape(d, k * h), alone, rtol=1e-4, atol=1e-6)
    n, h, d = g["proj"]["kernel"].shape
    alone = _orthogonalised(g["proj"]["kernel"].reshape(n * h, d), cfg)
    np.testing.assert_allclose(got["proj"]["kernel"].reshape(n * h, d), alone, rtol=1e-4, atol=1e-6)
    separate = ModelConfig(**{**MODEL.__dict__, "fused_qkv": False})
    params = _params(separate)
    grads = _random_like(params)
    got = _first_update(cfg, params, grads)["params"]["h_0"]["attn"]["q"]["kernel"]
    q = grads["params"]["h_0"]["attn"]["q"]["kernel"]
    np.testing.assert_allclose(got, _orthogonalised(q.reshape(32, -1), cfg).reshape(q.shape), rtol=1e-4, atol=1e-6)
    # Biases and norms take AdamW's first step: lr * sign(gradient).
    bias = grads["params"]["h_0"]["mlp"]["fc"]["bias"]
    np.testing.assert_allclose(_first_update(cfg, params, grads)["params"]["h_0"]["mlp"]["fc"]["bias"], -cfg.lr * np.sign(bias), rtol=1e-4)


def test_scanned_layers_are_orthogonalised_layer_by_layer():
    """With scan_layers each layer's slice of a stacked [L, ...] kernel is its own matrix: the same updates as
    the unscanned model's."""
    scanned = ModelConfig(**{**MODEL.__dict__, "scan_layers": True})
    cfg = _muon_cfg(muon_lr=1.0, muon_weight_decay=0.1)
    params = _params(scanned)
    grads = _random_like(params)
    got, _ = unscanned(_first_update(cfg, params, grads), scanned)
    flat_params, _ = unscanned(params, scanned)
    flat_grads, _ = unscanned(grads, scanned)
    want = _first_update(cfg, flat_params, flat_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)


def test_each_group_has_its_own_learning_rate_and_weight_decay():
    model = ModelConfig(**{**MODEL.__dict__, "tie_embeddings": False})
    cfg = _muon_cfg(lr=1e-3, weight_decay=0.5, muon_lr=0.02, muon_weight_decay=0.25)
    params = _params(model)
    zero = jax.tree.map(jnp.zeros_like, params)
    u = _first_update(cfg, params, zero)["params"]
    p = params["params"]
    # With zero gradients only decoupled decay moves: lr x decay x weight, each group its own.
    np.testing.assert_allclose(u["h_0"]["mlp"]["fc"]["kernel"], -0.02 * 0.25 * p["h_0"]["mlp"]["fc"]["kernel"], rtol=1e-5)
    np.testing.assert_allclose(u["lm_head"]["kernel"], -1e-3 * 0.5 * p["lm_head"]["kernel"], rtol=1e-5)
    assert not np.any(u["h_0"]["ln1"]["scale"]) and not np.any(u["wte"]["embedding"])
    # The Muon group's learning rate scales its updates, and only its.
    grads = _random_like(params)
    a, b = (_first_update(_muon_cfg(muon_lr=lr), params, grads)["params"] for lr in (0.01, 0.03))
    np.testing.assert_allclose(b["h_0"]["mlp"]["proj"]["kernel"], 3 * a["h_0"]["mlp"]["proj"]["kernel"], rtol=1e-5)
    np.testing.assert_array_equal(b["wte"]["embedding"], a["wte"]["embedding"])


def test_muon_momentum_and_nesterov_are_used():
    params = {"params": {"h_0": {"mlp": {"fc": {"kernel": jnp.zeros((8, 8))}}}}}
    g1, g2 = (_random_like(params, seed) for seed in (1, 2))

    def second_update(**kw):
        tx, update = _optimizer(_muon_cfg(muon_lr=1.0, **kw))
        _, state = update(g1, tx.init(params), params)
        return np.asarray(update(g2, state, params)[0]["params"]["h_0"]["mlp"]["fc"]["kernel"])

    base = second_update()
    assert not np.allclose(base, second_update(muon_nesterov=False), atol=1e-3)
    assert not np.allclose(base, second_update(muon_momentum=0.5), atol=1e-3)
    # Without momentum the second update depends on the second gradient alone.
    np.testing.assert_allclose(second_update(muon_momentum=0.0), _orthogonalised(g2["params"]["h_0"]["mlp"]["fc"]["kernel"], _muon_cfg(muon_lr=1.0)), rtol=1e-4, atol=1e-6)
    fewer = second_update(muon_ns_steps=2)
    assert not np.allclose(base, fewer, atol=1e-3)


def _muon_on(monkeypatch, setting: str):
    """Muon's optimizer (muon_lr 1) built under LM_PLATFORM=setting, and its update jitted."""
    monkeypatch.setenv("LM_PLATFORM", setting)
    platform.of.cache_clear()
    try:
        tx = make_optimizer(_muon_cfg(muon_lr=1.0), 100)
    finally:
        platform.of.cache_clear()
    return tx, jax.jit(tx.update)


def test_muon_matmuls_take_the_platforms_precision(monkeypatch):
    """lm.platform's muon_matmul: LM_PLATFORM=muon_matmul=bf16 traces every Newton-Schulz matmul with bfloat16
    inputs and float32 sums (none by default), and the update is still the orthogonalised gradient's (a CPU
    computes either in float32; a GPU rounds)."""
    params = {"params": {"h_0": {"mlp": {"fc": {"kernel": jnp.zeros((32, 128))}}}}}
    grads = _random_like(params)

    def traced(setting):
        tx, update = _muon_on(monkeypatch, setting)
        text = update.lower(grads, tx.init(params), params).as_text()
        return text, np.asarray(update(grads, tx.init(params), params)[0]["params"]["h_0"]["mlp"]["fc"]["kernel"])

    default, u_default = traced("")
    rounded, u_rounded = traced("muon_matmul=bf16")
    assert default.count("stablehlo.dot_general") > 0 and "lhs_precision_type = bf16" not in default
    assert rounded.count("lhs_precision_type = bf16") == rounded.count("stablehlo.dot_general") > 0
    assert np.sum(u_default * u_rounded) / np.linalg.norm(u_default) / np.linalg.norm(u_rounded) > 0.99


def test_muon_iterations_in_bfloat16_keep_optax_state_and_update(monkeypatch):
    """lm.platform's muon_matmul=bf16_iterations: every Newton-Schulz matmul takes and gives bfloat16 arrays, the
    momentum stays float32 and is optax's to the bit (a checkpoint moves between the choices), and the update is
    the float32 iterations' to within bfloat16's rounding, batched by shape too. With float32 arrays the two
    runs of optax's scale_by_muon are optax's one run: the same state, the same update to float32 rounding."""
    from optax.contrib import scale_by_muon

    from lm.optim import _iterated_in, muon_dimensions

    params = {"params": {"h_0": {"mlp": {"fc": {"kernel": jnp.zeros((32, 128))}, "proj": {"kernel": jnp.zeros((128, 32))}}}}}
    grads = [_random_like(params, seed) for seed in (1, 2)]
    optax_own = scale_by_muon(ns_steps=5, beta=0.95, nesterov=True, weight_dimension_numbers=muon_dimensions)
    in_float32 = _iterated_in(jnp.float32, 5, 0.95, True, muon_dimensions)
    state, mine = optax_own.init(params), in_float32.init(params)
    with jax.default_matmul_precision("float32"):  # (a GPU's default, TF32, would round the two runs apart)
        for g in grads:
            update, state = optax_own.update(g, state)
            my_update, mine = in_float32.update(g, mine)
    assert jax.tree.structure(mine) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, mine, state)
    # (the iterations' run normalises what the momentum's already did, to float32 rounding)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), my_update, update)

    def two_updates(setting):
        tx, step = _muon_on(monkeypatch, setting)
        text = step.lower(grads[0], tx.init(params), params).as_text()
        dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        updates, state = step(grads[0], tx.init(params), params)
        return dots, step(grads[1], state, params)

    _, (default, default_state) = two_updates("")
    for batch in ("matrix", "shape"):
        dots, (rounded, rounded_state) = two_updates(f"muon_matmul=bf16_iterations,muon_batch={batch}")
        assert dots and all(line.count("bf16>") == 3 and "f32>" not in line for line in dots), dots
        assert jax.tree.structure(rounded_state) == jax.tree.structure(default_state)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(rounded))
        assert jax.tree.leaves(jax.tree.map(lambda a, b: a.dtype == b.dtype, rounded_state, default_state)) == [True] * len(jax.tree.leaves(default_state))
        # (the momentum: the same sums in the same order; batched, stacked by shape and back)
        jax.tree.map(np.testing.assert_array_equal, rounded_state, default_state)
        for name in ("fc", "proj"):
            a, b = (np.asarray(u["params"]["h_0"]["mlp"][name]["kernel"]) for u in (default, rounded))
            assert np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b) > 0.99
            assert 0 < np.max(np.abs(a - b)) < 0.1 * np.max(np.abs(a))


@pytest.mark.parametrize("scan", [False, True])
def test_muon_batched_by_shape_is_the_same_update_in_fewer_matmuls(monkeypatch, scan):
    """lm.platform's muon_batch=shape: the matrices of one shape orthogonalised as one batch give the updates and
    state (a momentum per matrix, as a checkpoint holds it) of optax's one at a time, with a third of the matmuls
    for three layers' (scanned layers are one array a kind already: the same)."""
    import dataclasses

    model = dataclasses.replace(MODEL, n_layer=3, scan_layers=scan)
    params = _params(model)
    first, second = _random_like(params, 1), _random_like(params, 2)

    def two_updates(setting):
        tx, update = _muon_on(monkeypatch, setting)
        dots = update.lower(first, tx.init(params), params).as_text().count("stablehlo.dot_general")
        updates, state = update(first, tx.init(params), params)
        return dots, update(second, state, params)

    dots, (updates, state) = two_updates("muon_batch=matrix")
    batched_dots, (batched_updates, batched_state) = two_updates("muon_batch=shape")
    assert jax.tree.structure(batched_state) == jax.tree.structure(state)
    # (float32 sums in another order, which five iterations amplify: a GPU's kernels, and XLA:CPU's older emitters,
    # which the suite compiles with (tests/conftest.py), reorder a batch's matmuls more than XLA:CPU's own)
    same = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    jax.tree.map(same, (batched_updates, batched_state), (updates, state))
    assert batched_dots == (dots if scan else dots // 3) > 0


def test_lora_adapters_are_muon_matrices():
    params = _params(MODEL)
    adapters = lora.init_adapters(params, 4, ["qkv", "fc"], jax.random.PRNGKey(1))
    dims = jax.tree.leaves(muon_dimensions(adapters), is_leaf=_is_dims)
    assert len(dims) == 2 * 2 * 2 and all(d is not None for d in dims)
    grads = _random_like(adapters)
    cfg = _muon_cfg(muon_lr=1.0)
    a = grads["params"]["h_0"]["attn"]["qkv"]["a"]  # [D, rank]
    got = _first_update(cfg, adapters, grads)["params"]["h_0"]["attn"]["qkv"]["a"]
    np.testing.assert_allclose(got, _orthogonalised(a, cfg), rtol=1e-4, atol=1e-6)


# --- in training ----------------------------------------------------------------------------------------------


def _args(tiny_args, run_dir, *more):
    return [a for a in tiny_args if not a.startswith("run.dir=")] + [f"run.dir={run_dir}", *more]


STEADY = ["train.log_every=1", "train.eval_every=4", "train.ckpt_every=4", "optim.warmup_steps=2", "optim.decay=wsd"]


# slow: about 13 s, outside the default suite's 15 minutes; .ci/run runs it after the default suite
@pytest.mark.slow
def test_a_decay_branched_from_the_stable_phase_is_the_longer_run_exactly(tmp_path, tiny_args, capsys):
    """The README's recipe: a wsd run of 8 steps has a checkpoint at step 4, in its stable phase; that step
    directory copied into a new run directory and resumed with train.steps=16 continues as the 16-step run does:
    the same lr and loss at every step, the same parameters."""
    whole = train(config_lib.load("tiny", _args(tiny_args, tmp_path / "whole", *STEADY, "train.steps=16")))
    stable = train(config_lib.load("tiny", _args(tiny_args, tmp_path / "stable", *STEADY, "train.steps=8")))
    shutil.copytree(os.path.join(stable, "checkpoints", "4"), tmp_path / "branch" / "checkpoints" / "4")
    capsys.readouterr()
    branch = train(config_lib.load(os.path.join(stable, "config.yaml"), [f"run.dir={tmp_path / 'branch'}", "train.steps=16"]))
    assert "warning:" not in capsys.readouterr().err
    # A decay that begins at the checkpoint, from update 5 on, as a 5-step run's: asked for, so no warning of a
    # learning rate "jump" (there was one, which also advised wsd to a wsd run).
    shutil.copytree(os.path.join(stable, "checkpoints", "4"), tmp_path / "short" / "checkpoints" / "4")
    short = train(config_lib.load(os.path.join(stable, "config.yaml"), [f"run.dir={tmp_path / 'short'}", "train.steps=5"]))
    assert "warning:" not in capsys.readouterr().err
    (lr,) = [r["lr"] for r in losses(short) if r["step"] == 5 and "lr" in r]
    assert lr < 3e-3  # decaying
    # The optimizer's other settings are still named where a branch changes them (the schedule's are the branch).
    shutil.copytree(os.path.join(stable, "checkpoints", "4"), tmp_path / "wd" / "checkpoints" / "4")
    more = [f"run.dir={tmp_path / 'wd'}", "train.steps=16", "optim.decay_fraction=0.25", "optim.weight_decay=0.5"]
    train(config_lib.load(os.path.join(stable, "config.yaml"), more))
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert "optim.weight_decay" in warning and "decay_fraction" not in warning and "learning rate" not in warning
    after = lambda run: [r for r in losses(run) if r["step"] > 4]
    assert_same_losses(after(whole), after(branch))
    assert_same_params(params(whole, 16), params(branch, 16))
    lrs = [r["lr"] for r in losses(whole) if "lr" in r]
    assert lrs[2:14] == [pytest.approx(3e-3)] * 12 and lrs[-1] < 1e-3  # the peak until step 14, then the decay
    assert [r["lr"] for r in losses(stable) if "lr" in r][-1] < 1.5e-3  # the stable run decayed at its own end


def test_a_checkpoint_taken_in_the_decay_cannot_branch(tmp_path, tiny_args):
    done = _args(tiny_args, tmp_path / "run", *STEADY, "train.steps=8", "train.ckpt_every=8")
    train(config_lib.load("tiny", done))  # its decay: steps 7 and 8
    with pytest.raises(UserError, match=r"cannot branch into this wsd schedule: it was taken in its run's decay, "
                                        r"which began after step 7; branch from a checkpoint at step 7 or before"):
        train(config_lib.load("tiny", [*done, "train.steps=16"]))
    early = _args(tiny_args, tmp_path / "early", *STEADY, "train.steps=8")
    train(config_lib.load("tiny", early), stop_after=4)
    with pytest.raises(UserError, match=r"this schedule's decay begins after step 3, before the checkpoint; raise "
                                        r"train.steps or lower optim.decay_fraction"):  # fmt: skip
        train(config_lib.load("tiny", [*early, "optim.decay_fraction=0.75"]))
    # Where data.epochs sets train.steps, raising train.steps changes nothing: the advice names data.epochs.
    wsd = config_lib.OptimConfig(decay="wsd", warmup_steps=0, decay_fraction=0.5)
    with pytest.raises(UserError, match=r"raise data.epochs \(=2, which sets train.steps\) or lower optim.decay"):
        check_branch(wsd, 40, wsd, 12, 8, "ckpt", "data.epochs (=2, which sets train.steps)")


def test_muon_resume_is_exact(tmp_path, tiny_args):
    run = ["optim.name=muon", "train.steps=12", "train.ckpt_every=6", "train.eval_every=6", "train.log_every=1"]
    whole = train(config_lib.load("tiny", _args(tiny_args, tmp_path / "whole", *run)))
    cut = config_lib.load("tiny", _args(tiny_args, tmp_path / "cut", *run))
    train(cut, stop_after=8)
    resumed = train(cut)
    assert_same_losses(losses(whole), losses(resumed))
    assert_same_params(params(whole, 12), params(resumed, 12))
    rows = [r for r in losses(whole) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


def test_muon_with_grad_accum_matches_one_batch(tmp_path, tiny_args):
    run = ["optim.name=muon", "train.steps=4", "train.log_every=1", "train.eval_every=0"]
    one = train(config_lib.load("tiny", _args(tiny_args, tmp_path / "one", *run)))
    four = train(config_lib.load("tiny", _args(tiny_args, tmp_path / "four", *run, "train.grad_accum=4")))
    assert_same_losses([r for r in losses(one) if "loss" in r], [r for r in losses(four) if "loss" in r], rtol=1e-4)


def test_muon_trains_lora_adapters(tmp_path, tiny_args, tiny_run):
    run = ["optim.name=muon", f"init_from={tiny_run}", "lora.rank=4", "train.steps=10", "train.eval_every=10",
           "train.log_every=1"]  # fmt: skip
    run_dir = train(config_lib.load("tiny", _args(tiny_args, tmp_path / "lora", *run)))
    rows = losses(run_dir)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]  # step 0: the base model
    stored = params(run_dir, 10)
    names = {path[-1].key for path, _ in jax.tree_util.tree_flatten_with_path(stored)[0]}
    assert names == {"a", "b"}
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert "name: muon" in f.read()
    # The logged lr is the one the adapters take, Muon's (it was optim.lr's, which no parameter of the run takes).
    cfg = config_lib.load("tiny", _args(tiny_args, tmp_path / "lora", *run))
    want = np.asarray(schedule(cfg.optim, 10, cfg.optim.muon_lr)(jnp.arange(10)))
    np.testing.assert_allclose([r["lr"] for r in rows if "lr" in r], want, rtol=1e-6)


def test_a_branch_refused_for_muon_lr_names_optim_muon_lr():
    """(The line said "keep the lr", though optim.lr was the same and optim.muon_lr had changed.)"""
    wsd = OptimConfig(name="muon", decay="wsd", warmup_steps=2)
    with pytest.raises(UserError, match=r"\(optim.muon_lr's schedule\).*keep optim.muon_lr"):
        check_branch(wsd, 8, dataclasses.replace(wsd, muon_lr=0.03), 16, 4, "ckpt")


def test_a_linear_decay_starts_at_the_peak_exactly():
    """The decay's first update takes the peak itself, so a checkpoint at the warmup's end plus one (which a refusal
    names as a branch point) branches into wsd. (optax's linear_schedule gave 1e-3 - 9e-4 + 9e-4 = 0.00099999993 at
    lr=1e-3, min_lr=1e-4: the branch was refused as "took learning rate 0.001, this schedule gives 0.001".)"""
    linear = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=5, decay="linear")
    k = np.arange(21)
    got = np.asarray(schedule(linear, 20)(k))
    assert got[5] == np.float32(1e-3)
    expected = np.where(k < 5, 1e-3 * (k + 1) / 5, 1e-3 - 9e-4 * np.clip((k - 5) / 15, 0, 1))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    check_branch(linear, 20, dataclasses.replace(linear, decay="wsd"), 30, 6, "ckpt")  # passes: no exception


def test_a_resume_whose_epochs_give_other_steps_names_data_epochs():
    """Under data.epochs a resume at another batch size changes train.steps without the user giving it: the line
    names data.epochs, not a train.steps they never set, nor advice to lengthen train.steps under wsd."""
    from lm.train import _resume_changes

    stored = config_lib.load("tiny", ["data.format=examples", "data.epochs=3", "data.tokenizer=bytes"])
    stored = config_lib.replace(stored, train={"steps": 21})
    now = config_lib.replace(stored, train={"steps": 35}, data={"batch_size": 4})
    line = _resume_changes(stored, now, 7)[0]
    assert "data.epochs=3 now gives train.steps 35, the run's 21" in line
    assert "train.steps 21 vs 35" not in line and "optim.decay=wsd" not in line


def test_a_resume_names_only_the_schedules_settings_as_the_learning_rates_cause():
    """A longer run with another optim.b1 said "the learning rate of update 8 is ... (train.steps 20 vs 40; optim.b1
    0.9 vs 0.5)", as if b1 moved the learning rate; b1 is among the settings that change the run's course."""
    from lm.train import _resume_changes

    stored = config_lib.load("tiny", ["train.steps=20"])
    now = config_lib.replace(stored, train={"steps": 40}, optim={"b1": 0.5, "min_lr": 1e-5})
    rate, course = _resume_changes(stored, now, 7)
    assert rate.startswith("the learning rate of update 8 is ") and "optim.b1" not in rate
    assert rate.endswith(f"(train.steps 20 vs 40; optim.min_lr {stored.optim.min_lr} vs 1e-05)")
    assert course.startswith("resuming step 7 with other settings than the run's (optim.b1 0.9 vs 0.5)")


def test_a_resume_at_the_last_step_warns_of_no_changed_setting():
    """A run resumed at its last step trains no update: another lr, batch or seed changes nothing there, so no line
    says the run goes on otherwise (the lr line was already left out; the others named the changed lr instead)."""
    from lm.train import _resume_changes

    stored = config_lib.load("tiny", [])
    now = config_lib.replace(stored, seed=3, optim={"lr": 1e-2}, data={"batch_size": 4})
    assert _resume_changes(stored, now, stored.train.steps) == []
    assert any("optim.lr" in line for line in _resume_changes(stored, now, stored.train.steps - 1))


def test_a_resume_that_evaluates_other_validation_batches_says_so():
    """The best checkpoint is chosen by val_loss across resumes: another train.eval_batches (or batch, or block)
    measures it on other windows from the resume on, which nothing said."""
    from lm.train import _resume_changes

    stored = config_lib.load("tiny", [])
    line = _resume_changes(stored, config_lib.replace(stored, train={"eval_batches": 5}), 10)[-1]
    assert line.startswith("val_loss after step 10 is measured on other validation batches than before "
                           "(train.eval_batches 2 vs 5)")  # fmt: skip
    assert _resume_changes(stored, config_lib.replace(stored, train={"eval_every": 5}), 10) == []


def test_a_resume_that_weighs_validation_otherwise_says_so():
    """val_loss is a mixture's weighted mean, and the best checkpoint is chosen by it across resumes: other weights
    (or document masks) measure the same weights' val_loss otherwise from the resume on, which only the line that
    the run goes on otherwise said, nothing of --best."""
    from lm.config import SourceConfig
    from lm.train import _resume_changes

    stored = config_lib.load("tiny", [])
    mix = lambda a, b: config_lib.replace(stored, data={"path": "", "sources": [
        SourceConfig(path="a.txt", weight=a), SourceConfig(path="b.txt", weight=b)]})  # fmt: skip
    line = _resume_changes(mix(3, 1), mix(1, 3), 10)[-1]
    assert line.startswith("val_loss after step 10 weighs its sources' losses by other shares than before "
                           "(data.sources [a.txt: 3, b.txt: 1] vs [a.txt: 1, b.txt: 3])")  # fmt: skip
    assert _resume_changes(mix(3, 1), mix(6, 2), 10) == []  # the same shares
    masked = config_lib.replace(stored, data={"document_mask": True})
    assert "(data.document_mask False vs True)" in _resume_changes(stored, masked, 10)[-1]


def test_a_resume_compares_learning_rates_in_one_compiled_program():
    """The resume's learning-rate check evaluates both schedules in one jitted call: op by op, each of a schedule's
    dozen operations compiled a program of its own, about a second of every resume (a fresh process: this one's
    earlier tests have compiled those operations already)."""
    import subprocess
    import sys

    code = """
import jax
from lm import config as C
from lm.train import _resume_changes
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, **__: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
)
stored = C.load("shakespeare_char")
assert _resume_changes(stored, C.replace(stored, train={"steps": 4000}), 500)
print(len(compiles))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.getcwd())
    assert int(out.stdout.split()[-1]) <= 1, out.stdout
