"""Behaviour of lm.loss: the chunked head and loss give the unchunked loss and gradients (tied and untied heads,
a remainder chunk, loss masks, label smoothing with a padded vocabulary, z-loss, LoRA, evaluation), and the
compiled train step never holds the float32 logits of the whole batch."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm import config as config_lib
from lm import lora, platform
from lm.loss import chunked_loss_sums, chunked_token_losses, online_logsumexp, token_losses
from lm.model import Transformer, init_params
from lm.steps import TrainState, loss_sums, make_eval_step, make_train_step, model_params, sequence_logprobs

from helpers import dot_operand_dtypes, xla_flags

B, T, V, N_VOCAB = 3, 20, 200, 190  # T = 2 chunks of 8 and a remainder of 4; 10 padded vocabulary rows


def tiny(loss_chunk: int, tie: bool = True, layers: int = 2, **train) -> config_lib.Config:
    model = dict(n_layer=layers, n_head=2, n_embd=32, vocab_size=V, max_seq_len=T, tie_embeddings=tie)
    return config_lib.replace(config_lib.Config(), model=model, train={"loss_chunk": loss_chunk, **train})


def batch(seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k1, (B, T + 1), 0, N_VOCAB)
    mask = (jax.random.uniform(k2, (B, T)) < 0.7).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


def params(cfg: config_lib.Config):
    return nn.unbox(init_params(cfg.model, jax.random.key(1)))


def mean_loss_and_grads(cfg, trained, data, frozen=None, loss_grad=None, log_z="two_pass", **losses):
    """(objective / tokens, cross-entropy sum) and the objective's gradient, as the train step takes them, with the
    backend's own platform choices, or with its loss gradient `loss_grad` (lm.platform's: autodiff, written) and
    log-partition function `log_z` (two_pass, online); the chunked loss's logits in float32 on every backend (a
    GPU's bfloat16 ones, logits=compute, have a test of their own), as the unchunked head writes them."""
    plat = dataclasses.replace(platform.current(), logits="float32")
    plat = dataclasses.replace(plat, loss_grad=loss_grad, log_z=log_z) if loss_grad else plat
    model = Transformer(cfg.model, platform=plat)

    def objective(trained):
        objective_sum, ce_sum = loss_sums(cfg, model, model_params(cfg, trained, frozen), data, **losses)
        return objective_sum / data["loss_mask"].sum(), ce_sum

    return jax.jit(jax.value_and_grad(objective, has_aux=True))(trained)


def assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "chunk, tie, losses",
    [
        (8, True, {}),  # 2 whole chunks and a remainder of 4
        (8, False, dict(label_smoothing=0.1, z_loss=1e-3, n_vocab=N_VOCAB)),
        (5, True, dict(label_smoothing=0.2, z_loss=1e-2, n_vocab=N_VOCAB)),  # 4 whole chunks, no remainder
        (64, False, {}),  # one chunk, shorter than loss_chunk
    ],
)
def test_chunked_loss_and_gradients_equal_the_full_logits(chunk, tie, losses):
    data = batch()
    p = params(tiny(0, tie))
    (full, ce_full), g_full = mean_loss_and_grads(tiny(0, tie), p, data, **losses)
    (chunked, ce_chunked), g_chunked = mean_loss_and_grads(tiny(chunk, tie), p, data, **losses)
    assert_close((chunked, ce_chunked), (full, ce_full))
    assert_close(g_chunked, g_full)
    assert all(np.any(g != 0) for g in jax.tree.leaves(g_chunked))


