"""The loss: cross-entropy per token (with label smoothing and z-loss), and its masked sums computed a chunk of
positions at a time, so that the float32 logits of a whole batch never exist at once.

    objective_BT, ce_BT = token_losses(logits_BTV, targets_BT, label_smoothing, z_loss, n_vocab)
    objective_sum, ce_sum = chunked_loss_sums(x_BTD, w_DV, targets_BT, mask_BT, chunk=128, dtype="float32")
    ce_BT, top_BT = chunked_token_scores(x_BTD, w_DV, targets_BT, chunk=128, dtype="float32")   # evaluation
    ce_BT = chunked_token_losses(x_BTD, w_DV, targets_BT, chunk=128, dtype="float32")          # with a gradient
    loss_P, rewards_P2 = dpo_loss(policy_logp_P2, reference_logp_P2, beta=0.1)                # preference pairs

Why chunks: GPT-2 small's 50,304-token vocabulary at 8 x 1024 tokens makes 1.6 GB of float32 logits, and the
gradient of the head and loss computed from all of them at once needs 3.1 GiB of temporaries; in chunks of
128 positions, 0.57 GiB (one chunk's logits and their gradient, 206 MB each, and the head's gradient).

How: a `jax.custom_vjp` whose forward pass, chunk by chunk, computes the chunk's logits, its losses and at
once their gradient with respect to the hidden states and the head's weight (through `jax.vjp` of the same
chunk function, so label smoothing and z-loss need no hand-written derivative); the backward pass only
scales those by the incoming cotangent. The other way, a `jax.lax.scan` whose body is under
`jax.checkpoint`, recomputes every chunk's logits in the backward pass: one more [B*T, D] x [D, V] matmul.
Measured (`python -m benchmarks.loss_chunk`: the gradient of the head and the loss alone, 8 x 1024 tokens,
float32, 2-core CPU): custom_vjp 11.8 s, checkpointed scan 16.0 s, the whole logits at once 13.2 s. Chunks of
64 / 128 / 256 / 512 positions took 12.0 / 11.3 / 11.8 / 12.6 s, hence train.loss_chunk=128. The price is a
float32 [D, V] sum of the head's gradient carried through the chunks (and the chunk's own before it is
added): 2 x 154 MB for GPT-2, which can outweigh what chunks save (the logits and their gradient, 0.4 MB a
token) below about 800 tokens a micro-batch.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model import einsum_f32


def token_losses(
    logits_BTV,
    targets_BT,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    n_vocab: int = 0,
    grad: str = "autodiff",
    log_z: str = "two_pass",
):
    """(objective, cross-entropy) per token, in float32.

    The softmax is over the tokenizer's n_vocab ids (0 = every row): the rows a padded vocabulary adds are never
    targets, and are left out as the model samples, scores and exports (real_ids). The objective adds label
    smoothing (mass spread uniformly over those ids) and the z-loss z * log(Z)^2;
    the plain cross-entropy is what gets reported. `grad` (lm.platform's loss_grad): the gradient with respect to
    the logits by autodiff, or "written" out (_written_losses). `log_z` (lm.platform's): the log-partition
    function in two passes over the logits ("two_pass", jax.nn.logsumexp) or one ("online", online_logsumexp).
    """
    if grad == "written":
        return _written_losses(logits_BTV, targets_BT, label_smoothing, z_loss, n_vocab, log_z)
    return _token_losses(logits_BTV, targets_BT, label_smoothing, z_loss, n_vocab, log_z)[:2]


@jax.custom_jvp
def online_logsumexp(x):
    """log(sum(exp(x))) over the last axis in one pass over x: a reduction of (running max, sum of exp relative to
    it) pairs, combined pairwise, where jax.nn.logsumexp reads x twice (its max, then the sum). Twice the exps;
    for a backend where the logits' passes cost more than the exps (lm.platform's log_z)."""

    def combine(a, b):
        (m1, s1), (m2, s2) = a, b
        m = jnp.maximum(m1, m2)
        # exp(m_i - m), 1 where m_i is the max (also when both are -inf: two runs of nothing but -inf)
        scale = lambda mi: jnp.exp(jnp.where(mi == m, 0.0, mi - m))
        return m, s1 * scale(m1) + s2 * scale(m2)

    init = (jnp.array(-jnp.inf, x.dtype), jnp.array(0, x.dtype))
    m, s = jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (x.ndim - 1,))
    return m + jnp.log(s)


@online_logsumexp.defjvp
def _online_logsumexp_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    out = online_logsumexp(x)
    return out, (jnp.exp(x - out[..., None]) * dx).sum(axis=-1)


def _token_losses(logits_BTV, targets_BT, label_smoothing: float, z_loss: float, n_vocab: int, log_z: str):
    """(objective, cross-entropy, log Z) per token: token_losses' with the log-partition function."""
    logits_BTV = real_ids(logits_BTV.astype(jnp.float32), n_vocab)
    log_z_BT = online_logsumexp(logits_BTV) if log_z == "online" else jax.nn.logsumexp(logits_BTV, axis=-1)
    ce_BT = log_z_BT - jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    objective_BT = ce_BT
    if label_smoothing:
        real_BTV = logits_BTV[..., :n_vocab] if n_vocab else logits_BTV
        uniform_BT = log_z_BT - real_BTV.mean(axis=-1)
        objective_BT = (1 - label_smoothing) * ce_BT + label_smoothing * uniform_BT
    if z_loss:
        objective_BT = objective_BT + z_loss * log_z_BT**2
    return objective_BT, ce_BT, log_z_BT


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _written_losses(logits_BTV, targets_BT, label_smoothing: float, z_loss: float, n_vocab: int, log_z: str):
    """token_losses with the gradient with respect to the logits written out, one elementwise pass over them:

        d objective / d logits = p (1 + 2 z log Z) - (1 - s) onehot(target) - (s / n) [id < n]
        d cross-entropy / d logits = p - onehot(target)

    for softmax p, z-loss z, label smoothing s over n ids. Autodiff computes the target's term as a scatter into
    a zero array of the logits' size, which it then adds to p's: two more full passes over a [B, T, V] array
    of float32, and one for the cast of their sum to the head's 16-bit dtype. Written out, the target's term is a
    comparison in the same pass, which writes the gradient in the logits' dtype."""
    return _token_losses(logits_BTV, targets_BT, label_smoothing, z_loss, n_vocab, log_z)[:2]


def _written_losses_fwd(logits_BTV, targets_BT, label_smoothing, z_loss, n_vocab, log_z):
    objective_BT, ce_BT, log_z_BT = _token_losses(logits_BTV, targets_BT, label_smoothing, z_loss, n_vocab, log_z)
    return (objective_BT, ce_BT), (logits_BTV, targets_BT, log_z_BT)


def _written_losses_bwd(label_smoothing, z_loss, n_vocab, log_z, residuals, cotangents):
    logits_BTV, targets_BT, log_z_BT = residuals
    g_objective_BT, g_ce_BT = cotangents
    # Each token's coefficients of p, of its target's one-hot and of the ids label smoothing spreads over.
    p_coef = g_objective_BT * (1 + 2 * z_loss * log_z_BT) + g_ce_BT
    target_coef = g_objective_BT * (1 - label_smoothing) + g_ce_BT
    ids_BTV = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1)
    p_BTV = jnp.exp(real_ids(logits_BTV.astype(jnp.float32), n_vocab) - log_z_BT[..., None])
    d_BTV = p_BTV * p_coef[..., None] - jnp.where(ids_BTV == targets_BT[..., None], target_coef[..., None], 0.0)
    if label_smoothing:
        n = n_vocab or logits_BTV.shape[-1]
        d_BTV = d_BTV - jnp.where(ids_BTV < n, (g_objective_BT * (label_smoothing / n))[..., None], 0.0)
    return d_BTV.astype(logits_BTV.dtype), None


