"""Behaviour of lm.lora: fresh adapters change nothing, merging adds x A B to each target's output, training
moves only the adapters, adapter shapes and counts, scanned layers, and the target names."""

from __future__ import annotations

import functools
import operator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm import lora
from lm import model as M
from lm.config import ModelConfig
from lm.errors import UserError

CFG = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_embd=32)
ALL = ("qkv", "attn_proj", "fc", "mlp_proj")
TOKENS = np.arange(24, dtype=np.int32).reshape(2, 12) % 64


@functools.cache
def base_params(cfg: ModelConfig = CFG):
    return nn.unbox(M.init_params(cfg, jax.random.key(0)))


def with_random_b(adapters, seed: int = 1):
    """Adapters whose B is random too, so that they change the model."""
    rng = np.random.default_rng(seed)
    draw = lambda path, x: rng.normal(0, 0.1, x.shape).astype(np.float32) if path[-1].key == "b" else x
    return jax.tree_util.tree_map_with_path(draw, adapters)


def forward(params, cfg: ModelConfig = CFG):
    return M.Transformer(cfg).apply(params, TOKENS)


def test_fresh_adapters_leave_the_model_unchanged():
    params = base_params()
    adapters = lora.init_adapters(params, 4, ALL, jax.random.key(1))
    merged = lora.merge(params, adapters, alpha=8.0, rank=4)
    assert jax.tree.all(jax.tree.map(np.array_equal, merged, params))
    assert jax.tree.structure(merged) == jax.tree.structure(params)


def test_a_merged_kernel_adds_x_a_b_to_its_output():
    """For attention's output projection (inputs [N, H]), the merged kernel computes y + alpha/r * (x A) B."""
    params = base_params()
    adapters = with_random_b(lora.init_adapters(params, 4, ["attn_proj"], jax.random.key(1)))
    merged = lora.merge(params, adapters, alpha=2.0, rank=4)
    w = params["params"]["h_1"]["attn"]["proj"]["kernel"]
    ab = adapters["params"]["h_1"]["attn"]["proj"]
    assert w.shape == (4, 8, 32) and ab["a"].shape == (32, 4) and ab["b"].shape == (4, 32)
    x = np.random.default_rng(0).normal(size=(2, 3, 4, 8)).astype(np.float32)
    expected = np.tensordot(x, w, axes=2) + 0.5 * (x.reshape(2, 3, 32) @ ab["a"] @ ab["b"])
    got = np.tensordot(x, merged["params"]["h_1"]["attn"]["proj"]["kernel"], axes=2)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    untouched = merged["params"]["h_1"]["attn"]["qkv"]["kernel"]
    assert np.array_equal(untouched, params["params"]["h_1"]["attn"]["qkv"]["kernel"])


def test_merged_model_equals_a_forward_with_the_deltas_added_by_hand():
    params = base_params()
    adapters = with_random_b(lora.init_adapters(params, 2, ALL, jax.random.key(2)))
    by_hand = jax.tree.map(np.array, params)
    places = {"qkv": ("attn", "qkv"), "attn_proj": ("attn", "proj"), "fc": ("mlp", "fc"), "mlp_proj": ("mlp", "proj")}
    for layer in ("h_0", "h_1"):
        for parent, module in places.values():
            ab = adapters["params"][layer][parent][module]
            kernel = by_hand["params"][layer][parent][module]["kernel"]
            kernel += 3.0 / 2 * np.einsum("ir,ro->io", ab["a"], ab["b"]).reshape(kernel.shape)
    merged = jax.jit(lora.merge, static_argnames=("alpha", "rank"))(params, adapters, alpha=3.0, rank=2)
    np.testing.assert_allclose(forward(merged), forward(by_hand), atol=1e-5)
    assert not np.allclose(forward(merged), forward(params), atol=1e-3)


