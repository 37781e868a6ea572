"""LayerNorm and RMSNorm over the last axis, with their gradients written out.

    y = Norm(eps, dtype, param_dtype, center=True, use_bias=True, scale_init=..., bias_init=...)(x)

They compute what flax.linen's LayerNorm (with its default one-pass variance) and RMSNorm compute, with
the same parameters ("scale", and "bias" for a LayerNorm with one), in float32 whatever the input's
dtype, and return `dtype`. What differs is the backward pass. Autodiff of the forward pass sums
dy * scale and dy * scale * xhat over each row; XLA:CPU hands such row sums to YNNPACK reductions,
which read their operands from memory, so it wrote the scale and the row statistics out broadcast
to the activations' full [..., D] shape, three such arrays a norm (benchmarks/README.md: that was
most of the LayerNorms' time in a training step). Here the row sums are matrix-vector products
with the scale, and every broadcast sits in an element-wise fusion, where it costs nothing; in the
forward pass an optimization barrier keeps the row statistics' broadcast out of their reduction.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


def _stats(x, eps: float, center: bool):
    """(x in float32, each row's mean (0 when not centering), 1 / its standard deviation)."""
    x = x.astype(jnp.float32)
    mean_sq = jnp.mean(x * x, -1, keepdims=True)
    if not center:
        return x, 0.0, jax.lax.rsqrt(mean_sq + eps)
    mean = jnp.mean(x, -1, keepdims=True)
    return x, mean, jax.lax.rsqrt(jnp.maximum(mean_sq - mean * mean, 0.0) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def normalize(eps: float, center: bool, dtype: Any, x, scale, bias):
    """(x - mean) / std * scale + bias over the last axis (no mean when not `center`; no bias when None)."""
    return _forward(eps, center, dtype, x, scale, bias)[0]


def _forward(eps, center, dtype, x, scale, bias):
    x32, mean, inv_std = _stats(x, eps, center)
    # Without the barrier XLA:CPU fused the broadcast of 1 / std into the YNNPACK reduction that computes it, which
    # then wrote it out at the activations' full size for the next fusion to read (from 128 x 64 rows of 128 on):
    # a norm's forward went from eight full-size reads and writes to four, its time in a step 30-60% lower.
    mean, inv_std = jax.lax.optimization_barrier((mean, inv_std))
    y = (x32 - mean) * inv_std * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype), (x, mean, inv_std, scale, bias)


def _backward(eps, center, dtype, residuals, dy):
    x, mean, inv_std, scale, bias = residuals
    xhat = (x.astype(jnp.float32) - mean) * inv_std
    dy = dy.astype(jnp.float32)
    scale32 = scale.astype(jnp.float32)
    dy_xhat = dy * xhat
    # d(loss)/d(xhat) = dy * scale; dx = inv_std * (that - its row mean - xhat * row mean of that * xhat)
    dx = dy * scale32 - xhat * ((dy_xhat @ scale32)[..., None] / x.shape[-1])
    if center:
        dx = dx - (dy @ scale32)[..., None] / x.shape[-1]
    rows = tuple(range(x.ndim - 1))
    d_bias = None if bias is None else jnp.sum(dy, rows).astype(bias.dtype)
    return (dx * inv_std).astype(x.dtype), jnp.sum(dy_xhat, rows).astype(scale.dtype), d_bias


normalize.defvjp(_forward, _backward)


class Norm(nn.Module):
    """A LayerNorm (center=True) or an RMSNorm (center=False) over the last axis, with a scale per feature."""

    eps: float
    dtype: Any
    param_dtype: Any
    center: bool = True
    use_bias: bool = True
    scale_init: Callable = nn.initializers.ones_init()
    bias_init: Callable = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        features = (x.shape[-1],)
        scale = self.param("scale", self.scale_init, features, self.param_dtype)
        bias = self.param("bias", self.bias_init, features, self.param_dtype) if self.center and self.use_bias else None
        return normalize(self.eps, self.center, jnp.dtype(self.dtype or x.dtype), x, scale, bias)