_written_losses.defvjp(_written_losses_fwd, _written_losses_bwd)


class _Spec(NamedTuple):
    """What the chunked loss fixes when it is traced (the custom_vjp's non-differentiated argument)."""

    chunk: int  # positions per chunk
    dtype: str  # compute dtype of the head's matmul
    label_smoothing: float
    z_loss: float
    n_vocab: int
    grad: str  # the loss's gradient with respect to the logits: "autodiff" or "written" (token_losses)
    log_z: str  # the log-partition function in "two_pass"es over the logits or one ("online"; token_losses)
    logits: str  # the logits written in "float32" or in the head's compute dtype ("compute"; _chunk_logits)


def chunked_loss_sums(
    x_BTD,
    w_DV,
    targets_BT,
    mask_BT,
    chunk: int,
    dtype,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    n_vocab: int = 0,
    grad: str = "autodiff",
    log_z: str = "two_pass",
    logits: str = "float32",
):
    """(sum of mask * objective, sum of mask * cross-entropy) over all tokens, as token_losses defines them.

    The logits are x_BTD . w_DV with both in `dtype`, written in float32 as the model's own head computes
    them (or, `logits`="compute", in `dtype`: _chunk_logits), `chunk` positions of every row at a time (the last
    chunk shorter when T is not a multiple): chunks split the time axis, not the batch, so the batch stays split
    over the devices as it was. The objective's sum is differentiable with respect to x_BTD and w_DV; the
    cross-entropy's sum is for reporting and carries no gradient.
    """
    spec = _Spec(
        min(chunk, x_BTD.shape[1]), jnp.dtype(dtype).name, label_smoothing, z_loss, n_vocab, grad, log_z, logits
    )
    objective_sum, ce_sum = _sums(x_BTD, w_DV, targets_BT, mask_BT.astype(jnp.float32), spec)
    return objective_sum, jax.lax.stop_gradient(ce_sum)


