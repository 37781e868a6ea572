"""The optimizer: AdamW, or Muon on the blocks' matrices and AdamW on the rest; warmup + decay schedules; clipping.

    tx = make_optimizer(cfg.optim, cfg.train.steps)   # an optax GradientTransformation
    lr_at = schedule(cfg.optim, cfg.train.steps)       # the AdamW group's learning rate at each step

Muon (optim.name=muon) is optax's optax.contrib.scale_by_muon: the momentum of each matrix's gradient,
orthogonalised by Newton-Schulz iterations. lm decides which parameters are matrices and how each kernel is
read as one (MATRICES), scales each update for its matrix's shape, and gives the two groups their own learning
rates and weight decay. The precision of the iterations' matmuls, or their arrays' dtype, is the platform's
(lm.platform, muon_matmul).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from lm import platform
from lm.config import OptimConfig
from lm.errors import UserError
from lm.run_dir import branch
from lm.validation import check_schedule, wsd_decay_steps

# The kernels Muon trains, by (parent module, module) in lm.model: (input axes, output axes), counted from the
# end so that a scan_layers stack's leading layer axis, like every axis named in neither, is a batch axis
# (one matrix per layer). Each kernel is the matrix of its Linear, inputs x outputs, except the fused qkv
# kernel [D, K, G+2, H], whose G+2 slots (G query heads per K/V head, then K, then V) are separate matrices
# [D, K*H]: with one query head per K/V head, exactly the Q, K and V matrices of separate projections.
MATRICES = {
    ("attn", "qkv"): ((-4,), (-3, -1)),  # [D, K, G+2, H]: per slot [D, K*H]
    ("attn", "q"): ((-3,), (-2, -1)),  # [D, N, H] as [D, N*H]
    ("attn", "k"): ((-3,), (-2, -1)),  # [D, K, H] as [D, K*H]
    ("attn", "v"): ((-3,), (-2, -1)),
    ("attn", "proj"): ((-3, -2), (-1,)),  # [N, H, D] as [N*H, D]
    ("mlp", "fc"): ((-2,), (-1,)),  # [D, F]
    ("mlp", "gate"): ((-2,), (-1,)),
    ("mlp", "up"): ((-2,), (-1,)),
    ("mlp", "proj"): ((-2,), (-1,)),  # [F, D]
}
LORA_MATRIX = ((-2,), (-1,))  # a LoRA adapter: A [in, rank], B [rank, out] (with a layer axis first when scanned)


def schedule(cfg: OptimConfig, steps: int, peak: float | None = None) -> optax.Schedule:
    """Linear warmup to the peak learning rate (cfg.lr, or `peak`) over warmup_steps, then cosine, linear, no
    decay or wsd, reaching min_lr (scaled by peak / lr) at `steps`.

    Update k (from 0) of the warmup takes peak * (k + 1) / warmup_steps: the first update already moves the
    parameters (from lr 0 it would be wasted), the last one reaches the peak. wsd (warmup-stable-decay) holds
    the peak until its decay, which takes the last wsd_decay_steps(cfg, steps) updates."""
    top = cfg.lr if peak is None else peak
    floor = cfg.min_lr * top / cfg.lr
    warmup = optax.linear_schedule(top / max(cfg.warmup_steps, 1), top, cfg.warmup_steps - 1)
    rest = max(steps - cfg.warmup_steps, 1)
    if cfg.decay == "cosine":
        decay = optax.cosine_decay_schedule(top, rest, alpha=floor / top)
    elif cfg.decay == "linear":  # (not optax's linear_schedule, whose first value can be a rounding below the peak)
        decay = _decay("linear", top, floor, rest)
    elif cfg.decay == "wsd":
        check_schedule(cfg, steps)
        length = wsd_decay_steps(cfg, steps)
        stable = max(steps - length - cfg.warmup_steps, 0)
        decay = optax.join_schedules(
            [optax.constant_schedule(top), _decay(cfg.decay_shape, top, floor, length)], [stable]
        )
    else:
        decay = optax.constant_schedule(top)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def _decay(shape: str, top: float, floor: float, length: int) -> optax.Schedule:
    """A decay (wsd's, of its decay_shape, or linear's) from `top` (count 0, exactly: a branch's check compares it
    with the peak) to `floor` (count `length`). 1-sqrt (Hägele et al. 2024) falls fastest at the end."""
    fall = {"linear": lambda t: t, "cosine": lambda t: 0.5 * (1 - jnp.cos(jnp.pi * t)), "1-sqrt": jnp.sqrt}[shape]
    return lambda count: top - (top - floor) * fall(jnp.clip(count / length, 0.0, 1.0))


def decay_start(cfg: OptimConfig, steps: int) -> float:
    """The last step at the peak learning rate, after which the decay lowers it (steps count updates from 1): the
    warmup's end, plus one (the decay starts at the peak), for cosine and linear; the stable phase's end for wsd;
    never for constant."""
    if cfg.decay == "constant":
        return float("inf")
    return (steps - wsd_decay_steps(cfg, steps) if cfg.decay == "wsd" else cfg.warmup_steps) + 1


def check_branch(
    before: OptimConfig,
    before_steps: int,
    after: OptimConfig,
    after_steps: int,
    step: int,
    where: str,
    sized_by: str = "train.steps",
    new_run: str = "run.name=NEW",
):
    """Refuse to resume checkpoint `step` (at `where`) of a run scheduled by (before, before_steps) under the wsd
    schedule (after, after_steps) unless its updates 0..step-1 took the learning rates the new schedule gives
    them: a decay branched from the stable phase, whose resumed run is then the run it would have been.
    `sized_by`: the setting that makes after_steps what they are (data.epochs where it sets train.steps); `new_run`:
    the setting that starts a new run (lm.run_dir.new_run)."""
    counts = jnp.arange(step)
    groups = [("optim.lr", None, None)]
    if before.name == after.name == "muon":
        groups.append(("optim.muon_lr", before.muon_lr, after.muon_lr))
    differ = []
    for name, peak_before, peak_after in groups:
        old = schedule(before, before_steps, peak_before)(counts)
        new = schedule(after, after_steps, peak_after)(counts)
        differ += [(k, float(old[k]), float(new[k]), name) for k in jnp.nonzero(old != new)[0][:1].tolist()]
    if not differ:
        return
    k, old, new, name = min(differ)
    was, now = decay_start(before, before_steps), decay_start(after, after_steps)
    if was < step:
        why = (f"it was taken in its run's decay, which began after step {was}; branch from a checkpoint at step {was} "
               "or before")
    elif now < step:
        why = (f"this schedule's decay begins after step {now}, before the checkpoint; raise {sized_by} or lower "
               f"optim.decay_fraction so that it begins after step {step} or later")  # fmt: skip
    else:
        why = (f"its step {k + 1} took learning rate {old:.4g} ({name}'s schedule), this schedule gives {new:.4g}; "
               f"keep {name}, optim.min_lr and optim.warmup_steps")
    raise UserError(
        f"checkpoint {where} cannot branch into this wsd schedule: {why}, or start a new run from it with "
        f"{branch(where, new_run)}"
    )


def decay_mask(params: Any, decay_embeddings: bool) -> Any:
    """True where weight decay applies: projection matrices (LoRA's adapters A and B too, the matrices a LoRA run
    trains, which Muon decays as well), and embedding tables if asked.

    Decided by the parameter's name, not its rank: with scan_layers a bias is stacked into
    a 2-D array, and a fused QKV bias is 3-D, yet neither should decay.
    """

    def leaf(path, _):
        name = path[-1].key
        return name in ("kernel", "a", "b") or (decay_embeddings and name == "embedding")

    return jax.tree_util.tree_map_with_path(leaf, params)


def muon_dimensions(params: Any) -> Any:
    """For each parameter, how Muon reads it as matrices (MuonDimensionNumbers), or None where AdamW trains it.

    Decided by name: the kernels of MATRICES inside a block, and LoRA adapters (a and b), which are all that a
    LoRA run trains. Embeddings, the untied head, norms and biases go to AdamW."""

    def leaf(path, _):
        keys = [getattr(k, "key", None) for k in path]
        if keys[-1] in ("a", "b"):
            axes = LORA_MATRIX
        elif keys[-1] == "kernel" and len(keys) >= 3:
            axes = MATRICES.get((keys[-3], keys[-2]))
        else:
            axes = None
        return None if axes is None else MuonDimensionNumbers(*axes)

    return jax.tree_util.tree_map_with_path(leaf, params)


def _is_dims(x) -> bool:
    """A leaf of muon_dimensions' tree (a MuonDimensionNumbers is a tuple, which jax would walk into)."""
    return x is None or isinstance(x, MuonDimensionNumbers)