@pytest.mark.parametrize(
    "chunk, tie, losses",
    [
        (8, False, dict(label_smoothing=0.1, z_loss=1e-3, n_vocab=N_VOCAB)),
        (5, True, dict(label_smoothing=0.2, n_vocab=0)),  # smoothing over every row of the vocabulary
        (0, True, dict(z_loss=1e-2)),  # the model's whole logits
    ],
)
def test_written_loss_gradient_equals_autodiff(chunk, tie, losses):
    """platform loss_grad=written: the same loss and gradients as autodiff's, with no scatter of the logits' size
    in the gradient (on a GPU, passes over [B, T, V] float32 arrays are what the loss costs); log_z=online (a GPU's
    choice) the same as two passes, with either gradient."""
    cfg, data = tiny(chunk, tie), batch()
    p = params(cfg)
    auto = mean_loss_and_grads(cfg, p, data, loss_grad="autodiff", **losses)
    for loss_grad, log_z in (("written", "two_pass"), ("written", "online"), ("autodiff", "online")):
        other = mean_loss_and_grads(cfg, p, data, loss_grad=loss_grad, log_z=log_z, **losses)
        assert_close(other, auto)
        assert all(np.any(g != 0) for g in jax.tree.leaves(other[1]))

    def hlo(loss_grad):
        model = Transformer(cfg.model, platform=dataclasses.replace(platform.current(), loss_grad=loss_grad))
        objective = lambda p: loss_sums(cfg, model, p, data, **losses)[0]
        return jax.jit(jax.grad(objective)).lower(p).as_text()

    def logits_scatters(hlo):  # scatters whose result has the shape of a chunk's logits (not the embedding's [V, D])
        results = re.findall(r'"stablehlo.scatter".*?\) -> tensor<([\dx]*)xf32>', hlo, re.S)
        return [shape for shape in results if shape.count("x") == 2 and shape.endswith(f"x{V}")]

    assert logits_scatters(hlo("autodiff"))  # the target's term (take_along_axis's transpose)
    assert not logits_scatters(hlo("written"))


def test_written_loss_gradient_of_both_outputs_equals_autodiff():
    """The cross-entropy's own gradient too (DPO's sequence log-probabilities), alone and beside the objective's."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 3, (B, T, V)), jnp.float32)
    targets, (g_objective, g_ce) = batch()["targets"], jnp.asarray(rng.normal(size=(2, B, T)), jnp.float32)
    for losses in ({}, dict(label_smoothing=0.1, z_loss=1e-2, n_vocab=N_VOCAB)):
        grads = {}
        for how, log_z in (("autodiff", "two_pass"), ("written", "two_pass"), ("written", "online")):
            weighted = (
                lambda x: (token_losses(x, targets, **losses, grad=how, log_z=log_z)[0] * g_objective).sum()
                + (token_losses(x, targets, **losses, grad=how, log_z=log_z)[1] * g_ce).sum()
            )
            grads[how, log_z] = jax.jit(jax.grad(weighted))(logits)  # (one program, not an op at a time: compiles less)
        assert_close(grads["written", "two_pass"], grads["autodiff", "two_pass"])
        assert_close(grads["written", "online"], grads["autodiff", "two_pass"])
    x, w = jnp.asarray(rng.normal(size=(B, T, 16)), jnp.float32), jnp.asarray(rng.normal(size=(16, V)), jnp.float32)
    loss = lambda x, w, how: (chunked_token_losses(x, w, targets, 8, "float32", how) * g_ce).sum()
    chunked = {how: jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(x, w, how) for how in ("autodiff", "written")}
    assert_close(chunked["written"], chunked["autodiff"])


def test_online_logsumexp_is_logsumexp_in_one_pass():
    """lm.loss.online_logsumexp (platform log_z=online): jax.nn.logsumexp's values and gradients, rows of -inf (a
    padded vocabulary's, scored) included, from one reduction over the vocabulary instead of two."""
    rng = np.random.default_rng(1)
    x = rng.normal(0, 8, (4, 7, V)).astype(np.float32)
    x[0, 0, N_VOCAB:] = -np.inf
    x[1, 2, :] = -np.inf  # nothing but -inf
    x[2, 3, 5] = 80.0  # exp(80) is near float32's largest: the sum must not overflow
    got, want = online_logsumexp(jnp.asarray(x)), jax.nn.logsumexp(jnp.asarray(x), axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[1, 2] == -np.inf
    finite = jnp.asarray(np.where(np.isfinite(x), x, -30.0))
    cotangent = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
    grad = lambda f: jax.grad(lambda y: (f(y) * cotangent).sum())(finite)
    assert_close(grad(online_logsumexp), grad(lambda y: jax.nn.logsumexp(y, axis=-1)))

    def reductions_over_v(f):
        return re.findall(rf"stablehlo.reduce.*?tensor<4x7x{V}xf32>", jax.jit(f).lower(finite).as_text())

    assert len(reductions_over_v(online_logsumexp)) == 1
    assert len(reductions_over_v(lambda y: jax.nn.logsumexp(y, axis=-1))) == 2


SHARDED_LOSS = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from lm.loss import chunked_loss_sums

rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(4, 12, 16)), jnp.float32)
w = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
targets = jnp.asarray(rng.integers(0, 60, (4, 12)))
mask = jnp.ones((4, 12), jnp.float32)
def loss(x, w, grad, log_z):
    return chunked_loss_sums(x, w, targets, mask, 5, "float32", 0.1, 1e-3, 60, grad=grad, log_z=log_z)[0]
