"""The decoder-only transformer, as pure Flax linen modules.

    params = Transformer(cfg).init(rng, tokens_BT)
    logits_BTV = Transformer(cfg).apply(params, tokens_BT)
    logits_BTV, cache = Transformer(cfg).apply(params, tokens_BT, cache=cache)   # KV-cached
    x_BTD = Transformer(cfg).apply(params, tokens_BT, head=False)   # hidden states; the head: head_kernel(params, cfg)

Tensor names carry their shapes: B batch, T query length, S key length (the cache length when
decoding), D model width, N query heads, K key/value heads, G = N // K, H head width,
F MLP width, V vocabulary, L layers.

The KV cache is an explicit pytree: {"layers": per-layer {"k", "v"} of shape [B, K, S, H]
(stacked on a leading L axis with scan_layers), "lengths": int32 [B]}. Heads lead the slots so that
the attention matmuls read the cache as it lies (with slots first, XLA copied it transposed, the whole
cache, at every decoding step). A call with T new
tokens lets each query attend to every slot up to its own (the cache's first lengths[b] slots, then
the new tokens causally), writes row b's keys and values at slots lengths[b] .. lengths[b]+T-1, and
returns lengths + T.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm import platform as platform_lib
from lm.config import ConfigError, ModelConfig
from lm.errors import first_line
from lm.norm import Norm
from lm.platform import Platform

Cache = dict[str, Any]

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _init(std: float, axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def _zeros(axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Name an activation's axes; lm.sharding.activate maps the names onto the mesh (a no-op outside it)."""
    return nn.with_logical_constraint(x, names)


def einsum_f32(spec: str, a, b):
    """jnp.einsum(spec, a, b) of operands in their own dtype, accumulated and written in float32: the float32
    result a 16-bit matmul produces anyway, with no rounding to 16 bits and no separate full-size cast after it
    (on an H100 casts took 4.2 of GPT-2's 73.5 ms step, most of it that of its bfloat16 logits). Its gradient runs in
    the operands' dtype: autodiff of preferred_element_type=float32 would cast the operands up and run both
    backward matmuls in float32. Float32 operands: plain jnp.einsum."""
    if a.dtype == b.dtype == jnp.float32:
        return jnp.einsum(spec, a, b)
    return _einsum_f32(spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_f32(spec: str, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_f32_fwd(spec: str, a, b):
    return _einsum_f32(spec, a, b), (a, b)


def _einsum_f32_bwd(spec: str, operands, g):
    """The gradient of the einsum in the operands' dtype: the float32 cotangent cast down first, as the gradient
    of a cast after a 16-bit einsum would be."""
    a, b = operands
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)
    return vjp(g.astype(jnp.result_type(a, b)))


_einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)


class Linear(nn.Module):
    """y = x . kernel (+ bias), contracting x's last `n_in` axes with a kernel of shape [*in, *features].

    Unlike nn.DenseGeneral, the kernel is initialised in its real shape (not flattened), so its
    logical axis names always match its rank, also under an active sharding rules context.
    `flat` computes it as one 2-D matmul (Platform.matmul); a `kernel_t` parameter instead of `kernel` is
    the decoding layout [prod(features), prod(inputs)] (outputs_first). `float32_out`: y in float32 as the
    matmul accumulates it (einsum_f32), not in `dtype` (the output head's logits). `split` = (axis, sizes):
    y as consecutive pieces of that feature axis, each the matmul of its own slice of the kernel (Platform.qkv).
    """

    features: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical names of the kernel's axes, inputs then features
    std: float
    use_bias: bool
    dtype: Any
    param_dtype: Any
    n_in: int = 1
    flat: bool = False
    float32_out: bool = False
    split: tuple[int, tuple[int, ...]] | None = None

    @nn.compact
    def __call__(self, x):
        lead, inputs = x.shape[: x.ndim - self.n_in], x.shape[x.ndim - self.n_in :]
        x = x.astype(self.dtype)
        if self.has_variable("params", "kernel_t"):  # decoding: no gradient, so no need of einsum_f32's
            kernel_t = self.get_variable("params", "kernel_t").astype(self.dtype)
            x_2d = x.reshape(math.prod(lead), math.prod(inputs))
            out = jnp.float32 if self.float32_out else None
            y = jax.lax.dot_general(x_2d, kernel_t, (((1,), (1,)), ((), ())), preferred_element_type=out)
            y = self._add(y.reshape(*lead, *self.features), self._bias())
            if self.split:  # one token's outputs: slicing them costs nothing worth a matmul each
                axis, sizes = self.split
                return tuple(jnp.split(y, np.cumsum(sizes)[:-1], axis=len(lead) + axis))
            return y
        kernel = self.param("kernel", _init(self.std, self.axes), (*inputs, *self.features), self.param_dtype)
        kernel, bias = kernel.astype(self.dtype), self._bias()
        if not self.split:
            return self._add(self._matmul(x, kernel), bias)
        axis, sizes = self.split
        pieces, start = [], 0
        for size in sizes:
            piece = lambda a, k: jax.lax.slice_in_dim(a, start, start + size, axis=k + axis)
            pieces.append(
                self._add(self._matmul(x, piece(kernel, self.n_in)), None if bias is None else piece(bias, 0))
            )
            start += size
        return tuple(pieces)

    def _matmul(self, x, kernel):
        """x's last n_in axes contracted with a kernel [*inputs, *features]."""
        lead, n_out = x.shape[: x.ndim - self.n_in], kernel.ndim - self.n_in
        if self.flat:
            x_2d, kernel_2d = x.reshape(math.prod(lead), -1), kernel.reshape(math.prod(kernel.shape[: self.n_in]), -1)
            y = einsum_f32("nd,df->nf", x_2d, kernel_2d) if self.float32_out else x_2d @ kernel_2d
            return y.reshape(*lead, *kernel.shape[self.n_in :])
        if self.float32_out:
            ins, outs = "ijkl"[: self.n_in], "uvwx"[:n_out]
            return einsum_f32(f"...{ins},{ins}{outs}->...{outs}", x, kernel)
        return jnp.tensordot(x, kernel, self.n_in)

    def _bias(self):
        if self.use_bias:
            return self.param("bias", _zeros(self.axes[self.n_in :]), self.features, self.param_dtype)
        return None

    @staticmethod
    def _add(y, bias):
        return y if bias is None else y + bias.astype(y.dtype)


