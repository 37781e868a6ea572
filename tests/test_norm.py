"""lm.norm: the same values and gradients as flax's LayerNorm and RMSNorm, and forward and backward passes
that XLA:CPU compiles without writing the scale or the row statistics out at the activations' full size."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.norm import Norm

SHAPE = (3, 8, 48)
EPS = 1e-5
random_init = nn.initializers.normal(1.0)  # scale and bias far from 1 and 0, so that a wrong term shows

CASES = {
    "layernorm": (dict(center=True, use_bias=True), lambda: nn.LayerNorm(EPS, scale_init=random_init, bias_init=random_init)),
    "layernorm_no_bias": (dict(center=True, use_bias=False), lambda: nn.LayerNorm(EPS, use_bias=False, scale_init=random_init)),
    "rmsnorm": (dict(center=False), lambda: nn.RMSNorm(EPS, scale_init=random_init)),
}


def inputs(shape=SHAPE, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 3 + 1.5  # a mean far from 0: a wrong centring shows
    return jnp.asarray(x, dtype), jnp.asarray(rng.standard_normal(shape), jnp.float32)


def value_and_grads(module, params, x, dy):
    loss = lambda p, x: jnp.vdot(module.apply(p, x).astype(jnp.float32), dy)
    return module.apply(params, x), jax.grad(loss, argnums=(0, 1))(params, x)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", [SHAPE, (2, 5, 4, 16)], ids=["rows", "heads"])
def test_norm_matches_flax(case, shape):
    options, flax_norm = CASES[case]
    ours = Norm(EPS, jnp.float32, jnp.float32, scale_init=random_init, bias_init=random_init, **options)
    x, dy = inputs(shape)
    params = ours.init(jax.random.key(1), x)
    theirs = flax_norm()
    # The same parameters, by name and shape: checkpoints and Hugging Face weights load either way.
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, theirs.init(jax.random.key(1), x))
    (y, (dp, dx)), (y_ref, (dp_ref, dx_ref)) = value_and_grads(ours, params, x, dy), value_and_grads(theirs, params, x, dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(dp):
        np.testing.assert_allclose(g, dict(jax.tree_util.tree_leaves_with_path(dp_ref))[path], rtol=1e-4, atol=1e-4)


def test_norm_computes_in_float32_and_returns_its_dtype():
    x, dy = inputs(dtype=jnp.bfloat16)
    ours = Norm(EPS, jnp.bfloat16, jnp.float32, scale_init=random_init, bias_init=random_init)
    theirs = nn.LayerNorm(EPS, jnp.bfloat16, jnp.float32, scale_init=random_init, bias_init=random_init)
    params = ours.init(jax.random.key(2), x)
    (y, (dp, dx)), (y_ref, (dp_ref, dx_ref)) = value_and_grads(ours, params, x, dy), value_and_grads(theirs, params, x, dy)
    assert y.dtype == dx.dtype == jnp.bfloat16 and dp["params"]["scale"].dtype == jnp.float32
    np.testing.assert_allclose(np.float32(y), np.float32(y_ref), atol=0.05)  # a bfloat16 ulp of values ~3
    np.testing.assert_allclose(np.float32(dx), np.float32(dx_ref), atol=0.05)
    np.testing.assert_allclose(dp["params"]["scale"], dp_ref["params"]["scale"], rtol=1e-2, atol=0.05)


def full_size_broadcasts(module, shape) -> list[str]:
    """The compiled (CPU) gradient's instructions that only broadcast something smaller to `shape`, or that end
    by broadcasting to it (a YNNPACK reduction fusion that writes its row statistic out at full size)."""
    x, dy = inputs(shape)
    params = module.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.vdot(module.apply(p, x), dy)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
    computations = dict(re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M))
    opcodes = lambda body: set(re.findall(r"= \w+\[[\d,]*\](?:\{[\d,]*\})? ([a-z\-]+)\(", body))
    size = f"f32[{','.join(map(str, shape))}]"
    found = []
    entry = re.search(r"^ENTRY .*?\n\}", hlo, re.S | re.M).group(0)  # what runs, not what a fusion computes inside
    for name, opcode, called in re.findall(rf"%([\w.\-]+) = {re.escape(size)}\S* ([a-z\-]+)\((?:.*calls=%([\w.\-]+))?", entry):
        body = computations.get(called, "")
        ops = opcodes(body) if opcode == "fusion" else {opcode}
        root = re.search(r"ROOT %?[\w.\-]+ = \S+ ([a-z\-]+)\(", body)
        only_broadcasts = "broadcast" in ops and ops <= {"broadcast", "parameter", "bitcast", "reshape", "copy"}
        if only_broadcasts or (root and root.group(1) == "broadcast"):
            found.append(name)
    return found


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what XLA:CPU makes of a norm's gradient")
def test_the_gradient_writes_no_broadcast_of_the_scale_or_the_statistics():
    # At 128 x 64 rows (not at 12 x 64) XLA:CPU fused the forward's 1 / std, broadcast, into the YNNPACK reduction
    # that computes it, until lm.norm put an optimization barrier between the statistics and their use.
    shape = (128, 64, 128)
    assert full_size_broadcasts(nn.LayerNorm(EPS), shape)  # the check sees what autodiff of flax's norm costs
    assert full_size_broadcasts(Norm(EPS, jnp.float32, jnp.float32), shape) == []
    assert full_size_broadcasts(Norm(EPS, jnp.float32, jnp.float32, center=False), shape) == []