def _adamw(cfg: OptimConfig, steps: int) -> optax.GradientTransformation:
    return optax.adamw(
        schedule(cfg, steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=lambda params: decay_mask(params, cfg.decay_embeddings),
    )


def _scale_by_shape(rms: float) -> optax.GradientTransformation:
    """An orthogonalised update of a fan_in x fan_out matrix has RMS 1/sqrt(max(fan_in, fan_out)). rms = 0
    multiplies it by sqrt(max(1, fan_out / fan_in)) (Jordan's Muon: the learning rate then suits every width);
    rms > 0 by rms * sqrt(max(fan_in, fan_out)), an update of about that RMS (~0.85x: the Newton-Schulz iterations
    leave singular values of ~0.7 to ~1.1, not 1), like AdamW's at rms ~0.2 (Liu et al. 2025, "Muon is scalable for
    LLM training"), so that AdamW's learning rate suits Muon too."""

    def scale(dim, update):
        fan_in = math.prod(update.shape[a] for a in dim.reduction_axis)
        fan_out = math.prod(update.shape[a] for a in dim.output_axis)
        return update * (rms * math.sqrt(max(fan_in, fan_out)) if rms else math.sqrt(max(1.0, fan_out / fan_in)))

    def update_fn(updates, state, params=None):
        return jax.tree.map(scale, muon_dimensions(updates), updates, is_leaf=_is_dims), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _with_matmul_precision(tx: optax.GradientTransformation, precision: str | None) -> optax.GradientTransformation:
    """tx with every matmul of its update traced at jax.default_matmul_precision(precision) (None: tx itself)."""
    if precision is None:
        return tx

    def update_fn(updates, state, params=None):
        with jax.default_matmul_precision(precision):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, update_fn)