def sinusoidal(positions_BT: jax.Array, d: int) -> jax.Array:
    """The original Transformer's encoding: sin and cos of position / 10000^(2i/d), interleaved."""
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    angles = positions_BT[..., None].astype(jnp.float32) * inv_freq
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pe.reshape(*positions_BT.shape, -1)[..., :d]


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE's angular frequency for each pair of a head's dimensions, after model.rope_scaling.

    llama3 (Llama 3.1) divides the frequencies whose wavelength exceeds original_max_len / low_freq_factor
    by rope_factor, keeps those below original_max_len / high_freq_factor, and blends linearly in between.
    """
    h = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        periods_per_context = cfg.rope_original_max_len * inv_freq / (2 * np.pi)  # original_max_len / wavelength
        keep = np.clip((periods_per_context - low) / (high - low), 0.0, 1.0)  # 1: short waves kept, 0: long scaled
        return keep * inv_freq + (1 - keep) * inv_freq / cfg.rope_factor
    return inv_freq


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary position embedding, rotating the first half of each head against the second."""
    angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq.astype(np.float32)
    sin, cos = jnp.sin(angles_BTh)[:, :, None, :], jnp.cos(angles_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


def attention_mask(t: int, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """[1, T, T] bool ([B, T, T] with segment ids): query t sees positions <= t, in its own segment."""
    mask_BTS = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]
    if segment_ids_BT is not None:
        mask_BTS &= segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return mask_BTS


# The most query blocks einsum_attention splits a causal sequence into: each block's own matmuls cost more than
# their share of the whole's (on a CPU, of 256 positions four blocks of 64 saved 3-9%, two of 128 24-38%;
# benchmarks.attention_blocks), and four blocks compute 5/8 of the whole's logits.
ATTENTION_BLOCKS = 4


def einsum_attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, dropout: nn.Dropout | None = None, block: int = 0):
    """Attention as two batched matmuls: float32 logits scaled once, future masked before a float32 softmax.
    Keys and values come heads first, as the KV cache holds them. The queries are laid out heads first too,
    each group of G query heads sharing a key head as one run of G*T rows (X), so that both matmuls and the
    softmax between them work on [B, K] batches of plain 2-D blocks: on a CPU that takes 1.5-1.6x less time
    than with the positions before the heads (jax.nn.dot_product_attention) or with a separate group axis
    (benchmarks/README.md).

    With `block` (Platform.attention_block; for self-attention, where the keys are the queries' own positions,
    causally masked), the queries go in blocks of `block` positions or more, at most ATTENTION_BLOCKS of them,
    each over the keys up to its last position only: the blocks above the diagonal, all masked, are never
    computed."""
    b, t, n, h = q_BTNH.shape
    k, s = k_BKSH.shape[1], k_BKSH.shape[2]
    g = n // k
    if mask_BTS is None:
        mask_BTS = attention_mask(t)
    q_BKGTH = q_BTNH.reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4)
    if not block or block >= t or s != t:
        out_BKGTH = _attend(q_BKGTH, k_BKSH, v_BKSH, mask_BTS, dropout)
    else:
        block = max(block, -(-t // ATTENTION_BLOCKS))
        rows = [(start, min(start + block, t)) for start in range(0, t, block)]
        out_BKGTH = jnp.concatenate(
            [
                _attend(q_BKGTH[:, :, :, i:j], k_BKSH[:, :, :j], v_BKSH[:, :, :j], mask_BTS[:, i:j, :j], dropout)
                for i, j in rows
            ],
            axis=3,
        )
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _attend(q_BKGTH, k_BKSH, v_BKSH, mask_BTS, dropout: nn.Dropout | None):
    """einsum_attention of queries [B, K, G, T, H] over keys and values [B, K, S, H] under mask [B or 1, T, S]."""
    b, k, g, t, h = q_BKGTH.shape
    q_BKXH = q_BKGTH.reshape(b, k, g * t, h)
    logits_BKXS = einsum_f32("bkxh,bksh->bkxs", q_BKXH, k_BKSH)
    mask_BXS = jnp.tile(mask_BTS, (1, g, 1))  # row x is query head x // t's position x % t
    # finfo.min, not -inf: a row with nothing to attend to stays finite (uniform) instead of NaN.
    logits_BKXS = jnp.where(mask_BXS[:, None], logits_BKXS * (1.0 / math.sqrt(h)), jnp.finfo(jnp.float32).min)
    probs_BKXS = jax.nn.softmax(logits_BKXS, axis=-1)
    if dropout is not None:
        probs_BKXS = dropout(probs_BKXS)
    out_BKXH = jnp.einsum("bkxs,bksh->bkxh", probs_BKXS.astype(v_BKSH.dtype), v_BKSH)
    return out_BKXH.reshape(b, k, g, t, h)


def dot_product_attention(implementation: str, p: Platform, q_BTNH, k_BSKH, v_BSKH, segment_ids_BT):
    """Attention by the kernel the platform picks for model.attention=`implementation` (platform.attention_kernel):
    cuDNN's fused flash attention, jax's XLA attention, einsum_attention, or for packed segments Pallas's flash
    attention with segment ids. `cudnn` raises a ConfigError where cuDNN cannot run. Segments go to cuDNN and XLA
    as a mask, beside their own causal masking."""
    segmented = segment_ids_BT is not None
    kernel, why = platform_lib.attention_kernel(p, implementation, q_BTNH.dtype, segmented)
    mask_BTS = attention_mask(q_BTNH.shape[1], segment_ids_BT) if segmented else None
    kwargs = dict(scale=1.0 / math.sqrt(q_BTNH.shape[-1]), mask=None if mask_BTS is None else mask_BTS[:, None])
    if kernel == "pallas":
        try:
            return pallas_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, interpret=p.backend != "gpu")
        except (ValueError, ImportError):  # a length the kernel's blocks do not divide, or a jax without the kernel
            # (deprecated in jax 0.11 for tokamax's, then removed): the segments as a mask
            kernel, why = platform_lib.attention_kernel(
                dataclasses.replace(p, segments="mask"), implementation, q_BTNH.dtype, True
            )
    if kernel == "cudnn" and not why:
        cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn", is_causal=True, **kwargs)
        try:
            # cuDNN's checks for training (e.g. a mask, as a bias, needs even lengths) run in its gradient's forward
            # rule, which under jax.checkpoint or nn.scan (model.remat, model.scan_layers) is traced after this call,
            # outside this try: made here first, by tracing its gradient's forward (shapes only, nothing compiled)
            jax.eval_shape(lambda *qkv: jax.vjp(cudnn, *qkv)[0], q_BTNH, k_BSKH, v_BSKH)
            return cudnn(q_BTNH, k_BSKH, v_BSKH)
        except (ValueError, NotImplementedError, RuntimeError) as e:  # shapes or a cuDNN it cannot use
            why = first_line(e)
            kernel = platform_lib.attention_kernel(
                dataclasses.replace(p, cuda=False), "dot_product", q_BTNH.dtype, False
            )[0]
    if implementation == "cudnn":
        raise ConfigError(f"model.attention=cudnn cannot be used here: {why}; use model.attention=dot_product")
    if kernel == "xla":
        return jax.nn.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, implementation="xla", is_causal=mask_BTS is None, **kwargs
        )
    heads_first = lambda x_BSKH: x_BSKH.transpose(0, 2, 1, 3)
    return einsum_attention(q_BTNH, heads_first(k_BSKH), heads_first(v_BSKH), mask_BTS, block=p.attention_block)