def real_ids(logits_BTV, n_vocab: int | None):
    """The logits with the vocabulary's padding beyond the tokenizer's n_vocab ids set to -inf (left out of the
    softmax: the model's distribution over tokens, as its export computes it); all of them where n_vocab is
    None or 0, or covers every row."""
    if not n_vocab or n_vocab >= logits_BTV.shape[-1]:
        return logits_BTV
    return jnp.where(jnp.arange(logits_BTV.shape[-1]) < n_vocab, logits_BTV, -jnp.inf)


def chunked_token_scores(
    x_BTD, w_DV, targets_BT, chunk: int, dtype, n_vocab: int | None = None, log_z: str = "two_pass", logits="float32"
):
    """(cross-entropy [B, T] float32, whether the target is the most likely token [B, T] bool) of every position,
    the logits x_BTD . w_DV computed as in chunked_loss_sums, `chunk` positions at a time. No gradient: for
    scoring (lm.eval) and DPO's reference model, where a row's log-likelihood is minus its cross-entropies summed.
    `n_vocab`: the tokenizer's ids, the vocabulary's padding beyond them left out of the softmax (a model's
    distribution over tokens, as its export to Hugging Face format computes it). `log_z` as in token_losses and
    `logits` as in chunked_loss_sums: DPO's reference computes as its policy does, so that the two agree to the bit
    where their weights do."""

    w_compute = w_DV.astype(dtype)

    def body(_, chunk_inputs):
        x_BCD, targets_BC, _mask = chunk_inputs
        logits_BCV = real_ids(_chunk_logits(x_BCD, w_compute, dtype, logits), n_vocab)
        _, ce_BC = token_losses(logits_BCV, targets_BC, log_z=log_z)
        return None, (ce_BC, jnp.argmax(logits_BCV, axis=-1) == targets_BC)

    _, (ce_BT, top_BT) = _over_chunks(body, None, min(chunk, x_BTD.shape[1]), x_BTD, targets_BT, targets_BT)
    return ce_BT, top_BT


