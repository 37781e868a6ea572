"""Behaviour of lm.model: causality, the KV cache, attention paths, encodings, dtypes, sizes.

Every model here is tiny (2 layers, width 32, vocabulary 64, 16 positions). Compilation is
what costs time on a CPU, so the tests share a few named configs (CONFIGS), one jitted
forward function per config, and a few batch shapes: [2, T] for full passes, and [2, 6],
[2, 3], [2, 1] for the prefill, chunk and single-token steps of cached decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import model as M
from lm import platform
from lm.config import ConfigError, ModelConfig
from helpers import dot_operand_dtypes

V, T, D = 64, 16, 32
PREFILL, CHUNK, SLOTS = 6, 3, T + 8  # SLOTS > T: empty cache slots must stay masked too
ATOL = 1e-4  # logits of size ~10 computed two ways in float32; the bugs caught move them by > 0.01


def tiny(**overrides) -> ModelConfig:
    fields = dict(vocab_size=V, max_seq_len=T, n_layer=2, n_head=4, n_embd=D)
    fields.update(overrides)
    return ModelConfig(**fields)


CONFIGS = {
    "learned": tiny(pos="learned"),
    "sinusoidal": tiny(pos="sinusoidal"),
    "rope": tiny(pos="rope"),
    "none": tiny(pos="none"),
    "gqa": tiny(n_kv_head=2, pos="rope"),
    "mqa": tiny(n_kv_head=1),
    "post_norm": tiny(norm_placement="post", fused_qkv=False),
    "scan": tiny(n_kv_head=2, pos="rope", scan_layers=True),  # "gqa" with its layers scanned
    "einsum_rope": tiny(attention="einsum", pos="rope"),  # "rope" on the reference path
    "einsum_gqa": tiny(attention="einsum", n_kv_head=2, pos="rope"),  # "gqa" on the reference path
    "rmsnorm_swiglu_untied": tiny(norm="rmsnorm", mlp="swiglu", tie_embeddings=False, fused_qkv=False),
    # Qwen3's attention: heads wider than n_embd/n_head, RMS-normed queries and keys, Q/K/V biases alone (Qwen2).
    "qwen": tiny(pos="rope", n_kv_head=2, head_dim=16, qk_norm=True, bias=False, qkv_bias=True, norm="rmsnorm"),
    # Llama 3.1's RoPE scaling, on separate Q/K/V projections.
    "llama3_rope": tiny(pos="rope", fused_qkv=False, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8),
}


def abstract_params(cfg: ModelConfig):
    """The unboxed parameter tree of init_params, as shapes only: nothing is allocated."""
    return nn.unbox(jax.eval_shape(functools.partial(M.init_params, cfg), jax.random.key(0)))


def random_like(tree, seed: int = 0):
    """Random values for a parameter tree, drawn in numpy so that no test pays for compiling init.

    Larger than init_params' (and biases non-zero) so that every weight visibly matters.
    """
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = path[-1].key
        std = 0.5 if name == "embedding" else 0.1
        return jnp.asarray((name == "scale") + std * rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(draw, tree)


@functools.cache
def params_for(cfg: ModelConfig):
    """Parameters of the shape init_params gives. Shared between tests: never mutate them."""
    return random_like(abstract_params(cfg))


@functools.cache
def forward(cfg: ModelConfig, deterministic: bool = True):
    """One jitted Transformer.apply per (config, deterministic); None arguments are static pytrees."""

    @jax.jit
    def apply(params, tokens, positions=None, segment_ids=None, cache=None, rngs=None):
        return M.Transformer(cfg, deterministic).apply(params, tokens, positions, segment_ids, cache=cache, rngs=rngs)

    return apply


def random_tokens(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


def decode(cfg: ModelConfig, params, tokens_BT, chunk: bool = False):
    """Logits for every position from a prefill, optionally one multi-token chunk, then single tokens."""
    f = forward(cfg)
    b, t = tokens_BT.shape
    logits, cache = f(params, tokens_BT[:, :PREFILL], cache=M.init_cache(cfg, b, SLOTS))
    pieces = [logits]
    if chunk:
        logits, cache = f(params, tokens_BT[:, PREFILL : PREFILL + CHUNK], cache=cache)
        pieces.append(logits)
    for pos in range(PREFILL + CHUNK if chunk else PREFILL, t):
        logits, cache = f(params, tokens_BT[:, pos : pos + 1], cache=cache)
        pieces.append(logits)
    np.testing.assert_array_equal(cache["lengths"], np.full((b,), t))
    return np.concatenate(pieces, axis=1)


def test_init_params_predict_a_near_uniform_distribution():
    # The one test that runs init_params' own values: small weights, zero biases, unit scales.
    cfg = CONFIGS["learned"]
    boxed = jax.jit(functools.partial(M.init_params, cfg))(jax.random.key(0))
    params = nn.unbox(boxed)
    assert jax.tree.structure(params) == jax.tree.structure(params_for(cfg))
    logits = np.asarray(forward(cfg)(params, random_tokens(12, 2, T)), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert abs(-log_probs.mean() - np.log(V)) < 0.05
    np.testing.assert_array_equal(params["params"]["h_0"]["mlp"]["fc"]["bias"], 0.0)
    np.testing.assert_array_equal(params["params"]["ln_f"]["scale"], 1.0)
    assert 0.015 < float(np.std(params["params"]["wte"]["embedding"])) < 0.025


# --- causality ------------------------------------------------------------------------------


def perturbed_pairs(seed: int = 0):
    """For each i, [2, T] tokens: a base row and a copy that differs from it exactly at positions >= i."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, V, T)
    for i in range(T):
        row = base.copy()
        row[i:] = (base[i:] + rng.integers(1, V, T - i)) % V  # every changed token really differs
        yield i, np.stack([base, row]).astype(np.int32)


def assert_causal(logits_fn, seed: int = 0) -> None:
    """logits_fn([2, T] tokens) -> [2, T, V]: positions < i ignore tokens >= i, position i sees token i."""
    for i, tokens in perturbed_pairs(seed):
        logits = np.asarray(logits_fn(tokens))
        np.testing.assert_allclose(
            logits[1, :i], logits[0, :i], rtol=0, atol=ATOL, err_msg=f"tokens at positions >= {i} leaked backwards"
        )
        assert np.abs(logits[1, i] - logits[0, i]).max() > 1e-3, f"logits at position {i} ignore token {i}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_future_tokens_never_change_past_logits(name):
    cfg = CONFIGS[name]
    assert_causal(functools.partial(forward(cfg), params_for(cfg)))


@pytest.mark.parametrize("name", ["gqa", "einsum_gqa"])
def test_explicit_mask_path_is_causal(name):
    # segment_ids send the mask through attention_mask instead of is_causal / the default mask.
    cfg = CONFIGS[name]
    positions, segments = np.tile(np.arange(T, dtype=np.int32), (2, 1)), np.zeros((2, T), np.int32)
    assert_causal(lambda tokens: forward(cfg)(params_for(cfg), tokens, positions, segments), seed=1)