def pallas_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, interpret: bool):
    """Causal attention within segments by Pallas's fused flash-attention kernel for GPUs
    (jax.experimental.pallas.ops.gpu.attention.mha), which takes segment ids instead of a [B, T, T] mask;
    `interpret`ed off a GPU (a CPU's tests). Its kernel has no grouped heads: each key/value head is repeated for
    its query heads. Raises ValueError where its blocks do not divide the length: the forward's blocks of 128 and
    the backward's of 32 (or the whole of a shorter sequence), whose last block would read past the sequence."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    b, t, n, h = q_BTNH.shape
    g = n // k_BSKH.shape[2]
    k_BSNH, v_BSNH = (jnp.repeat(x, g, axis=2) if g > 1 else x for x in (k_BSKH, v_BSKH))
    block, backward = min(128, t), min(32, t)  # the kernel's default blocks, or the whole of a shorter sequence
    if t % block or t % backward:
        raise ValueError(f"a length of {t} is not a multiple of the kernel's blocks ({block}, {backward})")
    sizes = pallas_gpu.BlockSizes(block, block, backward, backward, backward, backward)
    return pallas_gpu.mha(
        q_BTNH, k_BSNH, v_BSNH, segment_ids_BT, sm_scale=1.0 / math.sqrt(h), causal=True, block_sizes=sizes,
        interpret=interpret,
    )


def _divides(name: str | None, size: int) -> bool:
    """Whether the mesh axes that logical axis `name` maps onto (lm.sharding.activate's rules) divide `size`: a
    table whose rows they do not divide (a vocabulary of 97 over 4 tensor devices) is left whole on each device,
    as its parameter is (lm.sharding._fit), not constrained onto an uneven split that XLA reaches only by
    replicating the table ("Involuntary full rematerialization")."""
    axes = nn.logical_to_mesh_axes((name,))[0] if name else None
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    mesh = jax.sharding.get_abstract_mesh()
    return size % math.prod(mesh.shape.get(a, 1) for a in names) == 0


def lookup(table: nn.Embed, ids, dtype, rows: str | None):
    """Rows of an embedding table, gathered in float32 and then cast to the compute dtype.

    nn.Embed casts the table first, so with bfloat16 compute the gradient's scatter-add (every token
    adds its row) would accumulate in bfloat16: imprecise when a token repeats thousands of times in a
    batch, and on GPUs a contended compare-and-swap loop (benchmarks/README.md has the cost).

    The table is gathered at full width (its `embed` axis whole, as FSDP gathers every weight it
    multiplies; `rows` names its first axis, which keeps its own sharding): XLA cannot move the
    gradient's batch-split rows onto an FSDP-split table's columns, and replicated them in full
    instead ("Involuntary full rematerialization")."""
    rows = rows if _divides(rows, table.embedding.shape[0]) else None
    full = _constrain(table.embedding.astype(jnp.float32), rows, None)
    return jnp.take(full, ids, axis=0).astype(dtype)


def cached_attention(q_BTNH, cache_k_BKSH, cache_v_BKSH, k_BTKH, v_BTKH, lengths_B):
    """Attention of T new queries over the cache's first lengths[b] slots and, causally, the T new
    keys and values (which the caller writes into the cache afterwards). Same scaling, masking and
    float32 softmax as einsum_attention."""
    b, t, n, h = q_BTNH.shape
    k, s = cache_k_BKSH.shape[1], cache_k_BKSH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
    # Rounded to the cache's dtype, as the later queries will read them.
    new_k_BKTH = k_BTKH.astype(cache_k_BKSH.dtype).astype(q_BTNH.dtype).transpose(0, 2, 1, 3)
    new_v_BKTH = v_BTKH.astype(cache_v_BKSH.dtype).astype(q_BTNH.dtype).transpose(0, 2, 1, 3)
    dot = lambda spec, a, c: jnp.einsum(spec, a, c, preferred_element_type=jnp.float32)
    old_BKGTS = dot("btkgh,bksh->bkgts", q_BTKGH, cache_k_BKSH.astype(q_BTNH.dtype))
    new_BKGTU = dot("btkgh,bkuh->bkgtu", q_BTKGH, new_k_BKTH)
    filled_BS = jnp.arange(s) < lengths_B[:, None]
    old_BKGTS = jnp.where(filled_BS[:, None, None, None], old_BKGTS, jnp.finfo(jnp.float32).min)
    new_BKGTU = jnp.where(attention_mask(t)[:, None, None], new_BKGTU, jnp.finfo(jnp.float32).min)
    logits_BKGTX = jnp.concatenate([old_BKGTS, new_BKGTU], axis=-1) * (1.0 / math.sqrt(h))
    probs_BKGTX = jax.nn.softmax(logits_BKGTX, axis=-1).astype(q_BTNH.dtype)
    out_BKGTH = jnp.einsum("bkgts,bksh->bkgth", probs_BKGTX[..., :s], cache_v_BKSH.astype(q_BTNH.dtype))
    out_BKGTH += jnp.einsum("bkgtu,bkuh->bkgth", probs_BKGTX[..., s:], new_v_BKTH)
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _write_cache(
    buf_BKSH: jax.Array, new_BTKH: jax.Array, start_B: jax.Array, after_BTNH: jax.Array | None
) -> jax.Array:
    """The cache with row b's new keys or values at slots start[b]...; with `after` (Platform.cache_write
    after_reads), written after that attention output, which read the old cache: XLA:CPU orders an in-place update
    after the cache's readers only when it depends on them (written first and then read, the cache was copied
    twice a token too). The dependency: a row whose attention output is NaN writes zeros (its outputs are NaN
    anyway)."""
    if after_BTNH is not None:
        finite_B = ~jnp.isnan(after_BTNH[:, 0, 0, 0])
        new_BTKH = jnp.where(finite_B[:, None, None, None], new_BTKH, 0)
    write = lambda buf, new, start: jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0, start, 0))
    return jax.vmap(write)(buf_BKSH, new_BTKH.transpose(0, 2, 1, 3), start_B)


class Attention(nn.Module):
    cfg: ModelConfig
    deterministic: bool = True
    platform: Platform = Platform()

    @nn.compact
    def __call__(self, x_BTD, positions_BT, segment_ids_BT, layer_cache, lengths_B):
        cfg = self.cfg
        n, k, h, d = cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.n_embd
        b, t, _ = x_BTD.shape
        flat = self.platform.matmul == "flat"
        qkv_bias = cfg.bias or cfg.qkv_bias or cfg.attn_bias
        dense = lambda features, axes, name, split=None: Linear(
            features, ("embed", *axes), 0.02, qkv_bias, cfg.dtype, cfg.param_dtype, flat=flat, split=split, name=name
        )
        if cfg.fused_qkv:
            # Grouped layout [K, G+2]: each K/V head sits beside its G query heads, so sharding
            # the K axis over the tensor mesh axis keeps every group on one device.
            g = n // k
            split = (1, (g, 1, 1)) if self.platform.qkv == "split" else None
            qkv = dense((k, g + 2, h), ("kv_heads", None, "head_dim"), "qkv", split)(x_BTD)
            if split:  # three matmuls: queries, keys and values each in its own array
                q_BTKgH, k_BTK1H, v_BTK1H = qkv
                q_BTNH, k_BTKH, v_BTKH = q_BTKgH.reshape(b, t, n, h), k_BTK1H[:, :, :, 0], v_BTK1H[:, :, :, 0]
            else:  # one matmul, its output sliced
                q_BTNH = qkv[:, :, :, :g].reshape(b, t, n, h)
                k_BTKH, v_BTKH = qkv[:, :, :, g], qkv[:, :, :, g + 1]
        else:
            q_BTNH = dense((n, h), ("heads", "head_dim"), "q")(x_BTD)
            k_BTKH = dense((k, h), ("kv_heads", "head_dim"), "k")(x_BTD)
            v_BTKH = dense((k, h), ("kv_heads", "head_dim"), "v")(x_BTD)
        if cfg.qk_norm:
            q_norm, k_norm = _head_norm(cfg, self.platform, "q_norm"), _head_norm(cfg, self.platform, "k_norm")
            q_BTNH, k_BTKH = q_norm(q_BTNH), k_norm(k_BTKH)
        if cfg.pos == "rope":
            inv_freq = rope_frequencies(cfg)
            q_BTNH = rope(q_BTNH, positions_BT, inv_freq)
            k_BTKH = rope(k_BTKH, positions_BT, inv_freq)
        q_BTNH = _constrain(q_BTNH, "act_batch", "act_len", "act_heads", None)

        new_cache = None
        attn_dropout = cfg.attn_dropout > 0 and not self.deterministic
        if layer_cache is not None and self.platform.cache_write == "after_reads":
            out_BTNH = cached_attention(q_BTNH, layer_cache["k"], layer_cache["v"], k_BTKH, v_BTKH, lengths_B)
            new_cache = {
                "k": _write_cache(layer_cache["k"], k_BTKH, lengths_B, out_BTNH),
                "v": _write_cache(layer_cache["v"], v_BTKH, lengths_B, out_BTNH),
            }
        elif layer_cache is not None:  # write the new keys and values, then attend over the cache
            new_cache = {
                "k": _write_cache(layer_cache["k"], k_BTKH, lengths_B, None),
                "v": _write_cache(layer_cache["v"], v_BTKH, lengths_B, None),
            }
            # Query i, at position lengths[b] + i, sees the slots up to its own.
            s = new_cache["k"].shape[2]
            mask_BTS = jnp.arange(s)[None, None, :] <= lengths_B[:, None, None] + jnp.arange(t)[None, :, None]
            cast = lambda x_BKSH: x_BKSH.astype(q_BTNH.dtype)
            out_BTNH = einsum_attention(q_BTNH, cast(new_cache["k"]), cast(new_cache["v"]), mask_BTS)
        elif cfg.attention == "einsum" or attn_dropout:
            # jax.nn.dot_product_attention has no dropout on the weights, so that case runs here.
            drop = nn.Dropout(cfg.attn_dropout, deterministic=False) if attn_dropout else None
            heads_first = lambda x_BTKH: x_BTKH.transpose(0, 2, 1, 3)
            mask_BTS = None if segment_ids_BT is None else attention_mask(t, segment_ids_BT)
            out_BTNH = einsum_attention(
                q_BTNH, heads_first(k_BTKH), heads_first(v_BTKH), mask_BTS, drop, self.platform.attention_block
            )
        else:
            out_BTNH = dot_product_attention(cfg.attention, self.platform, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        out_BTD = Linear(
            (d,), ("heads", "head_dim", "embed"), resid_std, cfg.bias or cfg.attn_bias, cfg.dtype, cfg.param_dtype,
            n_in=2, flat=flat, name="proj",
        )(out_BTNH)
        return out_BTD, new_cache


class Mlp(nn.Module):
    cfg: ModelConfig
    platform: Platform = Platform()

    @nn.compact
    def __call__(self, x_BTD):
        cfg = self.cfg
        flat = self.platform.matmul == "flat"
        dense = lambda features, axes, std, name: Linear(
            (features,), axes, std, cfg.bias, cfg.dtype, cfg.param_dtype, flat=flat, name=name
        )
        f = cfg.hidden
        if cfg.mlp == "swiglu":
            gate_BTF = dense(f, ("embed", "mlp"), 0.02, "gate")(x_BTD)
            h_BTF = nn.silu(gate_BTF) * dense(f, ("embed", "mlp"), 0.02, "up")(x_BTD)
        else:
            act = nn.relu if cfg.mlp == "relu" else nn.gelu
            h_BTF = act(dense(f, ("embed", "mlp"), 0.02, "fc")(x_BTD))
        h_BTF = _constrain(h_BTF, "act_batch", "act_len", "act_mlp")
        return dense(cfg.n_embd, ("mlp", "embed"), 0.02 / math.sqrt(2 * cfg.n_layer), "proj")(h_BTF)


def _head_norm(cfg: ModelConfig, p: Platform, name: str) -> nn.Module:
    """RMSNorm over each head's features, with one scale per feature shared by the heads (model.qk_norm)."""
    scale_init = nn.with_logical_partitioning(nn.initializers.ones_init(), ("head_dim",))
    if p.norm == "rowsums":
        return Norm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, center=False, scale_init=scale_init, name=name)
    return nn.RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, scale_init=scale_init, name=name)