f = lambda grad, log_z: jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, grad, log_z), (0, 1)))
want = f("autodiff", "two_pass")(x, w)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
xs = jax.device_put(x, NamedSharding(mesh, P("data")))
ws = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))  # the vocabulary split 4 ways
got = f("written", "online")(xs, ws)
print("RESULT " + json.dumps([float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]))
"""


def test_a_gpus_loss_with_the_vocabulary_split_over_devices_equals_one_devices():
    """A GPU's loss (loss_grad=written, log_z=online) on a mesh whose tensor axis splits the vocabulary (8 host
    devices, in a process of its own): the same loss and gradients as autodiff's two passes on one device."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}
    done = subprocess.run([sys.executable, "-c", SHARDED_LOSS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert len(errors) == 3 and max(errors) < 1e-5, errors


def test_bfloat16_chunked_loss_is_within_bfloat16_rounding_and_keeps_the_parameter_dtype():
    results = []
    for chunk in (0, 8):
        cfg = config_lib.replace(tiny(chunk, False, layers=1), model={"dtype": "bfloat16", "param_dtype": "bfloat16"})
        (loss, _), grads = mean_loss_and_grads(cfg, params(cfg), batch(), label_smoothing=0.1, n_vocab=N_VOCAB)
        assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
        results.append((float(loss), np.concatenate([np.ravel(g.astype(np.float32)) for g in jax.tree.leaves(grads)])))
    (loss_full, g_full), (loss_chunked, g_chunked) = results
    assert loss_chunked == pytest.approx(loss_full, rel=1e-5)  # the loss itself is float32
    assert np.linalg.norm(g_chunked - g_full) <= 0.02 * np.linalg.norm(g_full)  # 0.7% here; bfloat16: 2^-8


@pytest.mark.parametrize("chunk", [0, 8])
def test_bfloat16_logits_come_out_of_the_head_in_float32_and_its_gradient_runs_in_bfloat16(chunk):
    """No separate cast of bfloat16 logits to float32 (on an H100, most of the 4.2 ms of casts in GPT-2's 73.5 ms
    step), and no float32 matmul in the head's backward pass."""
    cfg = config_lib.replace(tiny(chunk, False, layers=1), model={"dtype": "bfloat16", "param_dtype": "float32"})
    model = Transformer(cfg.model, platform=dataclasses.replace(platform.current(), logits="float32"))
    data = batch()
    objective = lambda p: loss_sums(cfg, model, p, data)[0]
    hlo = jax.jit(jax.grad(objective)).lower(params(cfg)).as_text()
    dots = dot_operand_dtypes(hlo, matrices_only=True)
    assert dots and all(dtypes == ("bf16", "bf16") for dtypes in dots), dots
    casts = re.findall(r"stablehlo.convert .*: \(tensor<([\dx]*)xbf16>\) -> tensor<[\dx]*xf32>", hlo)
    weight = f"{cfg.model.n_embd}x{V}"  # the head's bfloat16 gradient, cast for its float32 parameter
    assert not [shape for shape in casts if shape.endswith(f"x{V}") and shape != weight], casts
    bf16_dot_to_f32 = r"stablehlo.dot_general .*: \(tensor<[\dx]*xbf16>, tensor<[\dx]*xbf16>\) -> tensor<([\dx]*)xf32>"
    head_outputs = re.findall(bf16_dot_to_f32, hlo)
    assert any(shape.endswith(f"x{V}") for shape in head_outputs), head_outputs


@pytest.mark.parametrize("way", [{}, {"loss_grad": "written", "log_z": "online"}], ids=["autodiff", "gpu_loss"])
def test_logits_in_the_compute_dtype_are_the_16_bit_heads_rounded_logits(way):
    """lm.platform's logits=compute: a bfloat16 model's chunked loss reads logits written in bfloat16 (the matmul's
    output, no float32 [.., V] array out of the head), and its loss is the cross-entropy of those rounded logits,
    not of the float32 ones; DPO's reference scores as the policy does, so that equal weights give equal
    log-probabilities to the bit."""
    rng = np.random.default_rng(3)
    bf16_values = lambda a: jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)  # exact in bfloat16 and float32
    x, w = bf16_values(rng.normal(0, 1, (B, T, 32))), bf16_values(rng.normal(0, 0.5, (32, V)))
    targets, mask = jnp.asarray(rng.integers(0, N_VOCAB, (B, T))), jnp.ones((B, T), jnp.float32)
    how = {"grad": way.get("loss_grad", "autodiff"), "log_z": way.get("log_z", "two_pass")}
    chunked = lambda logits: chunked_loss_sums(x, w, targets, mask, 8, "bfloat16", logits=logits, **how)[1]
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)

    def ce_sum(logits_BTV):  # float64 cross-entropy summed over every token
        z = logits_BTV - logits_BTV.max(-1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return -np.take_along_axis(log_p, np.asarray(targets)[..., None], -1).sum()

    rounded = ce_sum(np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float64))
    assert abs(float(chunked("compute")) - rounded) < 1e-5 * abs(rounded)
    assert abs(float(chunked("float32")) - ce_sum(exact)) < 1e-5 * abs(rounded)
    assert abs(ce_sum(exact) - rounded) > 1e-4 * abs(rounded)  # the rounding shows at this size (1.8e-4)

    cfg = config_lib.replace(tiny(8, False, layers=1), model={"dtype": "bfloat16", "param_dtype": "float32"})
    model = Transformer(cfg.model, platform=dataclasses.replace(platform.current(), logits="compute", **way))
    p, data = params(cfg), batch()
    hlo = jax.jit(jax.grad(lambda p: loss_sums(cfg, model, p, data)[0])).lower(p).as_text()
    head = r"stablehlo.dot_general .*: \(tensor<[\dx]*xbf16>, tensor<[\dx]*xbf16>\) -> tensor<([\dx]*)x(\w+)>"
    head_outputs = [t for shape, t in re.findall(head, hlo) if shape.endswith(f"x{V}")]
    assert head_outputs and set(head_outputs) == {"bf16"}, head_outputs
    policy = jax.jit(lambda p: sequence_logprobs(cfg, model, p, data, grad=True))(p)
    reference = jax.jit(lambda p: sequence_logprobs(cfg, model, p, data, grad=False))(p)
    np.testing.assert_array_equal(policy, reference)