def test_causality_check_catches_a_leak(monkeypatch):
    cfg = CONFIGS["einsum_rope"]
    see_everything = lambda t, segment_ids_BT=None: jnp.ones((1, t, t), bool)
    monkeypatch.setattr(M, "attention_mask", see_everything)
    leaky = jax.jit(lambda tokens: M.Transformer(cfg).apply(params_for(cfg), tokens, None, jnp.zeros_like(tokens)))
    with pytest.raises(AssertionError, match="leaked backwards"):
        assert_causal(leaky)


# --- platforms ---------------------------------------------------------------------------------


@functools.cache
def forward_on(cfg: ModelConfig, plat: platform.Platform):
    """forward() computed with a given platform's formulation (lm.platform), whatever the backend."""
    return jax.jit(lambda params, tokens, cache=None: M.Transformer(cfg, platform=plat).apply(params, tokens, cache=cache))


# Each platform's formulation, all computed on this backend: a CPU's (written-out norm backward, flat matmuls,
# the cache write ordered after its reads), the plain one of GPUs and TPUs (flax's norms, dot_general), and each
# with the fused QKV projection as three matmuls (qkv=split; decoding from the plain one's outputs-first copies).
PLATFORMS = {
    "cpu": platform.of("cpu"),
    "plain": platform.of("gpu"),
    "cpu, qkv split": dataclasses.replace(platform.of("cpu"), qkv="split"),
    "plain, qkv split": dataclasses.replace(platform.of("gpu"), qkv="split", decode_copies=True),
}


@pytest.mark.parametrize("name", ["learned", "gqa", "scan", "rmsnorm_swiglu_untied", "qwen", "post_norm"])
def test_every_platform_computes_the_same_model(name):
    """The per-backend formulations are the same model: logits, the gradients of a loss, and cached decoding."""
    cfg = CONFIGS[name]
    params, tokens = params_for(cfg), random_tokens(3, 2, T)
    platforms = {k: p for k, p in PLATFORMS.items() if cfg.fused_qkv or p.qkv == "fused"}

    def loss_and_logits(q, p):
        logits = M.Transformer(cfg, platform=p).apply(q, tokens)
        return jnp.sum(jnp.sin(logits)), logits

    # (the logits, and the gradients of a loss of them, from one program each platform: the suite compiles less)
    grads, logits = {}, {}
    for k, p in platforms.items():
        grads[k], logits[k] = jax.jit(jax.grad(functools.partial(loss_and_logits, p=p), has_aux=True))(params)
        logits[k] = np.asarray(logits[k])
    for k in platforms:
        np.testing.assert_allclose(logits[k], logits["cpu"], atol=ATOL, err_msg=k)
        for got, want in zip(jax.tree.leaves(grads[k]), jax.tree.leaves(grads["cpu"]), strict=True):
            np.testing.assert_allclose(got, want, atol=ATOL * max(1.0, float(np.abs(want).max())), err_msg=k)
    for k, p in platforms.items():  # prefill, then one token at a time, each platform's cache write
        f = forward_on(cfg, p)
        got, cache = f(params, tokens[:, :PREFILL], M.init_cache(cfg, 2, SLOTS))
        pieces = [got]
        for pos in range(PREFILL, T):
            got, cache = f(params, tokens[:, pos : pos + 1], cache)
            pieces.append(got)
        np.testing.assert_allclose(np.concatenate(pieces, axis=1), logits[k], atol=ATOL, err_msg=k)


def test_each_backend_has_its_formulation():
    assert M.Transformer(CONFIGS["learned"]).platform is None  # None: JAX's default backend's choices
    cpu, tpu = platform.of("cpu"), platform.of("tpu")
    gpu = dataclasses.replace(platform.of("gpu", True), deterministic_ops=False)  # the suite's XLA_FLAGS set them
    assert (cpu.norm, cpu.matmul, cpu.cache_write, cpu.decode_copies, cpu.greedy) == (
        "rowsums", "flat", "after_reads", True, "first_max"
    )
    for plain in (gpu, tpu):
        assert (plain.norm, plain.matmul, plain.cache_write, plain.decode_copies, plain.greedy) == (
            "autodiff", "general", "plain", False, "argmax"
        )
    # The loss: a GPU's gradient written out and its log Z in one pass (measured on an H100), elsewhere autodiff's
    assert [(p.loss_grad, p.log_z) for p in (cpu, gpu, tpu)] == [
        ("autodiff", "two_pass"), ("written", "online"), ("autodiff", "two_pass")
    ]
    # and a GPU's chunked loss reads bfloat16 logits, a whole sequence of 1024 positions a chunk (an H100's)
    chunked = [(p.logits, p.loss_chunk) for p in (cpu, gpu, tpu)]
    assert chunked == [("float32", 128), ("compute", 1024), ("float32", 128)]
    # Under XLA's deterministic GPU ops cuDNN's attention has no gradient: XLA's kernel, and cudnn refused
    deterministic = dataclasses.replace(gpu, deterministic_ops=True)
    assert platform.attention_kernel(deterministic, "dot_product", "bfloat16")[0] == "xla"
    assert "--xla_gpu_deterministic_ops" in platform.attention_kernel(deterministic, "cudnn", "bfloat16")[1]
    assert platform.attention_kernel(gpu, "dot_product", "bfloat16") == ("cudnn", "")
    assert platform.attention_kernel(gpu, "cudnn", "bfloat16") == ("cudnn", "")
    assert platform.attention_kernel(gpu, "dot_product", "float32")[0] == "xla"
    assert platform.attention_kernel(tpu, "dot_product", "bfloat16")[0] == "xla"
    assert platform.attention_kernel(cpu, "dot_product", "bfloat16")[0] == "einsum"
    assert platform.attention_kernel(cpu, "cudnn", "bfloat16")[1].startswith("it needs a CUDA GPU")
    assert platform.attention_kernel(gpu, "einsum", "bfloat16")[0] == "einsum"
    assert platform.attention_kernel(gpu, "dot_product", "bfloat16", segmented=True)[0] == "cudnn"  # as a mask
    pallas = dataclasses.replace(gpu, segments="pallas")
    assert platform.attention_kernel(pallas, "dot_product", "bfloat16", segmented=True)[0] == "pallas"
    assert platform.attention_kernel(pallas, "dot_product", "bfloat16", segmented=False)[0] == "cudnn"
    # Pallas's kernel is a GPU's (Triton): a TPU keeps the mask rather than run it interpreted in its step
    assert platform.attention_kernel(dataclasses.replace(tpu, segments="pallas"), "dot_product", "bfloat16", True)[0] == "xla"