def _norm(cfg: ModelConfig, p: Platform, name: str) -> nn.Module:
    """The model's LayerNorm or RMSNorm: flax's, or lm.norm's with the same parameters and values (Platform.norm)."""
    scale_init = nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",))
    bias_init = _zeros(("embed",))
    if p.norm == "rowsums":
        center = cfg.norm == "layernorm"
        return Norm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, center, cfg.norm_bias, scale_init, bias_init, name=name)
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.norm_eps, cfg.dtype, cfg.param_dtype, scale_init=scale_init, name=name)
    return nn.LayerNorm(
        cfg.norm_eps, cfg.dtype, cfg.param_dtype, use_bias=cfg.norm_bias, scale_init=scale_init, bias_init=bias_init,
        name=name,
    )


class Block(nn.Module):
    cfg: ModelConfig
    deterministic: bool = True
    platform: Platform = Platform()

    @nn.compact
    def __call__(self, x_BTD, layer_cache, positions_BT, segment_ids_BT, lengths_B):
        cfg = self.cfg
        attn = Attention(cfg, self.deterministic, self.platform, name="attn")
        mlp = Mlp(cfg, self.platform, name="mlp")
        drop = nn.Dropout(cfg.dropout, deterministic=self.deterministic)
        ln1, ln2 = _norm(cfg, self.platform, "ln1"), _norm(cfg, self.platform, "ln2")
        if cfg.norm_placement == "pre":
            a_BTD, layer_cache = attn(ln1(x_BTD), positions_BT, segment_ids_BT, layer_cache, lengths_B)
            x_BTD = x_BTD + drop(a_BTD)
            x_BTD = x_BTD + drop(mlp(ln2(x_BTD)))
        else:
            a_BTD, layer_cache = attn(x_BTD, positions_BT, segment_ids_BT, layer_cache, lengths_B)
            x_BTD = ln1(x_BTD + drop(a_BTD))
            x_BTD = ln2(x_BTD + drop(mlp(x_BTD)))
        return _constrain(x_BTD, "act_batch", "act_len", "act_embed"), layer_cache