def chunked_token_losses(
    x_BTD,
    w_DV,
    targets_BT,
    chunk: int,
    dtype,
    grad: str = "autodiff",
    log_z: str = "two_pass",
    logits="float32",
    n_vocab: int | None = None,
):
    """The cross-entropy [B, T] float32 of every position, differentiable, the logits x_BTD . w_DV computed as in
    chunked_loss_sums, `chunk` positions at a time. For objectives that weigh each row's sum differently (DPO):
    the custom gradient of chunked_loss_sums holds one sum's gradient only. Each chunk's logits are recomputed
    in the backward pass (jax.checkpoint), so that no more than one chunk's float32 logits exist at once.
    `n_vocab` as in chunked_token_scores: the vocabulary's padding left out of the softmax."""

    w_compute = w_DV.astype(dtype)  # cast once, not in every chunk (see _sums_fwd)

    @jax.checkpoint
    def chunk_losses(x_BCD, w_DV, targets_BC):
        logits_BCV = real_ids(_chunk_logits(x_BCD, w_DV, dtype, logits), n_vocab)
        return token_losses(logits_BCV, targets_BC, grad=grad, log_z=log_z)[1]

    def body(_, chunk_inputs):
        x_BCD, targets_BC, _mask = chunk_inputs
        return None, chunk_losses(x_BCD, w_compute, targets_BC)

    _, ce_BT = _over_chunks(body, None, min(chunk, x_BTD.shape[1]), x_BTD, targets_BT, targets_BT)
    return ce_BT


def dpo_loss(policy_logp_P2, reference_logp_P2, beta: float, label_smoothing: float = 0.0):
    """(loss [P], rewards [P, 2]) of P preference pairs from the log-probabilities of each pair's chosen (column 0)
    and rejected (column 1) response under the policy and the reference model (Rafailov et al. 2023, DPO).

    A response's reward is beta * (log pi(y|x) - log pi_ref(y|x)); the loss of a pair whose rewards differ by
    margin = r_chosen - r_rejected is -log sigmoid(margin), or with label smoothing e (the conservative variant,
    for pairs mislabelled with probability e) -(1 - e) log sigmoid(margin) - e log sigmoid(-margin)."""
    rewards_P2 = beta * (policy_logp_P2 - reference_logp_P2).astype(jnp.float32)
    margin_P = rewards_P2[:, 0] - rewards_P2[:, 1]
    loss_P = -(1 - label_smoothing) * jax.nn.log_sigmoid(margin_P) - label_smoothing * jax.nn.log_sigmoid(-margin_P)
    return loss_P, rewards_P2


def _chunk_logits(x_BCD, w_DV, dtype, logits: str = "float32"):
    """One chunk's logits, x_BCD . w_DV with both in `dtype`, accumulated in float32 and written in float32 as the
    model's head computes them (lm.model.einsum_f32), or with `logits`="compute" rounded to `dtype` as the matmul
    writes them (lm.platform's logits: a 16-bit model's loss then reads half the bytes in each of its passes over
    the logits, which upcast them as they read; the rounding is that of a 16-bit head, as in PyTorch's autocast)."""
    b, c, d = x_BCD.shape
    x_ND, w_DV = x_BCD.reshape(b * c, d).astype(dtype), w_DV.astype(dtype)
    # One 2-D matmul, as in the model's head: XLA:CPU runs the gradient of a 2-D dot far faster.
    logits_NV = jnp.einsum("nd,dv->nv", x_ND, w_DV) if logits == "compute" else einsum_f32("nd,dv->nv", x_ND, w_DV)
    return nn.with_logical_constraint(logits_NV.reshape(b, c, -1), ("act_batch", "act_len", "act_vocab"))


def _chunk_sums(spec: _Spec, w_DV, x_BCD, targets_BC, mask_BC):
    """The masked (objective, cross-entropy) sums of one chunk of C positions."""
    logits_BCV = _chunk_logits(x_BCD, w_DV, spec.dtype, spec.logits)
    objective_BC, ce_BC = token_losses(
        logits_BCV, targets_BC, spec.label_smoothing, spec.z_loss, spec.n_vocab, spec.grad, spec.log_z
    )
    return (objective_BC * mask_BC).sum(), (ce_BC * mask_BC).sum()