def test_training_moves_the_adapters_only():
    params = base_params()
    frozen = jax.tree.map(np.array, params)
    adapters = lora.init_adapters(params, 4, ALL, jax.random.key(3))
    tx = optax.adam(1e-2)
    opt_state = tx.init(adapters)

    @jax.jit
    def step(adapters, opt_state, params):
        def loss(adapters):
            logits = forward(lora.merge(params, adapters, alpha=8.0, rank=4))
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], TOKENS[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value, grads

    losses, grads = [], []
    for _ in range(5):
        adapters, opt_state, value, g = step(adapters, opt_state, params)
        losses.append(float(value))
        grads.append(g)
    # B starts at zero, so only B has a gradient at first; once B moves, A has one too.
    first, later = jax.tree_util.tree_flatten_with_path(grads[0])[0], jax.tree.leaves(grads[-1])
    assert all(np.any(g != 0) == (path[-1].key == "b") for path, g in first)
    assert all(np.any(g != 0) for g in later)
    assert losses[-1] < losses[0]
    assert jax.tree.all(jax.tree.map(np.array_equal, params, frozen))


def test_adapter_shapes_and_count():
    adapters = lora.init_adapters(base_params(), 4, ALL, jax.random.key(0))
    shapes = {k: v.shape for k, v in adapters["params"]["h_0"]["attn"]["qkv"].items()}
    assert shapes == {"a": (32, 4), "b": (4, 96)}  # qkv kernel [32, 4, 3, 8]
    # rank * (in + out) for qkv 32->96, attn_proj 32->32, fc 32->128, mlp_proj 128->32, in 2 layers
    assert M.count_params(adapters) == 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    a = adapters["params"]["h_0"]["mlp"]["fc"]["a"]
    assert a.dtype == jnp.float32 and 0.1 < float(a.std()) * np.sqrt(32) < 1.5
    assert set(lora.init_adapters(base_params(), 1, ["fc"], jax.random.key(0))["params"]["h_0"]) == {"mlp"}


def test_scanned_layers_get_stacked_adapters_that_merge_per_layer():
    scan_cfg = ModelConfig(**{**CFG.__dict__, "scan_layers": True})
    params = base_params()
    blocks = [params["params"][f"h_{i}"] for i in range(CFG.n_layer)]
    stacked = {"params": {**{k: v for k, v in params["params"].items() if not k.startswith("h_")}}}
    stacked["params"]["h"] = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    adapters = with_random_b(lora.init_adapters(stacked, 3, ALL, jax.random.key(4)))
    assert adapters["params"]["h"]["attn"]["proj"]["a"].shape == (2, 32, 3)
    assert adapters["params"]["h"]["attn"]["proj"]["b"].shape == (2, 3, 32)
    per_layer = {"params": {f"h_{i}": jax.tree.map(operator.itemgetter(i), adapters["params"]["h"]) for i in range(2)}}
    merged_scan = lora.merge(stacked, adapters, alpha=4.0, rank=3)
    merged = lora.merge(params, per_layer, alpha=4.0, rank=3)
    np.testing.assert_allclose(forward(merged_scan, scan_cfg), forward(merged), atol=1e-5)


def test_swiglu_and_separate_qkv_targets():
    cfg = ModelConfig(**{**CFG.__dict__, "mlp": "swiglu", "fused_qkv": False})
    params = base_params(cfg)
    adapters = lora.init_adapters(params, 2, ["q", "v", "gate", "up"], jax.random.key(0))
    assert set(adapters["params"]["h_0"]["attn"]) == {"q", "v"}
    assert adapters["params"]["h_0"]["attn"]["q"]["b"].shape == (2, 32)  # q kernel [32, 4, 8]
    assert set(adapters["params"]["h_0"]["mlp"]) == {"gate", "up"}
    merged = lora.merge(params, with_random_b(adapters), alpha=2.0, rank=2)
    assert not np.allclose(forward(merged, cfg), forward(params, cfg), atol=1e-3)
    default = lora.init_adapters(params, 2, ["qkv", "attn_proj"], jax.random.key(0))  # the default targets
    assert set(default["params"]["h_0"]["attn"]) == {"q", "k", "v", "proj"}


@pytest.mark.parametrize(
    "targets, message",
    [
        (["qkv", "mlp"], "unknown LoRA target(s) mlp; choose from qkv, q, k, v, attn_proj, fc, gate, up, mlp_proj"),
        ([], "no LoRA targets given; choose from qkv, q, k, v, attn_proj, fc, gate, up, mlp_proj"),
        (["q", "gate"], "LoRA target(s) q, gate match no weights of this model; it has qkv, attn_proj, fc, mlp_proj"),
    ],
)
def test_bad_targets(targets, message):
    with pytest.raises(UserError) as e:
        lora.init_adapters(base_params(), 2, targets, jax.random.key(0))
    assert str(e.value) == message


def test_a_rank_beyond_the_smallest_side_of_an_adapted_weight_is_refused():
    """A @ B cannot have a rank above the smaller side of the weight it adapts: rank 1000 on a width-64 model had
    trained 0.77M adapter weights for a 0.12M model, without a word. The bound is the targeted weights' own."""
    assert lora.init_adapters(base_params(), 32, ["fc"], jax.random.key(0))  # fc: [32, 128]
    with pytest.raises(UserError) as e:
        lora.init_adapters(base_params(), 33, ["fc"], jax.random.key(0))
    assert str(e.value) == (
        "lora.rank=33 is more than the smallest side of the weights it adapts (32), which bounds an adapter's rank; "
        "choose lora.rank <= 32"
    )
    gqa = base_params(ModelConfig(**{**CFG.__dict__, "fused_qkv": False, "n_kv_head": 1}))  # k, v: [32, 1, 8]
    assert lora.init_adapters(gqa, 9, ["q"], jax.random.key(0))
    with pytest.raises(UserError, match=r"lora.rank=9 .* \(8\)"):
        lora.init_adapters(gqa, 9, ["q", "v"], jax.random.key(0))
    with pytest.raises(UserError, match=r"lora.rank=9 .* \(8\)"):  # a scanned stack's layers are not a side
        lora.init_adapters(base_params(ModelConfig(**{**CFG.__dict__, "fused_qkv": False, "n_kv_head": 1,
                                                   "scan_layers": True})), 9, ["k"], jax.random.key(0))  # fmt: skip


def test_mismatched_adapters_are_refused():
    adapters = lora.init_adapters(base_params(), 2, ["fc"], jax.random.key(0))
    with pytest.raises(UserError, match="adapters have rank 2, not 4"):
        lora.merge(base_params(), adapters, alpha=1.0, rank=4)
    with pytest.raises(UserError, match="rank must be >= 1"):
        lora.init_adapters(base_params(), 0, ["fc"], jax.random.key(0))


def test_a_resume_may_reorder_or_repeat_targets_but_not_change_them():
    """The order of lora.targets, or a target named twice, makes the same adapters (A drawn per kernel, whatever
    the order): a resume that reordered them was refused as "other settings that change what it stores"."""
    from lm import config as config_lib
    from lm import train as train_lib

    params = base_params()
    one, other = (lora.init_adapters(params, 4, t, jax.random.key(3)) for t in (["qkv", "fc"], ["fc", "qkv", "fc"]))
    assert jax.tree.all(jax.tree.map(np.array_equal, one, other))
    def cfg(*targets):
        return config_lib.load("tiny", ["init_from=BASE", "lora.rank=4", f"lora.targets=[{','.join(targets)}]"])

    train_lib._check_train_state_layout(cfg("qkv", "fc"), cfg("fc", "qkv", "fc"), "RUN/checkpoints/2")
    with pytest.raises(UserError, match=r"change what it stores \(lora\.targets \('fc', 'qkv'\) vs \('qkv',\)\)"):
        train_lib._check_train_state_layout(cfg("qkv", "fc"), cfg("qkv"), "RUN/checkpoints/2")


def test_a_diverged_lora_run_also_advises_a_lower_alpha_in_a_new_run():
    """lora.alpha=1e20 diverged at step 2 however low optim.lr was (alpha/rank scales every adapter update); the
    message advised only a lower optim.lr, and a resume with a lower lora.alpha is refused: a new run is."""
    import math

    from lm import config as config_lib
    from lm import loop

    def advice(*overrides):
        with pytest.raises(UserError) as caught:
            loop._finish_step(2, {"loss": math.nan, "grad_norm": 1.0}, None, None,
                              config_lib.load("tiny", ["init_from=BASE", *overrides]), "none yet", None)  # fmt: skip
        return str(caught.value)

    assert advice().endswith("Lower optim.lr or raise optim.warmup_steps, then resume")
    assert advice("lora.rank=4", "lora.alpha=1e20", "run.dir=RUN").endswith(
        "then resume; or, as lora.alpha/lora.rank = 2.5e+19 scales every adapter update, start a new run with a "
        "lower lora.alpha (a resume keeps it): run.dir=NEW"
    )
    # Under Muon the matrices train at optim.muon_lr, and a LoRA run's adapters all do: "Lower optim.lr" alone missed
    muon = advice("optim.name=muon")
    assert muon.endswith("Lower optim.muon_lr and optim.lr or raise optim.warmup_steps, then resume")
    assert advice("optim.name=muon", "lora.rank=4").startswith(
        "loss became nan at step 2; last good checkpoint: none yet. Lower optim.muon_lr or raise")