class Transformer(nn.Module):
    cfg: ModelConfig
    deterministic: bool = True
    platform: Platform | None = None  # how to compute on the backend (lm.platform); None = JAX's default backend's

    @nn.compact
    def __call__(
        self,
        tokens_BT,
        positions_BT=None,
        segment_ids_BT=None,
        cache: Cache | None = None,
        logits_at_B=None,
        head: bool = True,
    ):
        """Logits [B, T, V] (and the updated cache, when given one). With `logits_at_B`, only the
        logits at those positions, [B, 1, V]: a prefill needs just each prompt's last position.
        With head=False, the final hidden states [B, T, D] instead (after ln_f, in cfg.dtype): the
        chunked loss (lm/loss.py) applies the head itself, `head_kernel` of the parameters, a chunk of
        positions at a time, so that the float32 logits of the whole batch never exist at once."""
        cfg = self.cfg
        plat = self.platform or platform_lib.current()
        b, t = tokens_BT.shape
        lengths_B = cache["lengths"] if cache is not None else jnp.zeros((b,), jnp.int32)
        if positions_BT is None:
            positions_BT = lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)

        wte = nn.Embed(
            cfg.vocab_size,
            cfg.n_embd,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=_init(0.02, ("vocab", "embed")),
            name="wte",
        )
        x_BTD = lookup(wte, tokens_BT, cfg.dtype, "vocab")
        if cfg.pos == "learned":
            wpe = nn.Embed(
                cfg.max_seq_len,
                cfg.n_embd,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                embedding_init=_init(0.02, (None, "embed")),
                name="wpe",
            )
            x_BTD = x_BTD + lookup(wpe, positions_BT, cfg.dtype, None)
        elif cfg.pos == "sinusoidal":
            x_BTD = x_BTD + sinusoidal(positions_BT, cfg.n_embd).astype(x_BTD.dtype)
        x_BTD = nn.Dropout(cfg.dropout, deterministic=self.deterministic)(x_BTD)
        x_BTD = _constrain(x_BTD, "act_batch", "act_len", "act_embed")

        if cache is not None and segment_ids_BT is not None:
            raise ValueError("segment_ids are for packed training batches, not for cached decoding")
        # Segment ids reach the attention as they are: a kernel may take them (Pallas's), the others build the mask.
        # Without them attention is plain causal, which lets the kernel skip the masked half; cached calls mask by
        # the cache's lengths (cached_attention).
        layers = cache["layers"] if cache is not None else None

        block = Block
        if cfg.remat != "none":
            block = nn.remat(Block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            blocks = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.n_layer,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, self.deterministic, plat, name="h")
            x_BTD, layers = blocks(x_BTD, layers, positions_BT, segment_ids_BT, lengths_B)
        else:
            new_layers = []
            for i in range(cfg.n_layer):
                layer = None if layers is None else layers[i]
                x_BTD, layer = block(cfg, self.deterministic, plat, name=f"h_{i}")(
                    x_BTD, layer, positions_BT, segment_ids_BT, lengths_B
                )
                new_layers.append(layer)
            layers = new_layers

        if logits_at_B is not None:
            x_BTD = x_BTD[jnp.arange(b), logits_at_B][:, None]
        if cfg.norm_placement == "pre":
            x_BTD = _norm(cfg, plat, "ln_f")(x_BTD)
        out = x_BTD
        if head:
            if cfg.tie_embeddings:
                logits_BTV = _tied_head(x_BTD, wte.embedding, cfg, plat)
            else:
                logits_BTV = _lm_head(cfg, plat, name="lm_head")(x_BTD)
            out = _constrain(logits_BTV, "act_batch", "act_len", "act_vocab")
        if cache is None:
            return out
        return out, {"layers": layers, "lengths": lengths_B + tokens_BT.shape[1]}


