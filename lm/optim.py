"""The optimizer: AdamW with decay on matrices only, warmup + decay schedule, gradient clipping."""

from __future__ import annotations

from typing import Any

import jax
import optax

from lm.config import OptimConfig


def schedule(cfg: OptimConfig, steps: int) -> optax.Schedule:
    """Linear warmup to cfg.lr over warmup_steps, then cosine, linear or no decay, reaching min_lr at `steps`.

    Update k (from 0) of the warmup takes lr * (k + 1) / warmup_steps: the first update already moves the
    parameters (from lr 0 it would be wasted), the last one reaches lr."""
    warmup = optax.linear_schedule(cfg.lr / max(cfg.warmup_steps, 1), cfg.lr, cfg.warmup_steps - 1)
    rest = max(steps - cfg.warmup_steps, 1)
    if cfg.decay == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.min_lr / cfg.lr)
    elif cfg.decay == "linear":
        decay = optax.linear_schedule(cfg.lr, cfg.min_lr, rest)
    else:
        decay = optax.constant_schedule(cfg.lr)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def decay_mask(params: Any, decay_embeddings: bool) -> Any:
    """True where weight decay applies: projection matrices, and embedding tables if asked.

    Decided by the parameter's name, not its rank: with scan_layers a bias is stacked into
    a 2-D array, and a fused QKV bias is 3-D, yet neither should decay.
    """

    def leaf(path, _):
        name = path[-1].key
        return name == "kernel" or (decay_embeddings and name == "embedding")

    return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(cfg: OptimConfig, steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(
        schedule(cfg, steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=lambda params: decay_mask(params, cfg.decay_embeddings),
    )
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