def _iterated_in(dtype: Any, ns_steps: int, beta: float, nesterov: bool, dims: Any) -> optax.GradientTransformation:
    """optax's scale_by_muon with its Newton-Schulz iterations run on `dtype` arrays (lm.platform's
    muon_matmul=bf16_iterations: bfloat16 inputs, outputs and elementwise steps between the matmuls, as
    modded-nanogpt runs them), its momentum still float32. optax computes the iterations in the dtype it is given,
    which is its momentum's; so its own scale_by_muon runs twice: with no iterations for the momentum (this
    transformation's state, optax's MuonState as muon_matmul's other choices keep it, so a checkpoint moves
    between them), then on the cast result with momentum 0 (beta 0: the moment is the update itself, its bias
    correction 1 - 0^t = 1) and a state made afresh each step, for the iterations alone."""
    momentum = scale_by_muon(ns_steps=0, beta=beta, nesterov=nesterov, weight_dimension_numbers=dims)
    iterations = scale_by_muon(ns_steps=ns_steps, beta=0.0, nesterov=False, weight_dimension_numbers=dims)

    def update_fn(updates, state, params=None):
        normalised, state = momentum.update(updates, state)
        cast = jax.tree.map(lambda x: x.astype(dtype), normalised)
        orthogonalised, _ = iterations.update(cast, iterations.init(cast))
        return jax.tree.map(lambda o, u: o.astype(u.dtype), orthogonalised, updates), state

    return optax.GradientTransformation(momentum.init, update_fn)