def _tied_head(x_BTD, embedding_VD, cfg: ModelConfig, plat: platform_lib.Platform) -> jax.Array:
    """The head of tied embeddings: float32 logits straight out of the matmul (einsum_f32), for the loss and the
    sampler alike."""
    embedding_VD = embedding_VD.astype(cfg.dtype)
    if plat.matmul == "flat":
        x_ND = x_BTD.reshape(-1, cfg.n_embd)
        return einsum_f32("nd,vd->nv", x_ND, embedding_VD).reshape(*x_BTD.shape[:2], -1)
    return einsum_f32("btd,vd->btv", x_BTD, embedding_VD)


def _lm_head(cfg: ModelConfig, plat: platform_lib.Platform, name: str | None = None) -> Linear:
    """The head of untied embeddings, lm_head: float32 logits as the matmul accumulates them."""
    return Linear(
        (cfg.vocab_size,), ("embed", "vocab"), 0.02, False, cfg.dtype, cfg.param_dtype,
        flat=plat.matmul == "flat", float32_out=True, name=name,
    )  # fmt: skip


def head_logits(params: Any, cfg: ModelConfig, plat: platform_lib.Platform, x_BTD) -> jax.Array:
    """The logits [B, T, V] of final hidden states x_BTD (Transformer's with head=False), computed as its own head
    computes them, from its plain (unboxed) parameters in any layout it reads (lm.sampling.layout's too): for a
    head applied to a few positions at a time, so that the float32 logits of them all never exist at once."""
    p = params["params"]
    if cfg.tie_embeddings:
        return _tied_head(x_BTD, p["wte"]["embedding"], cfg, plat)
    return _lm_head(cfg, plat).apply({"params": p["lm_head"]}, x_BTD)