def test_chunked_loss_of_a_lora_model_gives_the_adapters_the_same_gradients():
    cfg = config_lib.replace(tiny(8), lora={"rank": 2, "alpha": 2.0, "targets": ("qkv", "attn_proj", "fc", "mlp_proj")})
    frozen = params(cfg)
    adapters = lora.init_adapters(frozen, 2, cfg.lora.targets, jax.random.key(2))
    rng = np.random.default_rng(0)  # B away from zero, so that A gets a gradient too
    draw = lambda path, x: rng.normal(0, 0.02, x.shape).astype(np.float32) if path[-1].key == "b" else x
    adapters = jax.tree_util.tree_map_with_path(draw, adapters)
    data = batch(1)
    full_cfg = config_lib.replace(cfg, train={"loss_chunk": 0})
    (full, _), g_full = mean_loss_and_grads(full_cfg, adapters, data, frozen, label_smoothing=0.1, n_vocab=N_VOCAB)
    (chunked, _), g_chunked = mean_loss_and_grads(cfg, adapters, data, frozen, label_smoothing=0.1, n_vocab=N_VOCAB)
    assert_close((chunked, g_chunked), (full, g_full))


def test_chunked_eval_and_train_steps_equal_the_unchunked_ones():
    data = batch(2)
    results = []
    for chunk in (0, 8):
        cfg = tiny(chunk, layers=1, grad_accum=3, z_loss=1e-3)
        tx = optax.sgd(0.1)  # not Adam, whose update of a near-zero gradient is its sign: noise
        p = params(cfg)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p), rng=jax.random.key(0))
        state, metrics = jax.jit(make_train_step(cfg, tx, N_VOCAB))(state, data)
        results.append((jax.jit(make_eval_step(cfg))(p, data), metrics, state.params))
    (eval_full, metrics_full, p_full), (eval_chunked, metrics_chunked, p_chunked) = results
    assert_close(eval_chunked, eval_full)
    scalars = lambda m: (m["loss"], m["grad_norm"])
    assert_close(scalars(metrics_chunked), scalars(metrics_full))
    assert_close(p_chunked, p_full)


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("way", ["autodiff", "written", "online"])
def test_the_softmax_leaves_out_a_padded_vocabularys_rows(chunk, way):
    """The loss is the model's cross-entropy over the tokenizer's ids, as it samples, scores (lm.eval) and exports
    (the padding trimmed): the padded rows took softmax mass in the training and validation loss, which read higher
    than lm.eval's loss of the same tokens (at initialisation by log(V / n_vocab)), and their head rows trained."""
    cfg, data = tiny(chunk, tie=False, layers=1), batch(3)
    p = params(cfg)
    loss_grad, log_z = ("autodiff", "online") if way == "online" else (way, "two_pass")
    (_, ce), grads = mean_loss_and_grads(cfg, p, data, loss_grad=loss_grad, log_z=log_z, n_vocab=N_VOCAB)
    logits = Transformer(cfg.model).apply(p, data["inputs"])[..., :N_VOCAB]  # the export's head
    by_hand = -jnp.take_along_axis(jax.nn.log_softmax(logits), data["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(ce, (by_hand * data["loss_mask"]).sum(), rtol=1e-5)
    head = grads["params"]["lm_head"]["kernel"]
    assert not np.any(head[:, N_VOCAB:]) and np.all(np.any(head[:, :N_VOCAB], axis=0))
    sums, _ = jax.jit(make_eval_step(cfg, N_VOCAB))(p, data)  # val_loss: the same cross-entropy
    np.testing.assert_allclose(sums["loss"], ce, rtol=1e-5)


def largest_f32_buffer(hlo: str) -> int:
    """Elements of the largest float32 array anywhere in an optimised HLO module."""
    shapes = re.findall(r"f32\[([\d,]+)\]", hlo)
    return max(int(np.prod([int(d) for d in s.split(",")])) for s in shapes)


def test_the_compiled_train_step_never_holds_the_whole_batchs_logits():
    # A batch whose logits dwarf everything else: 8 x 64 x 8192 float32 (16 MiB) against 131k-element weights.
    b, t, v = 8, 64, 8192
    tx = optax.sgd(0.1)
    data = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ("inputs", "targets")}
    compiled = {}
    for chunk in (0, 8):
        model = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=v, max_seq_len=t)
        cfg = config_lib.replace(config_lib.Config(), model=model, train={"loss_chunk": chunk})

        def init(rng, cfg=cfg):
            p = nn.unbox(init_params(cfg.model, rng))
            return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p), rng=rng)

        state = jax.eval_shape(init, jax.random.key(0))
        compiled[chunk] = jax.jit(make_train_step(cfg, tx)).lower(state, data).compile()
    logits_elements, chunk_elements = b * t * v, b * 8 * v
    assert largest_f32_buffer(compiled[0].as_text()) >= logits_elements  # the check sees the unchunked logits
    assert largest_f32_buffer(compiled[8].as_text()) <= chunk_elements
    # The unchunked step keeps the logits and their gradient; the chunked one a few chunks' worth (2 MiB each).
    temp_full, temp_chunked = (compiled[c].memory_analysis().temp_size_in_bytes for c in (0, 8))
    assert temp_full >= 2 * 4 * logits_elements and temp_chunked <= 4 * 4 * chunk_elements