def _batched_by_shape(muon: Callable[[Any], optax.GradientTransformation]) -> optax.GradientTransformation:
    """`muon(dimension numbers)` (optax's scale_by_muon) run on the matrices stacked by shape: those of one shape,
    dtype and layout (each layer's MLP kernels, say) as one array whose first axis is a batch, so that each
    Newton-Schulz iteration is one matmul per shape rather than one per matrix (a GPU runs each as kernels of their
    own). Its state stays a momentum per matrix, as muon(muon_dimensions) keeps it (and checkpoints hold it)."""
    per_matrix = muon(muon_dimensions)

    def update_fn(updates, state, params=None):
        leaves, tree = jax.tree.flatten(updates)
        dims = tree.flatten_up_to(muon_dimensions(updates))
        groups: dict[tuple, list[int]] = {}
        for i, (x, d) in enumerate(zip(leaves, dims)):
            groups.setdefault((x.shape, x.dtype, d), []).append(i)
        batches = list(groups.values())
        stack = lambda xs: {str(g): jnp.stack([xs[i] for i in members]) for g, members in enumerate(batches)}
        stacked_dims = {str(g): key[2] for g, key in enumerate(groups)}  # (negative axes: the batch axis is new)
        out, inner = muon(stacked_dims).update(
            stack(leaves), state._replace(mu=stack(tree.flatten_up_to(state.mu)))
        )

        def unstack(stacked: dict) -> Any:
            flat = [None] * len(leaves)
            for g, members in enumerate(batches):
                for j, i in enumerate(members):
                    flat[i] = stacked[str(g)][j]
            return tree.unflatten(flat)

        return unstack(out), inner._replace(mu=unstack(inner.mu))

    return optax.GradientTransformation(per_matrix.init, update_fn)


def _muon(cfg: OptimConfig, steps: int) -> optax.GradientTransformation:
    """Muon on the matrices of muon_dimensions, AdamW on the rest, each group with its own learning rate and
    weight decay. optax.partition hands each group its parameters, the others masked out."""
    chosen = platform.current()
    if chosen.muon_matmul == "bf16_iterations":
        muon = lambda dims: _iterated_in(jnp.bfloat16, cfg.muon_ns_steps, cfg.muon_momentum, cfg.muon_nesterov, dims)
    else:
        muon = lambda dims: scale_by_muon(
            ns_steps=cfg.muon_ns_steps,
            beta=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            weight_dimension_numbers=dims,
        )
    orthogonalised = _batched_by_shape(muon) if chosen.muon_batch == "shape" else muon(muon_dimensions)
    matrices = optax.chain(
        _with_matmul_precision(orthogonalised, platform.MUON_MATMUL_PRECISION[chosen.muon_matmul]),
        _scale_by_shape(cfg.muon_update_rms),
        optax.add_decayed_weights(cfg.muon_weight_decay),
        optax.scale_by_learning_rate(schedule(cfg, steps, peak=cfg.muon_lr)),
    )
    labels = lambda params: jax.tree.map(
        lambda d: "adamw" if d is None else "muon", muon_dimensions(params), is_leaf=_is_dims
    )
    return optax.partition({"muon": matrices, "adamw": _adamw(cfg, steps)}, labels)


def make_optimizer(cfg: OptimConfig, steps: int) -> optax.GradientTransformation:
    tx = _muon(cfg, steps) if cfg.name == "muon" else _adamw(cfg, steps)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
    return tx