def head_kernel(params: Any, cfg: ModelConfig) -> jax.Array:
    """The output head's weight as [D, V], in its storage dtype, from plain (unboxed) parameters: the token
    embedding transposed when the head is tied, else lm_head's kernel. x_BTD . kernel with both in cfg.dtype,
    written in float32 (einsum_f32), is what the model's own head computes."""
    p = params["params"]
    return p["wte"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
    """An empty KV cache for `batch` rows of up to `max_len` tokens, in the model's dtype."""
    dtype = cfg.dtype
    shape = (batch, cfg.kv_heads, max_len, cfg.head_size)
    if cfg.scan_layers:
        layer = lambda: jnp.zeros((cfg.n_layer, *shape), dtype)
        layers = {"k": layer(), "v": layer()}
    else:
        layers = [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.n_layer)]
    return {"layers": layers, "lengths": jnp.zeros((batch,), jnp.int32)}


def unscanned(params: Any, cfg: ModelConfig) -> tuple[Any, ModelConfig]:
    """The same model with its stacked blocks (scan_layers) split into h_0 ... h_{L-1}.

    Decoding reads every weight once per token; inside a scan over layers XLA copies each layer's
    weights out of the stack first, which makes a small-batch step several times slower.
    """
    if not cfg.scan_layers:
        return params, cfg
    inner = dict(params["params"])
    stacked = inner.pop("h")
    inner.update({f"h_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(cfg.n_layer)})
    return {**params, "params": inner}, dataclasses.replace(cfg, scan_layers=False)


def scanned(params: Any, cfg: ModelConfig) -> tuple[Any, ModelConfig]:
    """The same model with its blocks h_0 ... h_{L-1} stacked into one scanned h (scan_layers): unscanned's inverse."""
    if cfg.scan_layers:
        return params, cfg
    inner = dict(params["params"])
    layers = [inner.pop(f"h_{i}") for i in range(cfg.n_layer)]
    inner["h"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {**params, "params": inner}, dataclasses.replace(cfg, scan_layers=True)


def laid_out(params: Any, cfg: ModelConfig, scan_layers: bool) -> Any:
    """Parameters of model `cfg` in the layout of model.scan_layers=`scan_layers` (the same weights)."""
    return (scanned if scan_layers else unscanned)(params, cfg)[0]


def untied(params: Any, cfg: ModelConfig) -> tuple[Any, ModelConfig]:
    """The same model with a tied head given its own weight: lm_head's kernel, the token embedding transposed
    into a [D, V] copy (head_kernel), so that the head reads its weight in the layout of a plain matmul."""
    if not cfg.tie_embeddings:
        return params, cfg
    inner = {**params["params"], "lm_head": {"kernel": head_kernel(params, cfg)}}
    return {**params, "params": inner}, dataclasses.replace(cfg, tie_embeddings=False)


def outputs_first(params: Any, cfg: ModelConfig) -> Any:
    """The same model with every Linear kernel [*in, *out] stored transposed as a 2-D `kernel_t` of shape
    [prod(out), prod(in)] (unscanned parameters only)."""
    if cfg.scan_layers:
        raise ValueError("outputs_first takes unscanned parameters (lm.model.unscanned)")

    def convert(path: tuple[str, ...], tree: Any) -> Any:
        if not isinstance(tree, dict):
            return tree
        if "kernel" not in tree:
            return {name: convert((*path, name), sub) for name, sub in tree.items()}
        n_in = 2 if path[-2:] == ("attn", "proj") else 1  # the only Linear with two input axes
        kernel = tree["kernel"]
        rest = {name: sub for name, sub in tree.items() if name != "kernel"}
        return {**rest, "kernel_t": kernel.reshape(math.prod(kernel.shape[:n_in]), -1).T}

    return convert((), params)


def init_params(cfg: ModelConfig, rng: jax.Array) -> Any:
    """Parameters (boxed with their logical axis names) for a model of this config."""
    tokens = jnp.zeros((1, min(8, cfg.max_seq_len or 8)), jnp.int32)
    return Transformer(cfg).init(rng, tokens)


def count_params(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(params)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight of every matmul, plus the attention scores and mixing.

    Embedding lookups cost nothing; a tied output head is a matmul and counts. Attention adds
    12 * layers * width * seq_len (QK^T and AV, forward and backward), as in the PaLM paper.
    """
    d, n, k, h, f, layers = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.hidden, cfg.n_layer
    attn = d * (n + 2 * k) * h + n * h * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * f
    matmul_params = layers * (attn + mlp) + d * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * layers * n * h * seq_len