def _over_chunks(fn, carry, chunk: int, x_BTD, targets_BT, mask_BT):
    """Run fn(carry, (x_BCD, targets_BC, mask_BC)) -> (carry, out_BC...) over consecutive chunks of positions:
    a scan over the whole chunks, then one call on the shorter rest, if any. Returns the last carry and the
    outputs joined back along T (None where fn returns None)."""
    b, t = targets_BT.shape
    n = t // chunk
    whole = n * chunk
    # [n, B, C, ...]: the batch stays an axis of its own, split over the devices as in x_BTD.
    stack = lambda a: a[:, :whole].reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)
    unstack = lambda a: a.swapaxes(0, 1).reshape(b, whole, *a.shape[3:])
    carry, outs = jax.lax.scan(fn, carry, (stack(x_BTD), stack(targets_BT), stack(mask_BT)))
    outs = jax.tree.map(unstack, outs)
    if whole < t:
        carry, rest = fn(carry, (x_BTD[:, whole:], targets_BT[:, whole:], mask_BT[:, whole:]))
        outs = jax.tree.map(lambda a, r: jnp.concatenate([a, r], axis=1), outs, rest)
    return carry, outs


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sums(x_BTD, w_DV, targets_BT, mask_BT, spec: _Spec):
    """The loss sums without their gradient (evaluation): each chunk's logits, losses and sums, nothing kept."""

    w_compute = w_DV.astype(spec.dtype)

    def body(sums, chunk):
        objective, ce = _chunk_sums(spec, w_compute, *chunk)
        return (sums[0] + objective, sums[1] + ce), None

    zero = jnp.zeros((), jnp.float32)
    sums, _ = _over_chunks(body, (zero, zero), spec.chunk, x_BTD, targets_BT, mask_BT)
    return sums


def _sums_fwd(x_BTD, w_DV, targets_BT, mask_BT, spec: _Spec):
    """The sums, and as residuals the objective's gradient, computed chunk by chunk while each chunk's
    logits exist. The chunks' gradients are taken of the objective times `seed`, about 1 / (B*T): the
    16-bit matmuls of the gradient then see the magnitudes the unchunked mean loss gives them, not sums
    over thousands of tokens (which overflow float16). A power of two, so that undoing it is exact."""
    seed = 2.0 ** -math.ceil(math.log2(targets_BT.size))

    # Cast once, not in every chunk: with float32 master weights and bfloat16 compute, each chunk would read the
    # float32 head and write its bfloat16 copy again. The chunk's gradient is then the bfloat16 matmul's, as the
    # cast's own gradient would have made it.
    w_compute = w_DV.astype(spec.dtype)

    def body(carry, chunk):
        objective_sum, ce_sum, dw_DV = carry
        x_BCD, targets_BC, mask_BC = chunk
        sums = lambda x, w: _chunk_sums(spec, w, x, targets_BC, mask_BC)
        (objective, ce), vjp = jax.vjp(sums, x_BCD, w_compute)
        dx_BCD, dw = vjp((jnp.float32(seed), jnp.float32(0.0)))
        return (objective_sum + objective, ce_sum + ce, dw_DV + dw.astype(jnp.float32)), dx_BCD

    zero = jnp.zeros((), jnp.float32)
    init = (zero, zero, jnp.zeros(w_DV.shape, jnp.float32))
    (objective_sum, ce_sum, dw_DV), dx_BTD = _over_chunks(body, init, spec.chunk, x_BTD, targets_BT, mask_BT)
    return (objective_sum, ce_sum), (dx_BTD, dw_DV.astype(w_DV.dtype), jnp.float32(1.0 / seed))


def _sums_bwd(spec: _Spec, residuals, cotangents):
    """Scale the saved gradient by the objective's cotangent (the cross-entropy's gets none: see
    chunked_loss_sums); targets and mask are data, with no gradient."""
    dx_BTD, dw_DV, unseed = residuals
    scale = cotangents[0] * unseed
    return (dx_BTD * scale).astype(dx_BTD.dtype), (dw_DV * scale).astype(dw_DV.dtype), None, None


_sums.defvjp(_sums_fwd, _sums_bwd)