def test_the_eval_step_runs_in_the_training_steps_micro_batches():
    """A batch whose training step fits only in micro-batches (train.grad_accum) evaluated whole: the end-of-run
    evaluation ran out of memory, blamed on the training step, after raising train.grad_accum had fixed that."""
    b, t, v = 16, 64, 2048
    data = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ("inputs", "targets")}
    compiled, sums = {}, {}
    real = {k: jax.random.randint(jax.random.key(i), (b, t), 0, v) for i, k in enumerate(("inputs", "targets"))}
    for accum in (1, 8):
        model = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=v, max_seq_len=t)
        cfg = config_lib.replace(config_lib.Config(), model=model, train={"loss_chunk": 0, "grad_accum": accum})
        p = nn.unbox(init_params(cfg.model, jax.random.key(0)))
        step = jax.jit(make_eval_step(cfg))
        compiled[accum] = step.lower(p, data).compile()
        sums[accum] = step(p, real)
    assert_close(sums[8], sums[1])
    temp_whole, temp_micro = (compiled[a].memory_analysis().temp_size_in_bytes for a in (1, 8))
    assert temp_whole >= 4 * b * t * v  # the whole batch's logits
    assert temp_micro <= 4 * 4 * (b // 8) * t * v  # a few micro-batches' worth