def test_pallas_attention_keeps_to_segments():
    """Platform.segments=pallas: packed segments through Pallas's flash-attention kernel with segment ids (here
    interpreted on the CPU) give the masked attention's logits and gradients, grouped K/V heads included."""
    cfg = CONFIGS["gqa"]
    params, tokens = params_for(cfg), random_tokens(5, 2, T)
    positions = np.array([list(range(5)) + list(range(11)), list(range(12)) + list(range(4))], np.int32)
    segments = np.array([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4], np.int32)
    apply = lambda plat: jax.jit(
        jax.value_and_grad(lambda p: jnp.sum(jnp.sin(M.Transformer(cfg, platform=plat).apply(p, tokens, positions, segments))))
    )
    cpu = platform.of("cpu")
    (loss, grads), (want, want_grads) = apply(dataclasses.replace(cpu, segments="pallas"))(params), apply(cpu)(params)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, ref, atol=ATOL * max(1.0, float(np.abs(ref).max())))


def test_pallas_attention_without_the_kernel_falls_back_to_the_mask(monkeypatch):
    """Platform.segments=pallas on a jax that no longer ships Pallas's GPU attention (deprecated in jax 0.11 for
    tokamax's): the segments go to the masked attention, the same logits, instead of a ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.gpu.attention", None)  # an import of it raises
    if "jax.experimental.pallas.ops.gpu" in sys.modules:  # (and is not read off a package an earlier test imported)
        monkeypatch.delattr(sys.modules["jax.experimental.pallas.ops.gpu"], "attention", raising=False)
    cfg = CONFIGS["gqa"]
    params, tokens = params_for(cfg), random_tokens(5, 2, T)
    positions = np.array([list(range(5)) + list(range(11)), list(range(12)) + list(range(4))], np.int32)
    segments = np.array([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4], np.int32)
    apply = lambda plat: M.Transformer(cfg, platform=plat).apply(params, tokens, positions, segments)
    cpu = platform.of("cpu")
    np.testing.assert_allclose(apply(dataclasses.replace(cpu, segments="pallas")), apply(cpu), atol=ATOL)


# --- attention implementations --------------------------------------------------------------


@pytest.mark.parametrize("dot_product, einsum", [("rope", "einsum_rope"), ("gqa", "einsum_gqa")], ids=["mha", "gqa"])
def test_jax_attention_matches_einsum(dot_product, einsum):
    # lm's einsum attention (dot_product's fallback) against jax.nn.dot_product_attention's: logits, the
    # gradients of a loss, packed segments, and cached decoding.
    dp, es = dataclasses.replace(CONFIGS[dot_product], attention="xla"), CONFIGS[einsum]
    params = params_for(dp)  # attention= does not change the parameters
    tokens = random_tokens(0, 2, T)
    np.testing.assert_allclose(forward(dp)(params, tokens), forward(es)(params, tokens), atol=ATOL)
    loss = lambda cfg: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(M.Transformer(cfg).apply(p, tokens)))))
    for got, want in zip(jax.tree.leaves(loss(es)(params)), jax.tree.leaves(loss(dp)(params))):
        np.testing.assert_allclose(got, want, atol=ATOL * max(1.0, float(np.abs(want).max())))
    positions = np.array([list(range(5)) + list(range(11)), list(range(12)) + list(range(4))], np.int32)
    segments = np.array([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4], np.int32)
    np.testing.assert_allclose(
        forward(dp)(params, tokens, positions, segments), forward(es)(params, tokens, positions, segments), atol=ATOL
    )
    np.testing.assert_allclose(decode(dp, params, tokens), decode(es, params, tokens), atol=ATOL)


@pytest.mark.parametrize("name", ["gqa", "einsum_rope", "mqa"])
def test_attention_by_query_blocks_equals_all_queries_at_once(name, monkeypatch):
    # Platform.attention_block: einsum attention a block of query positions at a time, each block over the keys
    # up to its own last position, gives the logits, gradients and packed segments' logits of all queries at
    # once, and stays causal. 5 does not divide T: the last block is shorter.
    cfg = CONFIGS[name]
    params, tokens = params_for(cfg), random_tokens(3, 2, T)
    positions = np.array([list(range(5)) + list(range(11)), list(range(12)) + list(range(4))], np.int32)
    segments = np.array([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4], np.int32)

    def model(block):
        plat = dataclasses.replace(platform.of("cpu"), attention_block=block)
        apply = lambda p, x, pos=None, seg=None: M.Transformer(cfg, platform=plat).apply(p, x, pos, seg)
        loss_and_logits = lambda p, x: (jnp.sum(jnp.sin(logits := apply(p, x))), logits)
        return jax.jit(apply), jax.jit(jax.grad(loss_and_logits, has_aux=True))  # (logits and gradients: one program)

    (whole, whole_grad), (blocked, blocked_grad) = model(0), model(5)
    keys, attend = [], M._attend
    monkeypatch.setattr(M, "_attend", lambda q, k, *a: keys.append(k.shape[2]) or attend(q, k, *a))
    (got_grads, got), (want_grads, want) = blocked_grad(params, tokens), whole_grad(params, tokens)
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert keys == [5, 10, 15, 16] * cfg.n_layer + [16] * cfg.n_layer  # blocked, then whole
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL * max(1.0, float(np.abs(want).max())))
    np.testing.assert_allclose(
        blocked(params, tokens, positions, segments), whole(params, tokens, positions, segments), atol=ATOL
    )
    assert_causal(functools.partial(blocked, params))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(n_kv_head=2, attention="einsum"),
        dict(n_kv_head=2, pos="rope"),
        dict(n_kv_head=1, fused_qkv=False, attention="einsum"),
    ],
    ids=["mha", "gqa_einsum", "gqa_rope", "mqa_unfused_einsum"],
)
def test_zero_query_key_weights_average_the_causal_prefix(overrides):
    cfg = tiny(**overrides)
    n, k = cfg.n_head, cfg.kv_heads
    g = n // k
    x = np.random.default_rng(1).standard_normal((2, T, D)).astype(np.float32)
    positions, lengths = np.tile(np.arange(T, dtype=np.int32), (2, 1)), np.zeros((2,), np.int32)
    attn = M.Attention(cfg)
    shapes = nn.unbox(jax.eval_shape(attn.init, jax.random.key(0), x, positions, None, None, lengths))
    # Random everything (biases included), then zero the query and key projections.
    p = jax.tree.map(np.array, random_like(shapes, seed=2))["params"]
    if cfg.fused_qkv:
        p["qkv"]["kernel"][:, :, : g + 1] = 0.0
        p["qkv"]["bias"][:, : g + 1] = 0.0
        v_BTKH = np.einsum("btd,dkh->btkh", x, p["qkv"]["kernel"][:, :, g + 1]) + p["qkv"]["bias"][:, g + 1]
    else:
        for name in ("q", "k"):
            p[name] = jax.tree.map(np.zeros_like, p[name])
        v_BTKH = np.einsum("btd,dkh->btkh", x, p["v"]["kernel"]) + p["v"]["bias"]
    mean_v_BTKH = np.cumsum(v_BTKH, axis=1) / np.arange(1, T + 1)[None, :, None, None]
    mean_v_BTNH = np.repeat(mean_v_BTKH, g, axis=2)  # query head i reads key/value head i // g
    want_BTD = np.einsum("btnh,nhd->btd", mean_v_BTNH, p["proj"]["kernel"]) + p["proj"]["bias"]
    got_BTD, cache = jax.jit(attn.apply)({"params": p}, x, positions, None, None, lengths)
    assert cache is None
    np.testing.assert_allclose(got_BTD, want_BTD, atol=1e-4, rtol=1e-4)


def lowered_text(cfg: ModelConfig, tokens) -> str:
    return jax.jit(lambda p, x: M.Transformer(cfg).apply(p, x)).lower(abstract_params(cfg), tokens).as_text()


@pytest.mark.parametrize("attention", ["dot_product", "xla"])
def test_xla_attention_is_chosen_off_cuda_and_for_float32(attention, monkeypatch):
    # Wherever cuDNN's attention does not apply (float32 never uses it), dot_product runs the backend's own
    # (lm.platform.attention_kernel: lm's einsum attention on a CPU, jax's XLA attention elsewhere); xla runs
    # jax.nn.dot_product_attention's XLA implementation.
    for dtype in ("float32",) if platform.current().cuda else ("float32", "bfloat16"):
        cfg = tiny(attention=attention, dtype=dtype)
        assert "cudnn" not in lowered_text(cfg, random_tokens(0, 2, T))
    kernel = platform.attention_kernel(platform.current(), attention, "float32")[0]
    assert kernel == ("einsum" if attention == "dot_product" and platform.current().backend == "cpu" else "xla")
    got, xla, einsum = (forward(tiny(attention=a))(params_for(tiny()), random_tokens(0, 2, T)) for a in (attention, "xla", "einsum"))
    np.testing.assert_allclose(xla, einsum, rtol=1e-5, atol=1e-5)
    if attention == "dot_product":  # (the backend's kernel: the same numbers as that kernel chosen by name)
        np.testing.assert_array_equal(got, einsum if kernel == "einsum" else xla)
    einsum_attention, calls = M.einsum_attention, []
    record = lambda q, *a, **kw: calls.append(q.shape[:2]) or einsum_attention(q, *a, **kw)
    monkeypatch.setattr(M, "einsum_attention", record)
    lowered_text(tiny(attention=attention), random_tokens(0, 2, T))  # (with parameters' init on its first call)
    assert calls.count((2, T)) == (tiny().n_layer if kernel == "einsum" else 0)


@pytest.mark.skipif(platform.current().cuda, reason="cuDNN attention is available on this device")
def test_cudnn_attention_off_cuda_says_why():
    cfg = tiny(attention="cudnn", dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"^model.attention=cudnn cannot be used here: it needs a CUDA GPU.*"):
        lowered_text(cfg, random_tokens(0, 2, T))


@pytest.mark.parametrize("remat, scan_layers", [("full", True), ("dots", False)])
def test_cudnn_refusing_training_shapes_falls_back_under_remat_and_scan(remat, scan_layers, monkeypatch):
    # jax checks cuDNN's training (a mask, as a bias, with an odd length: NotImplementedError) in the forward rule
    # of its gradient, which jax.checkpoint and nn.scan trace after lm's call (and its try) returned. A stand-in
    # cuDNN whose forward rule refuses odd lengths as jax's does: dot_product takes XLA's attention, cudnn is one
    # ConfigError, and an even length still trains with cuDNN.
    real, kernels = jax.nn.dot_product_attention, []

    @jax.custom_vjp
    def cudnn(q, k, v, mask):
        return real(q, k, v, mask=mask, implementation="xla")

    def cudnn_fwd(q, k, v, mask):
        if q.shape[1] % 2 or k.shape[1] % 2:
            raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}, KV {k.shape[1]}.")
        kernels.append("cudnn")
        return cudnn(q, k, v, mask), (q, k, v, mask)

    def cudnn_bwd(res, g):
        q, k, v, mask = res
        return *jax.vjp(lambda *qkv: real(*qkv, mask=mask, implementation="xla"), q, k, v)[1](g), None

    cudnn.defvjp(cudnn_fwd, cudnn_bwd)

    def fake(q, k, v, bias=None, mask=None, *, implementation=None, is_causal=False, **kwargs):
        if implementation != "cudnn":
            kernels.append(implementation)
            return real(q, k, v, bias, mask, implementation=implementation, is_causal=is_causal, **kwargs)
        causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        return cudnn(q, k, v, causal if mask is None else mask & causal)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    gpu = dataclasses.replace(platform.of("gpu", True), deterministic_ops=False, segments="mask")
    cfg = tiny(dtype="bfloat16", remat=remat, scan_layers=scan_layers)
    params = abstract_params(cfg)

    def train(cfg, t):
        segments = jnp.asarray(np.arange(t) >= t // 2, jnp.int32)[None].repeat(2, 0)  # two documents a row
        loss = lambda p: M.Transformer(cfg, platform=gpu).apply(p, random_tokens(0, 2, t), None, segments).sum()
        kernels.clear()
        jax.eval_shape(jax.grad(lambda p: loss(p).astype(jnp.float32)), params)  # traced, as a training step is
        return set(kernels)

    assert train(cfg, T - 1) == {"xla"}
    assert train(cfg, T) == {"cudnn"}
    with pytest.raises(ConfigError, match=r"^model.attention=cudnn cannot be used here: Unsupported sequence length"):
        train(dataclasses.replace(cfg, attention="cudnn"), T - 1)


@pytest.mark.skipif(not platform.current().cuda, reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["dot_product", "cudnn"])
def test_cudnn_attention_matches_xla_on_gpu(attention):
    # cuDNN's kernel and XLA's attention both round to bfloat16, differently: cuDNN's departure from XLA's
    # bfloat16 result must be of the order of XLA's own bfloat16 error against float32, not larger.
    if platform.deterministic_ops():
        # The suite's deterministic GPU ops (tests/conftest.py), under which cuDNN's attention has no gradient (and
        # lm takes XLA's): this test in a process of its own without them.
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(platform.DETERMINISTIC_FLAGS)]
        env = {**os.environ, "XLA_FLAGS": " ".join([*flags, "--xla_gpu_deterministic_ops=false"])}
        test = f"{__file__}::test_cudnn_attention_matches_xla_on_gpu[{attention}]"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test],
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:]
        return
    cfg = tiny(attention=attention, dtype="bfloat16", n_embd=128, n_head=2)  # head width 64, as cuDNN wants
    ref, exact = dataclasses.replace(cfg, attention="xla"), dataclasses.replace(cfg, attention="xla", dtype="float32")
    params = random_like(abstract_params(cfg))
    tokens = random_tokens(0, 2, T)
    assert "cudnn" in lowered_text(cfg, tokens)
    apply = lambda c: jax.jit(lambda p, x: M.Transformer(c).apply(p, x).astype(jnp.float32))
    grads = lambda c: jax.jit(jax.grad(lambda p, x: apply(c)(p, x).sum()))(params, tokens)
    got, want, truth = (np.asarray(apply(c)(params, tokens)) for c in (cfg, ref, exact))
    assert np.abs(got - want).max() <= 2 * np.abs(want - truth).max() + 1e-2
    for g, r, t in zip(*(jax.tree.leaves(grads(c)) for c in (cfg, ref, exact))):
        assert np.abs(g - r).max() <= 2 * np.abs(r - t).max() + 1e-2 * np.abs(t).max() + 1e-6
    assert_causal(functools.partial(apply(cfg), params))


# --- sinusoidal encoding --------------------------------------------------------------------


def test_sinusoidal_matches_the_formula():
    d = 64
    pe = np.asarray(M.sinusoidal(jnp.arange(50)[None], d))[0]
    p = np.arange(50)[:, None]
    freq = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    np.testing.assert_allclose(pe[:, 0::2], np.sin(p * freq), atol=1e-5)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(p * freq), atol=1e-5)
    assert M.sinusoidal(jnp.zeros((3, 5), jnp.int32), 10).shape == (3, 5, 10)
    assert M.sinusoidal(jnp.zeros((1, 4), jnp.int32), 7).shape == (1, 4, 7)  # odd widths are cut


def test_sinusoidal_positions_are_distinct():
    pe = np.asarray(M.sinusoidal(jnp.arange(1024)[None], 64), np.float64)[0]
    sq = (pe**2).sum(-1)
    dist2 = sq[:, None] + sq[None, :] - 2 * pe @ pe.T
    np.fill_diagonal(dist2, np.inf)
    assert dist2.min() > 1e-2


@pytest.mark.parametrize("offset", [1, 7, 100])
def test_sinusoidal_shift_is_a_fixed_linear_map(offset):
    d = 64
    pe = np.asarray(M.sinusoidal(jnp.arange(1024 + offset)[None], d), np.float64)[0]
    # The map is a rotation by offset*freq of every (sin, cos) pair ...
    rotation = np.zeros((d, d))
    for i, w in enumerate(1.0 / 10000.0 ** (np.arange(0, d, 2) / d)):
        c, s = np.cos(offset * w), np.sin(offset * w)
        rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, -s], [s, c]]  # rows act on (sin, cos)
    np.testing.assert_allclose(pe[:1024] @ rotation, pe[offset:], atol=2e-3)
    # ... and is recovered by least squares from even positions, then holds for the odd ones.
    # (Fitting early positions and extrapolating to late ones is ill-conditioned: the slowest
    # frequencies barely move over a few hundred positions.)
    fit, *_ = np.linalg.lstsq(pe[0:1024:2], pe[offset : 1024 + offset : 2], rcond=None)
    np.testing.assert_allclose(pe[1:1024:2] @ fit, pe[1 + offset : 1024 + offset : 2], atol=1e-3)


# --- KV cache -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, chunk",
    [
        ("learned", False),
        ("sinusoidal", False),
        ("rope", True),
        ("none", False),
        ("gqa", False),
        ("mqa", False),
        ("post_norm", False),
        ("scan", True),
        ("einsum_gqa", False),
        ("qwen", True),
        ("llama3_rope", False),
    ],
)
def test_cached_decoding_matches_full_forward(name, chunk):
    cfg = CONFIGS[name]
    params = params_for(cfg)
    tokens = random_tokens(3, 2, T)
    np.testing.assert_allclose(decode(cfg, params, tokens, chunk), forward(cfg)(params, tokens), atol=ATOL)


@pytest.mark.parametrize("name", ["learned", "gqa", "scan"])
def test_rows_with_different_prompt_lengths_decode_independently(name):
    cfg = CONFIGS[name]
    params = params_for(cfg)
    f = forward(cfg)
    seqs = random_tokens(4, 2, T)
    prompt_lens = np.array([PREFILL, PREFILL - 3])
    # A sampler pads the shorter prompt, prefills both rows, then rewinds each row to its length.
    padded = seqs.copy()
    padded[1, prompt_lens[1] :] = 0
    prefill_logits, cache = f(params, padded[:, :PREFILL], cache=M.init_cache(cfg, 2, SLOTS))
    cache = dict(cache, lengths=jnp.asarray(prompt_lens, jnp.int32))
    steps = T - PREFILL
    step_logits = []
    for s in range(steps):
        next_tokens = seqs[[0, 1], prompt_lens + s][:, None]
        logits, cache = f(params, next_tokens, cache=cache)
        step_logits.append(logits[:, 0])
    np.testing.assert_array_equal(cache["lengths"], prompt_lens + steps)
    for b in range(2):
        alone = np.asarray(f(params, seqs[[b, b]]))[0]  # the row without its neighbour
        n = prompt_lens[b]
        np.testing.assert_allclose(prefill_logits[b, :n], alone[:n], atol=ATOL)
        decoded = np.stack([step[b] for step in step_logits])
        np.testing.assert_allclose(decoded, alone[n : n + steps], atol=ATOL)


def test_init_cache_layout():
    plain = M.init_cache(tiny(n_kv_head=2), 3, 20)
    assert len(plain["layers"]) == 2
    assert plain["layers"][0]["k"].shape == (3, 2, 20, 8) and plain["layers"][1]["v"].dtype == jnp.float32
    scanned = M.init_cache(tiny(scan_layers=True, dtype="bfloat16"), 3, 20)
    assert scanned["layers"]["k"].shape == (2, 3, 4, 20, 8) and scanned["layers"]["v"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(scanned["lengths"], np.zeros(3, np.int32))


def test_segment_ids_with_a_cache_are_refused():
    cfg = CONFIGS["learned"]
    tokens = random_tokens(0, 1, 4)
    with pytest.raises(ValueError, match="segment_ids"):
        M.Transformer(cfg).apply(params_for(cfg), tokens, None, jnp.zeros_like(tokens), cache=M.init_cache(cfg, 1, T))


# --- scan and remat -------------------------------------------------------------------------


def stack_layers(params, n_layer: int):
    """Non-scan parameters (h_0 .. h_{L-1}) as scan parameters (h with a leading layer axis)."""
    p = dict(params["params"])
    layers = [p.pop(f"h_{i}") for i in range(n_layer)]
    p["h"] = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    return {"params": p}


def test_scan_layers_matches_a_python_loop():
    loop, scan = CONFIGS["gqa"], CONFIGS["scan"]
    params = params_for(loop)
    stacked = stack_layers(params, loop.n_layer)
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert shapes(stacked) == shapes(abstract_params(scan))
    tokens = random_tokens(5, 2, T)
    np.testing.assert_allclose(forward(scan)(stacked, tokens), forward(loop)(params, tokens), atol=ATOL)


def test_unscanned_splits_the_stack_back_into_layers():
    loop, scan = CONFIGS["gqa"], CONFIGS["scan"]
    params = params_for(loop)
    split, cfg = M.unscanned(stack_layers(params, loop.n_layer), scan)
    assert cfg == loop  # the same model, no longer scanned
    jax.tree.map(np.testing.assert_array_equal, split, params)
    assert M.unscanned(params, loop) == (params, loop)


def test_scanned_stacks_the_layers_back_unscanned_inverse():
    loop, scan = CONFIGS["gqa"], CONFIGS["scan"]
    params = params_for(loop)
    stacked, cfg = M.scanned(params, loop)
    assert cfg == scan
    jax.tree.map(np.testing.assert_array_equal, stacked, stack_layers(params, loop.n_layer))
    jax.tree.map(np.testing.assert_array_equal, M.laid_out(stacked, scan, False), params)
    assert M.scanned(stacked, scan) == (stacked, scan)


def test_untied_gives_a_tied_head_its_own_weight():
    cfg = CONFIGS["gqa"]
    assert cfg.tie_embeddings
    params = params_for(cfg)
    own, own_cfg = M.untied(params, cfg)
    assert own_cfg == dataclasses.replace(cfg, tie_embeddings=False)
    kernel = own["params"]["lm_head"]["kernel"]
    np.testing.assert_array_equal(kernel, np.asarray(params["params"]["wte"]["embedding"]).T)
    tokens = random_tokens(6, 2, T)
    np.testing.assert_allclose(forward(own_cfg)(own, tokens), forward(cfg)(params, tokens), atol=ATOL)
    assert M.untied(own, own_cfg) == (own, own_cfg)



@pytest.mark.parametrize("name", ["gqa", "rmsnorm_swiglu_untied", "qwen"])
def test_outputs_first_transposes_every_kernel(name):
    cfg = CONFIGS[name]
    params = params_for(cfg)
    rows = M.outputs_first(params, cfg)
    flat = {"/".join(p.key for p in path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}
    flat_rows = {"/".join(p.key for p in path): x for path, x in jax.tree_util.tree_leaves_with_path(rows)}
    kernels = [k for k in flat if k.endswith("/kernel")]
    assert kernels and not any(k.endswith("/kernel") for k in flat_rows)
    for k in kernels:
        kernel, kernel_t = np.asarray(flat[k]), np.asarray(flat_rows[k + "_t"])
        n_in = 2 if k.endswith("attn/proj/kernel") else 1  # [N, H, D]: two input axes
        np.testing.assert_array_equal(kernel_t, kernel.reshape(math.prod(kernel.shape[:n_in]), -1).T)
    assert {k for k in flat if k not in kernels} == {k for k in flat_rows if not k.endswith("/kernel_t")}
    tokens = random_tokens(7, 2, T)
    np.testing.assert_allclose(forward(cfg)(rows, tokens), forward(cfg)(params, tokens), atol=ATOL)
    with pytest.raises(ValueError, match="unscanned"):
        M.outputs_first(params, CONFIGS["scan"])

@functools.cache
def grad_fn(cfg: ModelConfig):
    def loss(params, tokens_BT):
        logits = M.Transformer(cfg).apply(params, tokens_BT[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1).mean()

    return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("remat, scan", [("full", False), ("dots", True)], ids=["full_loop", "dots_scan"])
def test_remat_does_not_change_gradients(remat, scan):
    # The reference is always the plain loop without remat; scanned gradients are compared stacked.
    base, rematted = tiny(), tiny(scan_layers=scan, remat=remat)
    params = params_for(base)
    as_rematted = (lambda tree: stack_layers(tree, base.n_layer)) if scan else (lambda tree: tree)
    assert jax.tree.structure(abstract_params(rematted)) == jax.tree.structure(as_rematted(params))
    tokens = random_tokens(6, 2, T + 1)
    loss0, grads0 = grad_fn(base)(params, tokens)
    loss1, grads1 = grad_fn(rematted)(as_rematted(params), tokens)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert min(np.abs(g).max() for g in jax.tree.leaves(grads0)) > 1e-6  # every weight gets a gradient
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads1, as_rematted(grads0))


# --- sizes and FLOPs -------------------------------------------------------------------------


GPT2_SMALL = ModelConfig(
    vocab_size=50257,
    max_seq_len=1024,
    n_layer=12,
    n_head=12,
    n_embd=768,
    pos="learned",
    tie_embeddings=True,
    bias=True,
    mlp="gelu",
    norm="layernorm",
)


def matmul_weights(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul, counted from the parameter tree itself."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
    kernels = sum(int(np.prod(x.shape)) for path, x in flat if path[-1].key == "kernel")
    tied_head = cfg.vocab_size * cfg.n_embd if cfg.tie_embeddings else 0
    return kernels + tied_head


def test_gpt2_small_has_124m_parameters():
    assert M.count_params(abstract_params(GPT2_SMALL)) == 124_439_808


def test_gpt2_small_flops_per_token():
    n_matmul = matmul_weights(GPT2_SMALL)
    assert n_matmul == 12 * 12 * 768**2 + 768 * 50257
    want = 6 * n_matmul + 12 * 12 * 768 * 1024
    assert want == 854_438_400
    assert M.flops_per_token(GPT2_SMALL, 1024) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(n_kv_head=1),
        dict(n_kv_head=2, mlp="swiglu", tie_embeddings=False),
        dict(fused_qkv=False, mlp_hidden=48, scan_layers=True),
    ],
    ids=["mha", "mqa", "gqa_swiglu_untied", "unfused_custom_mlp_scan"],
)
def test_flops_per_token_counts_every_matmul(overrides):
    cfg = tiny(**overrides)
    want = 6 * matmul_weights(cfg) + 12 * cfg.n_layer * cfg.n_embd * 11
    assert M.flops_per_token(cfg, 11) == pytest.approx(want, rel=1e-12)


# --- numerics -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_einsum_attention_with_a_fully_masked_row_is_finite(dtype):
    b, t, n, k, h = 2, 8, 4, 2, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    kk, v = (jnp.asarray(rng.standard_normal((b, k, t, h)), dtype) for _ in range(2))  # heads first, as cached
    causal = np.tril(np.ones((b, t, t), bool))
    masked = causal.copy()
    masked[0, 3] = False
    attend = jax.jit(M.einsum_attention)
    out = attend(q, kk, v, masked)
    assert out.dtype == dtype and out.shape == (b, t, n, h)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    ref = np.asarray(attend(q, kk, v, causal), np.float32)
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), ref[1])  # other rows untouched


@pytest.mark.parametrize("name", ["gqa", "einsum_gqa"])
def test_bfloat16_model_is_finite_and_close_to_float32(name):
    f32 = CONFIGS[name]
    bf16 = dataclasses.replace(f32, dtype="bfloat16")
    params = params_for(f32)
    tokens = random_tokens(7, 2, T)
    positions = np.array([list(range(4)) + list(range(12)), list(range(15)) + [0]], np.int32)
    segments = np.array([[0] * 4 + [1] * 12, [0] * 15 + [1]], np.int32)
    got = forward(bf16)(params, tokens, positions, segments)
    assert got.dtype == jnp.float32  # logits come back in float32 whatever the compute dtype
    assert np.isfinite(np.asarray(got)).all()
    want = np.asarray(forward(f32)(params, tokens, positions, segments))
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())  # bfloat16 keeps ~3 digits
    if name == "gqa":
        assert np.isfinite(decode(bf16, params, tokens)).all()


def test_einsum_f32_writes_float32_unrounded_and_differentiates_in_the_operands_dtype():
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((8, 32), (32, 64)))
    c = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)  # a fixed cotangent: the gradients are linear in it
    got = M.einsum_f32("nd,dv->nv", a, b)
    assert got.dtype == jnp.float32
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)  # float32 accumulation, not rounded to 16 bits
    rounded = jnp.einsum("nd,dv->nv", a, b).astype(jnp.float32)
    assert np.abs(np.asarray(rounded) - exact).max() > 100 * np.abs(np.asarray(got) - exact).max()
    # The gradient is the one a cast after a bfloat16 einsum has: the cotangent cast down, bfloat16 matmuls.
    new = jax.grad(lambda a, b: jnp.sum(M.einsum_f32("nd,dv->nv", a, b) * c), argnums=(0, 1))
    old = jax.grad(lambda a, b: jnp.sum(jnp.einsum("nd,dv->nv", a, b).astype(jnp.float32) * c), argnums=(0, 1))
    for g_new, g_old in zip(jax.jit(new)(a, b), jax.jit(old)(a, b)):
        assert g_new.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g_new, np.float32), np.asarray(g_old, np.float32))
    dots = dot_operand_dtypes(jax.jit(new).lower(a, b).as_text())
    assert len(dots) >= 2 and all(dtypes == ("bf16", "bf16") for dtypes in dots), dots
    # Autodiff of preferred_element_type=float32 itself would run the backward matmuls in float32.
    f32_out = lambda a, b: jnp.einsum("nd,dv->nv", a, b, preferred_element_type=jnp.float32)
    plain = jax.grad(lambda a, b: jnp.sum(f32_out(a, b) * c), argnums=(0, 1))
    assert ("f32", "f32") in dot_operand_dtypes(jax.jit(plain).lower(a, b).as_text())  # the check sees it


@pytest.mark.parametrize("name", ["einsum_rope", "rmsnorm_swiglu_untied"])
@pytest.mark.parametrize("plat", ["cpu", "plain"])
def test_a_bfloat16_model_runs_every_matmul_and_its_gradient_in_bfloat16(name, plat):
    """The attention logits and the output head write float32 (einsum_f32), yet no matmul of the forward or the
    backward pass takes a float32 operand: on a GPU that would be a float32 GEMM, several times slower."""
    cfg = dataclasses.replace(CONFIGS[name], dtype="bfloat16", attention="einsum")
    model = M.Transformer(cfg, platform=PLATFORMS[plat])
    tokens = random_tokens(3, 2, T)
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, tokens)))
    hlo = jax.jit(jax.grad(loss)).lower(abstract_params(cfg)).as_text()
    dots = dot_operand_dtypes(hlo, matrices_only=True)
    assert dots and all(dtypes == ("bf16", "bf16") for dtypes in dots), dots
    logits = forward_on(cfg, PLATFORMS[plat])(params_for(CONFIGS[name]), tokens)
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_embedding_gradients_accumulate_in_float32(param_dtype):
    # Every occurrence of a token adds its row to the embedding's gradient: in bfloat16 the sum of a
    # token repeated all over the batch would lose its low digits (and on GPUs runs a contended CAS loop).
    cfg = tiny(dtype="bfloat16", param_dtype=param_dtype)
    tokens = np.full((2, T), 3, np.int32)
    loss = lambda p: M.Transformer(cfg).apply(p, tokens).astype(jnp.float32).sum()
    hlo = jax.jit(jax.grad(loss)).lower(abstract_params(cfg)).as_text(dialect="hlo")
    scatters = [line.split("=", 1)[1].split()[0] for line in hlo.splitlines() if " scatter(" in line]
    assert scatters and all(shape.startswith("f32[") for shape in scatters), scatters


# --- packing --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["learned", "gqa", "einsum_gqa"])
def test_packed_segments_match_each_segment_alone(name):
    cfg = CONFIGS[name]
    params = params_for(cfg)
    a, b = random_tokens(8, 6), random_tokens(9, 10)
    packed = np.stack([np.concatenate([a, b]), np.concatenate([b, a])])
    positions = np.array([list(range(6)) + list(range(10)), list(range(10)) + list(range(6))], np.int32)
    segments = np.array([[1] * 6 + [2] * 10, [7] * 10 + [3] * 6], np.int32)
    got = np.asarray(forward(cfg)(params, packed, positions, segments))
    # Each segment alone, padded at the end to the same length (padding cannot reach back).
    alone = np.asarray(forward(cfg)(params, np.stack([np.pad(a, (0, T - 6)), np.pad(b, (0, T - 10))])))
    np.testing.assert_allclose(got[0, :6], alone[0, :6], atol=ATOL)
    np.testing.assert_allclose(got[0, 6:], alone[1, :10], atol=ATOL)
    np.testing.assert_allclose(got[1, :10], alone[1, :10], atol=ATOL)
    np.testing.assert_allclose(got[1, 10:], alone[0, :6], atol=ATOL)
    # Without the segment ids the second segment sees the first, so the check has teeth.
    leaky = np.asarray(forward(cfg)(params, packed, positions, np.zeros_like(segments)))
    assert np.abs(leaky[0, 6:] - alone[1, :10]).max() > 1e-3


# --- dropout --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [dict(dropout=0.3), dict(attn_dropout=0.3), dict(dropout=0.3, attn_dropout=0.1, scan_layers=True, remat="full")],
    ids=["dropout", "attn_dropout", "dropout_scan_remat"],
)
def test_dropout(overrides):
    cfg = tiny(**overrides)
    params = params_for(cfg)
    tokens = random_tokens(10, 2, T)
    rng1, rng2 = {"dropout": jax.random.key(1)}, {"dropout": jax.random.key(2)}
    det = np.asarray(forward(cfg, True)(params, tokens, rngs=rng1))
    if not cfg.scan_layers:  # (one more compilation; once is enough)
        np.testing.assert_array_equal(forward(cfg, True)(params, tokens), det)
    train = forward(cfg, False)
    out1, out2 = np.asarray(train(params, tokens, rngs=rng1)), np.asarray(train(params, tokens, rngs=rng2))
    np.testing.assert_array_equal(train(params, tokens, rngs=rng1), out1)
    assert np.abs(out1 - det).max() > 1e-3
    assert np.abs(out1 - out2).max() > 1e-3


def test_training_mode_without_dropout_is_deterministic():
    cfg = CONFIGS["learned"]
    tokens = random_tokens(11, 2, T)
    np.testing.assert_allclose(
        forward(cfg, False)(params_for(cfg), tokens, rngs={"dropout": jax.random.key(3)}),
        forward(cfg)(params_for(cfg), tokens),
        atol=1e-6,
    )


# --- logical axis names ---------------------------------------------------------------------

AXIS_NAMES = {None, "layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp"}


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(scan_layers=True, n_kv_head=2),
        dict(fused_qkv=False, mlp="swiglu", norm="rmsnorm", tie_embeddings=False, bias=False, pos="rope"),
        dict(norm_bias=False, pos="sinusoidal", remat="dots"),
        dict(scan_layers=True, pos="rope", head_dim=16, qk_norm=True, bias=False, qkv_bias=True),
    ],
    ids=["default", "scan_gqa", "unfused_swiglu_rms_untied", "remat_sinusoidal", "scan_qwen"],
)
def test_every_parameter_carries_logical_axis_names(overrides):
    cfg = tiny(**overrides)
    boxed = jax.eval_shape(functools.partial(M.init_params, cfg), jax.random.key(0))
    boxes = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert len(boxes) == len(jax.tree.leaves(nn.unbox(boxed))) > 0
    for box in boxes:
        assert isinstance(box, nn.Partitioned), f"parameter without axis names: {box}"
        assert len(box.names) == len(box.value.shape), (box.names, box.value.shape)
        assert set(box.names) <= AXIS_NAMES, box.names
    specs = nn.get_partition_spec(boxed)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        in_scan = any(getattr(k, "key", None) == "h" for k in path)
        assert (spec[0] == "layers") == in_scan, (path, spec)
    assert specs["params"]["wte"]["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")


def test_logits_at_selected_positions_equal_the_full_logits():
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_embd=32)
    for tie in (True, False):
        c = dataclasses.replace(cfg, tie_embeddings=tie)
        params = nn.unbox(M.init_params(c, jax.random.PRNGKey(0)))
        tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 16), 0, 64)
        full = M.Transformer(c).apply(params, tokens)
        at = jnp.array([15, 0, 7])
        picked = M.Transformer(c).apply(params, tokens, logits_at_B=at)
        assert picked.shape == (3, 1, 64)
        np.testing.assert_allclose(picked[:, 0], full[jnp.arange(3), at], atol=1e-5)


# --- options of open models: head_dim, qkv_bias, qk_norm, RoPE scaling -----------------------------


def test_head_dim_qkv_bias_and_qk_norm_shape_the_attention_parameters():
    params = abstract_params(CONFIGS["qwen"])["params"]["h_0"]
    attn = params["attn"]
    assert attn["qkv"]["kernel"].shape == (D, 2, 4, 16)  # 2 KV heads, each beside its 2 query heads; 16 wide
    assert attn["qkv"]["bias"].shape == (2, 4, 16)
    assert "bias" not in attn["proj"] and attn["proj"]["kernel"].shape == (4, 16, D)
    assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (16,)
    assert all("bias" not in layer for layer in params["mlp"].values())
    unfused = abstract_params(tiny(fused_qkv=False, bias=False, qkv_bias=True))["params"]["h_0"]["attn"]
    assert all("bias" in unfused[name] for name in "qkv") and "bias" not in unfused["proj"]
    # attn_bias (Llama's attention_bias without mlp_bias): Q, K, V and the output projection, none in the MLP
    for fused in (True, False):
        layer = abstract_params(tiny(fused_qkv=fused, bias=False, attn_bias=True, mlp="swiglu"))["params"]["h_0"]
        assert all("bias" in layer["attn"][name] for name in (["qkv"] if fused else ["q", "k", "v"]) + ["proj"])
        assert all("bias" not in mlp_layer for mlp_layer in layer["mlp"].values())


def scaled_projections(params, parts: slice, factor: float):
    """params with every layer's fused Q/K/V kernel and bias multiplied by factor on `parts` of the G+2 axis
    (queries are [:G], keys G, values G+1)."""
    out = jax.tree.map(lambda x: x, params)  # new containers, shared leaves
    for layer in ("h_0", "h_1"):
        qkv = dict(out["params"][layer]["attn"]["qkv"])
        qkv["kernel"] = qkv["kernel"].at[:, :, parts].multiply(factor)
        qkv["bias"] = qkv["bias"].at[:, parts].multiply(factor)
        out["params"][layer]["attn"]["qkv"] = qkv
    return out


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    cfg = CONFIGS["qwen"]  # 4 query heads over 2 KV heads: G = 2
    params = params_for(cfg)
    tokens = random_tokens(5, 2, T)
    base = forward(cfg)(params, tokens)
    queries_and_keys, values = slice(0, 3), slice(3, 4)
    same = forward(cfg)(scaled_projections(params, queries_and_keys, 3.0), tokens)
    np.testing.assert_allclose(same, base, atol=1e-3)  # the norm's epsilon moves them by ~1e-4
    assert np.abs(forward(cfg)(scaled_projections(params, values, 3.0), tokens) - base).max() > 0.01
    plain = dataclasses.replace(cfg, qk_norm=False)
    unnormed = jax.tree.map(lambda x: x, params)
    for layer in ("h_0", "h_1"):
        del unnormed["params"][layer]["attn"]["q_norm"], unnormed["params"][layer]["attn"]["k_norm"]
    plain_base = forward(plain)(unnormed, tokens)
    assert np.abs(forward(plain)(scaled_projections(unnormed, queries_and_keys, 3.0), tokens) - plain_base).max() > 0.01


def llama3_frequencies_by_the_rule(theta, dim, factor, low, high, original):
    """Llama 3.1's published rule, frequency by frequency, in terms of wavelengths."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_rope_frequencies_follow_each_scaling_rule():
    cfg = tiny(pos="rope", head_dim=64, rope_theta=500000.0)
    base = M.rope_frequencies(cfg)
    np.testing.assert_allclose(base, 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64))
    np.testing.assert_allclose(M.rope_frequencies(dataclasses.replace(cfg, rope_scaling="linear", rope_factor=4.0)), base / 4)
    llama3 = dataclasses.replace(cfg, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8192)
    got = M.rope_frequencies(llama3)
    np.testing.assert_allclose(got, llama3_frequencies_by_the_rule(500000.0, 64, 8.0, 1.0, 4.0, 8192), rtol=1e-12)
    kept, scaled = got == base, np.isclose(got, base / 8)
    assert kept.any() and scaled.any() and not (kept | scaled).all()  # all three regimes occur


def test_linear_rope_scaling_equals_positions_divided_by_the_factor():
    cfg = tiny(pos="rope", rope_scaling="linear", rope_factor=2.0)
    x = jax.random.normal(jax.random.key(0), (1, T, 4, 8))
    positions = jnp.arange(T)[None]
    scaled = M.rope(x, positions, M.rope_frequencies(cfg))
    plain = M.rope(x, positions / 2.0, M.rope_frequencies(dataclasses.replace(cfg, rope_scaling="none")))
    np.testing.assert_allclose(scaled, plain, atol=1e-6)
